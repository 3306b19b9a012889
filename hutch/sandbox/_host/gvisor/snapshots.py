"""Memory snapshots on disk: `state_dir()/memory-snapshots/<id>/` holds `meta.json` and `mem/` (runsc's image,
uncompressed); the filesystem is an image node of the layer store (the sandbox's writes as a layer over its
image), so a restore is a sandbox of that image with the memory put back.

Everything in a snapshot directory is input to check before use (it may come from another host through
export/import): the metadata is parsed with limits, the image files are regular files of known names whose
sizes add up to at most what the sandbox's memory limit allows, and the runsc build, platform and flags must
be this host's (a restore needs the same build: an image of another one fails to decode).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import stat
import time
from dataclasses import dataclass
from pathlib import Path

from hutch._core import paths, settings
from hutch._core.errors import ConfigError, NotFoundError, StateError

ID_RE = re.compile(r"^[0-9a-f]{32}\Z")
#: The files `runsc checkpoint --compression=none` writes (more than these: not an image of ours).
IMAGE_FILES = frozenset({"checkpoint.img", "pages_meta.img", "pages.img"})
#: What an image may hold beyond the sandbox's memory limit: the sentry's own state (6.5 MiB measured).
IMAGE_SLACK = 128 * 1024**2
META_MAX = 256 * 1024
#: meta.json's format. 2: `bundle` and `base` are required, and the bundle binds the root's own /tmp (a sandbox
#: of format 1 had runsc's tmpfs there: its restore would list other mounts than its checkpoint). A snapshot of
#: another format is refused (StateError naming both): take a new one.
FORMAT = 2


def total_max() -> int:
    """All memory snapshots of a host together (HUTCH_MEMORY_SNAPSHOTS_MAX, bytes): a snapshot past it is refused."""
    return settings.MEMORY_SNAPSHOTS_MAX.get()


def store_dir() -> Path:
    return paths.state_dir() / "memory-snapshots"


def new_id(node: str = "") -> str:
    """32 hex digits; on a fleet node (`node`: its key, when hex of at most 8 digits, as fleet keys are) the id
    starts with the key, so a caller that finds the snapshot on no node can say which node took it."""
    if node and len(node) <= 8 and not set(node) - set("0123456789abcdef"):
        return node + secrets.token_hex(16)[len(node):]
    return secrets.token_hex(16)


def path_of(snap_id: str) -> Path:
    if not isinstance(snap_id, str) or not ID_RE.match(snap_id):
        raise ConfigError(f"snapshot id {snap_id!r} must be 32 hex digits, as Sandbox.snapshot_memory() returns.")
    return store_dir() / snap_id


@dataclass(frozen=True)
class Meta:
    """A memory snapshot's metadata, checked."""

    id: str
    created_at: float
    runsc: str            # `runsc --version`'s first line: a restore needs the same build
    flags: tuple[str, ...]
    spec: dict            # the source's SandboxSpec.to_dict(), its image the snapshot's image node
    source: str
    memory_bytes: int
    bundle: str = ""      # runsc.bundle_id() of the host it was taken on: a restore needs the same
    base: str = ""        # the id of the base image its filesystem sits on (images.resolve_image(base).id)

    def to_dict(self) -> dict:
        return {"format": FORMAT, "id": self.id, "created_at": self.created_at, "runsc": self.runsc,
                "flags": list(self.flags), "spec": self.spec, "source": self.source,
                "memory_bytes": self.memory_bytes, "bundle": self.bundle, "base": self.base}

    @classmethod
    def from_dict(cls, d) -> "Meta":
        fmt = d.get("format") if isinstance(d, dict) else None
        if isinstance(fmt, int) and not isinstance(fmt, bool) and fmt != FORMAT:
            raise StateError(f"memory snapshot {str(d.get('id'))[:32]} is of snapshot format {fmt}; this hutch "
                             f"restores format {FORMAT} only (a sandbox's bundle differs between them); take a new "
                             "snapshot of a running sandbox with this hutch.")
        if not isinstance(d, dict) or fmt != FORMAT:
            raise ConfigError("this is not a memory snapshot of hutch (its meta.json has no format number); "
                              "take a new snapshot.")
        try:
            m = cls(id=str(d["id"]), created_at=float(d["created_at"]), runsc=str(d["runsc"]),
                    flags=tuple(str(f) for f in d["flags"]), spec=dict(d["spec"]), source=str(d["source"]),
                    memory_bytes=int(d["memory_bytes"]), bundle=str(d["bundle"]), base=str(d["base"]))
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(f"a memory snapshot's meta.json is malformed ({e}); take a new snapshot.") from e
        if not ID_RE.match(m.id) or len(m.flags) > 16 or m.memory_bytes < 0 or not 0 < len(m.bundle) <= 256 \
                or not 0 < len(m.base) <= 4096 or len(m.runsc) > 1024:
            raise ConfigError("a memory snapshot's meta.json is malformed (id, flags, bundle, base or size); take "
                              "a new snapshot.")
        return m


def write_meta(d: Path, meta: Meta) -> None:
    tmp = d / "meta.json.tmp"
    tmp.write_text(json.dumps(meta.to_dict()))
    os.replace(tmp, d / "meta.json")


def image_bytes(mem: Path) -> int:
    """The size of a runsc image directory, checked: regular files of the known names only, no links."""
    total = 0
    with os.scandir(mem) as it:
        for de in it:
            st = de.stat(follow_symlinks=False)
            if de.name not in IMAGE_FILES or not stat.S_ISREG(st.st_mode):
                raise ConfigError(f"memory snapshot {mem.parent.name} holds {de.name!r}, which no runsc image has; "
                                  "it is not a snapshot of ours: delete it.")
            total += st.st_size
    return total


def load(snap_id: str, *, runsc_version: str, flags: list[str], bundle: str = "") -> Meta:
    """The snapshot's checked metadata, refused unless this host can restore it (StateError naming why)."""
    d = path_of(snap_id)
    try:
        st = os.stat(d / "meta.json", follow_symlinks=False)
    except FileNotFoundError:
        raise NotFoundError(f"no memory snapshot {snap_id}; list them with hutch.Snapshot.list().") from None
    if not stat.S_ISREG(st.st_mode) or st.st_size > META_MAX:
        raise ConfigError(f"memory snapshot {snap_id}'s meta.json is not a small regular file; delete the snapshot.")
    meta = Meta.from_dict(json.loads((d / "meta.json").read_text()))
    if meta.id != snap_id:
        raise ConfigError(f"memory snapshot {snap_id} names itself {meta.id}; delete it.")
    if meta.runsc != runsc_version:
        raise StateError(f"memory snapshot {snap_id} was taken with {meta.runsc!r}, this host runs {runsc_version!r}; "
                         "a restore needs the same runsc build (install it, or take a new snapshot here).")
    if list(meta.flags) != flags:
        raise StateError(f"memory snapshot {snap_id} was taken with runsc flags {list(meta.flags)}, this host uses "
                         f"{flags}; take a new snapshot here.")
    if bundle and meta.bundle != bundle:
        raise StateError(f"memory snapshot {snap_id} was taken with another bundle ({meta.bundle[:40]}: the host busybox "
                         f"every gVisor sandbox has bound in), this host has {bundle[:40]}; take a new snapshot here.")
    size = image_bytes(d / "mem")
    limit = (meta.spec.get("limits") or {}).get("memory")
    if not isinstance(limit, int) or size > limit + IMAGE_SLACK or size != meta.memory_bytes:
        raise ConfigError(f"memory snapshot {snap_id}'s image ({size} bytes) does not match its metadata or exceeds "
                          "its sandbox's memory limit; delete it.")
    return meta


def total_bytes() -> int:
    total = 0
    root = store_dir()
    if not root.is_dir():
        return 0
    for d in root.iterdir():
        mem = d / "mem"
        if mem.is_dir():
            total += sum(f.stat().st_size for f in mem.iterdir() if f.is_file())
    return total


def make_dir(snap_id: str) -> Path:
    """A fresh directory for a snapshot being taken (`<id>.<daemon pid>.tmp`, renamed once complete); 0700
    root's. The pid: daemons of several run directories may share a state directory (remove_partial)."""
    root = store_dir()
    root.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = root / f"{snap_id}.{os.getpid()}.tmp"
    tmp.mkdir(mode=0o700)
    (tmp / "mem").mkdir(mode=0o700)
    return tmp


def complete(tmp: Path, snap_id: str) -> Path:
    final = store_dir() / snap_id
    os.rename(tmp, final)
    return final


def remove(snap_id: str) -> None:
    d = path_of(snap_id)
    if not d.exists():
        raise NotFoundError(f"no memory snapshot {snap_id}; list them with hutch.Snapshot.list().")
    shutil.rmtree(d)


_TMP_PID = re.compile(r"(?:^\.(?:export|import)-(\d+)-|\.(\d+)\.tmp\Z)")


def spool_prefix(kind: str) -> str:
    """The name an export or import spools its archive under (remove_partial tells whose it is)."""
    return f".{kind}-{os.getpid()}-"


def remove_partial() -> None:
    """At daemon start: a snapshot a crashed daemon was taking (or importing) is incomplete, and the archive
    an export or import spooled (`.export-<pid>-*.tmp`, `.import-<pid>-*.tmp`) is left over; only those of a
    daemon no longer running (another daemon sharing this state directory may be taking one now)."""
    root = store_dir()
    if root.is_dir():
        for d in root.glob("*.tmp"):
            m = _TMP_PID.search(d.name)
            pid = m and (m.group(1) or m.group(2))
            if pid and int(pid) != os.getpid() and os.path.exists(f"/proc/{pid}"):
                continue
            if not pid and time.time() - d.lstat().st_mtime < 3600:   # an older hutch's: whose is not known
                continue
            if d.is_dir() and not d.is_symlink():
                shutil.rmtree(d, ignore_errors=True)
            else:
                d.unlink(missing_ok=True)


def list_all() -> list[dict]:
    root = store_dir()
    out = []
    if root.is_dir():
        for d in sorted(root.iterdir()):
            if ID_RE.match(d.name) and (d / "meta.json").is_file():
                try:
                    meta = json.loads((d / "meta.json").read_text())
                    out.append({k: meta.get(k) for k in ("id", "format", "created_at", "source", "memory_bytes",
                                                         "runsc")}
                               | {"image": (meta.get("spec") or {}).get("image")})
                except (OSError, ValueError):
                    continue
    return out


def prefetch(mem: Path) -> None:
    """Ask the kernel to read the image ahead (a restore reads it through the page cache; an image written
    O_DIRECT (cgroup v2), imported, or evicted since is not cached, and a cold read doubles a restore of 256 MiB)."""
    for name in IMAGE_FILES:
        try:
            fd = os.open(mem / name, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
        finally:
            os.close(fd)


__all__ = ["Meta", "complete", "image_bytes", "list_all", "load", "make_dir", "new_id", "path_of", "prefetch",
           "remove", "remove_partial", "spool_prefix", "store_dir", "total_bytes", "total_max", "write_meta"]
