"""The store's write path: one logical operation = one transaction = one git commit.

`Writer` owns what every write shares: the store's lock (an flock on `.hutch/write.lock`, taken by
each writer in any process, with the crash recovery of a dead writer's journal on taking it), the
transaction open in this instance (operations inside it join it), and the commit that ends it, with
the Hutch-* trailers of docs/smf-format.md ("History and provenance"). If the block raises, every
touched path is put back and nothing is committed.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from hutch._core import settings
from hutch.memory._commits import Committer
from hutch.memory._git import Git, trailer_value
from hutch.memory._tx import LOCK_NAME, StoreLock, Transaction, recover

#: The directory inside a store for derived, never-committed state (index, lock, journal).
DERIVED_DIR = ".hutch"
#: Trailers hutch adds to each commit message.
TRAILER_PREFIX = "Hutch-"
_MAX_TRAILER_ENTITIES = 100
_BULK_PATHS = 64  # above this many paths a commit writes one pack (fast-import) instead of loose objects
_ENTITY_OPS = ("put", "update", "supersede", "forget")


class Writer:
    """Transactions and commits of the store at `root`, signed by `author` (name, email)."""

    def __init__(self, root: Path, git: Git, author: tuple[str, str]):
        self.root = root
        self.git = git
        self.commits = Committer(git)
        self.author = author
        self.lock = StoreLock(root / DERIVED_DIR / LOCK_NAME, recover=self._recover)
        self._tx: Transaction | None = None
        self._tags: tuple[tuple[str, str], ...] = ()

    @contextmanager
    def tagged(self, **trailers: str) -> Iterator[None]:
        """Add `Hutch-<key>: value` trailers to every commit this instance makes in the block (the fleet's writer
        records each write's request id this way: docs/fleet.md, "Memory")."""
        old = self._tags
        self._tags = old + tuple((k, trailer_value(v)) for k, v in trailers.items())
        try:
            yield
        finally:
            self._tags = old

    def _recover(self, root_fd: int, hutch_fd: int) -> None:
        """Run with the lock just taken: undo the transaction of a writer that died holding it."""
        # (the journal stays until its paths are unstaged: a git holding index.lock fails this write, not the index)
        from hutch.memory._gitindex import wait_for_dead_writers_children

        recover(self.root, root_fd, hutch_fd, self.git.head, lambda paths: self.commits.unstage(paths, check=True),
                lambda: wait_for_dead_writers_children(str(self.root / ".git")))

    # ------------------------------------------------------------ the repository

    def ignores_derived(self) -> bool:
        """True if the store's .gitignore keeps `.hutch/` out of git."""
        try:
            return f"/{DERIVED_DIR}/" in (self.root / ".gitignore").read_text().splitlines()
        except (FileNotFoundError, UnicodeDecodeError):
            return False

    def init_repo(self) -> None:
        """Make the directory a store: a git repository whose .gitignore excludes .hutch/, committed."""
        with self.lock:
            if not self.git.is_repo():
                self.git.init()
            if self.git.has_head() and self.ignores_derived():
                return
            gi = self.root / ".gitignore"
            text = gi.read_text() if gi.exists() else ""
            if f"/{DERIVED_DIR}/" not in text.splitlines():
                from hutch._core.atomic import atomic_write

                text = text + ("" if text.endswith("\n") or not text else "\n") + f"/{DERIVED_DIR}/\n"
                atomic_write(gi, text.encode())
            self.commits.commit([".gitignore"], commit_message("init", "init store", []), self.author)

    # ------------------------------------------------------------ transactions

    @contextmanager
    def transaction(self, message: str | None = None, *, source: str | None = None,
                    reason: str | None = None) -> Iterator[Transaction]:
        """A grouped transaction (see Memory.transaction): synced once, committed as one pack."""
        with self.op(None, None, message=message, source=source, reason=reason) as tx:
            if self._tx is tx and not tx.ops:
                tx.bulk = True
                tx.stream_factory = self.commits.blob_stream
            yield tx

    @contextmanager
    def op(self, op: str | None, subject: str | None, *, message: str | None = None,
           source: str | None = None, reason: str | None = None, **trailers: str | None) -> Iterator[Transaction]:
        """One operation: it joins the transaction open in this instance, else it is a transaction of its own,
        committed when the block ends (nothing is committed if it changed nothing, or raised)."""
        with self.lock:
            outer = self._tx
            if outer is not None:
                if op:
                    outer.record(op, subject or "", **{"Source": source, "Reason": reason, **trailers})
                yield outer
                return
            tx = Transaction(self.root, message, source, reason, root_fd=self.lock.root_fd,
                             hutch_fd=self.lock.hutch_fd)
            tx.trailers.extend(self._tags)
            if op:
                tx.record(op, subject or "", **{"Source": source, "Reason": reason, **trailers})
            self._tx = tx
            try:
                yield tx
                self._commit(tx, op, message)
            except BaseException:
                tx.rollback()
                raise
            else:
                tx.finish()   # outside the rollback: once committed, a failure here must not undo the files
            finally:
                self._tx = None
                tx.close()

    def _commit(self, tx: Transaction, op: str | None, subject: str | None) -> None:
        paths = tx.paths
        if not paths:
            return
        msg = commit_message(op or "transaction", subject or _subject(tx), tx.ops, tx, self.author)
        try:
            if len(paths) > _BULK_PATHS or tx.stream is not None:
                tx.sync()
                self.commits.commit_bulk(paths, msg, self.author, tx.stream, on_parent=tx.committing, known=tx.final)
                tx.stream = None
            else:  # the commit's objects first, then one flush of the files and them together
                self.commits.commit(paths, msg, self.author, on_parent=tx.committing, sync=tx.sync)
        except BaseException:
            self.commits.unstage(paths)
            raise


# ==================================================================== commit messages

def _subject(tx: Transaction) -> str:
    ops = [o for o in tx.ops if o[1]]
    if len(ops) == 1:
        return f"{ops[0][0]} {ops[0][1]}"
    return f"transaction: {len(ops)} operations"


def commit_message(op: str, subject: str, ops: list, tx: Transaction | None = None,
            author: tuple[str, str] | None = None) -> str:
    """Commit message: a subject line, then Hutch-* trailers (each key capped, so huge batches stay small)."""
    trailers: list[tuple[str, str]] = [("Op", tx.kind if tx is not None and tx.kind else op)]
    entities: dict[str, None] = {}
    for o, s in ops:
        e = s.split(" -[", 1)[0] if o in ("link", "unlink") else s if o in _ENTITY_OPS else None
        if e:
            entities.setdefault(e)
    trailers += [("Entity", e) for e in list(entities)[:_MAX_TRAILER_ENTITIES]]
    if len(entities) > _MAX_TRAILER_ENTITIES:
        trailers.append(("Entities", str(len(entities))))
    if tx is not None:
        extra: dict[tuple[str, str], None] = {}
        if tx.source:
            extra[("Source", tx.source)] = None
        if tx.reason:
            extra[("Reason", tx.reason)] = None
        for kv in tx.trailers:
            extra.setdefault(kv)
        per_key: dict[str, int] = {}
        for k, v in extra:
            per_key[k] = per_key.get(k, 0) + 1
            if per_key[k] <= _MAX_TRAILER_ENTITIES:
                trailers.append((k, v))
        for k, n in per_key.items():
            if n > _MAX_TRAILER_ENTITIES:
                trailers.append(("Omitted", f"{n - _MAX_TRAILER_ENTITIES} more {k} values"))
        if len(ops) > 1:
            counts: dict[str, int] = {}
            for o, _ in ops:
                counts[o] = counts.get(o, 0) + 1
            trailers.append(("Ops", ", ".join(f"{k}={v}" for k, v in sorted(counts.items()))))
    lines = [trailer_value(subject)[:200], ""]
    lines += [f"{TRAILER_PREFIX}{k}: {trailer_value(v)}" for k, v in trailers]
    return "\n".join(lines) + "\n"


def parse_author(author: str | None) -> tuple[str, str]:
    """'Name <email>' (else $HUTCH_AUTHOR, else hutch's default) -> (name, email)."""
    from hutch.memory._git import DEFAULT_AUTHOR

    author = author or settings.AUTHOR.get()
    if not author:
        return DEFAULT_AUTHOR
    if "<" in author and author.rstrip().endswith(">"):
        name, email = author.rsplit("<", 1)
        return name.strip() or DEFAULT_AUTHOR[0], email.rstrip()[:-1].strip()
    return author.strip(), DEFAULT_AUTHOR[1]
