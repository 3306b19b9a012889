"""Image references -> root filesystem layers. (Contract shared by the daemon and the image builder.)

An image reference is a string:
- "debian-slim" (the default image: debootstrap minbase bookworm + python3 with its whole standard library, pip
  and venv, built once and cached under images_dir()/<its cache key>),
- "dir:/abs/path" (a prepared root directory, `hutch.Image.from_directory(path)`),
- "image:<64 hex>" (a built image or a snapshot: a node of the layer store, hutch/sandbox/_host/layers.py).

`resolve_image(ref)` returns the layers of a cached image (fast, never builds);
`ensure_image(ref, progress)` builds what is missing first, reporting progress events.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from hutch._core import paths, settings
from hutch._core.atomic import atomic_write
from hutch._core.errors import ImageError, NotFoundError
from hutch.sandbox._host import layers

DEBIAN_SLIM = "debian-slim"
DEBIAN_SUITE = "bookworm"
# minbase already has coreutils; agents run Python first of all: the whole standard library, pip and venv
DEBIAN_EXTRA_PACKAGES = ("python3", "python3-pip", "python3-venv", "ca-certificates")
#: Bumped when the default image's content changes in a way its packages do not show (a build step below).
DEBIAN_SLIM_VERSION = 2
#: Env: a Debian mirror URL for debootstrap; unset means debootstrap's own default.
ENV_DEBIAN_MIRROR = settings.DEBIAN_MIRROR.name
IMAGE_ENV = (
    ("PATH", "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"),
    ("HOME", "/home/user"),
    ("LANG", "C.UTF-8"),
)
IMAGE_WORKDIR = "/home/user"
_META = "image.json"
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}\Z")
_TMP_PREFIX = ".tmp-"


@dataclass(frozen=True)
class ResolvedImage:
    """What the runtime needs to start a sandbox from an image."""

    ref: str
    id: str
    lowerdirs: tuple[Path, ...]          # overlay lower layers, top-most first
    env: tuple[tuple[str, str], ...] = ()
    workdir: str | None = None


ProgressFn = Callable[[dict], None]


def images_dir() -> Path:
    """Where built images live: state_dir()/images/<cache key>/{rootfs,image.json}."""
    return paths.state_dir() / "images"


def default_image_key() -> str:
    """The default image's cache key: its suite, packages and version. A changed definition is a new key, so
    it is built beside the old one (which a running daemon of the old code may still be using), never over it,
    and an image cached under an old key is never taken for it."""
    spec = json.dumps([DEBIAN_SUITE, sorted(DEBIAN_EXTRA_PACKAGES), DEBIAN_SLIM_VERSION])
    return f"{DEBIAN_SLIM}-{DEBIAN_SUITE}-{hashlib.sha256(spec.encode()).hexdigest()[:12]}"


def default_image_status() -> dict:
    """The default image's cache entry: its key, whether it is built, and if so its id, size and build time."""
    key = default_image_key()
    try:
        meta = json.loads((images_dir() / key / _META).read_text())
    except (OSError, ValueError):
        return {"ref": DEBIAN_SLIM, "key": key, "built": False, "packages": list(DEBIAN_EXTRA_PACKAGES)}
    return {"ref": DEBIAN_SLIM, "key": key, "built": True, "id": meta.get("id"), "size": meta.get("size"),
            "build_seconds": meta.get("build_seconds"), "packages": meta.get("packages")}


def resolve_image(ref: str) -> ResolvedImage:
    """Layers of an image that is ready to use; raises NotFoundError if it must be built first."""
    if ref.startswith("dir:"):
        root = Path(ref[4:])
        if not root.is_absolute() or not root.is_dir():
            raise NotFoundError(
                f"image {ref!r}: {root} is not a directory; give hutch.Image.from_directory() an existing root."
            )
        return ResolvedImage(ref=ref, id=ref, lowerdirs=(root,))
    if ref == DEBIAN_SLIM:
        d = images_dir() / default_image_key()
        try:
            meta = json.loads((d / _META).read_text())
        except FileNotFoundError:
            raise NotFoundError(
                f"image {ref!r} is not built yet on this host; hutch builds it on first use "
                "(Sandbox.create or POST /v1/images/ensure)."
            ) from None
        return ResolvedImage(ref=ref, id=meta["id"], lowerdirs=(d / "rootfs",), env=IMAGE_ENV, workdir=IMAGE_WORKDIR)
    if ref.startswith(layers.PREFIX):
        return _resolve_layered(ref)
    if _NAME_RE.match(ref):   # a built image's name (or id prefix), as `hutch image build FILE:NAME` gave it
        try:
            node = layers.find(ref)
        except NotFoundError:
            pass
        else:
            return _resolve_layered(layers.PREFIX + node["id"])
    raise NotFoundError(f"image {ref!r} is not known here; use hutch.Image.debian_slim(), hutch.Image.from_directory(path) "
                        "or the name of a built image (`hutch image ls` lists them; `hutch image build FILE:NAME` "
                        "names one).")


def _resolve_layered(ref: str) -> ResolvedImage:
    """A built image or snapshot: its layers (top first) over its base's, env and workdir merged bottom-up."""
    nid = layers.node_id_of(ref)
    if nid is None:
        raise NotFoundError(f"image {ref!r} is not an image id; it must be 'image:' and 64 hex digits.")
    nodes, base_ref = layers.chain(nid)
    base = resolve_image(base_ref)
    env = dict(base.env)
    workdir = base.workdir
    for node in reversed(nodes):
        env.update(node.get("env") or {})
        workdir = node.get("workdir") or workdir
    lowers = tuple(layers.layer_fs(n["layer"]) for n in nodes if n.get("layer"))
    return ResolvedImage(ref=ref, id=nid, lowerdirs=_once(lowers + base.lowerdirs), env=tuple(env.items()),
                         workdir=workdir)


def _once(lowerdirs: tuple) -> tuple:
    """Each layer once, where it is topmost. Layers are named by their content, so a snapshot whose writes
    equal a layer below it (a gVisor copy of a restore writes the few directories its image's first snapshot
    held) lists that layer twice, and overlayfs refuses a lowerdir it already has (ELOOP, "conflicting lowerdir
    path": a fork of a restore with a volume answered 500). The lower copy changes nothing: its every path,
    whiteout and opaque directory is the upper copy's too, which hides the same below."""
    seen: set = set()
    out = []
    for d in lowerdirs:
        if d not in seen:
            seen.add(d)
            out.append(d)
    return tuple(out)


def list_images() -> list[dict]:
    """The default image if built, then every built image and snapshot in the layer store."""
    out = []
    try:
        meta = json.loads((images_dir() / default_image_key() / _META).read_text())
        out.append({"ref": DEBIAN_SLIM, "id": meta.get("id"), "kind": "base", "name": DEBIAN_SLIM,
                    "size": meta.get("size"), "created_at": meta.get("created_at"), "parent": None})
    except (OSError, ValueError):
        pass
    for n in layers.list_nodes():
        out.append({"ref": n["ref"], "id": n["id"], "kind": n.get("kind"), "name": n.get("name"),
                    "size": layers.layer_size(n.get("layer")), "created_at": n.get("created_at"),
                    "parent": n.get("parent"), "pinned": n.get("pinned"), "description": n.get("description")})
    return out


def ensure_image(ref: str, progress: ProgressFn | None = None) -> ResolvedImage:
    """Like resolve_image, but builds a buildable image (the default) first, reporting progress."""
    try:
        return resolve_image(ref)
    except NotFoundError:
        if ref != DEBIAN_SLIM:
            raise
    return _build_debian_slim(progress or (lambda ev: None))


def _build_debian_slim(progress: ProgressFn) -> ResolvedImage:
    base = images_dir()
    base.mkdir(parents=True, exist_ok=True)
    key = default_image_key()
    with open(base / f".{key}.lock", "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)   # one build per host; waiters find it done
        try:
            return resolve_image(DEBIAN_SLIM)
        except NotFoundError:
            pass
        for stale in base.glob(f"{_TMP_PREFIX}{key}-*"):   # a build that crashed
            _remove_tree(stale)
        tmp = Path(tempfile.mkdtemp(prefix=f"{_TMP_PREFIX}{key}-", dir=base))
        t0 = time.monotonic()
        try:
            _debootstrap(tmp / "rootfs", progress)
            meta = {"ref": DEBIAN_SLIM, "id": f"{key}-{int(time.time())}", "key": key,
                    "suite": DEBIAN_SUITE, "packages": list(DEBIAN_EXTRA_PACKAGES),
                    "size": _du(tmp / "rootfs"), "created_at": time.time(),
                    "build_seconds": round(time.monotonic() - t0, 1)}
            atomic_write(tmp / _META, json.dumps(meta, indent=1).encode())
            os.rename(tmp, base / key)   # the commit point: the image exists only when complete
        except BaseException:
            _remove_tree(tmp)
            raise
    return resolve_image(DEBIAN_SLIM)


_PHASES = (("Retrieving", "download"), ("Validating", "download"), ("Checking", "download"),
           ("Resolving", "resolve"), ("Found", "resolve"), ("Extracting", "extract"),
           ("Installing", "install"), ("Unpacking", "install"), ("Configuring", "configure"),
           ("Base system installed", "finish"))


def _phase(line: str) -> str:
    text = line[3:] if line.startswith(("I: ", "W: ", "E: ")) else line
    for prefix, phase in _PHASES:
        if text.startswith(prefix):
            return phase
    return "debootstrap"


def _debootstrap(rootfs: Path, progress: ProgressFn) -> None:
    cmd = ["debootstrap", "--variant=minbase", f"--include={','.join(DEBIAN_EXTRA_PACKAGES)}",
           DEBIAN_SUITE, str(rootfs)]
    if mirror := settings.DEBIAN_MIRROR.get():
        cmd.append(mirror)
    t0 = time.monotonic()
    size, size_at = 0, 0.0
    tail: list[str] = []
    progress({"phase": "start", "message": " ".join(cmd), "bytes": 0, "elapsed": 0.0})
    try:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, errors="replace", env=dict(os.environ, DEBIAN_FRONTEND="noninteractive"))
    except FileNotFoundError:
        raise ImageError(
            "building the default image needs debootstrap, which is not installed; "
            "run scripts/setup.sh (it installs scripts/debian-packages.txt) or `apt-get install debootstrap`."
        ) from None
    try:
        for line in proc.stdout:
            line = line.rstrip()
            tail = (tail + [line])[-8:]
            now = time.monotonic()
            if now - size_at >= 2.0:   # walking the tree costs tens of ms: not on every line
                size, size_at = _du(rootfs), now
            progress({"phase": _phase(line), "message": line, "bytes": size, "elapsed": round(now - t0, 2)})
        rc = proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()   # (it was left to the garbage collector: ResourceWarning, a fd per build)
    if rc != 0:
        raise ImageError(
            f"debootstrap of the default image failed with exit code {rc}; its last output: {' | '.join(tail)}. "
            f"Check that the Debian archive is reachable (or set {ENV_DEBIAN_MIRROR}) and try again."
        )
    (rootfs / "home" / "user").mkdir(parents=True, exist_ok=True)
    os.chmod(rootfs / "home" / "user", 0o755)
    # the .deb files and package lists are not needed to run anything; they are half the size
    for junk in (rootfs / "var/cache/apt/archives").glob("*.deb"):
        junk.unlink()
    shutil.rmtree(rootfs / "var/lib/apt/lists", ignore_errors=True)
    (rootfs / "var/lib/apt/lists/partial").mkdir(parents=True, exist_ok=True)
    progress({"phase": "done", "message": "built", "bytes": _du(rootfs), "elapsed": round(time.monotonic() - t0, 2)})


def _du(root: Path) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(root):
        for f in files:
            try:
                total += os.lstat(os.path.join(dirpath, f)).st_size
            except OSError:
                pass
    return total


def _remove_tree(path: Path) -> None:
    """Remove a (failed) build tree, unmounting first whatever debootstrap left mounted in it (proc, sys)."""
    prefix = str(path.resolve()) + "/"
    try:
        with open("/proc/self/mountinfo") as f:
            points = [ln.split()[4] for ln in f]
    except OSError:
        points = []
    for mp in sorted((p for p in points if p.startswith(prefix)), key=len, reverse=True):
        subprocess.run(["umount", "-l", mp], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
    with open("/proc/self/mountinfo") as f:
        if any(ln.split()[4].startswith(prefix) for ln in f):
            raise ImageError(f"cannot clean up the failed image build {path}: something is still mounted in it; "
                             "unmount it and remove the directory.")
    shutil.rmtree(path, ignore_errors=True)


__all__ = ["ImageError", "ResolvedImage", "default_image_key", "default_image_status", "ensure_image", "images_dir",
           "list_images", "resolve_image"]
