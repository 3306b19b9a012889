"""How a write becomes a commit: the changed trees alone for an operation, one pack for a transaction.

`Committer` commits exactly the paths a transaction touched and stages them in git's index:

- an operation's commit is built from the parent's trees and the changed paths (_objects.py: loose
  objects, no process per object), while `git update-index` stages the paths; HEAD moves by
  compare-and-swap, and back if staging failed, so a write that raised committed nothing;
- a transaction's (or a lone operation of more than 64 paths) goes through `git fast-import`, which was
  fed each file's bytes as they were written (`BlobStream`), as one pack, to `refs/hutch/pending` until
  its paths are staged;
- a repository hutch cannot write objects into (not SHA-1) is committed through git's index.
"""

from __future__ import annotations

import os
import subprocess
import time
from typing import TYPE_CHECKING

from hutch._core.errors import MemoryStoreError
from hutch.memory._git import Git, Running

if TYPE_CHECKING:  # pragma: no cover
    from hutch.memory._objects import Objects

#: Where a big commit (fast-import) waits while its paths are staged, before HEAD moves to it.
PENDING_REF = "refs/hutch/pending"
#: An index larger than this is split (core.splitIndex): see Committer.stage.
_SPLIT_INDEX_BYTES = 2 << 20


class Committer:
    """Commits and staging for the repository of `git`."""

    def __init__(self, git: Git):
        self.git = git
        self._split: bool | None = None    # git's index is split (see stage); None: not looked yet
        self._objects = None   # Objects, False if hutch cannot write this repository's objects, None: not asked

    def objects(self) -> "Objects | None":
        """The repository's object database as hutch writes it directly (_objects.py); None if it cannot."""
        if self._objects is None:
            from hutch.memory._objects import Objects

            self._objects = Objects.open(self.git) or False
        return self._objects or None

    def commit(self, paths: list[str], message: str, author: tuple[str, str], on_parent=None,
               sync=None) -> str | None:
        """Commit exactly `paths` as the work tree holds them (additions, changes, deletions) and stage them.
        None if nothing changed.

        The commit is built from HEAD's trees and the paths alone (_objects.py): nothing reads or writes the
        whole index, whose cost grows with the store. `sync()` is called once the commit's objects are
        written, before anything names them (the caller's flush of the work tree; one syncfs covers the
        objects too when they live on the same file system). Then the paths are staged (git's index holds
        what was committed, so `git status` is clean), `on_parent(sha or None)` is told, and HEAD moves.
        Returns the new commit's sha.
        """
        objs = self.objects()
        if objs is None:
            if sync is not None:
                sync()
            return self._commit_through_index(paths, message, author, on_parent)
        from hutch.memory import _gitindex
        from hutch.memory._objects import worktree_entry

        # a split index takes added and changed paths without git reading its shared part (_gitindex); else
        # git's index is read and written meanwhile (see stage)
        direct = _gitindex.split(objs.git_dir) and not _gitindex.crowded(objs.git_dir)
        staging = None if direct else self.stage(paths, wait=False)
        stats: dict = {}
        try:
            parent, base = objs.head()
            changes = {}
            root_fd = os.open(self.git.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                for rel in paths:
                    entry = worktree_entry(root_fd, rel, stats)
                    changes[rel] = None if entry is None else (entry[0], objs.write(b"blob", entry[1]))
            finally:
                os.close(root_fd)
            tree = objs.apply(base, changes)
            sha = None
            if not (parent and tree == base):   # else the paths were written back to what HEAD holds
                now = int(time.time())
                sha = objs.write_commit(tree, parent, message, author, now, time.localtime(now).tm_gmtoff)
                if sync is not None:
                    sync()
                objs.sync_objects()
        except BaseException:
            if staging is not None:
                staging.wait(check=False)
            raise
        if sha is None:
            if staging is not None:
                staging.wait()
            return None
        if on_parent is not None:
            on_parent(parent)
        # HEAD moves while the paths are still being staged; if staging fails (another git holds index.lock)
        # HEAD is moved back, so a write that raised committed nothing
        subject = message.split("\n", 1)[0]
        moving = self.git.start("update-ref", "-m", f"commit: {subject}", "HEAD", sha, parent or "0" * 40)
        failed = None
        if direct:
            try:
                new = {rel: (stats[rel], _gitindex.git_mode(stats[rel]), change[1])
                       for rel, change in changes.items() if change is not None}
                if len(new) < len(changes) or not _gitindex.stage(objs.git_dir, str(self.git.root), new):
                    staging = self.stage(paths, wait=False)   # a removal, or an index git must write
            except MemoryStoreError as e:
                failed = e
        if staging is not None:
            try:
                staging.wait()
            except MemoryStoreError as e:
                failed = e
        try:
            moving.wait()
        except MemoryStoreError:
            if failed is None:
                raise   # staged, not committed: the caller unstages
            raise failed from None
        if failed is not None:
            back = ["HEAD", parent, sha] if parent else ["-d", "HEAD", sha]
            self.git.run("update-ref", "-m", "hutch: the paths could not be staged, commit undone", *back, check=False)
            raise failed
        self._sync_ref()
        return sha

    def stage(self, paths: list[str], *, wait: bool = True) -> "Running | None":
        """Make git's index hold exactly what the work tree has at `paths` (added, changed or removed); with
        `wait=False`, return the running update-index instead of waiting for it.

        update-index takes exact paths (no pathspec matching, which is quadratic for big batches), but it
        reads and writes the whole index, a cost that grows with the store: a big index is split
        (core.splitIndex: each write writes only the entries changed since the shared part was last
        rewritten) and records offsets, so that reading it can be spread over threads."""
        if not paths:
            return None
        from hutch.memory import _gitindex

        # the index.lock a hutch writer killed while it held it left behind (only that one: never another git's)
        _gitindex.recover_lock(os.path.join(self.git.root, ".git"))
        split = []
        try:
            if self._split is None:   # split already (by this store's earlier writers, or by hand)?
                self._split = any(n.startswith("sharedindex.") for n in os.listdir(self.git.root / ".git"))
            if self._split or os.path.getsize(self.git.root / ".git" / "index") > _SPLIT_INDEX_BYTES:
                # once split, stay split, and let every rewrite of the shared part record its offsets
                self._split = True
                split = ["-c", "core.splitIndex=true", "-c", "index.recordOffsetTable=true",
                         "-c", "index.recordEndOfIndexEntries=true"]
        except OSError:
            pass
        if self._split:
            if _gitindex.crowded(os.path.join(self.git.root, ".git")):
                # the entries staged directly (_gitindex) go into a new shared index now
                split += ["-c", "splitIndex.maxPercentChange=0"]
        running = self.git.start(*split, "update-index", "--add", "--remove", "-z", "--stdin", input=_nul_list(paths))
        if wait:
            running.wait()
            return None
        return running

    def _commit_through_index(self, paths: list[str], message: str, author: tuple[str, str],
                              on_parent=None) -> str | None:
        """The commit for a repository hutch does not write objects into (not SHA-1): through git's index."""
        self.stage(paths)
        # plumbing instead of `git commit`: porcelain commit re-stats every file of the work tree
        # (its index refresh), which dominates once a store holds tens of thousands of entities
        tree = self.git.run("write-tree").strip()
        heads = self.git.run("show", "-s", "--format=%H %T", "HEAD", check=False).split()
        parent = heads[0] if len(heads) == 2 else None
        if parent and heads[1] == tree:
            return None  # the paths were written back to what HEAD already holds
        name, email = author
        env = {
            "GIT_AUTHOR_NAME": name, "GIT_AUTHOR_EMAIL": email,
            "GIT_COMMITTER_NAME": name, "GIT_COMMITTER_EMAIL": email,
        }
        args = ["commit-tree", tree, *(["-p", parent] if parent else []), "-F", "-"]
        sha = self.git.run(*args, input=message.encode(), env=env).strip()
        subject = message.split("\n", 1)[0]
        if on_parent is not None:
            on_parent(parent)
        self.git.run("update-ref", "-m", f"commit: {subject}", "HEAD", sha, parent or "0" * 40)
        return sha

    def blob_stream(self) -> "BlobStream":
        """A running `git fast-import` that takes blobs while a transaction writes (see commit_bulk)."""
        return BlobStream(self.git)

    def commit_bulk(self, paths: list[str], message: str, author: tuple[str, str],
                    stream: "BlobStream | None" = None, on_parent=None, known: dict | None = None) -> str | None:
        """Commit many paths at once: blobs go into one pack through `git fast-import`, not loose files.

        `known` says what the caller left at each path (Transaction.final: "file", ("link", target) or
        None): a file whose bytes went to `stream` as they were written is referenced by its mark, and no
        file is read back; any other file is read from the work tree (never through a link) and sent inline.
        Then the same paths are staged, so the index matches and keeps stat data. Falls back to `commit()`
        on a detached HEAD or an unborn branch.
        """
        from hutch.memory._objects import LINK, worktree_entry

        branch = self.git.run("symbolic-ref", "-q", "HEAD", check=False).strip()
        if not branch or not self.git.has_head():
            if stream is not None:
                stream.abort()
            return self.commit(paths, message, author, on_parent=on_parent)
        parent = self.git.run("rev-parse", "HEAD").strip()
        marks = stream.marks if stream is not None else {}
        known = known or {}
        body: list[bytes] = []
        root_fd = os.open(self.git.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            for rel in paths:
                bpath = rel.encode("utf-8", errors="surrogateescape")
                state = known.get(rel, "unknown")
                if state == "file" and rel in marks:
                    body.append(b"M 100644 :%d " % marks[rel] + bpath + b"\n")
                    continue
                if isinstance(state, tuple) and state[0] == "link":
                    mode, data = LINK, os.fsencode(state[1])
                elif state is None:
                    body.append(b"D " + bpath + b"\n")
                    continue
                else:
                    entry = worktree_entry(root_fd, rel)
                    if entry is None:
                        body.append(b"D " + bpath + b"\n")
                        continue
                    mode, data = entry
                body.append(b"M " + mode + b" inline " + bpath + b"\ndata %d\n" % len(data) + data + b"\n")
        finally:
            os.close(root_fd)
        from hutch.memory._objects import safe_ident

        name, email = safe_ident(author[0]) or "hutch", safe_ident(author[1])
        who = f"{name} <{email}> {int(time.time())} +0000".encode("utf-8", "surrogateescape")
        msg = message.encode("utf-8", "surrogateescape")
        # the commit goes to a ref of hutch's own first: HEAD moves only once the paths are staged, so a failure
        # to stage (another git holds index.lock) commits nothing, as for a small commit
        head = [b"commit " + PENDING_REF.encode() + b"\n", b"author " + who + b"\n", b"committer " + who + b"\n",
                b"data %d\n" % len(msg) + msg + b"\n", b"from " + parent.encode() + b"\n"]
        stream_in = b"".join(head + body) + b"\ndone\n"
        if stream is not None:
            stream.finish(stream_in)
        else:
            self.git.run("fast-import", "--quiet", "--done", input=stream_in)
        new, tree, old_tree = self.git.run("rev-parse", PENDING_REF, f"{PENDING_REF}^{{tree}}",
                                           f"{parent}^{{tree}}").split()
        try:
            # stage the same paths: their blobs are in the pack now, so this writes no loose objects,
            # and it records stat data so later git commands need not re-read every file
            self.stage(paths)
            if tree == old_tree:
                return None  # nothing changed: no empty commit
            if on_parent is not None:
                on_parent(parent)
            self.git.run("update-ref", "-m", f"commit: {message.split(chr(10), 1)[0]}", branch, new, parent)
        finally:
            self.git.run("update-ref", "-d", PENDING_REF, check=False)
        self._sync_ref()
        return new

    def _sync_ref(self) -> None:
        objs = self.objects()
        if objs is not None:
            try:
                objs.sync_ref()
            except OSError:
                pass   # the commit landed; only the flush of the ref's directory failed

    def unstage(self, paths: list[str], *, check: bool = False) -> None:
        """The index back to HEAD at `paths`. `check`: MemoryStoreError if git could not (another git holds
        index.lock), for the recovery of a dead writer, which must not forget its journal before this is done."""
        if paths and self.git.has_head():
            from hutch.memory import _gitindex

            # a dead writer's recovery: the index.lock it, or its git, may have left would fail the reset
            _gitindex.recover_lock(os.path.join(self.git.root, ".git"))
            data = _nul_list(paths)
            self.git.run("reset", "-q", "--pathspec-from-file=-", "--pathspec-file-nul", input=data, check=check)


class BlobStream:
    """`git fast-import` fed blob by blob while a big transaction writes, so packing overlaps writing.

    Nothing is referenced until `finish()` sends the commit; `abort()` (on
    rollback) ends the process without updating any ref (its objects are
    unreachable and harmless).
    """

    def __init__(self, git: "Git"):
        import tempfile

        self._err = tempfile.TemporaryFile()
        self._proc = subprocess.Popen(
            git.argv("fast-import", "--quiet", "--done"),
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=self._err,
            env=git.env(),
        )
        try:   # a pipe of 1 MiB, not 64 KiB: the writer runs on while fast-import lags (a loaded machine)
            import fcntl

            fcntl.fcntl(self._proc.stdin.fileno(), getattr(fcntl, "F_SETPIPE_SZ", 1031), 1 << 20)
        except OSError:
            pass
        self.marks: dict[str, int] = {}  # path -> the mark of the bytes last sent for it
        self._next = 1

    def add(self, rel: str, data: bytes) -> None:
        """Send one blob now; remember it as the content of `rel`."""
        mark = self._next
        self._next += 1
        self._proc.stdin.write(b"blob\nmark :%d\ndata %d\n" % (mark, len(data)) + data + b"\n")
        self.marks[rel] = mark

    def finish(self, rest: bytes) -> None:
        """Send the commit (and `done`), wait, and raise MemoryStoreError if fast-import failed."""
        try:
            self._proc.stdin.write(rest)
            self._proc.stdin.close()
        except BrokenPipeError:
            pass
        rc = self._proc.wait()
        if rc != 0:
            self._err.seek(0)
            raise MemoryStoreError(
                f"git fast-import failed (exit {rc}): {self._err.read().decode(errors='replace').strip()}. "
                "Check the store's git repository with 'git status'."
            )
        self._err.close()

    def abort(self) -> None:
        """End the process without committing anything (its blobs stay unreachable until git gc)."""
        if self._proc.returncode is None:
            try:
                # a clean `done` with no commit: no ref changes, no crash report, no temp pack left behind
                self._proc.stdin.write(b"done\n")
                self._proc.stdin.close()
            except (OSError, ValueError):
                pass
            try:
                self._proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._proc.kill()  # our own child, by its Popen handle
                self._proc.wait()
        self._err.close()


def _nul_list(paths: list[str]) -> bytes:
    """NUL-terminated paths in git's (byte) order, so update-index appends instead of inserting mid-array."""
    return b"".join(p + b"\0" for p in sorted(p.encode("utf-8", errors="surrogateescape") for p in paths))


