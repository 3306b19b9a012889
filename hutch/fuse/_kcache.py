"""The kernel's cache of the view, kept exact: what the kernel was told, and telling it when that changed.

The kernel may keep names, attributes and pages of the mount for `cache_seconds` (60 s by default), so a
`cat` costs one request (open) and reads from the page cache. That is only safe if every change reaches
the kernel before a reader can see stale bytes or a stale size (a sendfile/splice reader such as busybox
`cat` stops at the size the kernel holds). Three paths tell it; the last two through libfuse3's
`fuse_invalidate_path` (FUSE_NOTIFY_INVAL_INODE: attributes and pages of that inode are dropped),
after which the path is suspect (its next open answers ESTALE) until an open's re-lookup refreshed it:

- open: the server remembers (inode, mtime_ns, size) of each store file whose attributes it gave the
  kernel (`seen`; the size, for a generated file). An open that finds the file different (or suspect)
  answers ESTALE: the path walk before it trusted a stale entry, and an inode's size, which a splice
  read trusts, is only ever refreshed by a reply. The kernel answers ESTALE by walking the path again
  with a lookup per component (the new size) and retrying the open once, without the old pages. This
  is what makes "edit behind the mount, read at once" exact, whatever inotify has delivered yet.
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

# the libfuse mfusepy loaded (it has no public handle; loading one by name could pick another libfuse, whose
# request context would not be the one mfusepy's callbacks run in)
_lib = mfusepy._libfuse
_invalidate_path = getattr(_lib, "fuse_invalidate_path", None)
if _invalidate_path is not None:
    _invalidate_path.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
    _invalidate_path.restype = ctypes.c_int


#: Seconds an ESTALE answer waits for its retry before other openers of the path stop waiting with it.
RETRY_SECONDS = 1.0


KEEP, DROP, DIRECT, ESTALE = range(4)


def _opener() -> int:
    """The thread id of the process whose request is being served."""
    return _lib.fuse_get_context().contents.pid


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
        #: path -> when it was last invalidated, until an open's re-lookup refreshed it (check_open)
        self.suspect: dict[str, float] = {}
        self._fuse: int | None = None   # struct fuse *, learned in init (a request context)
        self._stop_r = self._stop_w = -1
        self._thread: threading.Thread | None = None

    def attach(self) -> None:
        """Learn the `struct fuse *` (call from init, which runs in a request context)."""
        ctx = _lib.fuse_get_context()
        if ctx and ctx.contents.fuse:
            self._fuse = ctx.contents.fuse

    def check_open(self, path: str, key: tuple[int, int, int]) -> int:
        """What an open of `path`, now at version `key`, answers: KEEP (the kernel's size and pages are of
        this version), ESTALE (the kernel must look the path up again; it then retries the open once),
        DROP (that retry, its re-lookup applied: drop the pages) or DIRECT (that retry, but the file or the
        kernel's view changed again meanwhile: direct reads, a size that may lag).

        It never invalidates the inode itself: an invalidation makes the kernel discard the reply of any
        lookup in flight (another reader's re-lookup), leaving the old size in the inode."""
        told = self.seen.get(path)
        if self.retried:
            asked = self.retried.pop((path, _opener()), None)
            if asked is not None:  # the retry: its re-lookup was sent after `asked`
                if told == key and self.suspect.get(path, 0.0) <= asked:
                    self.suspect.pop(path, None)  # a reply sent after the last invalidation was applied
                    return DROP
                return DIRECT
            now = time.monotonic()
            # another opener's re-lookup may not have reached the kernel yet, though its getattr updated `seen`
            if any(k[0] == path and now - t < RETRY_SECONDS for k, t in list(self.retried.items())):
                told = None
            elif len(self.retried) > 256:  # openers that never retried: forget them
                for k, t in list(self.retried.items()):
                    if now - t >= RETRY_SECONDS:
                        self.retried.pop(k, None)
        if told == key and path not in self.suspect:
            return KEEP
        self.retried[(path, _opener())] = time.monotonic()
        return ESTALE

    def invalidate(self, path: str, *, force: bool = False) -> None:
        """Drop the kernel's attributes and pages of `path` (only if it was told anything, unless `force`).
        The path stays suspect until an open's re-lookup has refreshed it: a lookup in flight meanwhile
        had its reply discarded, though its getattr recorded the new version in `seen`."""
        if self.seen.pop(path, None) is None and not force:
            return
        self.suspect[path] = time.monotonic()
        if self._fuse is None or _invalidate_path is None:
            return
        # -ENOENT: the kernel holds no inode for that path (never looked up, or forgotten): nothing to drop
        _invalidate_path(self._fuse, os.fsencode(path))

    def changed(self, path: str) -> None:
        """inotify says `path` may have changed: invalidate it unless the kernel already holds this version
        or an open's re-lookup is bringing it (invalidating would only make the kernel discard that reply)."""
        told = self.seen.get(path)
        if told is None or any(k[0] == path for k in list(self.retried)):
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
