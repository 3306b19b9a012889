"""The kernel's cache of the view, kept exact: what the kernel was told, and telling it when that changed.

The kernel may keep names, attributes and pages of the mount for `cache_seconds` (60 s by default), so a
`cat` costs one request (open) and reads from the page cache. That is only safe if every change reaches
the kernel before a reader can see stale bytes or a stale size (a sendfile/splice reader such as busybox
`cat` stops at the size the kernel holds). Three paths tell it, each through libfuse3's
`fuse_invalidate_path` (FUSE_NOTIFY_INVAL_INODE: attributes and pages of that inode are dropped):

- open: the server remembers (inode, mtime_ns, size) of each store file whose attributes it gave the
  kernel (`seen`; the size, for a generated file). An open that finds the file different invalidates
  it and answers ESTALE (invalidating alone leaves the old size in the inode, which a splice read
  trusts): the path walk before the open trusted a stale entry, and the kernel answers
  ESTALE by walking the path again with a lookup per component (the new size) and retrying the open
  once. This is what makes "edit behind the mount, read at once" exact, also for a splice reader,
  whatever inotify has delivered yet.
- a write through the mount: the commit invalidates the entity (its bytes may differ from what was
  written: front matter added).
- inotify on the store (hutch/memory/_index/_watch.py, the index's own change detection): a change made
  behind the mount invalidates what the kernel holds of it within milliseconds, for `stat` and `ls -l`
  that never open. An overflowed queue invalidates everything the kernel was told.
"""

from __future__ import annotations

import ctypes
import logging
import os
import select
import threading
import time
from pathlib import Path

import mfusepy

log = logging.getLogger("hutch.fuse")

_lib = mfusepy._libfuse
_invalidate_path = getattr(_lib, "fuse_invalidate_path", None)
if _invalidate_path is not None:
    _invalidate_path.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
    _invalidate_path.restype = ctypes.c_int


#: Seconds an ESTALE answer waits for its retry before other openers of the path stop waiting with it.
RETRY_SECONDS = 1.0


def stat_key(st: os.stat_result) -> tuple[int, int, int]:
    """What identifies a version of a file: an atomic rewrite changes the inode, an edit in place mtime/size."""
    return st.st_ino, st.st_mtime_ns, st.st_size


class KernelCache:
    """Tracks what the kernel holds of store paths and invalidates it. Safe from any thread."""

    def __init__(self, root: str):
        self.root = root
        #: mount path -> stat_key of the attributes last given to the kernel for it
        self.seen: dict[str, tuple[int, int, int]] = {}
        #: (path, opener's thread id) answered ESTALE -> when: its retried open has not come yet. A retry is
        #: never refused again. While one is outstanding, other openers of that path are refused too: the
        #: getattr of the re-lookup records the new version before the kernel has applied the reply.
        self.retried: dict[tuple[str, int], float] = {}
        self._fuse: int | None = None   # struct fuse *, learned in init (a request context)
        self._stop_r = self._stop_w = -1
        self._thread: threading.Thread | None = None

    def attach(self) -> None:
        """Learn the `struct fuse *` (call from init, which runs in a request context)."""
        ctx = _lib.fuse_get_context()
        if ctx and ctx.contents.fuse:
            self._fuse = ctx.contents.fuse

    def fresh(self, path: str, st: os.stat_result) -> bool:
        """True if the kernel was told exactly this version of `path` (its cached pages and size are right)."""
        if self.seen.get(path) != stat_key(st):
            return False
        if self.retried:  # another opener's retry still to come: its re-lookup may not have reached the kernel
            me, now = (path, _lib.fuse_get_context().contents.pid), time.monotonic()
            return not any(k[0] == path and k != me and now - t < RETRY_SECONDS
                           for k, t in list(self.retried.items()))
        return True

    def stale_open(self, path: str) -> bool:
        """An open found `path` changed since the kernel was told: drop what the kernel holds. True if the
        open should fail with ESTALE (the kernel then looks the path up again and retries); False on that
        retry, which must not fail (it found the file changed once more)."""
        self.invalidate(path, force=True)
        key = (path, _lib.fuse_get_context().contents.pid)
        if self.retried.pop(key, None) is not None:
            return False
        if len(self.retried) > 256:  # openers that never retried: forget them
            now = time.monotonic()
            for k, t in list(self.retried.items()):
                if now - t >= RETRY_SECONDS:
                    self.retried.pop(k, None)
        self.retried[key] = time.monotonic()
        return True

    def opened(self, path: str) -> None:
        """An open of `path` found it fresh: its opener needs no retry any more."""
        if self.retried:
            self.retried.pop((path, _lib.fuse_get_context().contents.pid), None)

    def invalidate(self, path: str, *, force: bool = False) -> None:
        """Drop the kernel's attributes and pages of `path` (only if it was told anything, unless `force`)."""
        if self.seen.pop(path, None) is None and not force:
            return
        if self._fuse is None or _invalidate_path is None:
            return
        # -ENOENT: the kernel holds no inode for that path (never looked up, or forgotten): nothing to drop
        _invalidate_path(self._fuse, os.fsencode(path))

    def changed(self, path: str) -> None:
        """inotify says `path` may have changed: invalidate it unless the kernel already holds this version.
        (An event often arrives after a getattr that saw the new file: invalidating then would only make
        the kernel discard that reply, which a splice reader's stale size would show.)"""
        told = self.seen.get(path)
        if told is None:
            return
        try:
            now = stat_key(os.lstat(self.root + path))
        except OSError:
            now = None
        if now != told:
            self.invalidate(path)

    def invalidate_under(self, prefix: str) -> None:
        for p in [p for p in list(self.seen) if p == prefix or p.startswith(prefix + "/")]:
            self.invalidate(p)

    def invalidate_all(self) -> None:
        for p in list(self.seen):
            self.invalidate(p)

    # ------------------------------------------------------------------ changes behind the mount

    def watch(self) -> None:
        """Start a thread that invalidates what changes in the store behind the mount (inotify)."""
        from hutch.memory._index._watch import Watcher

        try:
            watcher = Watcher(Path(self.root))
        except OSError as e:
            log.warning("inotify unavailable (%s): a change behind the mount shows in stat after the kernel's "
                        "cache timeout (reads stay exact: each open checks the file)", e)
            return
        self._stop_r, self._stop_w = os.pipe2(os.O_CLOEXEC)
        self._thread = threading.Thread(target=self._run, args=(watcher,), name="hutch-fuse-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._stop_w >= 0:
            os.write(self._stop_w, b"x")
            if self._thread is not None:
                self._thread.join(5)
            for fd in (self._stop_r, self._stop_w):
                os.close(fd)
            self._stop_r = self._stop_w = -1

    def _run(self, watcher) -> None:
        from hutch.memory._index._watch import Watcher

        try:
            while True:
                ready, _, _ = select.select([watcher.fd, self._stop_r], [], [])
                if self._stop_r in ready:
                    return
                files, links, classes = watcher.drain()
                for eid in files:
                    self.changed(f"/{eid}.md")
                for eid in links:
                    self.invalidate(f"/{eid}.links")
                    self.invalidate_under(f"/{eid}.links")
                for cls in classes:
                    self.invalidate_under(f"/{cls}")
                if watcher.broken:  # overflow or a watch limit: what changed is unknown, so everything did
                    self.invalidate_all()
                    watcher.close()
                    watcher = Watcher(Path(self.root))
        except Exception:  # never take the server down; opens stay exact without this thread
            log.exception("the store watch stopped: stat may show a change behind the mount late")
        finally:
            watcher.close()
