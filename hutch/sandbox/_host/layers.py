"""The content-addressed layer store: image layers, image nodes, snapshots (archives: archive.py).

Layout under state_dir() (export and import: archive.py):

    layers/<digest>/fs          a layer's tree, used as an overlay lower dir (whiteouts and opaque
                                directories kept as overlay writes them: char 0/0, trusted.overlay.opaque)
    layers/<digest>/layer.json  {digest, size, files, created_at}
    nodes/<id>.json             an image: {id, parent, layer, env, workdir, kind, name, pinned, ...}

A layer's digest is the sha256 of a canonical listing of its tree (paths, types, modes, owners,
file contents, link targets, whiteouts, opaque flags; not times), so the same tree is stored once.
A node's parent is another node ("image:<id>") or a base reference ("debian-slim", "dir:/path").
A built step's node id is its build key (hash of the parent and the step); a snapshot's is the hash
of its parent and its layer. Everything is written under a `.tmp-` name and renamed when complete.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import stat
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

from hutch._core import paths
from hutch._core.atomic import atomic_write
from hutch._core.errors import ConfigError, ImageError, NotFoundError, StateError

PREFIX = "image:"
ID_RE = re.compile(r"^[0-9a-f]{64}\Z")   # \Z: `$` would take a trailing newline
NAME_RE = re.compile(r"^[A-Za-z0-9:][A-Za-z0-9_.:-]{0,127}\Z")   # an image's name, as hutch.Image names it
KINDS = ("step", "snapshot", "import")
OPAQUE_XATTRS = ("trusted.overlay.opaque", "user.overlay.opaque")
_OVERLAY_XATTR = ("trusted.overlay.", "user.overlay.")
TMP_PREFIX = ".tmp-"
STALE_TMP = 3600.0     # seconds after which prune takes a .tmp- entry for a crashed write
_CHUNK = 1 << 20
_cache: dict[str, dict] = {}          # node id -> node (nodes never change; rm drops them)
_lock = threading.Lock()


def layers_dir() -> Path:
    return paths.state_dir() / "layers"


def nodes_dir() -> Path:
    return paths.state_dir() / "nodes"


@contextmanager
def store_lock():
    """One writer at a time across threads and processes (commit vs rm/prune)."""
    d = layers_dir()
    private_dir(d)
    with _lock, open(d / ".lock", "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def private_dir(path: Path) -> None:
    """0700: layers hold what sandboxes wrote (setuid-root files among it), nodes an image's env (a build's
    settings, secrets among them); no host user may reach them."""
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    if stat.S_IMODE(path.stat().st_mode) != 0o700:
        os.chmod(path, 0o700)


# --- walking a tree: digest and (optionally) copy ---------------------------------------------

def _field(s: str) -> str:
    """A name or symlink target as the canonical listing holds it: itself, unless it holds a newline (or starts
    with \\x01), then \\x01 and the text with \\x01 doubled and each newline \\x01n. A record ends at its only
    newline, so no two trees list alike: a target "t\\n/x" before /y read the same as a target "t" before
    "/x\\n/y" (two trees, one digest: the store kept whichever came first under both). Digests of trees without
    such names are what they always were."""
    if "\n" not in s and not s.startswith("\x01"):
        return s
    return "\x01" + s.replace("\x01", "\x01\x01").replace("\n", "\x01n")


class _Walker:
    """Walks a tree through directory fds (never following a symlink: the tree may be a live
    sandbox's upper dir), feeding the canonical listing into a sha256 and copying into `dst`."""

    def __init__(self, dst: Path | None, uid_shift: int = 0, max_bytes: int | None = None):
        self.dst = dst
        self.shift = uid_shift
        self.max_bytes = max_bytes
        self.h = hashlib.sha256()
        self.size = 0
        self.files = 0
        self.opaque: list[str] = []

    def _ids(self, st) -> tuple[int, int]:
        uid, gid = st.st_uid, st.st_gid
        if self.shift:
            uid = uid - self.shift if self.shift <= uid < self.shift + 65536 else 65534
            gid = gid - self.shift if self.shift <= gid < self.shift + 65536 else 65534
        return uid, gid

    def _rec(self, rel: str, kind: str, st, extra: str) -> None:
        uid, gid = self._ids(st)
        self.h.update(f"{_field(rel)}\0{kind}\0{stat.S_IMODE(st.st_mode):o}\0{uid}\0{gid}\0{_field(extra)}\n".encode(
            "utf-8", "surrogateescape"))
        self.files += 1

    def _meta(self, path: Path, st, follow: bool = False) -> None:
        uid, gid = self._ids(st)
        os.chown(path, uid, gid, follow_symlinks=follow)
        if not stat.S_ISLNK(st.st_mode):
            os.chmod(path, stat.S_IMODE(st.st_mode))
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns), follow_symlinks=follow)

    def walk_dir(self, dfd: int, rel: str) -> None:
        st = os.fstat(dfd)
        opaque = any(_getxattr(dfd, x) == b"y" for x in OPAQUE_XATTRS)
        if opaque:
            self.opaque.append(rel)
        self._rec(rel, "d", st, "o" if opaque else "")
        out = self.dst / rel.lstrip("/") if self.dst is not None else None
        if out is not None and rel != "/":
            os.mkdir(out, 0o700)
        if out is not None and opaque:   # both: read by overlay in a user namespace (userxattr) or not
            for x in OPAQUE_XATTRS:
                os.setxattr(out, x, b"y")
        with os.scandir(dfd) as it:
            names = sorted(e.name for e in it)
        for name in names:
            child = f"{rel.rstrip('/')}/{name}"
            try:
                cst = os.stat(name, dir_fd=dfd, follow_symlinks=False)
            except FileNotFoundError:
                continue  # removed while we walked
            m = cst.st_mode
            if stat.S_ISDIR(m):
                cfd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
                try:
                    self.walk_dir(cfd, child)
                finally:
                    os.close(cfd)
            elif stat.S_ISREG(m):
                self._file(dfd, name, child)
            elif stat.S_ISLNK(m):
                target = os.readlink(name, dir_fd=dfd)
                self._rec(child, "l", cst, target)
                if self.dst is not None:
                    p = self.dst / child.lstrip("/")
                    os.symlink(target, p)
                    self._meta(p, cst)
            elif stat.S_ISCHR(m) and cst.st_rdev == 0:   # an overlay whiteout: a deletion
                self._rec(child, "w", cst, "")
                if self.dst is not None:
                    p = self.dst / child.lstrip("/")
                    os.mknod(p, stat.S_IFCHR | 0o600, 0)
                    self._meta(p, cst)
            # devices, fifos and sockets are not part of an image: skipped
        if out is not None:
            self._meta(out, st)

    def _file(self, dfd: int, name: str, rel: str) -> None:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dfd)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                return
            self._check_size(rel, st.st_size)
            fh = hashlib.sha256()
            out = None
            if self.dst is not None:
                out = os.open(self.dst / rel.lstrip("/"), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            hashing = None
            try:
                # hashlib and os.write both release the GIL: chunk i is hashed in the pool thread
                # while it is written here (and chunk i+1 read), so a copy costs about max(hash, write)
                while data := os.read(fd, _CHUNK):
                    if hashing is not None:
                        hashing.result()
                    hashing = _pool().submit(fh.update, data) if out is not None else fh.update(data)
                    if out is not None:
                        view = memoryview(data)
                        while view:
                            view = view[os.write(out, view):]
                    self.size += len(data)
                    self._check_size(rel, 0)   # it may grow while it is copied
                if hashing is not None:
                    hashing.result()
            finally:
                if out is not None:
                    os.close(out)
            self._rec(rel, "f", st, fh.hexdigest())
            if self.dst is not None:
                self._meta(self.dst / rel.lstrip("/"), st)
        finally:
            os.close(fd)


    def _check_size(self, rel: str, more: int) -> None:
        """A copy writes every byte: a sparse file's holes, each hard link's and reflink's copy. What a sandbox's
        disk= does not charge it for is bounded by disk= here, so it cannot make the host write more."""
        if self.max_bytes is not None and self.size + more > self.max_bytes:
            raise ImageError(f"the sandbox's files add up to more than its disk= limit of {self.max_bytes} bytes once "
                             f"each is counted whole (holes of sparse files and every hard link included; at {rel!r}"
                             f"{f', of {more} bytes' if more else ', which grew while it was copied'}); a snapshot "
                             "copies every byte, so nothing was "
                             "stored: remove or shrink what it does not need, or give the sandbox a larger disk=.")


_hasher = None


def _pool():
    global _hasher
    if _hasher is None:
        from concurrent.futures import ThreadPoolExecutor

        _hasher = ThreadPoolExecutor(1, thread_name_prefix="hutch-layer-hash")
    return _hasher


def _getxattr(fd: int, name: str) -> bytes | None:
    try:
        return os.getxattr(fd, name)
    except OSError:
        return None


def tree_digest(root: str | os.PathLike) -> str:
    """The content digest of a tree (as a layer of it would be named)."""
    return measure_tree(root)["digest"]


def measure_tree(root: str | os.PathLike) -> dict:
    """A tree's layer meta as the store computes it: {digest, size, files, opaque}, by the canonical walk."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        w = _Walker(None)
        w.walk_dir(fd, "/")
        return {"digest": w.h.hexdigest(), "size": w.size, "files": w.files, "opaque": w.opaque}
    finally:
        os.close(fd)


# --- layers -----------------------------------------------------------------------------------

def layer_fs(digest: str) -> Path:
    return layers_dir() / digest / "fs"


def commit_tree(src_fd: int, uid_shift: int = 0, max_bytes: int | None = None) -> tuple[str, dict]:
    """Copy the tree at directory fd `src_fd` into the store; returns (digest, layer meta). `max_bytes` (a
    sandbox's disk=) bounds the bytes of its files counted whole: refused with ImageError past it, nothing kept.

    An identical layer already stored is reused (the copy is dropped)."""
    base = layers_dir()
    private_dir(base)
    tmp = Path(tempfile.mkdtemp(prefix=TMP_PREFIX, dir=base))
    try:
        (tmp / "fs").mkdir()
        w = _Walker(tmp / "fs", uid_shift, max_bytes)
        w.walk_dir(src_fd, "/")
        digest = w.h.hexdigest()
        meta = {"digest": digest, "size": w.size, "files": w.files, "opaque": w.opaque, "created_at": time.time()}
        return digest, commit_dir(tmp, digest, meta)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def commit_dir(tmp: Path, digest: str, meta: dict) -> dict:
    """Rename the complete temp dir `tmp` (holding `fs`, the verified tree of `digest`) into the store."""
    final = layers_dir() / digest
    with store_lock():
        if (final / "layer.json").exists():   # deduplicated: this content is stored already
            shutil.rmtree(tmp, ignore_errors=True)
            return json.loads((final / "layer.json").read_text())
        atomic_write(tmp / "layer.json", json.dumps(meta).encode(), fsync_file=False, fsync_dir=False)
        os.rename(tmp, final)   # the commit point
    return meta


# --- nodes ------------------------------------------------------------------------------------

def node_id_of(ref: str) -> str | None:
    if ref.startswith(PREFIX) and ID_RE.match(ref[len(PREFIX):]):
        return ref[len(PREFIX):]
    return None


def get_node(node_id: str) -> dict:
    node = _cache.get(node_id)
    if node is not None:
        return node
    try:
        node = json.loads((nodes_dir() / f"{node_id}.json").read_text())
    except FileNotFoundError:
        raise NotFoundError(f"image {PREFIX}{node_id[:12]} is not in this host's store; build it again, "
                            "import it (hutch image import), or list images with `hutch image ls`.") from None
    _cache[node_id] = node
    return node


def has_node(node_id: str) -> bool:
    try:
        chain(node_id)
        return True
    except NotFoundError:
        return False


def chain(node_id: str) -> tuple[list[dict], str]:
    """The nodes from `node_id` down to the base (top first), and the base reference."""
    out, seen = [], set()
    ref = PREFIX + node_id
    while (nid := node_id_of(ref)) is not None:
        if nid in seen:
            raise ImageError(f"image {ref} has a parent loop; remove it with `hutch image rm`.")
        seen.add(nid)
        node = get_node(nid)
        if node.get("layer") and not (layers_dir() / node["layer"] / "layer.json").exists():
            raise NotFoundError(f"layer {node['layer'][:12]} of image {ref} is missing; rebuild or re-import it.")
        out.append(node)
        ref = node["parent"]
    return out, ref


def chain_digest(nodes: list[dict], base: str) -> str:
    """The SHA-256 of an image as it runs: its base and, bottom up, each node's id, parent, layer digest (a hash
    of the layer's content), kind, env and workdir (not its name, pin or description). The same from a store's
    nodes (`chain`, reversed) and from an archive's checked manifest: an importer given the digest the source
    reported (GET /v1/images/{key} -> "digest") refuses an archive that would run anything else."""
    canon = [base] + [[n["id"], n["parent"], n.get("layer"), n.get("kind", "import"), dict(n.get("env") or {}),
                       n.get("workdir")] for n in nodes]
    return hashlib.sha256(json.dumps(canon, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _check_fields(kind, env, workdir, name) -> None:
    """What a node records is used later (as a sandbox's env and workdir, as a name to look up): checked here,
    whoever writes it."""
    if kind not in KINDS:
        raise ConfigError(f"image kind {kind!r} must be one of {', '.join(KINDS)}.")
    for k, v in (env or {}).items():
        if not isinstance(k, str) or not k or "=" in k or "\0" in k or not isinstance(v, str) or "\0" in v:
            raise ConfigError(f"image env {k!r}={v!r}: names are non-empty without '=' or NUL, values strings "
                              "without NUL.")
    if workdir is not None and (not isinstance(workdir, str) or not workdir.startswith("/") or "\0" in workdir):
        raise ConfigError(f"image workdir {workdir!r} must be an absolute path, like '/home/user'.")
    if name is not None and (not isinstance(name, str) or not NAME_RE.match(name)):
        raise ConfigError(f"image name {name!r} must be 1-128 letters, digits, '_', '.', ':', '-'.")


def put_node(node_id: str, parent: str, *, layer: str | None, kind: str, env: dict | None = None,
             workdir: str | None = None, name: str | None = None, description: str = "",
             pinned: bool = False) -> dict:
    """Record an image node (idempotent: an existing node is kept, a name or pin is added to it)."""
    if not isinstance(node_id, str) or not ID_RE.match(node_id):
        raise ConfigError(f"image id {node_id!r} must be 64 hex digits.")
    _check_fields(kind, env, workdir, name)
    private_dir(nodes_dir())   # an image's env, name and description are the daemon's, as its layers are
    with store_lock():
        return _put(node_id, parent, layer=layer, kind=kind, env=env, workdir=workdir, name=name,
                    description=description, pinned=pinned)


#: What an import does with a name one of its nodes carries when that name would move (`name_moves`): refuse
#: the import, leave every name of this host where it is (the node comes in without it), or move the name.
NAME_POLICIES = ("refuse", "keep", "replace")


def name_moves(nodes: list[dict], here: list[dict] | None = None) -> list[tuple[dict, dict]]:
    """The (node, this host's node) pairs where recording `nodes` (put_node fields: id, name) with their names
    would move a name of this host: the name names another image here, or the node is here under another name
    (which it would lose). A node already here under its own name moves nothing."""
    here = list_nodes() if here is None else here
    by_id = {n["id"]: n for n in here}
    by_name = {n["name"]: n for n in here if n.get("name")}
    out = []
    for n in nodes:
        name = n.get("name")
        if not name:
            continue
        holder = by_name.get(name)
        if holder is not None and holder["id"] != n["id"]:
            out.append((n, holder))
        elif (own := by_id.get(n["id"])) is not None and own.get("name") and own["name"] != name:
            out.append((n, own))
    return out


def put_nodes(nodes: list[dict], *, names: str, refuse: Callable[[list[tuple[dict, dict]]], Exception]) -> None:
    """Record `nodes` (each put_node's fields, with id and parent) under one hold of the store lock, so what
    name_moves finds is what is written. `names` (NAME_POLICIES) decides a name that would move: "refuse" raises
    `refuse(moves)` before anything is written, "keep" records those nodes without their names."""
    if names not in NAME_POLICIES:
        raise ConfigError(f"names={names!r} must be one of {', '.join(NAME_POLICIES)}.")
    for n in nodes:
        if not isinstance(n.get("id"), str) or not ID_RE.match(n["id"]):
            raise ConfigError(f"image id {n.get('id')!r} must be 64 hex digits.")
        _check_fields(n["kind"], n.get("env"), n.get("workdir"), n.get("name"))
    private_dir(nodes_dir())
    with store_lock():
        moves = name_moves(nodes) if names != "replace" else []
        if moves and names == "refuse":
            raise refuse(moves)
        kept = {id(n) for n, _ in moves}
        for n in nodes:
            _put(n["id"], n["parent"], layer=n.get("layer"), kind=n["kind"], env=n.get("env"),
                 workdir=n.get("workdir"), name=None if id(n) in kept else n.get("name"),
                 description=n.get("description", ""), pinned=bool(n.get("pinned")))


def _put(node_id: str, parent: str, *, layer: str | None, kind: str, env: dict | None, workdir: str | None,
         name: str | None, description: str, pinned: bool) -> dict:
    """put_node under the store lock (its caller holds it)."""
    path = nodes_dir() / f"{node_id}.json"
    if name:   # a name names one image: it moves from any other (also when this node exists already)
        for other in list_nodes():
            if other.get("name") == name and other["id"] != node_id:
                other["name"] = None
                atomic_write(nodes_dir() / f"{other['id']}.json", json.dumps(other).encode(), fsync_file=False)
                _cache.pop(other["id"], None)
    node = json.loads(path.read_text()) if path.exists() else None
    if node is not None and node.get("kind") == "import" and kind in ("step", "snapshot"):
        # a build step (or a snapshot) recorded under the id an import had: this host's own content wins
        name, pinned = name or node.get("name"), bool(pinned or node.get("pinned"))
        node = None
    if node is not None:
        if (name and node.get("name") != name) or (pinned and not node.get("pinned")):
            node.update(name=name or node.get("name"), pinned=bool(pinned or node.get("pinned")))
            atomic_write(path, json.dumps(node).encode(), fsync_file=False)
        _cache.pop(node_id, None)
        return node
    node = {"id": node_id, "ref": PREFIX + node_id, "parent": parent, "layer": layer, "kind": kind,
            "env": dict(env or {}), "workdir": workdir, "name": name, "pinned": bool(pinned),
            "description": description, "created_at": time.time()}
    atomic_write(path, json.dumps(node).encode(), fsync_file=False)
    _cache.pop(node_id, None)   # an imported node replaced by a build's
    return node


def snapshot_id(parent: str, layer: str, env: dict | None = None, workdir: str | None = None) -> str:
    """A snapshot's id: a hash of all it runs (its parent, its layer's digest, and the env and workdir it sets),
    so two snapshots share one node only when they run alike. Without env and workdir, the id hutch always gave."""
    if not env and workdir is None:
        return hashlib.sha256(f"snapshot\0{parent}\0{layer}".encode()).hexdigest()
    run = json.dumps([dict(env or {}), workdir], sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(f"snapshot\0{parent}\0{layer}\0{run}".encode()).hexdigest()


def is_own_snapshot(node: dict) -> bool:
    """Is `node` (put_node's fields) a snapshot whose id is the one this host gives what it runs (snapshot_id)?
    An archive's other "snapshot" claims an id a sandbox here may make later, with content of its own."""
    return node.get("kind") == "snapshot" and isinstance(node.get("layer"), str) and \
        node["id"] == snapshot_id(node["parent"], node["layer"], node.get("env"), node.get("workdir"))


def list_nodes() -> list[dict]:
    out = []
    d = nodes_dir()
    if d.is_dir():
        private_dir(d)   # a store of before it was private is closed at its first listing
    for p in sorted(d.glob("*.json")) if d.is_dir() else ():
        try:
            out.append(json.loads(p.read_text()))
        except (OSError, ValueError):
            continue
    return out


def find(key: str) -> dict:
    """A node by full id, `image:` ref, unique id prefix (>= 6 digits) or name."""
    key = key[len(PREFIX):] if key.startswith(PREFIX) else key
    if ID_RE.match(key) and (nodes_dir() / f"{key}.json").exists():
        return get_node(key)   # the common case, without listing the store
    nodes = list_nodes()
    named = [n for n in nodes if n.get("name") == key]
    if named:
        return named[0]
    hits = [n for n in nodes if len(key) >= 6 and n["id"].startswith(key)]
    if len(hits) == 1:
        return hits[0]
    if len(hits) > 1:
        raise ConfigError(f"image {key!r} matches {len(hits)} images; give more digits of the id.")
    raise NotFoundError(f"no image {key!r} on this host; list them with `hutch image ls`.")


def layer_size(digest: str | None) -> int:
    if not digest:
        return 0
    try:
        return json.loads((layers_dir() / digest / "layer.json").read_text())["size"]
    except (OSError, ValueError, KeyError):
        return 0


def remove(key: str, in_use: set[str], *, force: bool = False) -> list[str]:
    """Remove an image node (and, with force, the images built on it). Layers go at the next prune."""
    node = find(key)
    with store_lock():
        nodes = list_nodes()
        doomed = {node["id"]}
        grew = True
        while grew:
            grew = False
            for n in nodes:
                if n["id"] not in doomed and node_id_of(n["parent"]) in doomed:
                    doomed.add(n["id"])
                    grew = True
        children = doomed - {node["id"]}
        if children and not force:
            names = ", ".join(sorted(c[:12] for c in children)[:5])
            raise StateError(f"image {node['id'][:12]} has {len(children)} image(s) built on it ({names}); "
                             "remove those first, or pass --force to remove them all.")
        busy = doomed & in_use
        if busy:
            raise StateError(f"image {sorted(busy)[0][:12]} is in use by a running sandbox; terminate it first.")
        for nid in doomed:
            (nodes_dir() / f"{nid}.json").unlink(missing_ok=True)
            _cache.pop(nid, None)
    return sorted(doomed)


def prune(in_use_layers: set[str], in_use_nodes: set[str]) -> dict:
    """Drop build-cache nodes that no pinned image (named build or snapshot) needs, then every layer
    no remaining node uses, and crashed writes."""
    with store_lock():
        nodes = {n["id"]: n for n in list_nodes()}
        keep: set[str] = set()
        for n in nodes.values():
            if n.get("pinned") or n["id"] in in_use_nodes:
                nid = n["id"]
                while nid in nodes and nid not in keep:
                    keep.add(nid)
                    nid = node_id_of(nodes[nid]["parent"])
        removed_nodes = []
        for nid in set(nodes) - keep:
            (nodes_dir() / f"{nid}.json").unlink(missing_ok=True)
            _cache.pop(nid, None)
            removed_nodes.append(nid)
        used = {nodes[n]["layer"] for n in keep if nodes[n].get("layer")} | in_use_layers
        removed_layers, freed = [], 0
        d = layers_dir()
        for p in list(d.iterdir()) if d.is_dir() else ():
            if p.name.startswith(TMP_PREFIX):
                if time.time() - p.stat().st_mtime < STALE_TMP:   # a snapshot or import under way
                    continue
                shutil.rmtree(p, ignore_errors=True)
            elif p.is_dir() and p.name not in used:
                freed += layer_size(p.name)
                shutil.rmtree(p, ignore_errors=True)
                removed_layers.append(p.name)
    return {"nodes": sorted(removed_nodes), "layers": sorted(removed_layers), "bytes": freed}


__all__ = ["ID_RE", "OPAQUE_XATTRS", "PREFIX", "TMP_PREFIX", "chain", "chain_digest", "commit_dir", "commit_tree", "find", "get_node",
           "list_nodes", "measure_tree", "node_id_of", "private_dir", "prune", "put_node", "remove", "snapshot_id",
           "tree_digest"]
