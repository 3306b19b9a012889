"""`MemoryFS`: the FUSE operations of a memory store's view (mfusepy over libfuse3).

Layout of the mount (see docs/fuse.md):

    /<class>/<slug>.md              the store's entities: read-write (read-only on a read-only mount)
    /<class>/<slug>.links/<rel>/    relations as relative symlinks (ln -s / rm make and remove links)
    /search/<query>/NN-<class>-<slug>.md   the query's hits, best first, read-only
    /search/<query>/.explain        which channels found each hit
    /as-of/<date>/<class>/<slug>.md what was valid on that date, read-only
    /profile.md                     a digest of the store, generated on read

Reads of entity files go straight to the file (pread on an fd). A write is
buffered from open to close and committed on flush (so close() reports a
failure) through `_write.commit_bytes`: one atomic, validated git commit whose
source is this mount's provenance. Other names written in a class directory
(an editor's or `sed -i`'s temp files) live in memory only, until renamed onto
an entity. Errors are errno values: ENOENT, EROFS, EACCES, EINVAL, EEXIST, EPERM.
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
from hutch.fuse._fs_write import SOURCE_WAIT, WriteOps, _err, _Handle, _pin_thread, open_regular
from hutch.fuse._kcache import DIRECT, ESTALE, KEEP, KernelCache, stat_key
from hutch.memory import _format as fmt

log = logging.getLogger("hutch.fuse")

#: Seconds a query directory's hits (and a profile or as-of listing) are reused before being computed again.
CACHE_SECONDS = 2.0
_LINKS = fmt.LINKS_SUFFIX
FUSE_CAP_ATOMIC_O_TRUNC = 1 << 3


class MemoryFS(WriteOps, Operations):
    """The view of one store. `source` is the provenance every write through it records."""

    use_ns = True

    def __init__(self, mem, *, writable: bool = True, source: str = "fuse"):
        self.mem = mem
        self.root = str(mem.root)
        self.writable = writable
        self.source = source
        self._handles: dict[int, _Handle] = {}
        self._next_fh = 1
        self._lock = threading.RLock()
        self._search_lock = threading.Lock()
        self._cache: dict[tuple, tuple[float, object]] = {}
        self._scratch: dict[str, bytearray] = {}   # mount path -> bytes of a temp file not (yet) an entity
        self._vdirs: set[str] = set()               # link directories made with mkdir, not yet holding a link
        self._pending: dict[str, _Handle] = {}      # mount path -> open write buffer (getattr shows its size)
        self._uid, self._gid = os.getuid(), os.getgid()
        self._t0 = time.time_ns()
        self.kcache = KernelCache(self.root)        # what the kernel holds, and invalidating it (_kcache.py)
        self.on_ready = None                        # called once the mount is live (see _mount.serve)
        #: set once `source` is final; a mount handed to a sandbox learns the sandbox's id after it starts
        self.source_known = threading.Event()
        self.source_known.set()
        #: what writes through the mount may add to the host's disk (a sandbox's disk limit; _quota.py), or None
        self.budget = None

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

    def _parts(self, path: str) -> list[str]:
        return [p for p in path.split("/") if p]

    def _store_path_ok(self, parts: list[str]) -> bool:
        """A path of the store's own tree that the view shows (no dot names at the top: .git, .hutch)."""
        return bool(parts) and not parts[0].startswith(".") and parts[0] not in _view.RESERVED

    def _need_writable(self) -> None:
        if not self.writable:
            raise _err(errno.EROFS)

    def _entity_id(self, parts: list[str]) -> str | None:
        if len(parts) == 2 and parts[1].endswith(".md") and not parts[1].startswith("."):
            try:
                fmt.split_id(f"{parts[0]}/{parts[1][:-3]}")
            except ConfigError:
                return None
            return f"{parts[0]}/{parts[1][:-3]}"
        return None

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
        if not self.source_known.wait(SOURCE_WAIT):
            log.warning("refused: the mount was never told which sandbox it serves")
            raise _err(errno.EIO)

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
            raise _err(errno.ENOENT) from None

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
            raise _err(errno.ENOENT) from None

    def _asof_ids(self, date: str) -> list[str]:
        head = self.mem.git.run("rev-parse", "-q", "--verify", "HEAD", check=False).strip()
        view = self._view_at(date)
        return self._cached(("asof", date, head), view.ls, ttl=60.0)

    def _asof_text(self, date: str, entity_id: str) -> bytes:
        if entity_id not in self._asof_ids(date):
            raise _err(errno.ENOENT)
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
            raise _err(errno.ENOENT)
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
            eid = self._entity_id(parts[2:])
            if eid is None:
                raise _err(errno.ENOENT)
            return self._asof_text(parts[1], eid)
        return None

    # ------------------------------------------------------------------ reading

    def getattr(self, path, fh=None):
        _pin_thread()
        parts = self._parts(path)
        if not parts:
            return self._dir_attr(0o755 if self.writable else 0o555)
        pend = self._pending.get(path)
        if pend is not None:
            self.kcache.seen.pop(path, None)  # not the file's attributes: the next open re-checks
            return self._file_attr(len(pend.data), 0o644)
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
                    raise _err(errno.ENOENT) from None
                self.kcache.seen[path] = stat_key(st)
                attr = self._stat_attr(st)
                attr["st_mode"] &= ~0o222  # read-only, as everything under search/
                return attr
            raise _err(errno.ENOENT)
        if top == _view.AS_OF_DIR:
            if len(parts) == 1:
                return self._dir_attr()
            ids = self._asof_ids(parts[1])
            if len(parts) == 2:
                return self._dir_attr()
            if len(parts) == 3:
                if any(i.startswith(parts[2] + "/") for i in ids):
                    return self._dir_attr()
                raise _err(errno.ENOENT)
            if len(parts) == 4:
                return self._gen_attr(path, self._generated(parts))
            raise _err(errno.ENOENT)
        if not self._store_path_ok(parts):
            raise _err(errno.ENOENT)
        if path in self._scratch:
            self.kcache.seen.pop(path, None)
            return self._file_attr(len(self._scratch[path]), 0o644)
        if path in self._vdirs:
            return self._dir_attr(0o755)
        try:
            st = os.lstat(self._real(path))
        except FileNotFoundError:
            self.kcache.seen.pop(path, None)
            raise _err(errno.ENOENT) from None
        self.kcache.seen[path] = stat_key(st)
        return self._stat_attr(st)

    def readdir(self, path, fh):
        _pin_thread()
        parts = self._parts(path)
        base = [".", ".."]
        if not parts:
            names = [e.name for e in os.scandir(self.root)
                     if e.is_dir(follow_symlinks=False) and self._store_path_ok([e.name])]
            return base + sorted(names) + [_view.SEARCH_DIR, _view.AS_OF_DIR, _view.PROFILE]
        top = parts[0]
        if top == _view.SEARCH_DIR:
            if len(parts) == 1:  # the queries asked lately
                with self._lock:
                    return base + sorted({k[1] for k in self._cache if k[0] == "search"})
            if len(parts) == 2:
                return base + [_view.EXPLAIN] + list(self._hit_files(parts[1]))
            raise _err(errno.ENOTDIR)
        if top == _view.AS_OF_DIR:
            if len(parts) == 1:
                with self._lock:
                    return base + sorted({k[1] for k in self._cache if k[0] == "asof"})
            ids = self._asof_ids(parts[1])
            if len(parts) == 2:
                return base + sorted({i.split("/", 1)[0] for i in ids})
            if len(parts) == 3:
                return base + [i.split("/", 1)[1] + ".md" for i in ids if i.startswith(parts[2] + "/")]
            raise _err(errno.ENOTDIR)
        if not self._store_path_ok(parts):
            raise _err(errno.ENOENT)
        names: set[str] = set()
        if path not in self._vdirs:
            try:
                names.update(os.listdir(self._real(path)))
            except FileNotFoundError:
                raise _err(errno.ENOENT) from None
        prefix = path.rstrip("/") + "/"
        with self._lock:
            for p in list(self._scratch) + list(self._vdirs) + list(self._pending):
                if p.startswith(prefix) and "/" not in p[len(prefix):]:
                    names.add(p[len(prefix):])
        names = {n for n in names if not n.startswith(".tmp-")}
        return base + sorted(names)

    def readlink(self, path):
        parts = self._parts(path)
        if not self._store_path_ok(parts):
            raise _err(errno.ENOENT)
        try:
            return os.readlink(self._real(path))
        except FileNotFoundError:
            raise _err(errno.ENOENT) from None

    def _new_handle(self, h: _Handle) -> int:
        with self._lock:
            fh = self._next_fh
            self._next_fh += 1
            self._handles[fh] = h
        return fh

    def open(self, path, fi):
        _pin_thread()
        parts = self._parts(path)
        flags = fi.flags
        wants_write = (flags & os.O_ACCMODE) != os.O_RDONLY or flags & os.O_TRUNC
        if parts and parts[0] in (_view.SEARCH_DIR, _view.AS_OF_DIR) or parts == [_view.PROFILE]:
            if wants_write:
                raise _err(errno.EROFS)
            hit = self._hit_path(parts)
            if hit is not None:
                return self._open_file(path, hit, fi)
            data = self._generated(parts)
            if data is None:
                raise _err(errno.EISDIR if len(parts) < 3 else errno.ENOENT)
            # generated anew: if its size differs from what getattr told, refresh the kernel's (as below)
            if self.kcache.check_open(path, (0, 0, len(data))) == ESTALE:
                raise _err(errno.ESTALE)
            self._hold(len(data))
            fi.fh = self._new_handle(_Handle("mem", path, data=data))
            fi.direct_io = 1  # generated on open: its size may differ from what getattr said a moment ago
            return 0
        if not self._store_path_ok(parts):
            raise _err(errno.ENOENT)
        if wants_write:
            self._need_writable()
            return self._open_write(path, parts, fi, flags)
        if path in self._scratch or path in self._pending:
            src = self._pending[path].data if path in self._pending else self._scratch[path]
            self._hold(len(src))
            fi.fh = self._new_handle(_Handle("mem", path, data=bytes(src)))
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
            raise _err(errno.ESTALE)
        fi.fh = self._new_handle(_Handle("fd", path, fd=fd))
        if hasattr(fi, "noflush"):
            fi.noflush = 1  # a reader's close() needs no FLUSH round trip (FOPEN_NOFLUSH)
        if how == KEEP:
            fi.keep_cache = 1   # else (DROP) the kernel drops the pages it holds of this file
        elif how == DIRECT:  # the retry found it changed once more: fresh bytes at least (see _kcache.py)
            fi.direct_io = 1
        return 0

    def read(self, path, size, offset, fi):
        _pin_thread()
        h = self._handles.get(fi.fh)
        if h is None:
            raise _err(errno.EBADF)
        if h.kind == "fd":
            return os.pread(h.fd, size, offset)
        with h.lock:
            return bytes(h.data[offset:offset + size])

    # ------------------------------------------------------------------ writing

    def statfs(self, path):
        st = os.statvfs(self.root)
        return {k: getattr(st, k) for k in ("f_bsize", "f_frsize", "f_blocks", "f_bfree", "f_bavail",
                                             "f_files", "f_ffree", "f_favail", "f_namemax")}
