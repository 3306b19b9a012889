"""`MemoryFS`: the FUSE operations of a memory store's view (mfusepy over libfuse3).

Layout of the mount (see docs/fuse.md):

    /<class>/<slug>.md              the store's entities: read-write (read-only on a read-only mount)
    /<class>/<slug>.links/<rel>/    relations as relative symlinks (ln -s / rm make and remove links)
    /search/<query>/NN-<class>-<slug>.md   the query's hits, best first, read-only
    /search/<query>/.explain        which channels found each hit
    /as-of/<date>/<class>/<slug>.md what was valid on that date, read-only
    /profile.md                     a digest of the store, generated on read

`MemoryFS` routes each operation by path: reads of entity files go straight to the file (pread on an
fd, `_handles.py`), generated files are rendered by `_view.py`, and every change is handed to the mount's
`Writes` (`_writes.py`), which buffers a write from open to flush and commits it through
`_write.commit_bytes`: one atomic, validated git commit whose source is this mount's `Provenance`.
Errors are errno values: ENOENT, EROFS, EACCES, EINVAL, EEXIST, EPERM.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import threading
import time

from mfusepy import Operations

from hutch._core.errors import ConfigError, MemoryStoreError
from hutch.fuse import _view
from hutch.fuse._handles import APPEND, FD, MEM, Handle, Handles, fuse_error, open_regular, pin_thread
from hutch.fuse._kcache import DIRECT, ESTALE, KEEP, KernelCache, stat_key
from hutch.fuse._writes import Provenance, Writes

log = logging.getLogger("hutch.fuse")

#: Seconds a query directory's hits (and a profile or as-of listing) are reused before being computed again.
CACHE_SECONDS = 2.0
FUSE_CAP_ATOMIC_O_TRUNC = 1 << 3


class MemoryFS(Operations):
    """The view of one store. `source` is the provenance every write through it records; `source_known=False`
    holds writes and queries until `provenance.learn()` names it (a sandbox's mount, see _mount.py)."""

    use_ns = True

    def __init__(self, mem, *, writable: bool = True, source: str = "fuse", source_known: bool = True):
        self.mem = mem
        self.root = str(mem.root)
        self.writable = writable
        self._lock = threading.RLock()
        self._search_lock = threading.Lock()
        self._cache: dict[tuple, tuple[float, object]] = {}
        self._uid, self._gid = os.getuid(), os.getgid()
        self._t0 = time.time_ns()
        self.kcache = KernelCache(self.root)        # what the kernel holds, and invalidating it (_kcache.py)
        self.on_ready = None                        # called once the mount is live (see _mount.serve)
        self.handles = Handles()                    # fh -> open file (_handles.py)
        #: whose writes these are, and the disk budget they count against (a sandbox's, once it runs)
        self.provenance = Provenance(source, known=source_known)
        #: every change through the mount: write buffers, temp files, link dirs, commits (_writes.py)
        self.writes = Writes(mem, self.handles, self.provenance, self.kcache, writable=writable,
                             on_change=self._invalidate)

    # ------------------------------------------------------------------ lifecycle

    def init_with_config(self, conn, config):
        if conn is not None:
            # O_TRUNC arrives with open() instead of as a separate truncate: `echo x > f.md` is one commit
            conn.want |= FUSE_CAP_ATOMIC_O_TRUNC & conn.capable
        self.kcache.attach()
        self.kcache.watch()
        log.debug("fuse conn capable=%#x want=%#x", getattr(conn, "capable", 0), getattr(conn, "want", 0))
        if self.on_ready is not None:
            self.on_ready()

    def destroy(self, path):
        self.kcache.stop()

    # ------------------------------------------------------------------ helpers

    def _real(self, path: str) -> str:
        return self.root + path

    def _cached(self, key: tuple, make, ttl: float = CACHE_SECONDS):
        now = time.monotonic()
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None and now - hit[0] < ttl:
                return hit[1]
        value = make()
        with self._lock:
            self._cache[key] = (time.monotonic(), value)
            if len(self._cache) > 256:
                oldest = sorted(self._cache.items(), key=lambda kv: kv[1][0])[:64]
                for k, _ in oldest:
                    self._cache.pop(k, None)
        return value

    def _invalidate(self) -> None:
        with self._lock:
            self._cache = {k: v for k, v in self._cache.items() if k[0] == "asof-text"}

    def _dir_attr(self, mode: int = 0o555) -> dict:
        return {"st_mode": stat.S_IFDIR | mode, "st_nlink": 2, "st_uid": self._uid, "st_gid": self._gid,
                "st_mtime": self._t0, "st_ctime": self._t0, "st_atime": self._t0}

    def _file_attr(self, size: int, mode: int = 0o444, mtime: int | None = None) -> dict:
        t = self._t0 if mtime is None else mtime
        return {"st_mode": stat.S_IFREG | mode, "st_nlink": 1, "st_size": size, "st_uid": self._uid,
                "st_gid": self._gid, "st_mtime": t, "st_ctime": t, "st_atime": t}

    def _gen_attr(self, path: str, data: bytes) -> dict:
        self.kcache.seen[path] = (0, 0, len(data))  # open compares: a size that changed since is refreshed
        return self._file_attr(len(data))

    def _stat_attr(self, st: os.stat_result) -> dict:
        mode = st.st_mode
        if not self.writable:
            mode &= ~0o222
        return {"st_mode": mode, "st_nlink": st.st_nlink, "st_size": st.st_size, "st_uid": st.st_uid,
                "st_gid": st.st_gid, "st_mtime": st.st_mtime_ns, "st_ctime": st.st_ctime_ns,
                "st_atime": st.st_atime_ns, "st_ino": st.st_ino}

    # ------------------------------------------------------------------ generated content

    def _charged_to_sandbox(self) -> None:
        """Work done for a sandbox (searching, reading history) waits until the server has joined the sandbox's
        cgroups, so that none of it is charged to the host (a moment after the sandbox starts)."""
        self.provenance.wait("a query")

    def _hits(self, query: str):
        self._charged_to_sandbox()

        def run():
            with self._search_lock:
                t = time.perf_counter()
                hits = list(self.mem.search(query, k=_view.SEARCH_K))
                log.debug("search %r: %d hits in %.1f ms", query, len(hits), (time.perf_counter() - t) * 1e3)
                return hits
        try:
            return self._cached(("search", query), run)
        except ConfigError:
            raise fuse_error(errno.ENOENT) from None

    def _hit_files(self, query: str) -> dict[str, str]:
        return {_view.hit_name(i, h.entity_id, h.anchor): h.entity_id
                for i, h in enumerate(self._hits(query), 1)}

    def _profile(self) -> bytes:
        self._charged_to_sandbox()

        def make():
            commits = self.mem.git.log(limit=10)
            return _view.profile(self.mem, commits=commits, ids=self.mem.ls(), links=list(self.mem.iter_links()))
        return self._cached(("profile",), make, ttl=1.0)

    def _view_at(self, date: str):
        self._charged_to_sandbox()
        try:
            return self.mem.as_of(date)
        except (ConfigError, MemoryStoreError, ValueError):
            raise fuse_error(errno.ENOENT) from None

    def _asof_ids(self, date: str) -> list[str]:
        head = self.mem.git.run("rev-parse", "-q", "--verify", "HEAD", check=False).strip()
        view = self._view_at(date)
        return self._cached(("asof", date, head), view.ls, ttl=60.0)

    def _asof_text(self, date: str, entity_id: str) -> bytes:
        if entity_id not in self._asof_ids(date):
            raise fuse_error(errno.ENOENT)
        head = self.mem.git.run("rev-parse", "-q", "--verify", "HEAD", check=False).strip()
        view = self._view_at(date)
        return self._cached(("asof-text", date, entity_id, head),
                            lambda: view.get(entity_id).text.encode("utf-8", "surrogateescape"), ttl=60.0)

    def _hit_path(self, parts: list[str]) -> str | None:
        """The entity file a query hit (`search/<query>/NN-...md`) shows, None if `parts` is not a hit. It is
        served from the file like the entity itself (never copied into memory: a hit may be a 64 MiB file)."""
        if len(parts) != 3 or parts[0] != _view.SEARCH_DIR or parts[2] == _view.EXPLAIN:
            return None
        eid = self._hit_files(parts[1]).get(parts[2])
        if eid is None:
            raise fuse_error(errno.ENOENT)
        return os.path.join(self.root, eid + ".md")

    def _generated(self, parts: list[str]) -> bytes | None:
        """The bytes of a generated file, None if `parts` is not one (raises ENOENT for a missing one)."""
        if parts == [_view.PROFILE]:
            return self._profile()
        if parts[0] == _view.SEARCH_DIR and len(parts) == 3:
            query = parts[1]
            if parts[2] == _view.EXPLAIN:
                return _view.explain(query, self._hits(query))
            return None  # a hit: the entity's own file (_hit_path)
        if parts[0] == _view.AS_OF_DIR and len(parts) == 4:
            eid = _view.entity_id(parts[2:])
            if eid is None:
                raise fuse_error(errno.ENOENT)
            return self._asof_text(parts[1], eid)
        return None

    # ------------------------------------------------------------------ reading

    def getattr(self, path, fh=None):
        pin_thread()
        parts = _view.parts(path)
        if not parts:
            return self._dir_attr(0o755 if self.writable else 0o555)
        size = self.writes.pending_size(path)
        if size is not None:
            self.kcache.seen.pop(path, None)  # not the file's attributes: the next open re-checks
            return self._file_attr(size, 0o644)
        top = parts[0]
        if top == _view.PROFILE and len(parts) == 1:
            return self._gen_attr(path, self._profile())
        if top == _view.SEARCH_DIR:
            if len(parts) == 1:
                return self._dir_attr()
            if len(parts) == 2:
                self._hits(parts[1])
                return self._dir_attr()
            if len(parts) == 3:
                hit = self._hit_path(parts)
                if hit is None:
                    return self._gen_attr(path, self._generated(parts))
                try:
                    st = os.lstat(hit)
                except FileNotFoundError:
                    raise fuse_error(errno.ENOENT) from None
                self.kcache.seen[path] = stat_key(st)
                attr = self._stat_attr(st)
                attr["st_mode"] &= ~0o222  # read-only, as everything under search/
                return attr
            raise fuse_error(errno.ENOENT)
        if top == _view.AS_OF_DIR:
            if len(parts) == 1:
                return self._dir_attr()
            ids = self._asof_ids(parts[1])
            if len(parts) == 2:
                return self._dir_attr()
            if len(parts) == 3:
                if any(i.startswith(parts[2] + "/") for i in ids):
                    return self._dir_attr()
                raise fuse_error(errno.ENOENT)
            if len(parts) == 4:
                return self._gen_attr(path, self._generated(parts))
            raise fuse_error(errno.ENOENT)
        if not _view.is_store_path(parts):
            raise fuse_error(errno.ENOENT)
        size = self.writes.scratch_size(path)
        if size is not None:
            self.kcache.seen.pop(path, None)
            return self._file_attr(size, 0o644)
        if self.writes.is_dir(path):
            return self._dir_attr(0o755)
        try:
            st = os.lstat(self._real(path))
        except FileNotFoundError:
            self.kcache.seen.pop(path, None)
            size = self.writes.unborn_size(path)
            if size is not None:   # made by `>>`, not committed yet
                return self._file_attr(size, 0o644)
            raise fuse_error(errno.ENOENT) from None
        self.kcache.seen[path] = stat_key(st)
        return self._stat_attr(st)

    def readdir(self, path, fh):
        pin_thread()
        parts = _view.parts(path)
        base = [".", ".."]
        if not parts:
            names = [e.name for e in os.scandir(self.root)
                     if e.is_dir(follow_symlinks=False) and _view.is_store_path([e.name])]
            return base + sorted(names) + [_view.SEARCH_DIR, _view.AS_OF_DIR, _view.PROFILE]
        top = parts[0]
        if top == _view.SEARCH_DIR:
            if len(parts) == 1:  # the queries asked lately
                with self._lock:
                    return base + sorted({k[1] for k in self._cache if k[0] == "search"})
            if len(parts) == 2:
                return base + [_view.EXPLAIN] + list(self._hit_files(parts[1]))
            raise fuse_error(errno.ENOTDIR)
        if top == _view.AS_OF_DIR:
            if len(parts) == 1:
                with self._lock:
                    return base + sorted({k[1] for k in self._cache if k[0] == "asof"})
            ids = self._asof_ids(parts[1])
            if len(parts) == 2:
                return base + sorted({i.split("/", 1)[0] for i in ids})
            if len(parts) == 3:
                return base + [i.split("/", 1)[1] + ".md" for i in ids if i.startswith(parts[2] + "/")]
            raise fuse_error(errno.ENOTDIR)
        if not _view.is_store_path(parts):
            raise fuse_error(errno.ENOENT)
        names: set[str] = set()
        if not self.writes.is_dir(path):
            try:
                names.update(os.listdir(self._real(path)))
            except FileNotFoundError:
                raise fuse_error(errno.ENOENT) from None
        names |= self.writes.names_in(path)
        names = {n for n in names if not n.startswith(".tmp-")}
        return base + sorted(names)

    def readlink(self, path):
        parts = _view.parts(path)
        if not _view.is_store_path(parts):
            raise fuse_error(errno.ENOENT)
        try:
            return os.readlink(self._real(path))
        except FileNotFoundError:
            raise fuse_error(errno.ENOENT) from None

    def open(self, path, fi):
        pin_thread()
        parts = _view.parts(path)
        flags = fi.flags
        wants_write = (flags & os.O_ACCMODE) != os.O_RDONLY or flags & os.O_TRUNC
        if parts and parts[0] in (_view.SEARCH_DIR, _view.AS_OF_DIR) or parts == [_view.PROFILE]:
            if wants_write:
                raise fuse_error(errno.EROFS)
            hit = self._hit_path(parts)
            if hit is not None:
                return self._open_file(path, hit, fi)
            data = self._generated(parts)
            if data is None:
                raise fuse_error(errno.EISDIR if len(parts) < 3 else errno.ENOENT)
            # generated anew: if its size differs from what getattr told, refresh the kernel's (as below)
            if self.kcache.check_open(path, (0, 0, len(data))) == ESTALE:
                raise fuse_error(errno.ESTALE)
            self.writes.hold(len(data))
            fi.fh = self.handles.add(Handle(MEM, path, data=data))
            fi.direct_io = 1  # generated on open: its size may differ from what getattr said a moment ago
            return 0
        if not _view.is_store_path(parts):
            raise fuse_error(errno.ENOENT)
        if wants_write:
            fi.fh = self.handles.add(self.writes.open(path, flags))
            return 0
        data = self.writes.snapshot(path)
        if data is not None:   # being written, or a temp file: a copy, read directly
            fi.fh = self.handles.add(Handle(MEM, path, data=data))
            fi.direct_io = 1
            return 0
        return self._open_file(path, self._real(path), fi)

    def _open_file(self, path: str, real: str, fi) -> int:
        """Open a file of the store for reading: reads go to its fd (pread), nothing is copied."""
        fd, st = open_regular(real)  # never a symlink, FIFO or device planted in the store
        # The kernel may hold this file's size and pages for cache_seconds: keep them if they are of this very
        # version. Otherwise the path walk before this open trusted a stale entry, and a splice reader (busybox
        # cat's sendfile) would stop at the old size: answer ESTALE, on which the kernel walks the path again
        # with a lookup per component (fresh size) and retries the open once; that open drops the pages.
        how = self.kcache.check_open(path, stat_key(st))
        if how == ESTALE:
            os.close(fd)
            raise fuse_error(errno.ESTALE)
        fi.fh = self.handles.add(Handle(FD, path, fd=fd))
        if hasattr(fi, "noflush"):
            fi.noflush = 1  # a reader's close() needs no FLUSH round trip (FOPEN_NOFLUSH)
        if how == KEEP:
            fi.keep_cache = 1   # else (DROP) the kernel drops the pages it holds of this file
        elif how == DIRECT:  # the retry found it changed once more: fresh bytes at least (see _kcache.py)
            fi.direct_io = 1
        return 0

    def read(self, path, size, offset, fi):
        pin_thread()
        h = self.handles.get(fi.fh)
        if h is None:
            raise fuse_error(errno.EBADF)
        if h.kind == FD:
            return os.pread(h.fd, size, offset)
        if h.kind == APPEND:
            return self.writes.read_appender(h, size, offset)
        with h.lock:
            return bytes(h.data[offset:offset + size])

    def statfs(self, path):
        st = os.statvfs(self.root)
        return {k: getattr(st, k) for k in ("f_bsize", "f_frsize", "f_blocks", "f_bfree", "f_bavail",
                                             "f_files", "f_ffree", "f_favail", "f_namemax")}

    # ------------------------------------------------------------------ writing: handed to self.writes

    def create(self, path, mode, fi):
        fi.fh = self.handles.add(self.writes.create(path, fi.flags))
        return 0

    def write(self, path, data, offset, fi):
        return self.writes.write(self.handles.get(fi.fh), data, offset)

    def truncate(self, path, length, fh=None):
        self.writes.truncate(path, length)
        return 0

    def flush(self, path, fi):
        self.writes.flush(self.handles.get(fi.fh))
        return 0

    def fsync(self, path, datasync, fi):
        return self.flush(path, fi)

    def release(self, path, fi):
        pin_thread()
        h = self.handles.pop(fi.fh)
        if h is not None:
            self.writes.release(h)
        return 0

    def unlink(self, path):
        self.writes.unlink(path)
        return 0

    def symlink(self, target, source):
        self.writes.symlink(target, source)
        return 0

    def mkdir(self, path, mode):
        self.writes.mkdir(path)
        return 0

    def rmdir(self, path):
        self.writes.rmdir(path)
        return 0

    def rename(self, old, new):
        self.writes.rename(old, new)
        return 0

    def chmod(self, path, mode):
        self.writes.accept_metadata()
        return 0

    def chown(self, path, uid, gid):
        self.writes.accept_metadata()
        return 0

    def utimens(self, path, times=None):
        self.writes.accept_metadata()
        return 0
