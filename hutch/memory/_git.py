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

from hutch._core.errors import MemoryStoreError

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
]
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
        argv = self.argv(*args)
        full_env = self.env(env)
        try:
            p = subprocess.run(argv, input=input, capture_output=True, env=full_env, check=False)
        except FileNotFoundError as e:
            raise MemoryStoreError(
                "git is not installed: install the Debian package 'git' (listed in scripts/debian-packages.txt)."
            ) from e
        if check and p.returncode != 0:
            raise MemoryStoreError(
                f"git {' '.join(args[:2])} failed in {self.root} (exit {p.returncode}): "
                f"{p.stderr.decode(errors='replace').strip()}. Check the store's git repository with "
                f"'git -C {self.root} status'."
            )
        return p.stdout.decode("utf-8", errors="surrogateescape")

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

    def commit(self, paths: list[str], message: str, author: tuple[str, str], when: str | None = None,
               on_parent=None) -> str | None:
        """Stage exactly `paths` (additions, changes, deletions) and commit them. None if nothing changed.

        Returns the new commit's sha. `on_parent(sha or None)` is called just before HEAD moves.
        """
        if paths:
            # update-index takes exact paths (no pathspec matching, which is quadratic for big batches)
            # and stages additions, changes and removals alike
            data = _nul_list(paths)
            self.run("update-index", "--add", "--remove", "-z", "--stdin", input=data)
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
        if when:
            env["GIT_AUTHOR_DATE"] = when
            env["GIT_COMMITTER_DATE"] = when
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
                    stream: "BlobStream | None" = None, on_parent=None) -> str | None:
        """Commit many paths at once: blobs go into one pack through `git fast-import`, not loose files.

        With a `stream`, blobs already sent while writing are referenced by
        mark (their final content, unless the file changed since); the rest
        are sent inline now. Then the same paths are staged, so the index
        matches and keeps stat data. Falls back to `commit()` on a detached
        HEAD or an unborn branch.
        """
        branch = self.run("symbolic-ref", "-q", "HEAD", check=False).strip()
        if not branch or not self.has_head():
            if stream is not None:
                stream.abort()
            return self.commit(paths, message, author, on_parent=on_parent)
        parent = self.run("rev-parse", "HEAD").strip()
        marks = stream.marks if stream is not None else {}
        body: list[bytes] = []
        for rel in paths:
            full = self.root / rel
            bpath = rel.encode("utf-8", errors="surrogateescape")
            if os.path.islink(full):
                data, mode = os.readlink(full).encode("utf-8", errors="surrogateescape"), b"120000"
            elif os.path.isfile(full):
                with open(full, "rb") as f:
                    data = f.read()
                mode = b"100755" if os.access(full, os.X_OK) else b"100644"
                sent = marks.get(rel)
                if sent is not None and sent[1] == len(data) and sent[2] == hash(data):
                    body.append(b"M " + mode + b" :%d " % sent[0] + bpath + b"\n")
                    continue
            else:
                body.append(b"D " + bpath + b"\n")
                continue
            body.append(b"M " + mode + b" inline " + bpath + b"\ndata %d\n" % len(data) + data + b"\n")
        name, email = author
        who = f"{name} <{email}> {int(time.time())} +0000".encode()
        msg = message.encode()
        head = [b"commit " + branch.encode() + b"\n", b"author " + who + b"\n", b"committer " + who + b"\n",
                b"data %d\n" % len(msg) + msg + b"\n", b"from " + parent.encode() + b"\n"]
        stream_in = b"".join(head + body) + b"\ndone\n"
        if on_parent is not None:
            on_parent(parent)
        if stream is not None:
            stream.finish(stream_in)
        else:
            self.run("fast-import", "--quiet", "--done", input=stream_in)
        new = self.run("rev-parse", "HEAD").strip()
        if self.run("rev-parse", f"{new}^{{tree}}") == self.run("rev-parse", f"{parent}^{{tree}}"):
            self.run("update-ref", branch, parent, new)  # nothing changed: drop the empty commit
            return None
        # stage the same paths: their blobs are in the pack now, so this writes no loose objects,
        # and it records stat data so later git commands need not re-read every file
        data = _nul_list(paths)
        self.run("update-index", "--add", "--remove", "-z", "--stdin", input=data)
        return new

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
        self.marks: dict[str, tuple[int, int, int]] = {}  # path -> (mark, length, hash of bytes)
        self._next = 1

    def add(self, rel: str, data: bytes) -> None:
        """Send one blob now; remember it as the content of `rel`."""
        mark = self._next
        self._next += 1
        self._proc.stdin.write(b"blob\nmark :%d\ndata %d\n" % (mark, len(data)) + data + b"\n")
        self.marks[rel] = (mark, len(data), hash(data))

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
