"""A memory store on a Ray cluster: one writer actor, a git remote as the truth, a reader on every node.

    writer  a named, detached actor (`hutch-mem:NAME`, max_restarts=-1): the one process that writes the store.
            Its clone is `ROOT/NAME/writer` on whatever node it runs (a flock keeps it its own); it is made again
            from the remote whenever the writer starts (a restart on another node after its node died included),
            so nothing but the remote carries state. A write runs on hutch.Memory there, is committed with the
            caller's request id as a `Hutch-Request` trailer, and is acknowledged only once `git push` moved the
            remote's branch to it (durable: the remote flushed the objects and the ref, `core.fsync=committed`).
            A push that fails takes the clone back to what the remote has: nothing is acknowledged that is not
            there. A request id the remote's history already holds is answered without writing again, so a
            caller may retry a write whose answer it lost (its writer's node died) without doing it twice.
    reader  one per Ray node (`hutch-mem:NAME:reader:NODE`, pinned there), started by the writer: `ROOT/NAME/reader-N`
            (a slot of its host), kept up to date by `git fetch` every POLL seconds. The clone's work tree and
            the search index derived from it move together: under the reader's lock the tree is reset to the
            fetched commit and the index refreshed (embedded in full) before `commit` names it, and every read
            holds the same lock, so a read sees one commit's files and that commit's index, never a mix. A read
            may ask for at least a commit (the caller's last acknowledged write): the reader fetches until it has it.

The remote is a git URL (an absolute path, file://, ssh://, https://, or user@host:path); git's transports
that run programs (ext::, fd::) are refused, and no hook of the remote runs (core.hooksPath=/dev/null reaches
a local receive-pack too). Ray itself trusts whoever reaches the cluster (docs/fleet.md, "Trust").
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import threading
import time
from collections import OrderedDict
from dataclasses import replace
from pathlib import Path
from typing import Any

from hutch._core.errors import ConfigError, MemoryStoreError, StateError
from hutch.sandbox._fleet import NAMESPACE

POLL = 0.5                 # seconds between a reader's fetches
RECONCILE = 1.0            # seconds between the writer's looks for nodes without a reader
LOCK_WAIT = 60.0           # seconds a new writer waits for a dead one's clone lock on the same host
AT_LEAST_WAIT = 30.0       # seconds a read waits for the commit it asked for
SETUP_WAIT = 120.0         # seconds a starting writer asks again a remote that does not answer
PUSH_TRIES = 3             # a write is done again this often when the remote moved on under its push
SEEN = 20_000              # request ids of the newest commits a writer remembers (a retry older than that writes again)
BRANCH = "main"
SLOTS = 64
NAME_RE = re.compile(r"[a-z0-9][a-z0-9_-]{0,47}")
WRITES = ("put", "update", "supersede", "link", "unlink", "forget", "ingest_text", "ingest_conversation")
READS = ("get", "head", "exists", "ls", "classes", "search", "history", "neighbors", "backlinks")
#: what every git command that talks to the remote adds: no program-running transport; the remote flushes
_REMOTE_CONFIG = ("-c", "protocol.ext.allow=never", "-c", "protocol.fd.allow=never", "-c", "core.fsync=committed",
                  "-c", "core.fsyncMethod=fsync")


def writer_name(name: str) -> str:
    return f"hutch-mem:{name}"


def reader_name(name: str, node_id: str) -> str:
    return f"hutch-mem:{name}:reader:{node_id[:16]}"


def check_name(name: object) -> str:
    if not isinstance(name, str) or not NAME_RE.fullmatch(name):
        raise ConfigError(f"{name!r} is not a memory store name: use 1-48 of a-z 0-9 _ - (starting with a letter or "
                          "digit), e.g. hutch.fleet.memory('agent-notes', remote=...).")
    return name


_SCP = re.compile(r"[A-Za-z0-9._-]+@[A-Za-z0-9.-]+:[^:].*|[A-Za-z0-9.-]+:[^:/][^:]*")


def check_remote(remote: object) -> str:
    """A git URL that runs no program: an absolute path, file://, ssh://, https://, or scp-like user@host:path."""
    if not isinstance(remote, str) or not remote or remote.startswith("-") or any(c in remote for c in "\0\n\r"):
        raise ConfigError(f"remote={remote!r} is not a git URL: give the replicated truth's address, e.g. "
                          "remote='/srv/git/notes.git', 'ssh://git@host/notes.git' or 'https://host/notes.git'.")
    if "::" in remote:
        raise ConfigError(f"remote={remote!r} names a git transport helper ({remote.split('::')[0]}::), which runs a "
                          "program: use a path, file://, ssh:// or https:// URL.")
    if remote.startswith("/"):
        return remote
    m = re.match(r"([a-z][a-z0-9+.-]*)://", remote)
    if m:
        if m.group(1) not in ("file", "ssh", "git+ssh", "https", "http"):
            raise ConfigError(f"remote={remote!r}: the {m.group(1)}:// transport is not one hutch uses; give a path, "
                              "file://, ssh:// or https:// URL.")
        return remote
    if _SCP.fullmatch(remote):
        return remote
    raise ConfigError(f"remote={remote!r} is a relative path: give the remote's absolute path (the writer and the "
                      "readers run in other processes, on other nodes).")


def init_remote(path: str | os.PathLike) -> str:
    """Make a bare git repository at `path` to be a store's remote (flushing what it receives); returns its path.
    An existing bare repository is kept (its objects and refs untouched)."""
    import subprocess

    p = Path(os.path.abspath(os.fspath(path)))
    if (p / "HEAD").is_file() and (p / "objects").is_dir():
        return str(p)
    if p.exists() and any(p.iterdir()):
        raise ConfigError(f"{p} exists and is not a bare git repository: give an empty or new directory.")
    p.mkdir(parents=True, exist_ok=True, mode=0o700)
    for args in (["init", "-q", "--bare", "-b", BRANCH, str(p)],
                 ["-C", str(p), "config", "core.fsync", "committed"],
                 ["-C", str(p), "config", "receive.denyNonFastForwards", "true"],
                 ["-C", str(p), "config", "receive.denyDeletes", "true"]):
        r = subprocess.run(["git", "-c", "core.hooksPath=/dev/null", *args], capture_output=True, text=True)
        if r.returncode != 0:
            raise MemoryStoreError(f"git {args[0]} failed for {p}: {r.stderr.strip()}")
    return str(p)


# ==================================================================== the clone both roles keep

class Clone:
    """A node's clone of the remote at `path` (made on first use), driven through hutch's hardened git."""

    def __init__(self, path: Path, remote: str):
        from hutch.memory._git import Git

        self.path = path
        self.remote = remote
        path.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.git = Git(path)
        if not (path / ".git").is_dir():
            self.git.run("init", "-q")
        self.git.run("config", "remote.origin.url", remote)
        self.git.run("config", "remote.origin.fetch", "+refs/heads/*:refs/remotes/origin/*")   # an empty remote has no main yet

    def fetch(self) -> str | None:
        """Fetch the remote's branch; its commit (None while the remote has none)."""
        self.git.run(*_REMOTE_CONFIG, "fetch", "-q", "--no-tags", "origin")
        return self.origin()

    def origin(self) -> str | None:
        return self.git.run("rev-parse", "-q", "--verify", f"refs/remotes/origin/{BRANCH}^{{commit}}",
                            check=False).strip() or None

    def reset(self, commit: str) -> None:
        """Make the work tree, git's index and the branch exactly `commit` (untracked files removed; the
        ignored .hutch/ with the search index kept)."""
        self.git.run("reset", "-q", "--hard", commit)
        self.git.run("clean", "-q", "-f", "-d")

    def push(self) -> None:
        self.git.run(*_REMOTE_CONFIG, "push", "-q", "--porcelain", "origin", f"HEAD:refs/heads/{BRANCH}")

    def contains(self, commit: str, head: str) -> bool:
        if not re.fullmatch(r"[0-9a-f]{40}|[0-9a-f]{64}", commit or ""):
            raise ConfigError(f"{commit!r} is not a commit id.")
        return self.git.ok("merge-base", "--is-ancestor", commit, head)


def _claim(path: Path, wait: float) -> Any:
    f = open(path, "a+")
    deadline = time.monotonic() + wait
    while True:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return f
        except BlockingIOError:
            if time.monotonic() >= deadline:
                f.close()
                return None
            time.sleep(0.2)


def _remove_later(paths: list[Path], wait: float = 30.0) -> None:
    """Remove a dead writer's clones, once what it left running there has had time to end."""
    time.sleep(wait)
    for p in paths:
        shutil.rmtree(p, ignore_errors=True)


def _reap(base: Path) -> None:
    """Remove the clones of this host's readers and writer that are gone (their lock is free)."""
    for lock in sorted(base.glob("*.lock")):
        f = _claim(lock, 0)
        if f is None:
            continue
        try:
            shutil.rmtree(base / lock.stem, ignore_errors=True)
            lock.unlink(missing_ok=True)
        finally:
            f.close()
    try:
        base.rmdir()   # the store's directory of this host, once nothing of it is left
    except OSError:
        pass


def portable(value: Any, root: Path) -> Any:
    """What a Memory call returned, made fit to cross Ray: entities and hits without their store (the caller's
    handle becomes theirs), paths relative to the store."""
    from hutch.memory._entity import Entity
    from hutch.memory._index import Hit

    if isinstance(value, Entity):
        return replace(value, _store=None, path=value.path.relative_to(root))
    if isinstance(value, Hit):
        return replace(value, _store=None)
    if isinstance(value, Path):
        try:
            return value.relative_to(root)
        except ValueError:
            return value
    if isinstance(value, list):
        return [portable(v, root) for v in value]
    if isinstance(value, tuple):
        return tuple(portable(v, root) for v in value)
    return value


# ==================================================================== the writer

class MemoryWriter:
    """The Ray actor that owns a store's writes (hutch/fleet/_memory.py starts it; module docstring)."""

    def __init__(self, name: str, remote: str, options: dict):
        import ray

        from hutch.memory import Memory

        self.name, self.remote, self.options = name, remote, options
        self.node_id = ray.get_runtime_context().get_node_id()
        self.base = Path(options["root"]) / name
        self.base.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._lock_file = _claim(self.base / "writer.lock", LOCK_WAIT)
        if self._lock_file is None:
            raise MemoryStoreError(f"another writer of memory {name!r} holds {self.base / 'writer.lock'}")
        self.clone, self.pushed = self._fresh_clone()
        self.mem = Memory(self.clone.path, author=options.get("author"))
        if self.mem.git.head() != self.pushed:   # a new store: its first commit (.gitignore) goes to the remote
            self.clone.push()
            self.pushed = self.mem.git.head()
        self.lock = threading.Lock()
        self.seen: OrderedDict[str, tuple[str, str]] = OrderedDict()   # request id -> (commit, its first entity)
        self.results: OrderedDict[str, Any] = OrderedDict()            # request id -> what it returned (this life)
        self._load_seen()
        self.started = time.time()
        self.writes = 0
        self.stopping = False
        self.readers: dict[str, Any] = {}
        if options.get("readers", True):
            threading.Thread(target=self._reconcile_loop, name="hutch-mem-readers", daemon=True).start()

    def _fresh_clone(self) -> tuple[Clone, str | None]:
        """This life's clone, made again from the remote, and the remote's commit. A dead writer's clone is moved
        aside, never reused: the git processes it started outlive its worker (a push or a fast-import still
        running there) and a killed one leaves lock files; either would fail this writer's first git command,
        and a constructor that raises ends the actor for good. Its .hutch/ (the search index, derived from the
        files and checked against them) is kept. A remote that does not answer is asked again for a while."""
        path, old = self.base / "writer", None
        if path.exists():
            old = self.base / f"writer.old-{os.getpid()}-{time.monotonic_ns()}"
            path.rename(old)
        deadline = time.monotonic() + SETUP_WAIT
        while True:
            try:
                clone = Clone(path, self.remote)
                pushed = clone.fetch()
                if pushed:
                    clone.reset(pushed)
                break
            except MemoryStoreError:
                if time.monotonic() >= deadline:
                    raise
                shutil.rmtree(path, ignore_errors=True)
                time.sleep(2.0)
        if old is not None and (old / ".hutch").is_dir() and not (path / ".hutch").exists():
            (old / ".hutch").rename(path / ".hutch")
        olds = sorted(self.base.glob("writer.old-*"))
        (path / ".hutch" / "journal").unlink(missing_ok=True)   # a dead writer's: the remote is the truth
        if olds:
            threading.Thread(target=_remove_later, args=(olds,), name="hutch-mem-old-clones", daemon=True).start()
        return clone, pushed

    def _load_seen(self, since: str | None = None) -> None:
        """The request ids of the newest SEEN commits (of those after `since` only, if given)."""
        fmt = "%H%x1f%(trailers:key=Hutch-Request,valueonly,separator=%x2c)%x1f" \
              "%(trailers:key=Hutch-Entity,valueonly,separator=%x2c)%x1e"
        out = self.mem.git.run("log", f"-n{SEEN}", f"--format={fmt}", f"{since}..HEAD" if since else "HEAD")
        rows = []
        for rec in out.split("\x1e"):
            parts = rec.strip("\n").split("\x1f")
            if len(parts) == 3 and parts[1]:
                rows.append((parts[1].strip(), parts[0], parts[2].split(",")[0].strip()))
        for rid, sha, entity in reversed(rows):
            self.seen[rid] = (sha, entity)

    # --- readers ------------------------------------------------------------------------

    def _reconcile_loop(self) -> None:
        while not self.stopping:
            try:
                self.reconcile()
            except Exception:   # Ray's GCS is briefly away: look again next time
                pass
            time.sleep(RECONCILE)

    def reconcile(self) -> None:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        alive = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
        for nid in list(self.readers):
            if nid not in alive:
                del self.readers[nid]
        for nid in alive - set(self.readers):
            if self.stopping:
                return
            self.readers[nid] = ray.remote(MemoryReader).options(
                name=reader_name(self.name, nid), namespace=NAMESPACE, lifetime="detached", num_cpus=0,
                max_restarts=-1, max_concurrency=8, get_if_exists=True,
                scheduling_strategy=NodeAffinitySchedulingStrategy(nid, soft=False),
            ).remote(self.name, self.remote, self.options)

    # --- writes -------------------------------------------------------------------------

    def write(self, rid: str, op: str, args: tuple, kwargs: dict) -> dict:
        """Do `op` once for request `rid`: {"commit": the remote's commit holding it, "result": what Memory
        returned, "again": True if an earlier try did it}. Raises what Memory raises (nothing written then)."""
        if op not in WRITES:
            raise ConfigError(f"{op!r} is not a write of a memory store: one of {', '.join(WRITES)}.")
        if not isinstance(rid, str) or not re.fullmatch(r"[0-9a-f]{16,64}", rid):
            raise ConfigError("a write's request id is 16-64 hex digits.")
        with self.lock:
            for attempt in range(PUSH_TRIES):
                if rid in self.seen:
                    return {"commit": self.seen[rid][0], "result": self._again(rid, op, args, kwargs), "again": True}
                before = self.mem.git.head()
                try:
                    with self.mem._writer.tagged(Request=rid):
                        result = getattr(self.mem, op)(*args, **kwargs)
                    after = self.mem.git.head()
                    if after != before:
                        self.clone.push()
                    break
                except BaseException as e:
                    moved = False
                    if self.mem.git.head() != self.pushed:
                        moved = self._resync(rid)   # not acknowledged; the clone becomes what the remote has
                    # the remote moved on under us (an earlier writer's push, still running as its node died,
                    # landed late): with that commit's request ids known, do this one again on top of it
                    if moved and isinstance(e, MemoryStoreError) and attempt + 1 < PUSH_TRIES:
                        continue
                    raise
            self.pushed = after
            self.writes += 1
            if after != before:
                self._remember(rid, after, getattr(result, "id", "") or "")
            self.results[rid] = portable(result, self.clone.path)
            while len(self.results) > 1000:
                self.results.popitem(last=False)
            return {"commit": after, "result": self.results[rid], "again": False}

    def _resync(self, rid: str) -> bool:
        """After a failed push: the clone back to the remote's branch as it is now (a push that failed after the
        remote took it leaves the commit there: its request id is then remembered, so a retry is not done twice).
        True if the remote holds commits of another writer that this one had not seen (their ids now known)."""
        mine, was = self.mem.git.head(), self.pushed
        try:
            origin = self.clone.fetch() or self.pushed
        except Exception:
            origin = self.pushed   # the remote is away: what it had when it last answered
        if not origin:
            return False
        self.clone.reset(origin)
        self.pushed = origin
        if mine and mine != origin and self.clone.contains(mine, origin):
            self._remember(rid, mine, "")
            return False
        if origin != was:
            self._load_seen(since=was)
            return True
        return False

    def _remember(self, rid: str, sha: str, entity: str) -> None:
        self.seen[rid] = (sha, entity)
        while len(self.seen) > SEEN:
            self.seen.popitem(last=False)

    def _again(self, rid: str, op: str, args: tuple, kwargs: dict) -> Any:
        """The answer to a retried request an earlier try (maybe an earlier writer) already committed."""
        if rid in self.results:
            return self.results[rid]
        entity = self.seen[rid][1]
        if op in ("put", "update", "supersede") and entity and self.mem.exists(entity):
            return portable(self.mem.get(entity), self.clone.path)
        if op in ("link", "ingest_text", "ingest_conversation"):   # idempotent: doing it again changes nothing
            return portable(getattr(self.mem, op)(*args, **kwargs), self.clone.path)
        return None

    def status(self) -> dict:
        import ray

        rows = {}
        for nid, r in list(self.readers.items()):
            try:
                rows[nid] = ray.get(r.status.remote(), timeout=5)
            except Exception as e:
                rows[nid] = {"node_id": nid, "error": f"{type(e).__name__}: {e}"}
        return {"name": self.name, "remote": self.remote, "node_id": self.node_id, "commit": self.pushed,
                "pid": os.getpid(), "clone": str(self.clone.path), "started": self.started, "writes": self.writes,
                "readers": sorted(rows.values(), key=lambda r: r["node_id"])}

    def stop(self) -> list[dict]:
        """Stop every reader (each removes its clone), then remove this writer's clone; the caller kills it."""
        import ray

        self.stopping = True
        out = []
        for nid, r in list(self.readers.items()):
            try:
                out.append(ray.get(r.stop.remote(), timeout=60))
            except Exception as e:
                out.append({"node_id": nid, "error": f"{type(e).__name__}: {e}"})
            try:
                ray.kill(r, no_restart=True)
            except Exception:
                pass
        with self.lock:
            if self.mem._search_index is not None:
                self.mem.index.close()
            shutil.rmtree(self.clone.path, ignore_errors=True)
            _remove_later(sorted(self.base.glob("writer.old-*")), 0)
            (self.base / "writer.lock").unlink(missing_ok=True)
            self._lock_file.close()
            _reap(self.base)
        return out


# ==================================================================== a reader

class MemoryReader:
    """The Ray actor that serves a store's reads on one node (the writer starts one per node; module docstring)."""

    def __init__(self, name: str, remote: str, options: dict):
        import ray

        self.name, self.remote, self.options = name, remote, options
        self.node_id = ray.get_runtime_context().get_node_id()
        self.base = Path(options["root"]) / name
        self.base.mkdir(parents=True, exist_ok=True, mode=0o700)
        for i in range(SLOTS):
            f = _claim(self.base / f"reader-{i}.lock", 0)
            if f is not None:
                self.slot, self._lock_file = i, f
                break
        else:
            raise MemoryStoreError(f"all {SLOTS} reader slots of {self.base} are held")
        self.clone = Clone(self.base / f"reader-{self.slot}", remote)
        self.lock = threading.Lock()      # the clone's tree and its index move together under it
        self._fetching = threading.Lock()
        self.commit: str | None = None    # the commit whose files and index the reader serves
        self.mem = None
        self.error = ""
        self.updated = 0.0
        self.stopping = False
        self.update()
        threading.Thread(target=self._poll, name="hutch-mem-fetch", daemon=True).start()

    def _poll(self) -> None:
        while not self.stopping:
            time.sleep(POLL)
            try:
                self.update()
                self.error = ""
            except Exception as e:   # the remote is away: serve the last commit, say why in status()
                self.error = f"{type(e).__name__}: {e}"

    def update(self) -> str | None:
        """Fetch; when the remote moved, move the tree and the index to its commit (reads wait meanwhile)."""
        from hutch.memory import Memory

        with self._fetching:
            new = self.clone.fetch()
            if new is None or new == self.commit or self.stopping:
                return self.commit
            with self.lock:
                self.commit = None   # until the tree and the index are both at `new`, no read is served
                self.clone.reset(new)
                if self.mem is None:
                    self.mem = Memory(self.clone.path, create=False, embedder=self.options.get("embedder"))
                self.mem.index.refresh(embed_budget=None)
                self.commit = new
                self.updated = time.time()
            return new

    def read(self, op: str, args: tuple, kwargs: dict, at_least: str | None = None) -> dict:
        """{"commit": the commit read, "result": what Memory returned}; with `at_least`, a commit that holds it."""
        if op not in READS:
            raise ConfigError(f"{op!r} is not a read of a memory store: one of {', '.join(READS)}.")
        if at_least:
            deadline = time.monotonic() + AT_LEAST_WAIT
            while not (self.commit and self.clone.contains(at_least, self.commit)):
                if time.monotonic() > deadline:
                    raise StateError(f"the reader of memory {self.name!r} on node {self.node_id[:16]} has not "
                                           f"got commit {at_least[:12]} after {AT_LEAST_WAIT:.0f} s (it serves "
                                           f"{(self.commit or 'nothing')[:12]}; {self.error or 'the remote lacks it'})")
                self.update()
                if not (self.commit and self.clone.contains(at_least, self.commit)):
                    time.sleep(0.05)
        with self.lock:
            if self.mem is None or self.commit is None:
                raise StateError(f"the reader of memory {self.name!r} on node {self.node_id[:16]} serves no commit "
                                 f"({self.error or 'the remote has none yet'})")
            return {"commit": self.commit, "result": portable(getattr(self.mem, op)(*args, **kwargs), self.clone.path)}

    def status(self) -> dict:
        return {"node_id": self.node_id, "commit": self.commit, "slot": self.slot, "clone": str(self.clone.path),
                "pid": os.getpid(), "updated": self.updated, "error": self.error}

    def stop(self) -> dict:
        self.stopping = True
        with self._fetching, self.lock:
            if self.mem is not None and self.mem._search_index is not None:
                self.mem.index.close()
            shutil.rmtree(self.clone.path, ignore_errors=True)
            (self.base / f"reader-{self.slot}.lock").unlink(missing_ok=True)
            self._lock_file.close()
            _reap(self.base)
        return {"node_id": self.node_id, "removed": str(self.clone.path)}


__all__ = ["MemoryReader", "MemoryWriter", "READS", "WRITES", "check_name", "check_remote", "init_remote",
           "reader_name", "writer_name"]
