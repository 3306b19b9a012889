"""Named volumes: plain directories under state_dir()/volumes/<name>, shared by the sandboxes that mount them.

The daemon does every host-side file call of a volume (`hutch.Volume.read/write/list/remove`)
through openat2(RESOLVE_IN_ROOT): a symlink that a sandbox planted in a volume resolves
inside the volume, never on the host.

Concurrent writers (documented in docs/images.md): a volume is one shared directory, no
locking across sandboxes; the last writer of a file wins; a rename is atomic (readers see
the old or the new file), and `Volume.write` writes a temp file and renames it.

Ownership: every sandbox maps its root to VOLUME_ID_BASE on a volume (an unprivileged host uid, the
same for all, so that one sandbox's files are another's), and what the daemon writes into one is
owned by that uid too; a volume made before that (host-root-owned) is shifted once on first use.
"""

from __future__ import annotations

import ctypes
import errno
import os
import secrets
import shutil
import stat
from pathlib import Path

from hutch._core import paths
from hutch._core.errors import ConfigError, NotFoundError
from hutch.sandbox._host.native.idmap import ID_COUNT, VOLUME_ID_BASE
from hutch.sandbox._spec import VOLUME_NAME_RE, check_volume_name

_NR_OPENAT2 = 437
_RESOLVE_NO_MAGICLINKS, _RESOLVE_NO_XDEV, _RESOLVE_IN_ROOT = 0x02, 0x01, 0x10
_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


def volumes_dir() -> Path:
    return paths.state_dir() / "volumes"


#: A tenant's volumes (`t.<tenant>.<name>`) live in its store, mounted at volumes_dir()/STORES/<tenant>
#: (daemon/volume_stores.py), once the daemon has mounted it.
STORES = ".stores"


def store_dir(tenant: str) -> Path:
    return volumes_dir() / STORES / tenant


def home(name: str) -> Path:
    """The directory that holds volume `name`: its tenant's store if that is mounted, else volumes_dir()."""
    if name.startswith("t."):
        d = store_dir(name[2:].partition(".")[0])
        if os.path.ismount(d):
            return d
    return volumes_dir()


def data_dir(name: str) -> Path:
    """The directory of an existing volume, owned as sandboxes see it; NotFoundError names the fix."""
    d = home(check_volume_name(name)) / name
    try:
        st = os.lstat(d)
    except FileNotFoundError:
        st = None
    if st is None or not stat.S_ISDIR(st.st_mode):
        raise NotFoundError(f"volume {name!r} does not exist; create it with "
                            f"hutch.Volume.from_name({name!r}, create=True).")
    if st.st_uid < ID_COUNT:
        _shift_ids(d)
    return d


def _shift_ids(root: Path) -> None:
    """Give a volume of an earlier version (its files host-root-owned) the volume ids: uid k -> VOLUME_ID_BASE + k.

    The root directory goes last, so an interrupted shift is done again (ids already shifted stay)."""
    def shift(fd_or_name, dir_fd=None):
        st = os.stat(fd_or_name, dir_fd=dir_fd, follow_symlinks=False)
        uid = st.st_uid + VOLUME_ID_BASE if st.st_uid < ID_COUNT else -1
        gid = st.st_gid + VOLUME_ID_BASE if st.st_gid < ID_COUNT else -1
        if uid != -1 or gid != -1:
            mode = stat.S_IMODE(st.st_mode)
            os.chown(fd_or_name, uid, gid, dir_fd=dir_fd, follow_symlinks=False)
            if not stat.S_ISLNK(st.st_mode) and mode & 0o6000:   # chown cleared them: no setuid bit survives
                os.chmod(fd_or_name, mode & 0o1777, dir_fd=dir_fd)

    for top, dirs, files, dfd in os.fwalk(root, topdown=False, follow_symlinks=False):
        for n in dirs + files:
            shift(n, dfd)
    shift(str(root))


def create(name: str, *, exist_ok: bool = True) -> dict:
    private_dir(volumes_dir())
    d = home(check_volume_name(name)) / name
    try:
        d.mkdir(mode=0o755)
        os.chown(d, VOLUME_ID_BASE, VOLUME_ID_BASE)   # root inside every sandbox
    except FileExistsError:
        if not exist_ok:
            raise ConfigError(f"volume {name!r} exists already; use it, or remove it first.") from None
    return info(name)


def private_dir(path: Path) -> None:
    """0700: a sandbox (root inside) can leave a setuid-root file in a volume; no host user may reach it."""
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(path, 0o700)


def info(name: str) -> dict:
    st = data_dir(name).stat()
    return {"name": name, "created_at": st.st_ctime}


def list_volumes() -> list[dict]:
    d = volumes_dir()
    if not d.is_dir():
        return []
    homes = [d] + [s for s in sorted((d / STORES).iterdir()) if os.path.ismount(s)] if (d / STORES).is_dir() else [d]
    names = {p.name for h in homes for p in h.iterdir() if p.is_dir() and VOLUME_NAME_RE.match(p.name)}
    out = []
    for n in sorted(names):
        try:
            out.append(info(n))
        except NotFoundError:   # a tenant's volume of before its store, not yet moved into it
            continue
    return out


def remove_volume(name: str) -> None:
    d = data_dir(name)
    trash = d.parent / f".trash-{name}-{secrets.token_hex(4)}"   # the same filesystem: a rename
    try:
        os.rename(d, trash)   # gone for everyone at once; the bytes go next
    except OSError as e:
        if e.errno not in (errno.EDQUOT, errno.ENOSPC):
            raise
        # a tenant's store at its quota has no room for the rename's new entry; deleting needs none
        shutil.rmtree(d)
        return
    shutil.rmtree(trash, ignore_errors=True)


# --- file calls, confined to the volume ---------------------------------------------------------

def _open(name: str, path: str, flags: int, mode: int = 0) -> int:
    if not isinstance(path, str) or not path or "\0" in path:
        raise ConfigError(f"path={path!r} must be a path inside the volume, like '/data.csv'.")
    root = os.open(data_dir(name), os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        how = _OpenHow(flags | os.O_CLOEXEC, mode, _RESOLVE_IN_ROOT | _RESOLVE_NO_MAGICLINKS | _RESOLVE_NO_XDEV)
        fd = _libc.syscall(_NR_OPENAT2, root, path.lstrip("/").encode() or b".", ctypes.byref(how),
                           ctypes.sizeof(how))
        if fd < 0:
            err = ctypes.get_errno()
            raise _file_error(err, name, path)
        return fd
    finally:
        os.close(root)


def _file_error(err: int, name: str, path: str) -> Exception:
    if err in (2, 20):   # ENOENT, ENOTDIR
        return NotFoundError(f"{path!r} does not exist in volume {name!r}; list it with vol.list('/').")
    return ConfigError(f"{path!r} in volume {name!r}: {os.strerror(err)}.")


def _split(path: str) -> tuple[str, str]:
    parent, _, base = path.strip("/").rpartition("/")
    if not base or base in (".", ".."):
        raise ConfigError(f"path={path!r} must name a file inside the volume, like '/dir/file.txt'.")
    return "/" + parent, base


def list_dir(name: str, path: str = "/") -> list[dict]:
    fd = _open(name, path, os.O_RDONLY | os.O_DIRECTORY)
    out = []
    try:
        with os.scandir(fd) as it:
            for e in it:
                try:
                    st = e.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                m = st.st_mode
                kind = "dir" if stat.S_ISDIR(m) else "file" if stat.S_ISREG(m) else "symlink" if stat.S_ISLNK(m) else "other"
                out.append({"name": e.name, "path": f"{path.rstrip('/')}/{e.name}", "type": kind,
                            "size": st.st_size, "mode": stat.S_IMODE(m), "mtime": st.st_mtime})
    finally:
        os.close(fd)
    return sorted(out, key=lambda d: d["name"])


def open_read(name: str, path: str) -> tuple[int, int]:
    fd = _open(name, path, os.O_RDONLY | os.O_NONBLOCK)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise ConfigError(f"{path!r} in volume {name!r} is not a regular file; use vol.list() for a directory.")
    return fd, st.st_size


def write(name: str, path: str, chunks, mode: int = 0o644) -> int:
    """Write a file from an iterable of bytes: a temp file beside it, renamed over it when complete."""
    parent, base = _split(path)
    pfd = _mkdirs(name, parent)
    tmp = f".hutch-write-{secrets.token_hex(6)}"
    mode &= 0o1777   # no setuid or setgid file from outside either
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=pfd)
    n = 0
    try:
        try:
            os.fchown(fd, VOLUME_ID_BASE, VOLUME_ID_BASE)   # root's inside, as if a sandbox wrote it
            for chunk in chunks:
                view = memoryview(chunk)
                while view:
                    view = view[os.write(fd, view):]
                n += len(chunk)
            os.fchmod(fd, mode)
        finally:
            os.close(fd)
        os.rename(tmp, base, src_dir_fd=pfd, dst_dir_fd=pfd)
    except BaseException:
        try:
            os.unlink(tmp, dir_fd=pfd)
        except OSError:
            pass
        raise
    finally:
        os.close(pfd)
    return n


def _mkdirs(name: str, parent: str) -> int:
    """Open `parent` in the volume, making missing directories; each step resolves in the volume's root."""
    fd = _open(name, "/", os.O_RDONLY | os.O_DIRECTORY)
    done = ""
    for part in [p for p in parent.split("/") if p]:
        done = f"{done}/{part}"
        try:
            os.mkdir(part, 0o755, dir_fd=fd)
            os.chown(part, VOLUME_ID_BASE, VOLUME_ID_BASE, dir_fd=fd, follow_symlinks=False)
        except FileExistsError:
            pass   # a directory, or a symlink that _open resolves inside the volume
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)
        fd = _open(name, done, os.O_RDONLY | os.O_DIRECTORY)
    return fd


def remove(name: str, path: str, *, recursive: bool = False) -> None:
    parent, base = _split(path)
    pfd = _open(name, parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        st = os.stat(base, dir_fd=pfd, follow_symlinks=False)
        if stat.S_ISDIR(st.st_mode):
            if recursive:
                shutil.rmtree(base, dir_fd=pfd)
            else:
                try:
                    os.rmdir(base, dir_fd=pfd)
                except OSError as e:
                    raise ConfigError(f"{path!r} in volume {name!r} is a non-empty directory; "
                                      "pass recursive=True to remove it with its contents.") from e
        else:
            os.unlink(base, dir_fd=pfd)
    except FileNotFoundError:
        raise _file_error(2, name, path) from None
    finally:
        os.close(pfd)


__all__ = ["create", "data_dir", "list_dir", "list_volumes", "open_read", "remove", "remove_volume", "write"]
