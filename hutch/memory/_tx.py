"""The write path: a cross-process lock, and transactions that back up, write, and commit once.

Every write op runs inside a transaction (a lone op is a transaction of one).
The transaction holds an exclusive `flock` on `<store>/.hutch/write.lock`
from its first write until its commit, so writers in other processes queue
instead of interleaving; readers never lock (renames are atomic). Each file
touched is backed up in memory first, so a failure rolls the working tree back
to exactly what it was: nothing is half-written.
"""

from __future__ import annotations

import fcntl
import os
import threading
from pathlib import Path

from hutch._core.atomic import TEMP_PREFIX, atomic_write
from hutch._core.errors import StorePathError

LOCK_NAME = "write.lock"


def check_derived_dir(path: Path) -> None:
    """Refuse a `.hutch` that is a symbolic link: hutch writes its lock and search index there, and a link
    (planted by hand, or checked out of a hostile clone) would make it write outside the store."""
    if path.is_symlink():
        raise StorePathError(
            f"{path} is a symbolic link: hutch keeps its lock and search index there and does not write through "
            f"a link (it could lead outside the store). Remove the link (rm {path}); hutch recreates the directory.")


class StoreLock:
    """A reentrant (per instance) exclusive lock shared by every process that writes the store."""

    def __init__(self, path: Path):
        self.path = path
        self._thread = threading.RLock()
        self._depth = 0
        self._fd: int | None = None

    def __enter__(self) -> "StoreLock":
        self._thread.acquire()
        try:
            if self._depth == 0:
                check_derived_dir(self.path.parent)
                self.path.parent.mkdir(parents=True, exist_ok=True)
                try:
                    fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
                except OSError as e:
                    raise StorePathError(
                        f"{self.path} cannot be opened as the store's lock ({e.strerror}); if it is a symbolic "
                        f"link, remove it (rm {self.path}): hutch makes a new one.") from None
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX)
                except BaseException:
                    os.close(fd)
                    raise
                self._fd = fd
            self._depth += 1
        except BaseException:
            self._thread.release()
            raise
        return self

    def __exit__(self, *exc) -> None:
        try:
            self._depth -= 1
            if self._depth == 0 and self._fd is not None:
                fcntl.flock(self._fd, fcntl.LOCK_UN)
                os.close(self._fd)
                self._fd = None
        finally:
            self._thread.release()


class Transaction:
    """Files changed so far, their backups, and what the commit message will say."""

    def __init__(self, root: Path, message: str | None = None, source: str | None = None,
                 reason: str | None = None):
        self.root = root
        self.message = message
        self.source = source
        self.reason = reason
        self.kind: str | None = None  # the commit's Hutch-Op when it is not "transaction" (e.g. "ingest")
        self.ops: list[tuple[str, str]] = []  # (op, subject) in order
        self.trailers: list[tuple[str, str]] = []
        self._backup: dict[str, tuple[str, bytes | str | None]] = {}
        self._order: list[str] = []
        self._dirs: set[str] = set()
        self._made: set[Path] = set()
        self._created: list[Path] = []  # directories this transaction made, parents first
        #: a grouped transaction syncs once with syncfs() before its commit instead of fsyncing every file
        self.bulk = False
        #: in a grouped transaction, a git fast-import that receives each file's bytes as they are written
        self.stream = None
        self.stream_factory = None

    # ------------------------------------------------------------ recording

    def record(self, op: str, subject: str, **trailers: str | None) -> None:
        self.ops.append((op, subject))
        for k, v in trailers.items():
            if v is not None:
                self.trailers.append((k, v))

    def forget_op(self, op: str, subject: str = "") -> None:
        """Drop the last recorded op if it is (op, subject): it turned out to change nothing."""
        if self.ops and self.ops[-1] == (op, subject):
            self.ops.pop()

    def name_op(self, op: str, subject: str) -> None:
        """Give the last recorded (op, '') its subject, once it is known (put learns its id late)."""
        if self.ops and self.ops[-1] == (op, ""):
            self.ops[-1] = (op, subject)
        else:
            self.ops.append((op, subject))

    @property
    def paths(self) -> list[str]:
        return list(self._order)

    def _rel(self, path: Path) -> str:
        return path.relative_to(self.root).as_posix()

    def _save(self, path: Path) -> str:
        rel = self._rel(path)
        if rel not in self._backup:
            try:
                st = os.lstat(path)
            except FileNotFoundError:
                self._backup[rel] = ("none", None)
            else:
                import stat

                if stat.S_ISLNK(st.st_mode):
                    self._backup[rel] = ("link", os.readlink(path))
                else:
                    with open(path, "rb") as f:
                        self._backup[rel] = ("file", f.read())
            self._order.append(rel)
        self._dirs.add(str(path.parent))
        return rel

    # ------------------------------------------------------------ writes

    def _mkdir(self, d: Path) -> None:
        if d not in self._made:
            missing = []
            p = d
            while p != self.root and not p.exists():
                missing.append(p)
                p = p.parent
            d.mkdir(parents=True, exist_ok=True)
            self._created.extend(reversed(missing))
            self._made.add(d)

    def write(self, path: Path, text: str) -> None:
        self._save(path)
        self._mkdir(path.parent)
        # directory fsyncs are batched: sync() runs once per touched directory (or one syncfs) before the commit
        data = text.encode("utf-8", errors="surrogateescape")
        atomic_write(path, data, fsync_dir=False, fsync_file=not self.bulk)
        if self.bulk and self.stream_factory is not None:
            if self.stream is None:
                self.stream = self.stream_factory()
            self.stream.add(self._rel(path), data)

    def symlink(self, path: Path, target: str) -> None:
        self._save(path)
        self._mkdir(path.parent)
        tmp = path.parent / f"{TEMP_PREFIX}{os.getpid()}-{threading.get_ident()}-{path.name}"
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        os.symlink(target, tmp)
        os.replace(tmp, path)

    def remove(self, path: Path) -> None:
        self._save(path)
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        _prune_empty(path.parent, self.root)

    # ------------------------------------------------------------ end

    def sync(self) -> None:
        """Make every write of the transaction durable before it is committed."""
        if self.bulk and len(self._order) > 1 and _syncfs(self.root):
            return
        if self.bulk:
            for rel in self._order:
                try:
                    fd = os.open(self.root / rel, os.O_RDONLY | os.O_NOFOLLOW)
                except OSError:
                    continue  # removed, or a symlink: the directory sync covers it
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
        self.sync_dirs()

    def sync_dirs(self) -> None:
        for d in sorted(self._dirs):
            try:
                fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
            except FileNotFoundError:
                continue
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    def rollback(self) -> None:
        """Put every touched path back as it was before the transaction."""
        if self.stream is not None:
            self.stream.abort()
            self.stream = None
        for rel in reversed(self._order):
            kind, data = self._backup[rel]
            path = self.root / rel
            try:
                if os.path.lexists(path) and (kind != "file" or os.path.islink(path)):
                    os.unlink(path)
                if kind == "file":
                    path.parent.mkdir(parents=True, exist_ok=True)
                    atomic_write(path, data, fsync_dir=False)  # type: ignore[arg-type]
                elif kind == "link":
                    path.parent.mkdir(parents=True, exist_ok=True)
                    os.symlink(data, path)  # type: ignore[arg-type]
                else:
                    _prune_empty(path.parent, self.root)
            except OSError:
                continue
        for d in reversed(self._created):  # leave no empty directory behind
            try:
                d.rmdir()
            except OSError:
                pass
        self.sync_dirs()


def _syncfs(root: Path) -> bool:
    """syncfs(2) on the store's filesystem: one call flushes a whole batch. False if unavailable."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
        try:
            return libc.syncfs(fd) == 0
        finally:
            os.close(fd)
    except (OSError, AttributeError):
        return False


def _prune_empty(d: Path, root: Path) -> None:
    """Remove empty link directories up to (not including) the class directory."""
    while d != root and d.parent != root:
        try:
            d.rmdir()
        except OSError:
            return
        d = d.parent
