"""`hutch.Memory`: an SMF store on disk. Entities are files, relations are symlinks, history is git.

The format is specified in docs/smf-format.md. `Memory` is the public surface; each concern is a part
with its own state and contract, and Memory hands each call to one of them:

    _layout.Layout   where things are: entity files, link directories, ids from paths, the tree's listing
    _read.Reader     entities read from the working tree as it is (no lock, no write)
    _links.Links     relations as symlinks: reading them, back-links by a scan, link / unlink
    _edit.Edits      put / update / supersede / forget: byte-preserving edits of entity files
    _writer.Writer   the write path: the store's lock, transactions (_tx.py), one git commit per operation
    _history, _check, _ingest, _index   history and as_of, check(), ingest, search (modules of their own)
"""

from __future__ import annotations

import os
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Iterable, Iterator

from hutch._core.errors import ConfigError, MalformedEntityError, MemoryStoreError
from hutch.memory._edit import Edits
from hutch.memory._entity import Entity, Neighbor
from hutch.memory._git import Git
from hutch.memory._layout import Layout
from hutch.memory._links import Links
from hutch.memory._read import Reader
from hutch.memory._tx import Transaction
from hutch.memory._writer import DERIVED_DIR, TRAILER_PREFIX, Writer, parse_author

__all__ = ["DERIVED_DIR", "Memory", "TRAILER_PREFIX"]


def _id_of(ref: Any) -> str:
    if isinstance(ref, Entity):
        return ref.id
    if isinstance(ref, str):
        return ref[:-3] if ref.endswith(".md") else ref
    raise ConfigError(f"{ref!r} is not an entity: pass an Entity or an id such as 'actors/alice-chen'.")


class Memory:
    """An SMF store at `path`, created (with its git repository) if it does not exist.

    >>> mem = Memory("./agent-memory")
    >>> alice = mem.put("actors", "Alice Chen", body="Head of data at Acme.", facts=["prefers weekly reports"])
    >>> mem.link(alice, "works_at", mem.put("orgs", "Acme"))
    >>> mem.get("actors/alice-chen").links["works_at"]
    [Entity orgs/acme]

    `author` ("Name <email>") signs every commit this instance makes.
    """

    def __init__(self, path: str | os.PathLike, *, create: bool = True, author: str | None = None,
                 embedder: Any = None, reasoner: Any = None):
        self.root = Path(os.path.abspath(os.fspath(path)))
        self.author = parse_author(author)
        self.git = Git(self.root)
        self.embedder = embedder  # search: an EmbeddingProvider; None = the local default model
        self.reasoner = reasoner  # search: an optional LLM (hutch.OpenAIReasoner); None = off
        self._search_index = None
        self._layout = Layout(self.root)
        self._writer = Writer(self.root, self.git, self.author)
        self._links = Links(self._layout, self._writer)
        self._reader = Reader(self._layout, self._links, self)
        self._edits = Edits(self._layout, self._reader, self._links, self._writer)
        if not self.root.is_dir():
            if not create:
                raise MemoryStoreError(
                    f"There is no memory store at {self.root}: create it with `hutch mem init {self.root}` "
                    "or Memory(path) (create=True)."
                )
            self.root.mkdir(parents=True, exist_ok=True)
        if not self.git.is_repo() or not self._writer.ignores_derived() or not self.git.has_head():
            self._writer.init_repo()

    def __repr__(self) -> str:
        return f"Memory({str(self.root)!r})"

    @property
    def path(self) -> Path:
        return self.root

    def resolve_path(self, path: str | os.PathLike) -> str:
        """The entity id for a file path inside the store; StorePathError if it escapes the store."""
        return self._layout.resolve(path)

    def link_target(self, link: str | os.PathLike) -> str | None:
        """The entity id the relation link at `link` (a path in the store) points to; None if it is not a
        well-formed link to an entity of the store (absolute, leading out, not `<class>/<slug>.md`)."""
        return self._layout.target_id(Path(os.path.join(self.root, os.fspath(link))))

    # ================================================================ reads

    def get(self, ref: Any) -> Entity:
        """The entity `ref` ('class/slug' or an Entity), read from its file exactly as it is."""
        return self._reader.get(_id_of(ref))

    def head(self, ref: Any, max_bytes: int = 1 << 20) -> Entity:
        """The entity `ref` as the first `max_bytes` of its file read (cut at white space, as search cuts what it
        splits into units): all of it when the file is no larger, else its front matter and the start of its body,
        at a cost of `max_bytes` whatever the file's size. Search hits show this (`Hit.text`, `.title`, `.speaker`)."""
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1:
            raise ConfigError(f"max_bytes={max_bytes!r}: give a positive number of bytes, e.g. 1 << 20.")
        return self._reader.head(_id_of(ref), max_bytes)[0]

    def exists(self, ref: Any) -> bool:
        """True if the entity's file exists."""
        return self._reader.exists(_id_of(ref))

    def classes(self) -> list[str]:
        """Entity classes present in the store (directories that hold entities)."""
        return self._layout.classes()

    def ls(self, cls: str | None = None) -> list[str]:
        """Sorted ids of every entity (of one class if `cls` is given)."""
        return self._layout.ids(cls)

    def __iter__(self) -> Iterator[Entity]:
        for entity_id in self.ls():
            try:
                yield self.get(entity_id)
            except MalformedEntityError:
                continue

    def __len__(self) -> int:
        return len(self.ls())

    def iter_links(self) -> Iterator[tuple[str, str, str, Path]]:
        """Every link in the store: (source id, relation, target id or '' if malformed, link path)."""
        return self._links.iter_all()

    def neighbors(self, ref: Any) -> list[Neighbor]:
        """Typed edges of an entity: its links ('out') and the links pointing to it ('in', derived by a scan)."""
        return self._links.neighbors(self.get(ref))

    def backlinks(self, ref: Any) -> dict[str, list[str]]:
        """Relation -> ids of entities that link to this one."""
        out: dict[str, list[str]] = {}
        for n in self.neighbors(ref):
            if n.direction == "in":
                out.setdefault(n.relation, []).append(n.id)
        return out

    # ================================================================ transactions

    def transaction(self, message: str | None = None, *, source: str | None = None,
                    reason: str | None = None) -> AbstractContextManager[Transaction]:
        """Group several operations into one git commit; if the block raises, nothing is written.

        Other writers (threads or processes) wait until the block ends.
        """
        return self._writer.transaction(message, source=source, reason=reason)

    def write_lock(self) -> AbstractContextManager:
        """Hold the store's write lock (a context manager; reentrant in this thread): no other writer, in this
        process or another, commits until the block ends, so what the block reads stays what it writes over."""
        return self._writer.lock

    # ================================================================ writes

    def put(self, cls: str, title: str, *, body: str = "", facts: Iterable[str] = (), source: str | None = None,
            tags: Iterable[str] = (), confidence: float | None = None, valid_from: Any = None,
            valid_to: Any = None, slug: str | None = None, meta: dict[str, Any] | None = None,
            exist_ok: bool = False) -> Entity:
        """Create the entity `title` in class `cls` and commit it; returns it.

        The slug is `slugify(title)` unless given; a different entity already
        holding that slug gets '-2', '-3' ... appended. If an entity with the
        same title (or the given slug) exists, EntityExistsError is raised,
        unless `exist_ok`, which applies the given fields to it as `update()`
        does. Never overwrites silently: use update() for corrections and
        supersede() for a change that is true from a date on.
        """
        return self._edits.put(cls, title, body=body, facts=facts, source=source, tags=tags,
                               confidence=confidence, valid_from=valid_from, valid_to=valid_to, slug=slug,
                               meta=meta, exist_ok=exist_ok)

    def update(self, ref: Any, *, title: str | None = None, body: str | None = None,
               facts: Iterable[str] | None = None, add_facts: Iterable[str] = (), source: str | None = None,
               tags: Iterable[str] | None = None, confidence: float | None = None, valid_from: Any = None,
               valid_to: Any = None, meta: dict[str, Any] | None = None, message: str | None = None) -> Entity:
        """Correct an entity in place (a fix of what we recorded, not a change in the world) and commit it.

        Only what is given changes: a new `body` keeps the old facts unless
        `facts` is given; `facts` replaces the facts; `add_facts` appends new
        ones. Front matter keys are rewritten one by one, so a hand-edited file
        keeps every byte that is not being changed. Returns the entity (no
        commit if nothing changed).
        """
        return self._edits.update(_id_of(ref), title=title, body=body, facts=facts, add_facts=add_facts,
                                  source=source, tags=tags, confidence=confidence, valid_from=valid_from,
                                  valid_to=valid_to, meta=meta, message=message)

    def supersede(self, ref: Any, *, valid_from: Any, body: str | None = None, facts: Iterable[str] | None = None,
                  add_facts: Iterable[str] = (), title: str | None = None, source: str | None = None,
                  reason: str | None = None, tags: Iterable[str] | None = None, confidence: float | None = None,
                  meta: dict[str, Any] | None = None) -> Entity:
        """Record that the entity changed in the world from `valid_from` on; never overwrites the past.

        The file now holds the new version (valid_from set, valid_to cleared);
        the previous version stays in git history and stays valid until this
        `valid_from`: `as_of(an earlier date)` and `history()` return it.
        """
        return self._edits.supersede(_id_of(ref), valid_from=valid_from, body=body, facts=facts,
                                     add_facts=add_facts, title=title, source=source, reason=reason, tags=tags,
                                     confidence=confidence, meta=meta)

    def link(self, src: Any, relation: str, dst: Any, *, source: str | None = None) -> Path:
        """Link `src` -[relation]-> `dst` with a relative symlink; idempotent. Returns the link's path."""
        return self._links.link(_id_of(src), relation, _id_of(dst), source=source)

    def unlink(self, src: Any, relation: str, dst: Any, *, source: str | None = None) -> None:
        """Remove the link `src` -[relation]-> `dst`; EntityNotFoundError if there is none."""
        self._links.unlink(_id_of(src), relation, _id_of(dst), source=source)

    def forget(self, ref: Any, *, reason: str, source: str | None = None) -> None:
        """Delete an entity, its links and the links to it, in one commit that records `reason`.

        The commit (author, date, reason) is the audit record. The old bytes
        remain in git history; `as_of()` no longer returns the entity.
        """
        if not isinstance(reason, str) or not reason.strip():
            raise ConfigError("forget() needs a reason: forget('actors/x', reason='asked to be removed').")
        self._edits.forget(_id_of(ref), reason=reason, source=source)

    # ================================================================ history, time, check, ingest

    def history(self, ref: Any):
        """Every committed version of the entity, newest first, with who, when, why (list of Version)."""
        from hutch.memory._history import history

        return history(self, _id_of(ref))

    def as_of(self, when: Any, *, known_at: Any = None):
        """A read-only view of what was valid on `when` (see docs/smf-format.md, "Time")."""
        from hutch.memory._history import MemoryView

        return MemoryView(self, when, known_at)

    def diff(self, ref: Any = None, since: str = "HEAD~1") -> str:
        """`git diff` from revision `since` to the working tree, for one entity or the whole store."""
        from hutch.memory._history import diff

        return diff(self, None if ref is None else _id_of(ref), since)

    def check(self):
        """Report dangling links, malformed front matter, orphans and stray files (a CheckReport)."""
        from hutch.memory._check import check

        return check(self)

    def ingest_conversation(self, data: Any, **kw: Any):
        """Ingest a multi-session chat log (LoCoMo JSON: a path, a JSON string or a dict). See _ingest."""
        from hutch.memory._ingest import ingest_conversation

        return ingest_conversation(self, data, **kw)

    def ingest_text(self, path_or_str: Any, **kw: Any):
        """Ingest a Markdown/text document, chunked along its headings. See _ingest."""
        from hutch.memory._ingest import ingest_text

        return ingest_text(self, path_or_str, **kw)

    # ================================================================ search (hutch/memory/_index, docs/retrieval.md)

    @property
    def index(self):
        """The derived search index (hutch.memory._index.SearchIndex), opened on first use."""
        if self._search_index is None:
            from hutch.memory._index import SearchIndex

            self._search_index = SearchIndex(self, self.embedder, self.reasoner)
        return self._search_index

    def search(self, query: str, *, k: int = 10, classes=None, since: Any = None, until: Any = None,
               as_of: Any = None, expand: int = 0, fusion: str = "learned", now: Any = None):
        """Hybrid search (BM25 + dense + entity + mentions + time, fused, then a learned second stage); returns
        a list of Hit. `fusion="weighted"` is the plain sum without the second stage, "rrf" reciprocal rank
        fusion. A query of more than 4,096 characters, a k that is not a positive integer, a `classes` that is
        not a class name or up to 1,024 of them: each a ConfigError.

        Changes made to the files behind the API's back are indexed before the
        query answers. `classes` keeps those classes; `since` / `until` keep
        entities whose time (valid_from, else recorded_at, else created) is in
        range; `as_of` keeps what was valid then; `expand` adds entities up to
        that many links away. A hit on a conversation turn has `anchor` = its
        dia_id; `channels` says which channels found it, with rank and score.
        A time expression in the query ("in May 2023", "last week", "two days
        ago", "since March") adds the `time` channel; relative ones are read
        against `as_of` if given, else `now` (an ISO date/date-time), else the
        newest time among the candidates of the unit's kind, at most the clock:
        a conversation turn reads them from the newest candidate turn of its
        conversation (an ingested conversation's last session; sessions with
        the same speakers are one conversation, so each conversation in a
        store reads from its own end), anything else from the newest
        candidate, e.g. mem.search("what did we decide last week?",
        now="2026-11-20").
        """
        return self.index.search(query, k=k, classes=classes, since=since, until=until, as_of=as_of,
                                 expand=expand, fusion=fusion, now=now)

    def reindex(self, *, full: bool = False):
        """Bring the search index up to date now, embedding everything (full=True: rebuild from nothing)."""
        return self.index.reindex(full=full)

    def doctor(self):
        """Verify the search index against the files and report its exact state (an IndexReport)."""
        return self.index.doctor()


