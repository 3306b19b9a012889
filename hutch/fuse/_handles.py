"""The open files of a view: handles, the table FUSE's file handles (fh) name them by, and file access helpers.

A handle is one of: an entity file being read (its fd: reads are preads, nothing is copied), generated
bytes (a copy made at open: profile.md, an as-of version, .explain, a file being written), a whole-file
write buffer, or an appender (only the bytes appended through it). The write kinds belong to _writes.py.
"""

from __future__ import annotations

import ctypes
import errno
import os
import stat
import threading
from dataclasses import dataclass, field

from mfusepy import FuseOSError

from hutch._core.errors import (
    ConfigError, EntityExistsError, EntityNotFoundError, MalformedEntityError, NotFoundError,
)

#: Handle kinds: an entity file read in place, bytes copied at open, a whole-file write buffer, an appender.
FD, MEM, BUF, APPEND = "fd", "mem", "buf", "append"


def fuse_error(code: int) -> FuseOSError:
    """The exception a FUSE operation raises to answer `code` (an errno)."""
    return FuseOSError(code)


def errno_of(e: BaseException) -> int:
    """The errno a store error maps to."""
    if isinstance(e, FuseOSError):
        return e.errno
    if isinstance(e, (EntityNotFoundError, NotFoundError)):
        return errno.ENOENT
    if isinstance(e, EntityExistsError):
        return errno.EEXIST
    if isinstance(e, (MalformedEntityError, ConfigError)):
        return errno.EINVAL
    if isinstance(e, OSError) and e.errno:
        return e.errno
    return errno.EIO


_tls = threading.local()


def pin_thread() -> None:
    """Give this libfuse worker thread a Python thread state for good. A ctypes callback from a thread that
    Python did not start otherwise creates and destroys one per request: cat p50 104 -> 142 us measured
    side by side. (libfuse keeps its idle workers, so there is one state per worker, never more.)"""
    if not getattr(_tls, "pinned", False):
        ctypes.pythonapi.PyGILState_Ensure()  # never released: the state lives as long as the thread
        _tls.pinned = True


def open_regular(path: str) -> tuple[int, os.stat_result]:
    """An fd of a regular file of the store, never through a symlink (one planted in a class directory
    could otherwise lead out of the store) and never of a FIFO or device planted there (opening a FIFO
    blocks until a writer comes: O_NONBLOCK, then the type is checked on the fd). EACCES otherwise.
    Returns the fd and its fstat."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        raise fuse_error(errno.ENOENT) from None
    except OSError as e:
        raise fuse_error(errno.EACCES if e.errno in (errno.ELOOP, errno.ENXIO) else (e.errno or errno.EIO)) from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise fuse_error(errno.EACCES)
    return fd, st  # O_NONBLOCK means nothing to a regular file


def read_file(path: str) -> bytes:
    """The bytes of a regular file of the store (see `open_regular`)."""
    with os.fdopen(open_regular(path)[0], "rb") as f:
        return f.read()


@dataclass
class Handle:
    """One open file of the view. `kind` is FD (an entity file read by `fd`), MEM (bytes copied at open), BUF
    (a write: `data` is the whole file) or APPEND (an O_APPEND write: `data` is what it appended and has not
    committed yet); _writes.py keeps what a write handle means."""

    kind: str
    path: str
    fd: int = -1
    data: bytes | bytearray = b""
    entity_id: str | None = None   # set for a write that commits to an entity
    dirty: bool = False
    append: bool = False           # a temp file opened O_APPEND: writes go to its end
    written: bool = False          # a write() came: flush commits (a bare O_TRUNC waits for release)
    refused: int = 0               # the errno a write was refused with (EFBIG, ENOSPC): nothing is committed
    refs: int = 1
    lock: threading.Lock = field(default_factory=threading.Lock)
    #: held while an APPEND handle's bytes are committed, so two flushes of it commit in the order written
    committing: threading.Lock = field(default_factory=threading.Lock)


class Handles:
    """fh -> Handle for one mount. Safe from any thread."""

    def __init__(self):
        self._table: dict[int, Handle] = {}
        self._next = 1
        self._lock = threading.Lock()

    def add(self, h: Handle) -> int:
        """Register `h`; its fh."""
        with self._lock:
            fh = self._next
            self._next += 1
            self._table[fh] = h
        return fh

    def get(self, fh: int) -> Handle | None:
        return self._table.get(fh)

    def pop(self, fh: int) -> Handle | None:
        with self._lock:
            return self._table.pop(fh, None)

    def buffers(self) -> list:
        """The in-memory bytes every open handle holds (a buffer shared by several handles: once per handle)."""
        with self._lock:
            return [h.data for h in self._table.values() if h.kind != FD]
