"""The store's git repository, driven through the real `git` binary with argv lists.

Identity is set per commit through the environment, and user hooks, signing
and global excludes are switched off, so commits work the same on a machine
with no git configuration at all.

A store's `.git/config` is not trusted to run programs or to move the work
tree: hooks, `core.fsmonitor`, every filter driver it defines (clean, smudge,
process: `update-index --add` would run them), external diff and textconv,
and signature display are switched off on every command, and the work tree is
always the store (`core.worktree` could make a commit read files outside it).
"""

from __future__ import annotations

import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from hutch._core.errors import MemoryStoreError

if TYPE_CHECKING:  # pragma: no cover
    from hutch.memory._objects import Objects

#: Who commits when the caller names no one.
DEFAULT_AUTHOR = ("hutch", "hutch@localhost")
_CONFIG = [
    "-c", "core.hooksPath=/dev/null",
    "-c", "commit.gpgSign=false",
    "-c", "core.quotePath=false",
    "-c", "core.symlinks=true",
    "-c", "core.autocrlf=false",
    "-c", "gc.auto=0",
    "-c", "maintenance.auto=false",
    "-c", "init.defaultBranch=main",
    "-c", "core.fsmonitor=false",
    "-c", "log.showSignature=false",
    "-c", "diff.external=",
    # a moved ref is flushed before it is renamed into place (git's default flushes only packs)
    "-c", "core.fsync=reference",
]
#: Where a big commit (fast-import) waits while its paths are staged, before HEAD moves to it.
PENDING_REF = "refs/hutch/pending"
#: An index larger than this is split (core.splitIndex): see Git.stage.
_SPLIT_INDEX_BYTES = 2 << 20
_SEP_FIELD = "\x1f"
_SEP_RECORD = "\x1e"


@dataclass(frozen=True)
class Commit:
    """One commit as `git log` shows it, with the hutch trailers parsed."""

    sha: str
    author: str
    email: str
    date: str
    subject: str
    message: str
    trailers: dict[str, list[str]]

    def trailer(self, key: str) -> str | None:
        values = self.trailers.get(key)
        return values[0] if values else None


class Git:
    """A thin wrapper: `Git(store).run("status")`."""

    def __init__(self, root: Path):
        self.root = root
        self._filters: tuple[object, list[str]] | None = None  # (.git/config's stat, the -c pairs)
        self._objects = None   # Objects, False if hutch cannot write this repository's objects, None: not asked

    def env(self, extra: dict | None = None) -> dict:
        """The environment every git command of this store runs with (`extra` added)."""
        env = dict(os.environ)
        env.update({"GIT_TERMINAL_PROMPT": "0", "LC_ALL": "C",
                    "GIT_DIR": str(self.root / ".git"), "GIT_WORK_TREE": str(self.root)})
        if extra:
            env.update(extra)
        return env

    def argv(self, *args: str) -> list[str]:
        """The argv of `git args...` in this store, with the hardening -c pairs (module docstring)."""
        return ["git", "-C", str(self.root), *_CONFIG, *self._no_filters(), *args]

    def _no_filters(self) -> list[str]:
        """`-c` pairs that empty every filter driver git's configuration defines (a driver named by a
        .gitattributes line runs its command on `update-index --add`). Recomputed when .git/config changes
        (a change only in a file it includes is seen by the next process)."""
        try:
            st = os.stat(self.root / ".git" / "config")
            key: object = (st.st_ino, st.st_mtime_ns, st.st_size)
        except OSError:
            key = None
        if self._filters is not None and self._filters[0] == key:
            return self._filters[1]
        try:
            p = subprocess.run(["git", "-C", str(self.root), *_CONFIG, "config", "-z", "--name-only",
                                "--get-regexp", r"^filter\."], capture_output=True, env=self.env())
        except FileNotFoundError:
            return []
        out: list[str] = []
        names = {n.split(".", 1)[1].rsplit(".", 1)[0]
                 for n in p.stdout.decode("utf-8", errors="surrogateescape").split("\0") if n.count(".") >= 2}
        for name in sorted(names):
            for k in ("clean", "smudge", "process"):
                out += ["-c", f"filter.{name}.{k}="]
            out += ["-c", f"filter.{name}.required=false"]
        self._filters = (key, out)
        return out

    def run(self, *args: str, input: bytes | None = None, env: dict | None = None, check: bool = True) -> str:
        return self.start(*args, input=input, env=env).wait(check)

    def start(self, *args: str, input: bytes | None = None, env: dict | None = None) -> "Running":
        """`git args...` started in the background (it is fed `input`); `.wait()` for its output."""
        try:
            p = subprocess.Popen(self.argv(*args), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, env=self.env(env))
        except FileNotFoundError as e:
            raise MemoryStoreError(
                "git is not installed: install the Debian package 'git' (listed in scripts/debian-packages.txt)."
            ) from e
        return Running(self, args, p, input)

    def ok(self, *args: str) -> bool:
        return subprocess.run(self.argv(*args), capture_output=True, env=self.env()).returncode == 0

    def init(self) -> None:
        self.run("init", "-q")

    def is_repo(self) -> bool:
        return (self.root / ".git").exists()

    def has_head(self) -> bool:
        return self.ok("rev-parse", "-q", "--verify", "HEAD")

    def head(self) -> str | None:
        """The sha HEAD points to, or None on an unborn branch."""
        return self.run("rev-parse", "-q", "--verify", "HEAD", check=False).strip() or None

    def objects(self) -> "Objects | None":
        """The repository's object database as hutch writes it directly (_objects.py); None if it cannot."""
        if self._objects is None:
            from hutch.memory._objects import Objects

            self._objects = Objects.open(self) or False
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
        from hutch.memory._objects import worktree_entry

        staging = self.stage(paths, wait=False)   # git's index is read and written meanwhile (see stage)
        try:
            parent, base = objs.head()
            changes = {}
            root_fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                for rel in paths:
                    entry = worktree_entry(root_fd, rel)
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
        finally:
            if staging is not None:
                staging.wait()   # before HEAD moves: a failure to stage (another git holds index.lock) commits nothing
        if sha is None:
            return None
        if on_parent is not None:
            on_parent(parent)
        subject = message.split("\n", 1)[0]
        self.run("update-ref", "-m", f"commit: {subject}", "HEAD", sha, parent or "0" * 40)
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
        split = []
        try:
            if os.path.getsize(self.root / ".git" / "index") > _SPLIT_INDEX_BYTES:
                split = ["-c", "core.splitIndex=true", "-c", "index.recordOffsetTable=true",
                         "-c", "index.recordEndOfIndexEntries=true"]
        except OSError:
            pass
        running = self.start(*split, "update-index", "--add", "--remove", "-z", "--stdin", input=_nul_list(paths))
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
        tree = self.run("write-tree").strip()
        heads = self.run("show", "-s", "--format=%H %T", "HEAD", check=False).split()
        parent = heads[0] if len(heads) == 2 else None
        if parent and heads[1] == tree:
            return None  # the paths were written back to what HEAD already holds
        name, email = author
        env = {
            "GIT_AUTHOR_NAME": name, "GIT_AUTHOR_EMAIL": email,
            "GIT_COMMITTER_NAME": name, "GIT_COMMITTER_EMAIL": email,
        }
        args = ["commit-tree", tree, *(["-p", parent] if parent else []), "-F", "-"]
        sha = self.run(*args, input=message.encode(), env=env).strip()
        subject = message.split("\n", 1)[0]
        if on_parent is not None:
            on_parent(parent)
        self.run("update-ref", "-m", f"commit: {subject}", "HEAD", sha, parent or "0" * 40)
        return sha

    def blob_stream(self) -> "BlobStream":
        """A running `git fast-import` that takes blobs while a transaction writes (see commit_bulk)."""
        return BlobStream(self)

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

        branch = self.run("symbolic-ref", "-q", "HEAD", check=False).strip()
        if not branch or not self.has_head():
            if stream is not None:
                stream.abort()
            return self.commit(paths, message, author, on_parent=on_parent)
        parent = self.run("rev-parse", "HEAD").strip()
        marks = stream.marks if stream is not None else {}
        known = known or {}
        body: list[bytes] = []
        root_fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
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
            self.run("fast-import", "--quiet", "--done", input=stream_in)
        new, tree, old_tree = self.run("rev-parse", PENDING_REF, f"{PENDING_REF}^{{tree}}", f"{parent}^{{tree}}").split()
        try:
            # stage the same paths: their blobs are in the pack now, so this writes no loose objects,
            # and it records stat data so later git commands need not re-read every file
            self.stage(paths)
            if tree == old_tree:
                return None  # nothing changed: no empty commit
            if on_parent is not None:
                on_parent(parent)
            self.run("update-ref", "-m", f"commit: {message.split(chr(10), 1)[0]}", branch, new, parent)
        finally:
            self.run("update-ref", "-d", PENDING_REF, check=False)
        self._sync_ref()
        return new

    def _sync_ref(self) -> None:
        objs = self.objects()
        if objs is not None:
            try:
                objs.sync_ref()
            except OSError:
                pass   # the commit landed; only the flush of the ref's directory failed

    def unstage(self, paths: list[str]) -> None:
        if paths and self.has_head():
            data = _nul_list(paths)
            self.run("reset", "-q", "--pathspec-from-file=-", "--pathspec-file-nul", input=data, check=False)

    def log(self, *paths: str, rev: str = "HEAD", limit: int | None = None) -> list[Commit]:
        """Commits touching `paths` (all commits if none), newest first."""
        if not self.has_head():
            return []
        fmt = _SEP_FIELD.join(["%H", "%an", "%ae", "%aI", "%s", "%B"]) + _SEP_RECORD
        args = ["log", f"--format={fmt}", rev]
        if limit:
            args.append(f"-n{limit}")
        out = self.run(*args, "--", *paths)
        commits = []
        for rec in out.split(_SEP_RECORD):
            rec = rec.strip("\n")
            if not rec:
                continue
            sha, an, ae, ad, subject, body = rec.split(_SEP_FIELD, 5)
            commits.append(Commit(sha, an, ae, ad, subject, body, parse_trailers(body)))
        return commits

    def show(self, rev: str, path: str) -> str | None:
        """The text of `path` at `rev`, or None if it did not exist there."""
        p = subprocess.run(self.argv("show", f"{rev}:{path}"), capture_output=True, env=self.env())
        if p.returncode != 0:
            return None
        return p.stdout.decode("utf-8", errors="surrogateescape")

    def ls_tree(self, rev: str, path: str) -> list[tuple[str, str, str]]:
        """(mode, object, path) under `path` at `rev`."""
        out = self.run("ls-tree", "-r", "-z", rev, "--", path, check=False)
        rows = []
        for rec in out.split("\0"):
            if rec:
                meta, p = rec.split("\t", 1)
                mode, _type, obj = meta.split()
                rows.append((mode, obj, p))
        return rows


class Running:
    """A git command running in the background (Git.start)."""

    def __init__(self, git: Git, args: tuple[str, ...], proc: subprocess.Popen, input: bytes | None):
        self.git, self.args, self.proc = git, args, proc
        self._thread = None
        self._out = self._err = b""
        if input and len(input) > 1 << 15:   # more than a pipe holds: fed by a thread, so nobody blocks
            import threading

            self._thread = threading.Thread(target=self._talk, args=(input,), daemon=True)
            self._thread.start()
        else:
            try:
                if input:
                    proc.stdin.write(input)
                proc.stdin.close()
            except BrokenPipeError:
                pass
            proc.stdin = None   # fed: communicate() in wait() only reads

    def _talk(self, input: bytes) -> None:
        self._out, self._err = self.proc.communicate(input)

    def wait(self, check: bool = True) -> str:
        """Its output; MemoryStoreError naming the command if it failed (and `check`)."""
        if self._thread is not None:
            self._thread.join()
        else:
            self._out, self._err = self.proc.communicate()
        if check and self.proc.returncode != 0:
            words = [a for i, a in enumerate(self.args) if a != "-c" and (i == 0 or self.args[i - 1] != "-c")]
            raise MemoryStoreError(
                f"git {' '.join(words[:2])} failed in {self.git.root} (exit {self.proc.returncode}): "
                f"{self._err.decode(errors='replace').strip()}. Check the store's git repository with "
                f"'git -C {self.git.root} status'.")
        return self._out.decode("utf-8", errors="surrogateescape")


class BlobStream:
    """`git fast-import` fed blob by blob while a big transaction writes, so packing overlaps writing.

    Nothing is referenced until `finish()` sends the commit; `abort()` (on
    rollback) ends the process without updating any ref (its objects are
    unreachable and harmless).
    """

    def __init__(self, git: Git):
        import tempfile

        self._err = tempfile.TemporaryFile()
        self._proc = subprocess.Popen(
            git.argv("fast-import", "--quiet", "--done"),
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=self._err,
            env=git.env(),
        )
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


def parse_trailers(message: str) -> dict[str, list[str]]:
    """`Key: value` lines of the message's last paragraph."""
    paragraphs = [p for p in message.strip().split("\n\n") if p.strip()]
    out: dict[str, list[str]] = {}
    if len(paragraphs) < 2:
        return out
    for line in paragraphs[-1].splitlines():
        if ": " in line:
            k, v = line.split(": ", 1)
            if k and " " not in k:
                out.setdefault(k, []).append(v)
    return out


def trailer_value(value: object) -> str:
    """A value made safe for one trailer line."""
    return " ".join(str(value).split())
