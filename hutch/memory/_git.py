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
    # a moved ref is flushed before it is renamed into place (git's default flushes only packs)
    "-c", "core.fsync=reference",
]
#: git commands that may take `.git/index.lock` or move a ref: each runs under a _gitindex.ChildGuard, so that
#: the lock it leaves if it is killed can be known for ours and removed (_gitindex.recover_lock), and the
#: recovery of a writer that died waits for those it left running (_gitindex.wait_for_dead_writers_children)
_GUARDED = frozenset({"update-index", "reset", "write-tree", "read-tree", "add", "rm", "mv", "checkout",
                      "restore", "switch", "commit", "status", "stash", "merge", "apply", "clean", "update-ref"})
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
        return self.start(*args, input=input, env=env).wait(check)

    def start(self, *args: str, input: bytes | None = None, env: dict | None = None) -> "Running":
        """`git args...` started in the background (it is fed `input`); `.wait()` for its output. A command that may
        take index.lock or move a ref runs recorded (_GUARDED)."""
        guard = token = None
        if _subcommand(args) in _GUARDED and (self.root / ".git").is_dir():
            from hutch.memory._gitindex import ChildGuard

            guard = ChildGuard(str(self.root / ".git"))
        try:
            p = subprocess.Popen(self.argv(*args), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, env=self.env(env), pass_fds=guard.fds if guard else ())
            if guard is not None:
                guard.started(p.pid)
                token = guard.token()
        except FileNotFoundError as e:
            raise MemoryStoreError(
                "git is not installed: install the Debian package 'git' (listed in scripts/debian-packages.txt)."
            ) from e
        finally:
            if guard is not None:
                guard.close()
        return Running(self, args, p, input, token)

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

    def __init__(self, git: Git, args: tuple[str, ...], proc: subprocess.Popen, input: bytes | None,
                 guarded: tuple | None = None):
        self.git, self.args, self.proc = git, args, proc
        self._guarded = guarded   # its record in .git/hutch-git-child (_gitindex.ChildGuard), told how it ended
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
        if self._guarded is not None:
            from hutch.memory._gitindex import child_ended

            child_ended(self._guarded, self.proc.returncode)
            self._guarded = None
        if check and self.proc.returncode != 0:
            words = [a for i, a in enumerate(self.args) if a != "-c" and (i == 0 or self.args[i - 1] != "-c")]
            rc, err = self.proc.returncode, self._err.decode(errors="replace").strip()
            how = f"exit {rc}" if rc > 0 else f"killed by signal {-rc}"
            raise MemoryStoreError(
                f"git {' '.join(words[:2])} failed in {self.git.root} ({how})" + (f": {err}" if err else "")
                + (". Nothing was committed; write again (the index.lock it left is removed by the next write)"
                   if rc < 0 else "") + f". Check the store's git repository with 'git -C {self.git.root} status'.")
        return self._out.decode("utf-8", errors="surrogateescape")


def _subcommand(args: tuple[str, ...]) -> str | None:
    """The git command `args` run (the first word past the `-c key=value` pairs and other options)."""
    i = 0
    while i < len(args):
        if args[i] == "-c":
            i += 2
        elif args[i].startswith("-"):
            i += 1
        else:
            return args[i]
    return None


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
