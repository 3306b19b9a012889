"""What a sandbox's memory mount may add to the host's disk: the sandbox's `disk=` limit (ENOSPC beyond).

The store keeps every version of every file (git history), so what a sandbox writes through its mount
stays on the host's disk when the file is rewritten or removed. `DiskBudget` is charged, for each change
made through the mount, what it added to the store as it lies on disk: the working tree's growth (the
touched paths' blocks after minus before, so removing a file gives its blocks back), plus the loose
objects git wrote for it (the new version, the trees above it, the commit: whole blocks each), plus the
growth of git's index (a split one's shared part too) and reflogs. A change is refused with ENOSPC before
anything is written when its estimate (the new file's blocks, git's deflated copy of it, a few blocks of
trees and commit) would pass the limit; what it really added is then measured after its commit, under the
store's write lock, so that no other writer's commit is counted. The derived search index (.hutch/) is not counted: it is a cache.
"""

from __future__ import annotations

import errno
import os
import threading
import zlib
from contextlib import contextmanager

#: The unit a file system allocates in (ext4, xfs, tmpfs): a file of 1 byte takes one.
BLOCK = 4096
#: What a commit adds besides the file itself, as estimated before it: the trees above the file and the commit.
COMMIT_ESTIMATE = 3 * BLOCK
#: git's own files that a commit makes grow (every other one it writes is a new object; a split index's
#: shared files are measured too).
_GIT_FILES = (".git/index", ".git/logs")


class QuotaExceeded(OSError):
    """A change through the mount would pass the sandbox's disk limit (ENOSPC inside)."""

    def __init__(self, need: int, used: int, limit: int):
        super().__init__(errno.ENOSPC, f"the memory mount's disk budget is spent: {used} of {limit} bytes used, "
                                       f"this change needs about {need} more")


def _blocks(n: int) -> int:
    return -(-n // BLOCK) * BLOCK


def disk_usage(path: str) -> int:
    """Bytes that `path` takes on disk (st_blocks), a directory with everything in it; 0 if it is not there.
    Never follows a symlink."""
    try:
        st = os.lstat(path)
    except OSError:
        return 0
    total = st.st_blocks * 512
    if os.path.isdir(path) and not os.path.islink(path):
        stack = [path]
        while stack:
            try:
                with os.scandir(stack.pop()) as it:
                    for e in it:
                        try:
                            total += e.stat(follow_symlinks=False).st_blocks * 512
                        except OSError:
                            continue
                        if e.is_dir(follow_symlinks=False):
                            stack.append(e.path)
            except OSError:
                continue
    return total


def deflated_size(data: bytes) -> int:
    """The size of git's loose object of `data` (zlib at core.loosecompression 1, git's default), streamed."""
    z = zlib.compressobj(1)
    n = len(z.compress(b"blob %d\0" % len(data)))
    view = memoryview(data)
    for at in range(0, len(data), 1 << 20):
        n += len(z.compress(view[at:at + (1 << 20)]))
    return n + len(z.flush())


class DiskBudget:
    """The disk budget of one mount: `limit` bytes (the sandbox's disk limit), `used` so far."""

    def __init__(self, limit: int, root: str | None = None):
        self.limit = int(limit)
        self.used = 0
        #: what the last change cost besides its file (trees grow with their directory): the next estimate
        self.extra = COMMIT_ESTIMATE
        self._lock = threading.Lock()
        # git's object directories (objects/ab/) that exist: a new one is a block more on the disk
        self._fanout: set[str] = set()
        if root is not None:
            try:
                self._fanout = set(os.listdir(os.path.join(root, ".git", "objects")))
            except OSError:
                pass

    def left(self) -> int:
        """Bytes the mount may still add (a write whose file grows past this is refused at once)."""
        return max(0, self.limit - self.used)

    def estimate(self, root: str, paths: list[str], data: bytes | None) -> int:
        """What a change of `paths` (the new bytes `data` of the first, if it writes one) will add about."""
        need = 0
        if data is not None:
            before = disk_usage(os.path.join(root, paths[0]))
            need += max(0, _blocks(len(data)) - before) + _blocks(deflated_size(data))
        return need + self.extra

    @contextmanager
    def charge(self, mem, paths: list[str], data: bytes | None = None):
        """Around one change through the mount, holding the store's write lock: refuse it (QuotaExceeded)
        if it would pass the limit, else charge what it added once done (also if it failed half-way)."""
        root = str(mem.root)
        watched = [*paths, *_GIT_FILES]
        # the directories above the paths: one grows with its entries, a link makes two
        parents = {"/".join(p.split("/")[:i]) for p in paths for i in range(1, p.count("/") + 1)}
        with mem.write_lock():  # reentrant; no commit but this one between the two measures
            need = self.estimate(root, paths, data)
            with self._lock:
                if self.used + need > self.limit:
                    raise QuotaExceeded(need, self.used, self.limit)
            head = _head(mem)
            before = _measure(root, watched, parents)
            try:
                yield
            finally:
                objects, dirs = _new_objects(mem, head)
                fresh = dirs - self._fanout
                self._fanout |= fresh
                added = (_measure(root, watched, parents) - before + objects
                         + sum(_own_blocks(os.path.join(root, ".git", "objects", d)) for d in fresh))
                with self._lock:
                    self.used = max(0, self.used + added)
                    if objects:
                        self.extra = max(COMMIT_ESTIMATE, added - (need - self.extra))


def _own_blocks(path: str) -> int:
    """Disk bytes of `path` itself (a directory without what is in it); 0 if it is not there."""
    try:
        return os.lstat(path).st_blocks * 512
    except OSError:
        return 0


def _measure(root: str, watched: list[str], parents: set[str]) -> int:
    git = os.path.join(root, ".git")
    try:   # a split index (a big store's, see hutch/memory/_git.py) keeps most entries in a shared file
        shared = [os.path.join(git, n) for n in os.listdir(git) if n.startswith("sharedindex.")]
    except OSError:
        shared = []
    return (sum(disk_usage(os.path.join(root, p)) for p in watched) + sum(disk_usage(p) for p in shared)
            + sum(_own_blocks(os.path.join(root, d)) for d in parents))


def _head(mem) -> str:
    return mem.git.run("rev-parse", "-q", "--verify", "HEAD", check=False).strip()


def _new_objects(mem, before: str) -> tuple[int, set[str]]:
    """(disk bytes of the loose objects of the commits since `before`: the commit, its root tree and every
    object its diff names, the new blobs and the trees above them; the object directories they are in)."""
    out = mem.git.run("rev-parse", "HEAD", "HEAD^{tree}", check=False).split()
    if len(out) != 2 or out[0] == before:
        return 0, set()
    shas = set(out)
    if before:
        raw = mem.git.run("diff-tree", "-r", "-t", "-z", "--no-renames", before, out[0], check=False)
        fields = raw.split("\0")
        for meta in fields[0::2]:  # ":<old mode> <new mode> <old sha> <new sha> <status>", then the path
            parts = meta.split()
            if len(parts) == 5:
                shas.add(parts[3])
    total, dirs = 0, set()
    objects = os.path.join(str(mem.root), ".git", "objects")
    for sha in shas:
        if len(sha) == 40 and sha != "0" * 40:
            try:
                total += os.lstat(os.path.join(objects, sha[:2], sha[2:])).st_blocks * 512
                dirs.add(sha[:2])
            except OSError:
                pass  # already in a pack (or gone): nothing new on disk
    return total, dirs
