"""What a mount changes: write buffers committed on flush, temp files, link directories, links, removals.

`Writes` is the part of a view (`MemoryFS` holds one and hands it every mutating FUSE operation) that
owns the changes in flight: the write buffer of each entity file open for writing, the temp files an
editor or `sed -i` makes (in memory only, until renamed onto an entity), and the link directories made
with mkdir (in memory until they hold a link). Its contract:

- every change to the store goes through `_write.commit_bytes` or a `hutch.Memory` call, so it is one
  validated git commit whose source is the mount's `Provenance` (the mount, or the sandbox it serves);
- what the mount holds in the server's memory is bounded (MAX_FILE_BYTES a file, MAX_BUFFERED_BYTES
  together, MAX_SCRATCH_FILES temp files and link directories), and what a sandbox's writes add to the
  disk is charged to its budget (_quota.py);
- a refused write leaves the store as it was; the writer's close() gets the errno.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import stat
import threading
from typing import Callable

from mfusepy import FuseOSError

from hutch._core.errors import ConfigError
from hutch.fuse import _view
from hutch.fuse._handles import APPEND, BUF, FD, Handle, Handles, errno_of, fuse_error, read_file
from hutch.fuse._write import commit_bytes
from hutch.memory import _format as fmt

log = logging.getLogger("hutch.fuse")

#: Seconds a write waits for the mount to learn its provenance (the sandbox id, right after the sandbox starts).
SOURCE_WAIT = 30.0
#: The largest file a write through the mount may make (EFBIG beyond): the server buffers a file until
#: close, and a sandbox must not make it allocate without bound (`truncate -s 1T`, a write at offset 2^40).
MAX_FILE_BYTES = 64 << 20
#: What the open files and temp files of one mount may hold in the server's memory together: write buffers
#: and temp files (ENOSPC beyond), and the copies a reader of a generated file or of a file being written
#: gets at open (ENOMEM beyond), so that many opens of one big file cannot exhaust the host's memory.
MAX_BUFFERED_BYTES = 256 << 20
#: How many temp files (names that are not entities), and how many empty link directories made with mkdir,
#: one mount keeps in memory at once (ENOSPC beyond).
MAX_SCRATCH_FILES = 1024
_LINKS = fmt.LINKS_SUFFIX


class Provenance:
    """Whose changes a mount makes: `source` (the Hutch-Source of its commits) and the disk `budget` they are
    charged to (None: no limit). A sandbox's mount learns both only once the sandbox runs (`learn`); until
    then `wait()` holds every write, query, profile and as-of, so that all of it names and is charged to it."""

    def __init__(self, source: str, *, known: bool = True):
        self.source = source
        self.budget = None
        self.known = threading.Event()
        if known:
            self.known.set()

    def learn(self, source: str, budget) -> None:
        """The mount serves `source` from now on, and its writes are charged to `budget` (a DiskBudget)."""
        self.budget = budget
        self.source = source
        self.known.set()

    def wait(self, what: str = "write") -> str:
        """The source, once known; EIO if the mount never learns it."""
        if not self.known.wait(SOURCE_WAIT):
            log.warning("%s refused: the mount was never told whom it serves", what)
            raise fuse_error(errno.EIO)
        return self.source

    def charged(self, mem, paths: list[str], data: bytes | None = None):
        """Around a change of the store: what it adds to the disk counts against the budget, if there is one
        (a sandbox's disk limit, _quota.py); ENOSPC (QuotaExceeded) past it."""
        if self.budget is None:
            return contextlib.nullcontext()
        return self.budget.charge(mem, paths, data)


class Writes:
    """The changes in flight of one mount of `mem` (see the module docstring). `on_change()` is called after
    every change to the store (the view drops what it cached of it); `kcache` is told which entity changed."""

    def __init__(self, mem, handles: Handles, provenance: Provenance, kcache, *, writable: bool,
                 on_change: Callable[[], None]):
        self.mem = mem
        self.root = str(mem.root)
        self.handles = handles
        self.provenance = provenance
        self.kcache = kcache
        self.writable = writable
        self.on_change = on_change
        self._lock = threading.RLock()
        self._scratch: dict[str, bytearray] = {}   # mount path -> bytes of a temp file not (yet) an entity
        self._vdirs: set[str] = set()               # link directories made with mkdir, not yet holding a link
        self._pending: dict[str, Handle] = {}      # mount path -> open write buffer (getattr shows its size)
        self._appenders: dict[str, list[Handle]] = {}   # mount path -> its open O_APPEND handles

    # ------------------------------------------------------------ what the view shows of it

    def pending_size(self, path: str) -> int | None:
        """The size of the entity file `path` as it is being written, None if no write buffer holds it."""
        pend = self._pending.get(path)
        return None if pend is None else len(pend.data)

    def scratch_size(self, path: str) -> int | None:
        """The size of the temp file `path`, None if there is none."""
        buf = self._scratch.get(path)
        return None if buf is None else len(buf)

    def unborn_size(self, path: str) -> int | None:
        """The size of an entity file that exists only as appends not committed yet (`echo x >> new.md` between
        its create and its close), None if there is none."""
        with self._lock:
            hs = self._appenders.get(path)
            return None if not hs else sum(len(h.data) for h in hs)

    def is_dir(self, path: str) -> bool:
        """True if `path` is a link directory made with mkdir that holds no link yet."""
        return path in self._vdirs

    def snapshot(self, path: str) -> bytes | None:
        """A copy of what `path` holds as it is being written, for a reader (None if it is not)."""
        src = self._pending[path].data if path in self._pending else self._scratch.get(path)
        if src is None:
            return None
        self.hold(len(src))
        return bytes(src)

    def names_in(self, dirpath: str) -> set[str]:
        """Names directly in the directory `dirpath` that exist only here (temp files, link dirs, buffers)."""
        prefix = dirpath.rstrip("/") + "/"
        with self._lock:
            return {p[len(prefix):] for p in (*self._scratch, *self._vdirs, *self._pending, *self._appenders)
                    if p.startswith(prefix) and "/" not in p[len(prefix):]}

    # ------------------------------------------------------------ limits

    def held(self, skip=None) -> int:
        """Bytes the server holds for this mount's open handles and temp files (each buffer once)."""
        with self._lock:
            bufs = {id(b): b for b in self._scratch.values()}
            for h in self._pending.values():
                bufs[id(h.data)] = h.data
        for b in self.handles.buffers():
            bufs[id(b)] = b
        bufs.pop(id(skip), None)
        return sum(map(len, bufs.values()))

    def _room(self, buf, size: int) -> None:
        """Refuse to let the buffer `buf` grow to `size` bytes past the mount's limits (EFBIG, ENOSPC)."""
        if size <= len(buf):
            return
        if size > MAX_FILE_BYTES:
            raise fuse_error(errno.EFBIG)
        if self.held(skip=buf) + size > MAX_BUFFERED_BYTES:
            raise fuse_error(errno.ENOSPC)
        budget = self.provenance.budget
        if budget is not None and size > budget.left():  # a full disk refuses the write itself
            raise fuse_error(errno.ENOSPC)

    def hold(self, size: int, err: int = errno.ENOMEM) -> None:
        """Refuse a new in-memory handle of `size` bytes past MAX_BUFFERED_BYTES (ENOMEM for a reader)."""
        if size and self.held() + size > MAX_BUFFERED_BYTES:
            raise fuse_error(err)

    def _need_writable(self) -> None:
        if not self.writable:
            raise fuse_error(errno.EROFS)

    def _real(self, path: str) -> str:
        return self.root + path

    # ------------------------------------------------------------ files

    def open(self, path: str, flags: int) -> Handle:
        """A handle for writing `path` (open with a write mode or O_TRUNC)."""
        self._need_writable()
        parts = _view.parts(path)
        eid = _view.entity_id(parts)
        if eid is not None and flags & os.O_APPEND and not flags & os.O_TRUNC:
            return self._appender(path, eid, new=False)
        with self._lock:
            pend = self._pending.get(path)
            if pend is not None:  # a second writer of the same file shares the buffer
                pend.refs += 1
                if flags & os.O_TRUNC:
                    pend.data = bytearray()
                    pend.dirty = True
                return pend
        if eid is None:
            if len(parts) != 2 or parts[1].startswith(".tmp-"):
                raise fuse_error(errno.EACCES)  # only entity files and temp files directly in a class dir
            if path not in self._scratch:
                raise fuse_error(errno.ENOENT)
            h = Handle(BUF, path, data=self._scratch[path], append=bool(flags & os.O_APPEND))
            if flags & os.O_TRUNC:
                h.data.clear()
            return h
        data = bytearray(b"" if flags & os.O_TRUNC else read_file(self._real(path)))
        self.hold(len(data), errno.ENOSPC)
        if flags & os.O_TRUNC and not os.path.lexists(self._real(path)):
            raise fuse_error(errno.ENOENT)
        h = Handle(BUF, path, data=data, entity_id=eid, dirty=bool(flags & os.O_TRUNC),
                   append=bool(flags & os.O_APPEND))
        with self._lock:
            self._pending[path] = h
        return h

    def _appender(self, path: str, eid: str, *, new: bool) -> Handle:
        """An O_APPEND handle: it holds only what is appended through it, never a copy of the file, and shares
        no buffer; each flush commits the file as it is then plus those bytes (see `_commit_appends`)."""
        try:
            st = os.lstat(self._real(path))
        except FileNotFoundError:
            st = None
        if st is not None and not stat.S_ISREG(st.st_mode):
            raise fuse_error(errno.EACCES)  # a link, FIFO or device planted in the store
        with self._lock:
            if st is None and not new and path not in self._appenders and path not in self._pending:
                raise fuse_error(errno.ENOENT)
            h = Handle(APPEND, path, data=bytearray(), entity_id=eid)
            self._appenders.setdefault(path, []).append(h)
        return h

    def create(self, path: str, flags: int) -> Handle:
        """A handle for a file made with O_CREAT: an entity (committed on flush) or a temp file."""
        self._need_writable()
        parts = _view.parts(path)
        if parts and parts[0] in _view.RESERVED:
            raise fuse_error(errno.EROFS)
        if not _view.is_store_path(parts) or len(parts) != 2:
            raise fuse_error(errno.EACCES)
        if not os.path.isdir(self._real("/" + parts[0])):
            raise fuse_error(errno.ENOENT)
        eid = _view.entity_id(parts)
        if eid is None or parts[1].startswith("."):
            if parts[1].startswith(".tmp-"):
                raise fuse_error(errno.EACCES)
            with self._lock:
                if path not in self._scratch and len(self._scratch) >= MAX_SCRATCH_FILES:
                    raise fuse_error(errno.ENOSPC)
                buf = self._scratch.setdefault(path, bytearray())
                buf.clear()
            return Handle(BUF, path, data=buf)
        if flags & os.O_APPEND and not flags & os.O_TRUNC:  # `echo x >> new.md`: nothing to truncate
            return self._appender(path, eid, new=True)
        if os.path.lexists(self._real(path)):
            return self.open(path, flags | os.O_TRUNC)
        h = Handle(BUF, path, data=bytearray(), entity_id=eid, dirty=True)
        with self._lock:
            self._pending[path] = h
        return h

    def write(self, h: Handle | None, data: bytes, offset: int) -> int:
        if h is not None and h.kind == APPEND:
            return self._append(h, data)
        if h is None or h.kind != BUF:
            raise fuse_error(errno.EBADF)
        with h.lock:
            if h.append:
                offset = len(h.data)
            try:
                self._room(h.data, offset + len(data))
            except FuseOSError as e:  # a file cut short is not committed (as if the write never began)
                h.refused, h.dirty = e.errno, False
                raise
            if offset > len(h.data):
                h.data.extend(b"\0" * (offset - len(h.data)))
            h.data[offset:offset + len(data)] = data
            h.dirty = h.written = True
        if h.entity_id is not None:
            with self._lock:  # written again after a flush: getattr shows it (unless a newer buffer is open)
                self._pending.setdefault(h.path, h)
        return len(data)

    def _append(self, h: Handle, data: bytes) -> int:
        """The kernel's offset is ignored: an append goes at the end of the file as it is when it commits."""
        with h.lock:
            try:
                if h.refused:
                    raise fuse_error(h.refused)
                try:
                    size = os.lstat(self._real(h.path)).st_size
                except FileNotFoundError:
                    size = 0
                size += len(h.data) + len(data)
                if size > MAX_FILE_BYTES:
                    raise fuse_error(errno.EFBIG)
                if self.held(skip=h.data) + len(h.data) + len(data) > MAX_BUFFERED_BYTES:
                    raise fuse_error(errno.ENOSPC)
                budget = self.provenance.budget
                if budget is not None and size > budget.left():  # a full disk refuses the write itself
                    raise fuse_error(errno.ENOSPC)
            except FuseOSError as e:  # nothing of this appender is committed any more (as for a buffer)
                h.refused = e.errno
                h.data.clear()
                raise
            h.data += data
            h.dirty = h.written = True
        return len(data)

    def read_appender(self, h: Handle, size: int, offset: int) -> bytes:
        """A read through an O_RDWR|O_APPEND descriptor: the file as it is, then what it appended since."""
        try:
            now = read_file(self._real(h.path))
        except FuseOSError as e:
            if e.errno != errno.ENOENT:
                raise
            now = b""
        with h.lock:
            return (now + bytes(h.data))[offset:offset + size]

    def truncate(self, path: str, length: int) -> None:
        self._need_writable()
        parts = _view.parts(path)
        h = self._pending.get(path)
        if h is None and path in self._scratch:
            buf = self._scratch[path]
            self._room(buf, length)
            del buf[length:]
            buf.extend(b"\0" * (length - len(buf)))
            return
        if h is not None:
            with h.lock:
                self._room(h.data, length)
                del h.data[length:]
                h.data.extend(b"\0" * (length - len(h.data)))
                h.dirty = True
            return
        eid = _view.entity_id(parts) if _view.is_store_path(parts) else None
        if eid is None:
            raise fuse_error(errno.EACCES if parts and parts[0] not in _view.RESERVED else errno.EROFS)
        self._room(b"", length)
        data = read_file(self._real(path))[:length]
        self._commit(eid, data.ljust(length, b"\0"))

    def flush(self, h: Handle | None) -> None:
        """close() of a descriptor of `h` (FUSE flush): commit what it wrote, so close() reports a failure."""
        if h is not None and h.kind == APPEND:
            self._commit_appends(h)
            return
        if h is None or h.kind != BUF or h.entity_id is None:
            return
        with h.lock:
            if h.refused:
                raise fuse_error(h.refused)
            # a shell closes a dup of the fd before it writes: an O_TRUNC alone is committed at release
            if not (h.dirty and h.written):
                return
            data = bytes(h.data)
            h.dirty = False
        self._commit(h.entity_id, data)
        with self._lock:  # committed: the file on disk is the truth again (release may come much later)
            if self._pending.get(h.path) is h:
                del self._pending[h.path]

    def release(self, h: Handle) -> None:
        """The last descriptor of `h` closed: commit what no flush did, and forget the buffer."""
        if h.kind == FD:
            os.close(h.fd)
            return
        if h.kind == APPEND:
            try:
                self._commit_appends(h)  # what no flush committed (nothing, after a close's flush)
            except FuseOSError:
                pass
            finally:
                with self._lock:
                    hs = self._appenders.get(h.path, [])
                    if h in hs:
                        hs.remove(h)
                    if not hs:
                        self._appenders.pop(h.path, None)
            return
        if h.kind == BUF and h.entity_id is not None:
            try:
                with h.lock:
                    dirty, data = h.dirty and not h.refused, bytes(h.data)
                    h.dirty = False
                if dirty:  # a writer that never flushed (or whose flush failed and wrote again)
                    self._commit(h.entity_id, data)
            except FuseOSError:
                pass
            finally:
                with self._lock:
                    h.refs -= 1
                    if h.refs <= 0 and self._pending.get(h.path) is h:
                        del self._pending[h.path]

    # ------------------------------------------------------------ committing

    def _commit(self, entity_id: str, data: bytes) -> None:
        source = self.provenance.wait()
        try:
            with self.provenance.charged(self.mem, [f"{entity_id}.md"], data):
                commit_bytes(self.mem, entity_id, data, source)
        except Exception as e:  # the writer's close() gets the errno; the log says why
            log.warning("write of %s through the mount refused: %s", entity_id, e)
            raise fuse_error(errno_of(e)) from None
        finally:
            self.on_change()
            # the committed file may differ from what was written (front matter added): the kernel drops
            # the pages and attributes it cached of it (hutch/fuse/_kcache.py)
            self.kcache.invalidate("/" + entity_id + ".md", force=True)

    def _commit_appends(self, h: Handle) -> None:
        """Commit what the appender `h` appended and no commit took yet: the file as it is now plus those bytes,
        read and written under the store's write lock, so appenders of one file (`echo a >> f & echo b >> f`)
        and commits through the API in between lose nothing and nothing lands twice. The bytes leave the
        handle before the commit: a failed commit drops them (the writer's close() got the errno)."""
        with h.committing:   # two flushes of one handle (dup'd descriptors) commit in the order written
            with h.lock:
                if h.refused:
                    raise fuse_error(h.refused)
                if not h.data:
                    return
                chunk = bytes(h.data)
                h.data.clear()
                h.dirty = False
            self.provenance.wait()   # before the lock: a sandbox's mount may wait for its provenance
            with self.mem.write_lock():
                try:
                    now = read_file(self._real(h.path))
                except FuseOSError as e:
                    if e.errno != errno.ENOENT:
                        raise
                    now = b""   # not made yet (or forgotten since): the appends are the new file's body
                self._commit(h.entity_id, now + chunk)

    # ------------------------------------------------------------ names

    def unlink(self, path: str) -> None:
        """`rm`: an entity is forgotten, a link unlinked, a temp file dropped."""
        self._need_writable()
        parts = _view.parts(path)
        if parts and parts[0] in _view.RESERVED:
            raise fuse_error(errno.EROFS)
        if not _view.is_store_path(parts):
            raise fuse_error(errno.ENOENT)
        with self._lock:
            if self._scratch.pop(path, None) is not None:
                return
        eid = _view.entity_id(parts)
        try:
            if eid is not None:
                src = self.provenance.wait()
                with self.provenance.charged(self.mem, [f"{eid}.md", f"{eid}{_LINKS}"]):
                    self.mem.forget(eid, reason=f"removed through the mount ({src})", source=src)
                return
            if len(parts) == 4 and parts[1].endswith(_LINKS):
                src = f"{parts[0]}/{parts[1][:-len(_LINKS)]}"
                target = self.mem.link_target("/".join(parts))
                if target is None:
                    raise fuse_error(errno.ENOENT)
                source = self.provenance.wait()
                with self.provenance.charged(self.mem, ["/".join(parts)]):
                    self.mem.unlink(src, parts[2], target, source=source)
                return
        except FuseOSError:
            raise
        except Exception as e:
            raise fuse_error(errno_of(e)) from None
        finally:
            self.on_change()
        raise fuse_error(errno.EACCES)

    def symlink(self, target: str, source: str) -> None:
        """`ln -s ../../../orgs/acme.md actors/alice-chen.links/works_at/acme.md` links two entities."""
        self._need_writable()
        parts = _view.parts(target)
        if len(parts) != 4 or not parts[1].endswith(_LINKS) or not _view.is_store_path(parts):
            raise fuse_error(errno.EACCES)  # links live only in '<class>/<slug>.links/<relation>/'
        src = f"{parts[0]}/{parts[1][:-len(_LINKS)]}"
        dest = os.path.normpath(os.path.join("/" + "/".join(parts[:3]), source))
        dparts = _view.parts(dest)
        dst = _view.entity_id(dparts) if not os.path.isabs(source) and _view.is_store_path(dparts) else None
        if dst is None:
            raise fuse_error(errno.EINVAL)  # a link must point, relatively, at an entity file of the store
        source = self.provenance.wait()
        try:
            with self.provenance.charged(self.mem, ["/".join(parts)]):
                self.mem.link(src, parts[2], dst, source=source)
        except Exception as e:
            raise fuse_error(errno_of(e)) from None
        finally:
            self.on_change()
        with self._lock:
            self._vdirs.discard("/" + "/".join(parts[:3]))
            self._vdirs.discard("/" + "/".join(parts[:2]))

    def mkdir(self, path: str) -> None:
        """A class directory (on disk, empty until an entity is written) or a link directory (in memory)."""
        self._need_writable()
        parts = _view.parts(path)
        if parts and parts[0] in _view.RESERVED:
            raise fuse_error(errno.EROFS)
        if not _view.is_store_path(parts):
            raise fuse_error(errno.EACCES)
        if os.path.lexists(self._real(path)) or path in self._vdirs:
            raise fuse_error(errno.EEXIST)
        try:
            if len(parts) == 1:
                fmt.check_class(parts[0])
                self.provenance.wait()  # a sandbox's mount: its disk budget is known from here on
                try:
                    with self.provenance.charged(self.mem, [parts[0]]):
                        os.mkdir(self._real(path), 0o755)  # an empty class directory: git ignores it until it holds one
                except OSError as e:
                    raise fuse_error(e.errno or errno.EIO) from None
                return
            if len(parts) in (2, 3) and parts[1].endswith(_LINKS):
                if not self.mem.exists(f"{parts[0]}/{parts[1][:-len(_LINKS)]}"):
                    raise fuse_error(errno.ENOENT)
                if len(parts) == 3:
                    fmt.check_relation(parts[2])
                with self._lock:
                    if len(self._vdirs) >= MAX_SCRATCH_FILES:  # they live in memory until they hold a link
                        raise fuse_error(errno.ENOSPC)
                    self._vdirs.add(path)
                return
        except ConfigError:
            raise fuse_error(errno.EINVAL) from None
        raise fuse_error(errno.EACCES)

    def rmdir(self, path: str) -> None:
        self._need_writable()
        parts = _view.parts(path)
        if parts and parts[0] in _view.RESERVED:
            raise fuse_error(errno.EROFS)
        with self._lock:
            if path in self._vdirs:
                self._vdirs.discard(path)
                return
        if len(parts) == 1 and _view.is_store_path(parts):
            try:
                with self.provenance.charged(self.mem, [parts[0]]):
                    os.rmdir(self._real(path))
                return
            except OSError as e:
                raise fuse_error(e.errno) from None
        raise fuse_error(errno.EACCES)

    def rename(self, old: str, new: str) -> None:
        """Renaming a temp file onto an entity commits it (editors, `sed -i`); entities keep their names."""
        self._need_writable()
        op, np = _view.parts(old), _view.parts(new)
        if any(p and p[0] in _view.RESERVED for p in (op, np)):
            raise fuse_error(errno.EROFS)
        with self._lock:
            data = self._scratch.get(old)
        if data is None:
            raise fuse_error(errno.EPERM if _view.entity_id(op) else errno.EACCES)
        eid = _view.entity_id(np) if _view.is_store_path(np) else None
        if eid is None:
            # a temp file stays a temp file of a class directory: not `.gitattributes` at the top, nor anywhere
            # the view does not show (it would only hold memory)
            if len(np) != 2 or not _view.is_store_path(np) or np[1].startswith(".tmp-"):
                raise fuse_error(errno.EACCES)
            if not os.path.isdir(self._real("/" + np[0])):
                raise fuse_error(errno.ENOENT)
            with self._lock:
                self._scratch[new] = self._scratch.pop(old)
            return
        self._commit(eid, bytes(data))
        with self._lock:
            self._scratch.pop(old, None)

    def accept_metadata(self) -> None:
        """chmod, chown, utimens: accepted and ignored on a writable mount (no set-id bit reaches the store)."""
        self._need_writable()
