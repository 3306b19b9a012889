"""The undo journal of a transaction, so that a writer's death is rolled back by the next writer.

A transaction keeps every touched path's backup in memory (its own rollback); this file,
`<store>/.hutch/journal`, holds the same backups on disk, each written before its path is
touched: `{"v": 1, "tx": <id>}`, then one record per path (`{"rel", "kind": "none" | "file" |
"link", "n"}` and n bytes of the old content or link target), one per directory the transaction
made (`{"dir": rel}`), and `{"committing": <parent sha>}` just before git moves HEAD. It is
removed once the transaction has committed or rolled back. A writer killed in between (SIGKILL,
OOM) leaves it behind; the next writer finds it on taking the store's lock (nobody else can hold
that lock: the dead writer's flock died with it) and, unless HEAD has moved past the recorded
parent (the commit landed), puts every path back, removes the directories and the temp files the
dead writer made and unstages its paths. Records are written but not fsynced: this covers a
writer's death, not a host crash in the middle of a transaction.
"""

from __future__ import annotations

import json
import os
import secrets
from dataclasses import dataclass, field

NAME = "journal"
_MAX = 1 << 30   # a journal larger than this was not written by hutch: refused, not read into memory


@dataclass
class Undo:
    """What a dead writer's journal says: its id, the backups in order, the dirs it made, its commit point."""

    tx: str
    paths: list[tuple[str, str, bytes]] = field(default_factory=list)
    dirs: list[str] = field(default_factory=list)
    committing: str | None = None


class Journal:
    """Appends records to `.hutch/journal` (opened by the `.hutch` directory fd, never through a link)."""

    def __init__(self, hutch_fd: int):
        self.dfd = hutch_fd
        self.fd: int | None = None
        self.tx = secrets.token_hex(8)

    def _put(self, head: dict, data: bytes = b"") -> None:
        if self.fd is None:
            self.fd = os.open(NAME, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC,
                              0o600, dir_fd=self.dfd)
            self._write(json.dumps({"v": 1, "tx": self.tx, "pid": os.getpid()}).encode() + b"\n")
        self._write(json.dumps({**head, "n": len(data)}).encode() + b"\n" + data)

    def _write(self, buf: bytes) -> None:
        view = memoryview(buf)
        while view:
            view = view[os.write(self.fd, view):]

    def path(self, rel: str, kind: str, data: bytes | None) -> None:
        self._put({"rel": rel, "kind": kind}, data or b"")

    def made_dir(self, rel: str) -> None:
        self._put({"dir": rel})

    def committing(self, parent: str | None) -> None:
        if self.fd is not None:
            self._put({"committing": parent or ""})

    def end(self) -> None:
        """The transaction is over (committed or rolled back): nothing to undo any more."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
            os.unlink(NAME, dir_fd=self.dfd)


def _rel_ok(rel) -> bool:
    return isinstance(rel, str) and bool(rel) and not rel.startswith("/") and \
        all(p not in ("", ".", "..") for p in rel.split("/"))


def load(hutch_fd: int) -> Undo | None:
    """The journal a dead writer left, or None. A torn last record (killed while writing it) is dropped:
    its path had not been touched yet. Records naming a path outside the store are ignored."""
    try:
        fd = os.open(NAME, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=hutch_fd)
    except FileNotFoundError:
        return None
    try:
        if os.fstat(fd).st_size > _MAX:
            return Undo(tx="")
        chunks = []
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
        raw = b"".join(chunks)
    finally:
        os.close(fd)
    undo, pos = None, 0
    while (nl := raw.find(b"\n", pos)) >= 0:
        try:
            head = json.loads(raw[pos:nl])
        except ValueError:
            break
        if not isinstance(head, dict):
            break
        n = head.get("n", 0)
        data = raw[nl + 1:nl + 1 + n] if isinstance(n, int) and n >= 0 else b""
        if len(data) != n:
            break
        pos = nl + 1 + n
        if undo is None:
            undo = Undo(tx=str(head.get("tx", "")) if str(head.get("tx", "")).isalnum() else "")
        elif "committing" in head:
            undo.committing = str(head["committing"])
        elif _rel_ok(head.get("dir")):
            undo.dirs.append(head["dir"])
        elif _rel_ok(head.get("rel")) and head.get("kind") in ("none", "file", "link"):
            undo.paths.append((head["rel"], head["kind"], data))
    return undo or Undo(tx="")


def remove(hutch_fd: int) -> None:
    try:
        os.unlink(NAME, dir_fd=hutch_fd)
    except FileNotFoundError:
        pass


__all__ = ["Journal", "NAME", "Undo", "load", "remove"]
