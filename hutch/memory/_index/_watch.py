"""Change notification for the freshness check: Linux inotify through ctypes (no dependency).

Statting every file of a 100,000-entity store costs about a second, far over
a query's budget. So the first query of a process scans everything, and
from then on an inotify watch on the store's directories (the root, each
class, each `.links` directory and relation directory) names the entities
whose file or links changed; only those are re-checked (stat, then hash).
The kernel queues an event the moment a write, rename or unlink returns, so
an edit by an editor, a shell or `git checkout` is seen by the very next
query. If the queue overflows, or watches cannot be added (the per-user
limit), the next query falls back to a full scan, which is always correct.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import struct
from pathlib import Path

_IN_NONBLOCK = os.O_NONBLOCK
_IN_CLOEXEC = os.O_CLOEXEC
IN_MODIFY = 0x002
IN_ATTRIB = 0x004
IN_CLOSE_WRITE = 0x008
IN_MOVED_FROM = 0x040
IN_MOVED_TO = 0x080
IN_CREATE = 0x100
IN_DELETE = 0x200
IN_DELETE_SELF = 0x400
IN_MOVE_SELF = 0x800
IN_Q_OVERFLOW = 0x4000
IN_IGNORED = 0x8000
IN_ONLYDIR = 0x01000000
IN_EXCL_UNLINK = 0x04000000
IN_ISDIR = 0x40000000
_MASK = (IN_MODIFY | IN_ATTRIB | IN_CLOSE_WRITE | IN_MOVED_FROM | IN_MOVED_TO | IN_CREATE | IN_DELETE
         | IN_DELETE_SELF | IN_MOVE_SELF | IN_ONLYDIR | IN_EXCL_UNLINK)
_EVENT = struct.Struct("iIII")
LINKS_SUFFIX = ".links"

_libc = None


def _lib():
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    return _libc


class Watcher:
    """Watches one store. `drain()` returns what changed since the last call; `broken` asks for a full scan."""

    def __init__(self, root: Path):
        self.root = root
        self.fd = -1
        self.wd: dict[int, tuple[str, str]] = {}  # wd -> (kind, key): ("root", ""), ("class", cls), ...
        self.broken = False  # overflow or a watch that could not be added: the caller must scan everything
        fd = _lib().inotify_init1(_IN_NONBLOCK | _IN_CLOEXEC)
        if fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init1 failed")
        self.fd = fd
        self._add(root, ("root", ""))
        for d in os.scandir(root):
            if not d.name.startswith(".") and d.is_dir(follow_symlinks=False):
                self._watch_class(d.name)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __del__(self):  # the fd must not outlive the index that owns it
        self.close()

    def _add(self, path: Path, what: tuple[str, str]) -> None:
        wd = _lib().inotify_add_watch(self.fd, os.fsencode(path), _MASK)
        if wd < 0:
            err = ctypes.get_errno()
            if err in (errno.ENOENT, errno.ENOTDIR):
                return  # gone already: its parent's event covers it
            self.broken = True  # ENOSPC (watch limit) and the like: fall back to scanning
            return
        self.wd[wd] = what

    def _watch_class(self, cls: str) -> None:
        cdir = self.root / cls
        self._add(cdir, ("class", cls))
        try:
            with os.scandir(cdir) as it:
                for e in it:
                    if e.name.endswith(LINKS_SUFFIX) and e.is_dir(follow_symlinks=False):
                        self._watch_links(f"{cls}/{e.name[:-len(LINKS_SUFFIX)]}")
        except OSError:
            pass

    def _watch_links(self, entity_id: str) -> None:
        ldir = self.root / (entity_id + LINKS_SUFFIX)
        self._add(ldir, ("links", entity_id))
        try:
            with os.scandir(ldir) as it:
                for r in it:
                    if r.is_dir(follow_symlinks=False):
                        self._add(Path(r.path), ("rel", entity_id))
        except OSError:
            pass

    def drain(self) -> tuple[set[str], set[str], set[str]]:
        """(entity ids whose file may have changed, entity ids whose links may have changed, classes to rescan)."""
        files: set[str] = set()
        links: set[str] = set()
        classes: set[str] = set()
        while True:
            try:
                buf = os.read(self.fd, 1 << 16)
            except BlockingIOError:
                break
            except OSError:
                self.broken = True
                break
            pos = 0
            while pos + _EVENT.size <= len(buf):
                wd, mask, _cookie, length = _EVENT.unpack_from(buf, pos)
                name = buf[pos + _EVENT.size:pos + _EVENT.size + length].rstrip(b"\0").decode("utf-8", "surrogateescape")
                pos += _EVENT.size + length
                if mask & IN_Q_OVERFLOW:
                    self.broken = True
                    continue
                what = self.wd.get(wd)
                if what is None:
                    continue
                if mask & IN_IGNORED:
                    self.wd.pop(wd, None)
                    continue
                kind, key = what
                isdir = bool(mask & IN_ISDIR)
                if kind == "root":
                    if mask & (IN_MOVE_SELF | IN_DELETE_SELF):
                        self.broken = True
                    elif isdir and not name.startswith("."):
                        if mask & (IN_CREATE | IN_MOVED_TO):
                            self._watch_class(name)
                        classes.add(name)
                elif kind == "class":
                    if mask & (IN_DELETE_SELF | IN_MOVE_SELF):
                        classes.add(key)
                    elif name.endswith(".md") and not name.startswith("."):
                        files.add(f"{key}/{name[:-3]}")
                    elif name.endswith(LINKS_SUFFIX) and not name.startswith("."):
                        eid = f"{key}/{name[:-len(LINKS_SUFFIX)]}"
                        if isdir and mask & (IN_CREATE | IN_MOVED_TO):
                            self._watch_links(eid)
                        links.add(eid)
                elif kind == "links":
                    if isdir and mask & (IN_CREATE | IN_MOVED_TO):
                        self._add(self.root / (key + LINKS_SUFFIX) / name, ("rel", key))
                    links.add(key)
                else:  # a relation directory
                    links.add(key)
        return files, links, classes
