"""git's object database of a store, written and read without a git process per object.

A commit of a few paths needs a blob per changed file, the trees on the way from each to the root, and
the commit. `git update-index` + `git write-tree` would read and write the whole index for that (tens of
ms at 100,000 entities); here the new trees are built from the parent commit's trees, which are read
through one long-lived `git cat-file --batch` and kept by sha (a tree's sha names its content, so a
cached tree is never stale), and the new objects are written as loose objects in git's own format:
zlib of `<type> <size>\\0<bytes>`, named by its SHA-1, made as a temp file `tmp_obj_*` (the name git's
own prune removes if left behind) and linked into place, never replacing an object that is there.
Only SHA-1 repositories are written this way (`Objects.open` returns None for another object format;
the caller then commits through git's index, the old way).
"""

from __future__ import annotations

import errno
import hashlib
import os
import secrets
import stat
import subprocess
import threading
import weakref
import zlib
from collections import OrderedDict
from typing import TYPE_CHECKING

from hutch._core.errors import MemoryStoreError

if TYPE_CHECKING:  # pragma: no cover
    from hutch.memory._git import Git

EMPTY_TREE = "4b825dc642cb6eb9a060e54bf8d69288fbee4904"
TREE, FILE, EXEC, LINK = b"40000", b"100644", b"100755", b"120000"
_TREES_KEPT = 256          # parsed trees kept by sha (a class tree of 5,000 entities is ~250 KB)
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC

#: a tree's entries: name -> (mode, sha as hex)
Entries = dict[bytes, tuple[bytes, str]]


def _sort_key(item: tuple[bytes, tuple[bytes, str]]) -> bytes:
    name, (mode, _) = item
    return name + b"/" if mode == TREE else name   # git orders a tree as if its name ended in '/'


def tree_bytes(entries: Entries) -> bytes:
    """The body of a tree object holding `entries`, in git's order."""
    return b"".join(mode + b" " + name + b"\0" + bytes.fromhex(sha)
                    for name, (mode, sha) in sorted(entries.items(), key=_sort_key))


def parse_tree(body: bytes) -> Entries:
    """The entries of a tree object's body."""
    out: Entries = {}
    i, n = 0, len(body)
    while i < n:
        sp = body.index(b" ", i)
        nul = body.index(b"\0", sp)
        out[body[sp + 1:nul]] = (body[i:sp], body[nul + 1:nul + 21].hex())
        i = nul + 21
    return out


def object_id(kind: bytes, data: bytes) -> str:
    return hashlib.sha1(b"%s %d\0" % (kind, len(data)) + data).hexdigest()


def safe_ident(s: str) -> str:
    """A name or email made safe for a commit's author line."""
    # what git itself refuses in a name or email: they would end the header line or the <email>
    return "".join(c for c in s if c not in "<>\n\r\0").strip()


class Objects:
    """Loose objects in, trees and commits out, for the repository of `git` (see the module docstring)."""

    @classmethod
    def open(cls, git: "Git") -> "Objects | None":
        """The object database of `git`'s repository if hutch can write it directly (SHA-1), else None."""
        out = git.run("rev-parse", "--show-object-format", "--git-dir", "--git-common-dir", "--git-path", "objects",
                      check=False).splitlines()
        if len(out) != 4 or out[0].strip() != "sha1":
            return None
        gitdir, common, objects = (p.strip() if os.path.isabs(p.strip()) else os.path.join(str(git.root), p.strip())
                                   for p in out[1:])
        return cls(git, objects, gitdir, common)

    def __init__(self, git: "Git", objects_dir: str, git_dir: str, common_dir: str):
        self.git = git
        self.dir = objects_dir
        self.git_dir, self.common_dir = git_dir, common_dir
        try:
            self._own_fs = os.stat(objects_dir).st_dev != os.stat(git.root).st_dev
        except OSError:
            self._own_fs = True
        self._trees: OrderedDict[str, Entries] = OrderedDict()
        self._lock = threading.Lock()
        self._batch: subprocess.Popen | None = None
        self._batch_pid = 0
        self._fanout: set[str] = set()
        self._finalizer = None

    # ------------------------------------------------------------ reading

    def _proc(self) -> subprocess.Popen:
        if self._batch is None or self._batch_pid != os.getpid() or self._batch.poll() is not None:
            # a forked child never uses its parent's process (their requests and answers would interleave)
            self._batch = subprocess.Popen(self.git.argv("cat-file", "--batch"), stdin=subprocess.PIPE,
                                           stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=self.git.env())
            self._batch_pid = os.getpid()
            if self._finalizer is not None:
                self._finalizer.detach()
            self._finalizer = weakref.finalize(self, _stop, self._batch, self._batch_pid)
        return self._batch

    def read(self, name: str) -> tuple[str, str, bytes] | None:
        """(sha, type, bytes) of the object `name` (a sha or a revision such as 'HEAD'), None if missing."""
        if "\n" in name:
            raise ValueError(name)
        with self._lock:
            for attempt in (0, 1):
                p = self._proc()
                try:
                    p.stdin.write(name.encode() + b"\n")
                    p.stdin.flush()
                    head = p.stdout.readline().split()
                    if len(head) == 3:
                        data = p.stdout.read(int(head[2]) + 1)[:-1]
                        return head[0].decode(), head[1].decode(), data
                    if len(head) == 2 and head[1] in (b"missing", b"ambiguous"):
                        return None
                except (BrokenPipeError, ValueError, OSError):
                    pass
                self._stop_batch()   # it died or spoke out of turn: a fresh one, once
            raise MemoryStoreError(
                f"git cat-file failed reading {name} in {self.git.root}: check the store's repository with "
                f"'git -C {self.git.root} fsck'.")

    def _stop_batch(self) -> None:
        if self._finalizer is not None:
            self._finalizer()
            self._finalizer = None
        self._batch = None

    def close(self) -> None:
        """End the cat-file process (a new one starts when needed)."""
        with self._lock:
            self._stop_batch()

    def tree(self, sha: str) -> Entries:
        """The entries of tree `sha` (kept: its sha names its content)."""
        with self._lock:
            hit = self._trees.get(sha)
            if hit is not None:
                self._trees.move_to_end(sha)
                return hit
        if sha == EMPTY_TREE:
            return {}
        got = self.read(sha)
        if got is None or got[1] != "tree":
            raise MemoryStoreError(f"{sha} is not a tree of the store's repository {self.git.root}: run "
                                   f"'git -C {self.git.root} fsck'.")
        entries = parse_tree(got[2])
        self._keep(sha, entries)
        return entries

    def _keep(self, sha: str, entries: Entries) -> None:
        with self._lock:
            self._trees[sha] = entries
            while len(self._trees) > _TREES_KEPT:
                self._trees.popitem(last=False)

    def head(self) -> tuple[str | None, str | None]:
        """(HEAD's commit, its tree), or (None, None) on an unborn branch."""
        got = self.read("HEAD")
        if got is None:
            return None, None
        sha, kind, body = got
        if kind != "commit" or not body.startswith(b"tree "):
            raise MemoryStoreError(f"HEAD of {self.git.root} is not a commit: check it with 'git -C "
                                   f"{self.git.root} log'.")
        return sha, body[5:45].decode()

    # ------------------------------------------------------------ writing

    def write(self, kind: bytes, data: bytes) -> str:
        """Store one object (unless it is there) and return its sha."""
        sha = object_id(kind, data)
        sub, rest = sha[:2], sha[2:]
        final = os.path.join(self.dir, sub, rest)
        if os.path.lexists(final):
            return sha
        folder = os.path.join(self.dir, sub)
        if sub not in self._fanout:
            try:
                os.mkdir(folder, 0o777)
            except FileExistsError:
                pass
            self._fanout.add(sub)
        tmp = os.path.join(folder, f"tmp_obj_{secrets.token_hex(6)}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o444)
        try:
            try:
                view = memoryview(zlib.compress(b"%s %d\0" % (kind, len(data)) + data, 1))
                while view:
                    view = view[os.write(fd, view):]
            finally:
                os.close(fd)
            try:
                os.link(tmp, final)   # as git does: an object already there is never replaced
            except FileExistsError:
                pass
            except OSError as e:
                if e.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.EMLINK):
                    raise
                os.rename(tmp, final)   # a file system without hard links
        finally:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
        return sha

    def sync_objects(self) -> None:
        """Flush the objects written, where the caller's flush of the work tree did not reach them (another
        file system)."""
        if self._own_fs:
            fd = os.open(self.dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                syncfs(fd)
            finally:
                os.close(fd)

    def sync_ref(self) -> None:
        """Flush the directory of the branch HEAD names, so that the rename git made of its ref is on disk too
        (git flushed the ref's new content: core.fsync=reference)."""
        try:
            with open(os.path.join(self.git_dir, "HEAD"), "rb") as f:
                head = f.read(512).decode("utf-8", "replace").strip()
        except OSError:
            return
        rel = head[5:].strip() if head.startswith("ref: ") else ""
        folder = os.path.dirname(os.path.join(self.common_dir, rel)) if rel.startswith("refs/") else self.git_dir
        try:
            fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError:
            return   # a packed ref, or none: nothing of ours to flush
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def write_tree(self, entries: Entries) -> str:
        sha = self.write(b"tree", tree_bytes(entries))
        self._keep(sha, entries)
        return sha

    def apply(self, base: str | None, changes: dict[str, tuple[bytes, str] | None]) -> str:
        """The tree that is `base` (a tree sha; None: empty) with `changes` made: path -> (mode, blob sha), or
        None to remove it. Only the trees on the way to a changed path are read and written; a directory left
        empty disappears, as in git."""
        by_dir: dict[tuple[bytes, ...], dict[bytes, tuple[bytes, str] | None]] = {}
        for rel, entry in changes.items():
            parts = tuple(os.fsencode(rel).split(b"/"))
            by_dir.setdefault(parts[:-1], {})[parts[-1]] = entry
            for i in range(len(parts) - 1):   # every directory on the way gets a new tree
                by_dir.setdefault(parts[:i], {})

        def entries_at(d: tuple[bytes, ...]) -> Entries:
            sha = base
            for name in d:
                got = self.tree(sha).get(name) if sha is not None else None
                sha = got[1] if got is not None and got[0] == TREE else None
            return dict(self.tree(sha)) if sha is not None else {}

        for d in sorted(by_dir, key=len, reverse=True):   # deepest first: a child's new sha goes to its parent
            entries = entries_at(d)
            for name, entry in by_dir[d].items():
                if entry is None:
                    entries.pop(name, None)
                else:
                    entries[name] = entry
            sha = self.write_tree(entries) if entries or not d else None   # an empty directory disappears
            if d:
                by_dir[d[:-1]][d[-1]] = None if sha is None else (TREE, sha)
            else:
                return sha
        return base or EMPTY_TREE   # no change at all

    def write_commit(self, tree: str, parent: str | None, message: str, author: tuple[str, str],
                     when: int, offset: int) -> str:
        name, email = (safe_ident(author[0]) or "hutch"), safe_ident(author[1])
        sign = "-" if offset < 0 else "+"
        tz = f"{sign}{abs(offset) // 3600:02d}{abs(offset) % 3600 // 60:02d}"
        who = f"{name} <{email}> {when} {tz}".encode("utf-8", "surrogateescape")
        body = b"tree " + tree.encode() + b"\n"
        if parent:
            body += b"parent " + parent.encode() + b"\n"
        body += b"author " + who + b"\ncommitter " + who + b"\n\n"
        body += message.replace("\0", "").encode("utf-8", "surrogateescape")
        return self.write(b"commit", body)


def worktree_entry(root_fd: int, rel: str, stats: dict | None = None) -> tuple[bytes, bytes] | None:
    """(mode, blob bytes) of the path `rel` in the work tree as it is now: a regular file (its bytes), a
    symlink (its target); None if it is not there. Every directory on the way is opened O_NOFOLLOW, so a
    link there (a class or .links directory swapped for one) is refused, never read through. `stats`, if
    given, gets `rel`'s lstat taken before its bytes were read (what git's index records)."""
    parts = rel.split("/")
    fds = []
    try:
        dfd = root_fd
        for name in parts[:-1]:
            try:
                dfd = os.open(name, _DIR, dir_fd=dfd)
            except FileNotFoundError:
                return None
            except OSError:
                raise MemoryStoreError(f"{rel}: a directory on its way is a symbolic link or not a directory; "
                                       "hutch commits nothing through a link.") from None
            fds.append(dfd)
        try:
            st = os.stat(parts[-1], dir_fd=dfd, follow_symlinks=False)
        except FileNotFoundError:
            return None
        if stats is not None:
            stats[rel] = st
        if stat.S_ISLNK(st.st_mode):
            return LINK, os.fsencode(os.readlink(parts[-1], dir_fd=dfd))
        if not stat.S_ISREG(st.st_mode):
            return None   # a directory or a device where a file was: git tracks neither
        fd = os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dfd)
        with os.fdopen(fd, "rb") as f:
            data = f.read()
        return (EXEC if st.st_mode & 0o100 else FILE), data
    finally:
        for fd in fds:
            os.close(fd)


def syncfs(fd: int) -> bool:
    """syncfs(2) on the file system of `fd`: one call flushes everything written to it. False if unavailable."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        return libc.syncfs(fd) == 0
    except (OSError, AttributeError):
        return False


def _stop(proc: subprocess.Popen, pid: int) -> None:
    if os.getpid() != pid:
        return   # a forked child: the process is its parent's
    try:
        proc.stdin.close()
    except OSError:
        pass
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        proc.kill()   # our own child, by its Popen handle
        proc.wait()
    if proc.stdout is not None:
        proc.stdout.close()
