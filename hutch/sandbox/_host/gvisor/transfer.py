"""Moving a memory snapshot between hosts: `export` writes one as a tar, `import_` reads one back as hostile
input (the daemon is root; the archive is anyone's) and keeps nothing it has not checked.

The tar (format 1) holds, in this order:

    hutch-memory-snapshot.json   {"format": 1, "meta": Meta.to_dict() + "bundle", "mem": {name: {size, sha256}},
                                  "image": {"size", "digest"}}   (digest: the image's chain digest; older
                                  archives have none)
    mem/<name>                   runsc's image files (checkpoint.img, pages_meta.img, pages.img), as declared
    image.tar                    the snapshot's filesystem: an image archive (archive.export of its node)

Import refuses before storing anything: a manifest that is not small strict JSON of that shape; a runsc build,
flags or bundle (the host's busybox every gVisor sandbox has bound in) other than this host's; a spec this
host would not run (SandboxSpec.from_dict validates it as a create does; tmpfs mounts only); a member that is
not the next one expected, not a regular file, not its declared size, or whose sha256 differs; memory files
larger together than the spec's memory limit + IMAGE_SLACK; an image archive that untar.py refuses (its layers
digest-verified), whose top is not the spec's image, or whose base is not this host's same base image. What a
refused import extracted is removed; the layers of an accepted image stay (content-addressed, like any
import's).

A snapshot's digest (`digest()`, GET /v1/memory-snapshots/{id}/digest) is the SHA-256 of its metadata (all but
its id), its memory files' sha256s and its image's chain digest. An import told the digest to expect (a fleet
moving a snapshot between its nodes: `?digest=`) refuses, before storing anything, a manifest of any other,
then checks every memory file against its sha256 and the image against its chain digest as usual; the snapshot
it stores keeps the source's id (the digest vouches that it is that snapshot), and one of that id already here
is answered as it is if its digest is the same, refused if not.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import shutil
import stat
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Callable

from hutch._core.errors import ConfigError, InvalidArchiveError, StateError
from hutch.sandbox._host import archive, images, layers
from hutch.sandbox._host.gvisor import runsc, snapshots
from hutch.sandbox._host import untar
from hutch.sandbox._host.untar import ImportLimits
from hutch.sandbox._spec import SandboxSpec

MANIFEST = "hutch-memory-snapshot.json"
IMAGE_MEMBER = "image.tar"
FORMAT = 1
_CHUNK = 1 << 20
_FIX = "nothing was imported; import only archives made by `hutch snapshot export`, from a source you trust."
_NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def refuse(name: str, why: str) -> InvalidArchiveError:
    return InvalidArchiveError(f"the snapshot archive is refused: {name!r} {why}; {_FIX}")


def base_id(image_ref: str) -> str:
    """The id of the base an image node sits on (the default image's build id, or a directory's path)."""
    node = layers.find(image_ref[len(layers.PREFIX):] if image_ref.startswith(layers.PREFIX) else image_ref)
    _, base = layers.chain(node["id"])
    return images.resolve_image(base).id


# --- digest ------------------------------------------------------------------------------------

def image_digest(image_ref: str) -> str:
    """The chain digest of an image node (what GET /v1/images/{id} answers as "digest")."""
    node = layers.find(image_ref[len(layers.PREFIX):] if image_ref.startswith(layers.PREFIX) else image_ref)
    nodes, base = layers.chain(node["id"])
    return layers.chain_digest(list(reversed(nodes)), base)


def snapshot_digest(meta: "snapshots.Meta", mem_sha256: dict[str, str], image: str) -> str:
    """The digest of a snapshot: its metadata but its id, its memory files' sha256s, its image's chain digest."""
    canon = {"meta": {k: v for k, v in meta.to_dict().items() if k != "id"}, "mem": dict(sorted(mem_sha256.items())),
             "image": image}
    return hashlib.sha256(json.dumps(canon, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _filled(meta: "snapshots.Meta") -> "snapshots.Meta":
    """The metadata as an export writes it (bundle and base filled in)."""
    return dataclasses.replace(meta, bundle=meta.bundle or runsc.bundle_id(),
                               base=meta.base or base_id(meta.spec["image"]))


def digest(snap_id: str, *, runsc_version: str, flags: list[str]) -> dict:
    """{"id", "digest"} of memory snapshot `snap_id` (its memory files read and hashed)."""
    meta = _filled(snapshots.load(snap_id, runsc_version=runsc_version, flags=flags))
    d = snapshots.path_of(snap_id) / "mem"
    mem = {name: _sha256(d / name) for name in sorted(os.listdir(d))}
    return {"id": snap_id, "digest": snapshot_digest(meta, mem, image_digest(meta.spec["image"]))}


# --- export ------------------------------------------------------------------------------------

def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while data := f.read(_CHUNK):
            h.update(data)
    return h.hexdigest()


def export(snap_id: str, fileobj, *, runsc_version: str, flags: list[str]) -> dict:
    """Write memory snapshot `snap_id` (checked as a restore checks it) as a tar stream to `fileobj`."""
    meta = snapshots.load(snap_id, runsc_version=runsc_version, flags=flags)
    kinds = {m.get("kind") for m in meta.spec.get("mounts") or []} - {"tmpfs"}
    if kinds:
        raise StateError(f"memory snapshot {snap_id} is of a sandbox with {' and '.join(sorted(kinds))} mounts, "
                         "whose content is this host's and not in the snapshot; it can be restored here only.")
    d = snapshots.path_of(snap_id)
    mem = {name: {"size": (d / "mem" / name).stat().st_size, "sha256": _sha256(d / "mem" / name)}
           for name in sorted(os.listdir(d / "mem"))}
    image_ref = meta.spec["image"]
    meta = _filled(meta)
    chain = image_digest(image_ref)
    layers.private_dir(layers.layers_dir())
    fd, name = tempfile.mkstemp(prefix=layers.TMP_PREFIX + "export-", dir=layers.layers_dir())
    spool = Path(name)   # the image archive, spooled: its size goes first, in the manifest
    try:
        with os.fdopen(fd, "wb") as f:
            archive.export(image_ref[len(layers.PREFIX):], f)
        manifest = {"format": FORMAT, "meta": meta.to_dict(), "mem": mem, "image": {"size": spool.stat().st_size,
                                                                                   "digest": chain}}
        data = json.dumps(manifest).encode()
        with tarfile.open(fileobj=fileobj, mode="w|", format=tarfile.PAX_FORMAT) as tar:
            info = tarfile.TarInfo(MANIFEST)
            info.size, info.mtime, info.mode = len(data), int(time.time()), 0o600
            tar.addfile(info, io.BytesIO(data))
            for name in mem:
                _add(tar, d / "mem" / name, f"mem/{name}")
            _add(tar, spool, IMAGE_MEMBER)
    finally:
        spool.unlink(missing_ok=True)
    return {"id": snap_id, "memory_bytes": meta.memory_bytes, "image": image_ref}


def _add(tar: tarfile.TarFile, path: Path, arcname: str) -> None:
    info = tarfile.TarInfo(arcname)
    st = path.stat()
    info.size, info.mtime, info.mode = st.st_size, int(st.st_mtime), 0o600
    with open(path, "rb") as f:
        tar.addfile(info, f)


# --- import ------------------------------------------------------------------------------------

_Header = untar.header_type(refuse, "hutch snapshot export")


def check_manifest(m, *, runsc_version: str, flags: list[str],
                   check_spec: Callable = lambda spec: None) -> tuple["snapshots.Meta", dict, int, str | None]:
    """(meta, {name: (size, sha256)}, image archive size, image chain digest or None) of a manifest, or a
    refusal naming what is wrong:
    InvalidArchiveError for a malformed one, StateError for one this host cannot restore; `check_spec` refuses
    a spec the runtime does not run (daemon.gvisor.check_supported)."""
    if not isinstance(m, dict) or m.get("format") != FORMAT or set(m) != {"format", "meta", "mem", "image"}:
        raise refuse(MANIFEST, f"is not a hutch memory snapshot manifest of format {FORMAT}")
    try:
        meta = snapshots.Meta.from_dict(m["meta"])
    except ConfigError as e:
        raise refuse(MANIFEST, f"has malformed metadata ({e})") from None
    if meta.runsc != runsc_version:
        raise StateError(f"the snapshot was taken with {meta.runsc!r}, this host runs {runsc_version!r}; a restore "
                         "needs the same runsc build: install that build here (scripts/setup.sh installs "
                         "bookworm-backports' runsc), or export from a host that runs this one.")
    if list(meta.flags) != flags:
        raise StateError(f"the snapshot was taken with runsc flags {list(meta.flags)}, this host uses {flags}; "
                         "export it from a hutch of the same version.")
    if not meta.bundle or not meta.base:
        raise refuse(MANIFEST, "names no bundle or base image (an export always does)")
    if meta.bundle != runsc.bundle_id():
        raise StateError(f"the snapshot's sandbox had another bundle ({meta.bundle[:40]!r}: the host busybox bound "
                         f"into every gVisor sandbox), this host has {runsc.bundle_id()[:40]!r}; install the same "
                         "busybox-static build here, or take the snapshot again on this host.")
    try:
        spec = SandboxSpec.from_dict(meta.spec)
    except Exception as e:   # every spec error is a hutch.Error, but this is outside input: never a 500
        raise refuse(MANIFEST, f"holds a sandbox spec this host would not run ({e})") from None
    if spec.runtime != "gvisor" or not spec.image.startswith(layers.PREFIX) \
            or not layers.ID_RE.match(spec.image[len(layers.PREFIX):]):
        raise refuse(MANIFEST, "holds a spec that is not a gVisor sandbox of an image node")
    if any(m.kind != "tmpfs" for m in spec.mounts):
        raise refuse(MANIFEST, "holds a spec with binds or volumes (this host's paths); an archive carries "
                               "Mount.tmpfs mounts only")
    if spec.network.credentials:
        raise refuse(MANIFEST, "holds a spec with credentials, which an export never carries")
    check_spec(spec)
    mem, image = m["mem"], m["image"]
    if not isinstance(mem, dict) or not mem or set(mem) - snapshots.IMAGE_FILES:
        raise refuse(MANIFEST, f"lists memory files other than runsc's {sorted(snapshots.IMAGE_FILES)}")
    files: dict[str, tuple[int, str]] = {}
    for name, v in mem.items():
        if not isinstance(v, dict) or set(v) != {"size", "sha256"} or type(v["size"]) is not int or v["size"] < 0 \
                or not isinstance(v["sha256"], str) or len(v["sha256"]) != 64 \
                or set(v["sha256"]) - set("0123456789abcdef"):
            raise refuse(MANIFEST, f"declares {name} without a size and a sha256")
        files[name] = (v["size"], v["sha256"])
    total = sum(s for s, _ in files.values())
    if total != meta.memory_bytes:
        raise refuse(MANIFEST, f"declares {total} bytes of memory files, not its metadata's {meta.memory_bytes}")
    if total > spec.limits.memory + snapshots.IMAGE_SLACK:
        raise refuse(MANIFEST, f"declares {total} bytes of memory image, more than its sandbox's memory limit "
                               f"({spec.limits.memory}) + {snapshots.IMAGE_SLACK} allows")
    if not isinstance(image, dict) or set(image) - {"digest"} != {"size"} or type(image["size"]) is not int \
            or image["size"] < 0:
        raise refuse(MANIFEST, "declares no size of its image archive")
    chain = image.get("digest")
    if chain is not None and not (isinstance(chain, str) and layers.ID_RE.match(chain)):
        raise refuse(MANIFEST, "declares an image digest that is not 64 hex digits")
    return meta, files, image["size"], chain


class _Hashing:
    """A member's bytes as read, hashed; the image archive's reader (untar reads it as a stream)."""

    def __init__(self, f):
        self.f, self.n = f, 0

    def read(self, n: int = -1) -> bytes:
        data = self.f.read(n)
        self.n += len(data)
        return data


def _next(tar: tarfile.TarFile, name: str, size: int) -> tarfile.TarInfo:
    m = tar.next()
    if m is None or m.name != name:
        raise refuse(m.name if m is not None else "(end)", f"is where {name} should be")
    if not m.isreg() or m.size != size:
        raise refuse(name, f"is not a regular file of its declared {size} bytes")
    return m


def import_(fileobj, *, runsc_version: str, flags: list[str], limits: ImportLimits | None = None,
            check_spec: Callable = lambda spec: None, digest: str | None = None, base: str | None = None) -> dict:
    """Read a tar made by export(); a new snapshot (its own id) once every part checks out (module docstring).
    Given `digest` (what the source's GET .../digest answered), only the snapshot of that digest, kept under
    the source's id: refused before anything is stored if the manifest is of another. Its filesystem's base
    may be a host directory only if the importer names it (`base`) or gave `digest` (archive._base_allowed):
    the image's chain digest in the manifest is the archive's own word, not the importer's."""
    limits = limits or ImportLimits.from_env()
    tmp = None
    try:
        with tarfile.open(fileobj=untar.Counted(fileobj, limits.bytes, "snapshot"), mode="r|", tarinfo=_Header, bufsize=_CHUNK) as tar:
            m = tar.next()
            if m is None or m.name != MANIFEST or not m.isreg():
                raise refuse(m.name if m is not None else "(empty)", f"is the first member, not {MANIFEST}")
            if m.size > snapshots.META_MAX:
                raise refuse(MANIFEST, f"is {m.size} bytes (at most {snapshots.META_MAX})")
            meta, files, image_size, chain = check_manifest(
                untar.strict_json(tar.extractfile(m).read(), MANIFEST, refuse), runsc_version=runsc_version,
                flags=flags, check_spec=check_spec)
            if digest is None:
                cidrs = SandboxSpec.from_dict(meta.spec).network.cidrs
                if cidrs:   # what the restored sandbox reaches is the importer's to give, not the archive's
                    raise refuse(MANIFEST, f"holds a spec whose network reaches the addresses {', '.join(cidrs)[:200]} "
                                           "(CIDR rules: private, link-local and metadata addresses among them), which "
                                           "an archive may not give the sandbox it restores; export the sandbox with "
                                           "such rules removed, and give them to the restored one with "
                                           "sb.set_network(...) if you mean to")
                snap_id = snapshots.new_id()
            else:
                if chain is None:
                    raise refuse(MANIFEST, f"declares no image digest, so it cannot be the snapshot of digest "
                                           f"{digest[:12]} its importer was told to expect")
                got = snapshot_digest(meta, {n: sha for n, (_, sha) in files.items()}, chain)
                if got != digest:
                    raise InvalidArchiveError(
                        f"the snapshot archive is not the memory snapshot of digest {digest[:12]} its importer was "
                        f"told to expect (its manifest digests to {got[:12]}); nothing was imported: the transfer "
                        "was damaged or forged, fetch it again.")
                snap_id = meta.id
                if (here := _same(snap_id, digest, runsc_version, flags)) is not None:
                    return here
            if snapshots.total_bytes() + meta.memory_bytes > (total_max := snapshots.total_max()):
                raise StateError(f"the memory snapshots of this host hold {snapshots.total_bytes()} bytes, and this "
                                 f"one of {meta.memory_bytes} would pass HUTCH_MEMORY_SNAPSHOTS_MAX "
                                 f"({total_max}); delete some (hutch.Snapshot.list()).")
            tmp = snapshots.make_dir(snap_id)
            for name, (size, sha) in files.items():
                _member_file(tar, _next(tar, f"mem/{name}", size), tmp / "mem" / name, sha)
            im = _next(tar, IMAGE_MEMBER, image_size)
            src = _Hashing(tar.extractfile(im))
            try:
                # the snapshot names its image by id: this host's names stay where they are, and an archive
                # not vouched for by its source's digest brings none (a name another party builds later)
                got = archive.import_(src, limits, digest=chain, base=archive.ANY_BASE if digest else base,
                                      names="keep" if digest else "none")
            except InvalidArchiveError as e:
                raise InvalidArchiveError(f"the snapshot archive's filesystem is refused: {e}") from None
            if src.n != image_size or got["ref"] != meta.spec["image"]:
                raise refuse(IMAGE_MEMBER, f"holds image {got['ref']}, not the snapshot's {meta.spec['image']}")
            if tar.next() is not None:
                raise refuse(IMAGE_MEMBER, "is followed by more members; the archive ends with it")
        _check_base(meta)
        meta = dataclasses.replace(meta, id=snap_id)
        snapshots.write_meta(tmp, meta)
        try:
            snapshots.complete(tmp, snap_id)
        except OSError:   # another import of the same snapshot (a fleet's, ?digest=) finished first
            if digest is None or (here := _same(snap_id, digest, runsc_version, flags)) is None:
                raise
            shutil.rmtree(tmp, ignore_errors=True)
            return here
    except tarfile.TarError as e:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        raise InvalidArchiveError(f"the snapshot archive is not a readable tar ({e}); {_FIX}") from None
    except BaseException:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {**meta.to_dict(), "image": meta.spec["image"]}


def _same(snap_id: str, want: str, runsc_version: str, flags: list[str]) -> dict | None:
    """Snapshot `snap_id` as an import answers it if this host has it with digest `want`; None if it has none of
    that id; a refusal if the one it has is another snapshot."""
    if not (snapshots.path_of(snap_id) / "meta.json").exists():
        return None
    here = digest(snap_id, runsc_version=runsc_version, flags=flags)["digest"]
    if here != want:
        raise StateError(f"this host has another memory snapshot of id {snap_id} (digest {here[:12]}, not "
                         f"{want[:12]}); nothing was imported: delete it here (hutch.Snapshot.delete) first.")
    meta = snapshots.load(snap_id, runsc_version=runsc_version, flags=flags)
    return {**meta.to_dict(), "image": meta.spec["image"]}


def _check_base(meta: "snapshots.Meta") -> None:
    try:
        here = base_id(meta.spec["image"])
    except Exception as e:   # NotFoundError of a base not built here, ImageError of a broken chain
        raise StateError(f"the snapshot's filesystem sits on a base image this host does not have ({e}); build "
                         "it here first (a sandbox of it builds the default image), then import again.") from None
    if meta.base and here != meta.base:
        raise StateError(f"the snapshot's filesystem sits on base image {meta.base!r}, this host's is {here!r}: its "
                         "processes would see other files; import it on a host with the same base image build.")


def _member_file(tar: tarfile.TarFile, m: tarfile.TarInfo, dest: Path, digest: str) -> None:
    h = hashlib.sha256()
    fd = os.open(dest, _NEW_FILE, 0o600)
    try:
        src = tar.extractfile(m)
        while data := src.read(_CHUNK):
            h.update(data)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
    finally:
        os.close(fd)
    if h.hexdigest() != digest:
        raise refuse(m.name, "does not match its sha256 (the file is damaged or forged; export it again)")
    if not stat.S_ISREG(os.stat(dest, follow_symlinks=False).st_mode):
        raise refuse(m.name, "is not a regular file")


__all__ = ["FORMAT", "MANIFEST", "base_id", "check_manifest", "digest", "export", "image_digest", "import_",
           "snapshot_digest"]
