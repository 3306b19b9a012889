"""The write path: a cross-process lock, and transactions that back up, write, and commit once.

Every write op runs inside a transaction (a lone op is a transaction of one).
The transaction holds an exclusive `flock` on `<store>/.hutch/write.lock`
from its first write until its commit, so writers in other processes queue
instead of interleaving; readers never lock (renames are atomic). Each file
touched is backed up first (in memory, and in the undo journal on disk:
_journal.py), so a failure rolls the working tree back to exactly what it was,
and a writer killed mid-transaction is rolled back by the next one to take the
lock: nothing is half-written.

No write ever follows a symlink inside the store: every directory below the
store's root is opened from the root's descriptor one component at a time with
O_NOFOLLOW (a class, `.links` or relation directory that is a link is refused,
and directories are made with mkdirat), files are written to a temp file made
O_EXCL|O_NOFOLLOW in that directory and renamed over the name (which replaces
a link there rather than writing through it), and removals are unlinkat.
"""

from __future__ import annotations

import fcntl
import os
import secrets
import stat
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Callable

from hutch._core.atomic import TEMP_PREFIX
from hutch._core.errors import StorePathError
from hutch.memory import _journal
from hutch.memory._objects import syncfs

LOCK_NAME = "write.lock"
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_NEW = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_OPEN_DIRS = 32   # directory fds a transaction keeps open (a big ingest touches thousands of link dirs)


def check_derived_dir(path: Path) -> None:
    """Refuse a `.hutch` that is a symbolic link: hutch writes its lock and search index there, and a link
    (planted by hand, or checked out of a hostile clone) would make it write outside the store."""
    if path.is_symlink():
        raise StorePathError(
            f"{path} is a symbolic link: hutch keeps its lock and search index there and does not write through "
            f"a link (it could lead outside the store). Remove the link (rm {path}); hutch recreates the directory.")


def _link_error(path: Path) -> StorePathError:
    return StorePathError(
        f"{path} is a symbolic link or not a directory: hutch writes only into real directories inside the store "
        f"(a link could lead outside it). Replace it with a directory (rm {path}) and write again.")


class StoreLock:
    """A reentrant (per instance) exclusive lock shared by every process that writes the store.

    While held it keeps descriptors of the store's root and of `.hutch` (opened O_NOFOLLOW);
    taking it first runs `recover(root_fd, hutch_fd)`, which undoes a dead writer's transaction."""

    def __init__(self, path: Path, recover: Callable[[int, int], None] | None = None):
        self.path = path
        self.root = path.parent.parent
        self.recover = recover
        self._thread = threading.RLock()
        self._depth = 0
        self._fd: int | None = None
        self.root_fd: int | None = None
        self.hutch_fd: int | None = None

    def _open(self) -> None:
        check_derived_dir(self.path.parent)
        self.root_fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)  # the root itself may be a link
        name = self.path.parent.name
        try:
            os.mkdir(name, 0o777, dir_fd=self.root_fd)
        except FileExistsError:
            pass
        try:
            self.hutch_fd = os.open(name, _DIR, dir_fd=self.root_fd)
        except OSError:
            raise StorePathError(
                f"{self.path.parent} is a symbolic link or not a directory: hutch keeps its lock and search index "
                f"there and does not write through a link. Remove it (rm {self.path.parent}); hutch recreates it."
            ) from None
        try:
            st = os.stat(".git", dir_fd=self.root_fd, follow_symlinks=False)
        except FileNotFoundError:
            st = None
        if st is not None and stat.S_ISLNK(st.st_mode):
            raise StorePathError(
                f"{self.root / '.git'} is a symbolic link: git would write the store's history wherever it points. "
                "Replace it with the repository itself (or a `gitdir:` file, which is yours to write).")
        try:
            self._fd = os.open(self.path.name, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644,
                               dir_fd=self.hutch_fd)
        except OSError as e:
            raise StorePathError(
                f"{self.path} cannot be opened as the store's lock ({e.strerror}); if it is a symbolic "
                f"link, remove it (rm {self.path}): hutch makes a new one.") from None

    def _close(self) -> None:
        for attr in ("_fd", "hutch_fd", "root_fd"):
            fd = getattr(self, attr)
            if fd is not None:
                os.close(fd)
                setattr(self, attr, None)

    def __enter__(self) -> "StoreLock":
        self._thread.acquire()
        try:
            if self._depth == 0:
                try:
                    self._open()
                    fcntl.flock(self._fd, fcntl.LOCK_EX)
                    if self.recover is not None:
                        self.recover(self.root_fd, self.hutch_fd)
                except BaseException:
                    self._close()
                    raise
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
                self._close()
        finally:
            self._thread.release()


class _Dirs:
    """Directories below the store's root, opened by fds one component at a time, never through a link."""

    def __init__(self, root: Path, root_fd: int, before_mkdir: Callable[[str], None]):
        self.root, self.root_fd, self.before_mkdir = root, root_fd, before_mkdir
        self._open: OrderedDict[tuple[str, ...], int] = OrderedDict()

    def get(self, parts: tuple[str, ...], create: bool) -> int | None:
        """An fd of directory `parts` (owned by this cache); None if it is missing and not `create`."""
        if not parts:
            return self.root_fd
        fd = self._open.get(parts)
        if fd is not None:
            self._open.move_to_end(parts)
            return fd
        parent = self.get(parts[:-1], create)
        if parent is None:
            return None
        name = parts[-1]
        try:
            fd = os.open(name, _DIR, dir_fd=parent)
        except FileNotFoundError:
            if not create:
                return None
            self.before_mkdir("/".join(parts))   # journaled first: a death right after leaves no stray directory
            try:
                os.mkdir(name, 0o777, dir_fd=parent)
            except FileExistsError:
                pass
            try:
                fd = os.open(name, _DIR, dir_fd=parent)
            except OSError:
                raise _link_error(self.root.joinpath(*parts)) from None
        except OSError:   # ELOOP: a symlink; ENOTDIR: a file
            raise _link_error(self.root.joinpath(*parts)) from None
        self._open[parts] = fd
        while len(self._open) > _OPEN_DIRS:
            os.close(self._open.popitem(last=False)[1])
        return fd

    def forget(self, parts: tuple[str, ...]) -> None:
        """Drop `parts` and every directory under it (it was removed)."""
        for key in [k for k in self._open if k[:len(parts)] == parts]:
            os.close(self._open.pop(key))

    def close(self) -> None:
        while self._open:
            os.close(self._open.popitem()[1])


class Transaction:
    """Files changed so far, their backups, and what the commit message will say.

    `root_fd` is the store's root as the lock opened it; `hutch_fd`, its `.hutch`, holds the undo
    journal (none without it: a recovery's own rollback journals nothing)."""

    def __init__(self, root: Path, message: str | None = None, source: str | None = None,
                 reason: str | None = None, *, root_fd: int | None = None, hutch_fd: int | None = None):
        self.root = root
        self.message = message
        self.source = source
        self.reason = reason
        self.kind: str | None = None  # the commit's Hutch-Op when it is not "transaction" (e.g. "ingest")
        self.ops: list[tuple[str, str]] = []  # (op, subject) in order
        self.trailers: list[tuple[str, str]] = []
        self._backup: dict[str, tuple[str, bytes | str | None]] = {}
        self._order: list[str] = []
        self._touched: set[tuple[str, ...]] = set()   # directories to fsync before the commit
        self._created: list[tuple[str, ...]] = []  # directories this transaction made, parents first
        self._own_root = root_fd is None
        if root_fd is None:
            root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        self.journal = _journal.Journal(hutch_fd) if hutch_fd is not None else None
        self._id = self.journal.tx if self.journal is not None else secrets.token_hex(8)
        self._temps = 0
        self._rolling = False
        self.dirs = _Dirs(root, root_fd, self._made_dir)
        #: a grouped transaction (Memory.transaction): its commit is one pack (fast-import), see stream
        self.bulk = False
        #: in a grouped transaction, a git fast-import that receives each file's bytes as they are written
        self.stream = None
        self.stream_factory = None
        #: what each path is now, as this transaction left it: "file" (its bytes are on disk, and in `stream`
        #: if there is one), ("link", target), or None (removed); the commit reads no file back
        self.final: dict[str, object] = {}
        self._root_prefix = os.fspath(root).rstrip("/") + "/"

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
        s = os.fspath(path)
        if isinstance(path, Path) and s.startswith(self._root_prefix):
            # what relative_to() gives (a Path's string is normalized), without pathlib's cost
            return s[len(self._root_prefix):]
        return path.relative_to(self.root).as_posix()

    def _made_dir(self, rel: str) -> None:
        if self._rolling:
            return   # putting back a directory that was there before
        if self.journal is not None:
            self.journal.made_dir(rel)
        self._created.append(tuple(rel.split("/")))

    def _save(self, path: Path) -> tuple[str, ...]:
        rel = self._rel(path)
        parts = tuple(rel.split("/"))
        if rel not in self._backup:
            backup: tuple[str, bytes | str | None] = ("none", None)
            dfd = self.dirs.get(parts[:-1], create=False)
            st = None
            if dfd is not None:
                try:
                    st = os.stat(parts[-1], dir_fd=dfd, follow_symlinks=False)
                except FileNotFoundError:
                    pass
            if st is not None and stat.S_ISLNK(st.st_mode):
                backup = ("link", os.readlink(parts[-1], dir_fd=dfd))
            elif st is not None and stat.S_ISREG(st.st_mode):
                fd = os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dfd)
                with os.fdopen(fd, "rb") as f:
                    backup = ("file", f.read())
            elif st is not None:
                raise StorePathError(
                    f"{path} is not a regular file or a link (a directory, FIFO or device): hutch does not replace "
                    "it. Move it out of the store.")
            if self.journal is not None:   # on disk before the path is touched
                kind, data = backup
                self.journal.path(rel, kind, os.fsencode(data) if isinstance(data, str) else data)
            self._backup[rel] = backup
            self._order.append(rel)
        self._touched.add(parts[:-1])
        return parts

    # ------------------------------------------------------------ writes

    def _replace(self, dfd: int, name: str, *, data: bytes | None = None, link: str | None = None) -> None:
        """Make `name` in directory `dfd` the file `data` (or the symlink `link`) by renaming a new temp file
        over it: whatever is there (a link included) is replaced, never written through."""
        self._temps += 1
        tmp = f"{TEMP_PREFIX}{self._id}-{self._temps}"
        try:
            if link is not None:
                os.symlink(link, tmp, dir_fd=dfd)
            else:
                fd = os.open(tmp, _NEW, 0o644, dir_fd=dfd)
                try:
                    view = memoryview(data or b"")
                    while view:
                        view = view[os.write(fd, view):]
                    os.fchmod(fd, 0o644)
                finally:
                    os.close(fd)
            os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
        except BaseException:
            try:
                os.unlink(tmp, dir_fd=dfd)
            except FileNotFoundError:
                pass
            raise

    def write(self, path: Path, text: str) -> None:
        parts = self._save(path)
        dfd = self.dirs.get(parts[:-1], create=True)
        # no fsync per file: sync() flushes the whole transaction once (one syncfs) before the commit names it
        data = text.encode("utf-8", errors="surrogateescape")
        self._replace(dfd, parts[-1], data=data)
        rel = "/".join(parts)
        self.final[rel] = "file"
        if self.bulk and self.stream_factory is not None:
            if self.stream is None:
                self.stream = self.stream_factory()
            self.stream.add(rel, data)

    def symlink(self, path: Path, target: str) -> None:
        parts = self._save(path)
        self._replace(self.dirs.get(parts[:-1], create=True), parts[-1], link=target)
        self.final["/".join(parts)] = ("link", target)

    def remove(self, path: Path) -> None:
        parts = self._save(path)
        self.final["/".join(parts)] = None
        dfd = self.dirs.get(parts[:-1], create=False)
        if dfd is None:
            return
        try:
            os.unlink(parts[-1], dir_fd=dfd)
        except FileNotFoundError:
            pass
        self._prune_empty(parts[:-1])

    def _prune_empty(self, parts: tuple[str, ...]) -> None:
        """Remove empty link directories and an empty class directory, up to (not including) the store's root:
        git keeps no empty directory, so one left here would be a class on disk that the history does not have."""
        while len(parts) >= 1:
            pfd = self.dirs.get(parts[:-1], create=False)
            if pfd is None:
                return
            try:
                os.rmdir(parts[-1], dir_fd=pfd)
            except OSError:
                return
            self.dirs.forget(parts)
            parts = parts[:-1]

    # ------------------------------------------------------------ end

    def sync(self) -> None:
        """Make every write of the transaction durable: one syncfs(2) of the store's file system (which also
        flushes the commit's objects when they are written first, see Committer.commit), else each file and
        touched directory fsynced."""
        if self._order and _syncfs(self.dirs.root_fd):
            return
        for rel in self._order:
            parts = tuple(rel.split("/"))
            try:
                dfd = self.dirs.get(parts[:-1], create=False)
                fd = os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd) \
                    if dfd is not None else None
            except (OSError, StorePathError):
                continue  # removed, or a symlink: the directory sync covers it
            if fd is not None:
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
        self.sync_dirs()

    def sync_dirs(self) -> None:
        for parts in sorted(self._touched):
            try:
                dfd = self.dirs.get(parts, create=False)
            except StorePathError:
                continue
            if dfd is not None:
                os.fsync(dfd)

    def committing(self, parent: str | None) -> None:
        """Git is about to move HEAD from `parent`: from here a dead writer's commit may have landed."""
        if self.journal is not None:
            self.journal.committing(parent)

    def finish(self) -> None:
        """The transaction committed: its journal is no longer needed."""
        if self.journal is not None:
            self.journal.end()

    def close(self) -> None:
        self.dirs.close()
        if self._own_root:
            os.close(self.dirs.root_fd)
            self._own_root = False

    def rollback(self) -> None:
        """Put every touched path back as it was before the transaction."""
        if self.stream is not None:
            self.stream.abort()
            self.stream = None
        self._rolling = True
        try:
            for rel in reversed(self._order):
                kind, data = self._backup[rel]
                parts = tuple(rel.split("/"))
                try:
                    if kind == "none":
                        dfd = self.dirs.get(parts[:-1], create=False)
                        if dfd is not None:
                            try:
                                os.unlink(parts[-1], dir_fd=dfd)
                            except FileNotFoundError:
                                pass
                            self._prune_empty(parts[:-1])
                    else:
                        dfd = self.dirs.get(parts[:-1], create=True)
                        if kind == "file":
                            self._replace(dfd, parts[-1], data=data)  # type: ignore[arg-type]
                        else:
                            self._replace(dfd, parts[-1], link=data)  # type: ignore[arg-type]
                except (OSError, StorePathError):
                    continue
            for parts in reversed(self._created):  # leave no empty directory behind
                try:
                    pfd = self.dirs.get(parts[:-1], create=False)
                    if pfd is not None:
                        os.rmdir(parts[-1], dir_fd=pfd)
                        self.dirs.forget(parts)
                except (OSError, StorePathError):
                    pass
            self.sync_dirs()
        finally:
            self._rolling = False
        if self.journal is not None:
            self.journal.end()

    # ------------------------------------------------------------ recovery of a dead writer

    def undo(self, undo: _journal.Undo) -> None:
        """Roll back what a dead writer's journal records: its temp files, then its paths and directories."""
        for rel, kind, data in undo.paths:
            if rel not in self._backup:
                self._backup[rel] = (kind, data if kind == "file" else os.fsdecode(data) if kind == "link" else None)
                self._order.append(rel)
                self._touched.add(tuple(rel.split("/"))[:-1])
        self._created = [tuple(d.split("/")) for d in undo.dirs]
        if undo.tx:
            for parts in sorted(self._touched | set(self._created)):
                try:
                    dfd = self.dirs.get(parts, create=False)
                except StorePathError:
                    continue
                if dfd is None:
                    continue
                for e in os.scandir(dfd):
                    if e.name.startswith(f"{TEMP_PREFIX}{undo.tx}-"):
                        os.unlink(e.name, dir_fd=dfd)
        self.rollback()


def recover(root: Path, root_fd: int, hutch_fd: int, head: Callable[[], str | None],
            unstage: Callable[[list[str]], None], settle: Callable[[], None] | None = None) -> bool:
    """Undo the transaction of a writer that died holding the lock (see _journal); True if there was one.
    `settle()` first waits for the git commands the dead writer left running (one moving HEAD after this looked
    would undo the undo)."""
    undo = _journal.load(hutch_fd)
    if undo is None:
        return False
    if settle is not None:
        settle()
    if undo.committing is None or head() == (undo.committing or None):   # its commit never landed
        tx = Transaction(root, root_fd=root_fd)
        try:
            tx.undo(undo)
        finally:
            tx.close()
    # the index back to HEAD for those paths either way: a dead writer may have staged them, or (a bulk
    # commit) moved HEAD before staging them
    unstage([rel for rel, _, _ in undo.paths])
    _journal.remove(hutch_fd)
    return True


def _syncfs(fd: int) -> bool:
    return syncfs(fd)
