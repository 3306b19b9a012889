"""`hutch.Memory`: an SMF store on disk. Entities are files, relations are symlinks, history is git.

The format is specified in docs/smf-format.md. Reads never lock; every write
goes through a transaction (see _tx.py) and becomes exactly one git commit.
"""

from __future__ import annotations

import os
import stat
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterable, Iterator

from hutch._core.errors import (
    ConfigError,
    EntityExistsError,
    EntityNotFoundError,
    MalformedEntityError,
    MemoryStoreError,
    StorePathError,
)
from hutch.memory import _format as fmt
from hutch.memory._entity import Entity, Neighbor
from hutch.memory._git import DEFAULT_AUTHOR, Git, trailer_value
from hutch.memory._tx import LOCK_NAME, StoreLock, Transaction, recover

#: The directory inside a store for derived, never-committed state (index, lock).
DERIVED_DIR = ".hutch"
#: Trailers hutch adds to each commit message.
TRAILER_PREFIX = "Hutch-"
_MAX_TRAILER_ENTITIES = 100
_BULK_PATHS = 64  # above this many paths a commit writes one pack (fast-import) instead of loose objects
_ENTITY_OPS = ("put", "update", "supersede", "forget")

Ref = "str | Entity"


def _id_of(ref: Any) -> str:
    if isinstance(ref, Entity):
        return ref.id
    if isinstance(ref, str):
        return ref[:-3] if ref.endswith(".md") else ref
    raise ConfigError(f"{ref!r} is not an entity: pass an Entity or an id such as 'actors/alice-chen'.")


def _norm_title(title: str) -> str:
    return " ".join(str(title).split()).casefold()


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
        self.author = _parse_author(author)
        self.git = Git(self.root)
        self._lock = StoreLock(self.root / DERIVED_DIR / LOCK_NAME, recover=self._recover)
        self._tx: Transaction | None = None
        self.embedder = embedder  # search: an EmbeddingProvider; None = the local default model
        self.reasoner = reasoner  # search: an optional LLM (hutch.OpenAIReasoner); None = off
        self._search_index = None
        if not self.root.is_dir():
            if not create:
                raise MemoryStoreError(
                    f"There is no memory store at {self.root}: create it with `hutch mem init {self.root}` "
                    "or Memory(path) (create=True)."
                )
            self.root.mkdir(parents=True, exist_ok=True)
        if not self.git.is_repo() or not self._ignores_derived() or not self.git.has_head():
            self._init_repo()

    def _recover(self, root_fd: int, hutch_fd: int) -> None:
        """Run with the lock just taken: undo the transaction of a writer that died holding it."""
        recover(self.root, root_fd, hutch_fd, self.git.head, self.git.unstage)

    def __repr__(self) -> str:
        return f"Memory({str(self.root)!r})"

    @property
    def path(self) -> Path:
        return self.root

    def _ignores_derived(self) -> bool:
        try:
            return f"/{DERIVED_DIR}/" in (self.root / ".gitignore").read_text().splitlines()
        except (FileNotFoundError, UnicodeDecodeError):
            return False

    def _init_repo(self) -> None:
        """Make the directory a store: a git repository whose .gitignore excludes .hutch/, committed."""
        with self._lock:
            if not self.git.is_repo():
                self.git.init()
            if self.git.has_head() and self._ignores_derived():
                return
            gi = self.root / ".gitignore"
            text = gi.read_text() if gi.exists() else ""
            if f"/{DERIVED_DIR}/" not in text.splitlines():
                from hutch._core.atomic import atomic_write

                text = text + ("" if text.endswith("\n") or not text else "\n") + f"/{DERIVED_DIR}/\n"
                atomic_write(gi, text.encode())
            self.git.commit([".gitignore"], _message("init", "init store", []), self.author)

    # ================================================================ paths

    def _paths(self, entity_id: str) -> tuple[str, str, Path]:
        cls, slug = fmt.split_id(entity_id)
        return cls, slug, self._class_dir(cls) / f"{slug}.md"

    def _class_dir(self, cls: str) -> Path:
        # a clear error early; the guarantee is the write path's (_tx), which never follows a link
        cdir = self.root / cls
        if cdir.is_symlink():
            raise StorePathError(
                f"{cdir} is a symbolic link: an entity class must be a real directory inside the store "
                "(a link could lead outside it). Replace the link with a directory."
            )
        return cdir

    def _links_dir(self, cls: str, slug: str) -> Path:
        return self.root / cls / f"{slug}{fmt.LINKS_SUFFIX}"

    def _check_link_dirs(self, rdir: Path) -> None:
        """Refuse to write links through a `.links` or relation directory that is a symbolic link: the
        link (and the directories made for it) would land wherever that link points, outside the store."""
        for d in (rdir.parent, rdir):
            if d.is_symlink():
                raise StorePathError(
                    f"{d} is a symbolic link: links live in real directories inside the store (a link there "
                    f"could lead outside it). Remove it (rm {d}) and link again.")

    def resolve_path(self, path: str | os.PathLike) -> str:
        """The entity id for a file path inside the store; StorePathError if it escapes the store."""
        p = Path(os.path.abspath(os.path.join(self.root, os.fspath(path))))
        try:
            rel = p.relative_to(self.root)
        except ValueError:
            raise StorePathError(
                f"{path} is outside the store {self.root}: give a path inside it, such as 'actors/alice-chen.md'."
            ) from None
        parts = rel.parts
        if len(parts) != 2 or not parts[1].endswith(".md"):
            raise StorePathError(
                f"{path} is not an entity file: entities are '<class>/<slug>.md' directly under the store."
            )
        entity_id = f"{parts[0]}/{parts[1][:-3]}"
        fmt.split_id(entity_id)
        return entity_id

    # ================================================================ reads

    def get(self, ref: Any) -> Entity:
        """The entity `ref` ('class/slug' or an Entity), read from its file exactly as it is."""
        entity_id = _id_of(ref)
        cls, slug, path = self._paths(entity_id)
        return self._read(f"{cls}/{slug}", path)

    def _read(self, entity_id: str, path: Path) -> Entity:
        try:
            # O_NONBLOCK: a FIFO planted as an entity file would otherwise block the open forever
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except FileNotFoundError:
            raise EntityNotFoundError(
                f"There is no entity {entity_id} (no file {path}): create it with put(), "
                "or list what exists with ls() / `hutch mem ls`."
            ) from None
        except OSError as e:
            raise StorePathError(
                f"{path} is a symbolic link or unreadable ({e.strerror}): an entity must be a regular file "
                "inside the store. Replace it with the file it points to."
            ) from None
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise StorePathError(
                f"{path} is not a regular file (a FIFO, device or directory): an entity must be a regular file "
                "inside the store. Remove it, or move it out of the store."
            )
        with os.fdopen(fd, "rb") as f:
            raw = f.read()
        text = raw.decode("utf-8", errors="surrogateescape")
        meta, body = fmt.parse(text, str(path))
        cls, slug = entity_id.split("/")
        return Entity(entity_id, meta, body, text, path, self._link_ids(cls, slug), self)

    def exists(self, ref: Any) -> bool:
        """True if the entity's file exists."""
        _, _, path = self._paths(_id_of(ref))
        return os.path.isfile(path) and not os.path.islink(path)

    def classes(self) -> list[str]:
        """Entity classes present in the store (directories that hold entities)."""
        out = []
        with os.scandir(self.root) as it:
            for e in it:
                if e.is_dir(follow_symlinks=False) and not e.name.startswith(".") and fmt._NAME_RE.match(e.name):
                    out.append(e.name)
        return sorted(out)

    def ls(self, cls: str | None = None) -> list[str]:
        """Sorted ids of every entity (of one class if `cls` is given)."""
        out = []
        for c in [fmt.check_class(cls)] if cls else self.classes():
            d = self.root / c
            if not d.is_dir():
                continue
            with os.scandir(d) as it:
                for e in it:
                    if e.name.endswith(".md") and not e.name.startswith(".") and e.is_file(follow_symlinks=False):
                        out.append(f"{c}/{e.name[:-3]}")
        return sorted(out)

    def __iter__(self) -> Iterator[Entity]:
        for entity_id in self.ls():
            try:
                yield self.get(entity_id)
            except MalformedEntityError:
                continue

    def __len__(self) -> int:
        return len(self.ls())

    def _link_ids(self, cls: str, slug: str) -> dict[str, tuple[str, ...]]:
        ldir = self._links_dir(cls, slug)
        try:
            rels = sorted(os.listdir(ldir))
        except (FileNotFoundError, NotADirectoryError):
            return {}
        out: dict[str, tuple[str, ...]] = {}
        for rel in rels:
            try:
                names = sorted(os.listdir(ldir / rel))
            except (NotADirectoryError, FileNotFoundError):
                continue
            ids = []
            for name in names:
                tid = self._target_id(ldir / rel / name)
                if tid is not None:
                    ids.append(tid)
            if ids:
                out[rel] = tuple(ids)
        return out

    def _target_id(self, link: Path) -> str | None:
        """The entity id a link symlink points to, or None if it is not a well-formed in-store link."""
        try:
            target = os.readlink(link)
        except OSError:
            return None
        if os.path.isabs(target):
            return None
        full = os.path.normpath(os.path.join(link.parent, target))
        try:
            rel = Path(full).relative_to(self.root)
        except ValueError:
            return None
        if len(rel.parts) != 2 or not rel.parts[1].endswith(".md"):
            return None
        return f"{rel.parts[0]}/{rel.parts[1][:-3]}"

    def iter_links(self) -> Iterator[tuple[str, str, str, Path]]:
        """Every link in the store: (source id, relation, target id or '' if malformed, link path)."""
        for cls in self.classes():
            d = self.root / cls
            with os.scandir(d) as it:
                ldirs = [e for e in it if e.name.endswith(fmt.LINKS_SUFFIX) and e.is_dir(follow_symlinks=False)]
            for e in ldirs:
                src = f"{cls}/{e.name[: -len(fmt.LINKS_SUFFIX)]}"
                try:
                    rels = os.listdir(e.path)
                except NotADirectoryError:
                    continue
                for rel in sorted(rels):
                    rdir = Path(e.path) / rel
                    if not rdir.is_dir() or rdir.is_symlink():
                        continue
                    for name in sorted(os.listdir(rdir)):
                        yield src, rel, self._target_id(rdir / name) or "", rdir / name

    def neighbors(self, ref: Any) -> list[Neighbor]:
        """Typed edges of an entity: its links ('out') and the links pointing to it ('in', derived by a scan)."""
        entity = self.get(ref)
        out = [Neighbor(rel, "out", tid) for rel, ids in entity.link_ids.items() for tid in ids]
        out += [Neighbor(rel, "in", src) for src, rel, tid, _ in self.iter_links() if tid == entity.id]
        return out

    def backlinks(self, ref: Any) -> dict[str, list[str]]:
        """Relation -> ids of entities that link to this one."""
        out: dict[str, list[str]] = {}
        for n in self.neighbors(ref):
            if n.direction == "in":
                out.setdefault(n.relation, []).append(n.id)
        return out

    # ================================================================ transactions

    @contextmanager
    def transaction(self, message: str | None = None, *, source: str | None = None,
                    reason: str | None = None) -> Iterator[Transaction]:
        """Group several operations into one git commit; if the block raises, nothing is written.

        Other writers (threads or processes) wait until the block ends.
        """
        with self._op(None, None, message=message, source=source, reason=reason) as tx:
            if self._tx is tx and not tx.ops:
                tx.bulk = True
                tx.stream_factory = self.git.blob_stream
            yield tx

    @contextmanager
    def _op(self, op: str | None, subject: str | None, *, message: str | None = None,
            source: str | None = None, reason: str | None = None, **trailers: str | None) -> Iterator[Transaction]:
        with self._lock:
            outer = self._tx
            if outer is not None:
                if op:
                    outer.record(op, subject or "", **{"Source": source, "Reason": reason, **trailers})
                yield outer
                return
            tx = Transaction(self.root, message, source, reason, root_fd=self._lock.root_fd,
                             hutch_fd=self._lock.hutch_fd)
            if op:
                tx.record(op, subject or "", **{"Source": source, "Reason": reason, **trailers})
            self._tx = tx
            try:
                yield tx
                tx.sync()
                paths = tx.paths
                if paths:
                    msg = _message(op or "transaction", message or _subject(tx), tx.ops, tx, self.author)
                    try:
                        if len(paths) > _BULK_PATHS or tx.stream is not None:
                            self.git.commit_bulk(paths, msg, self.author, tx.stream, on_parent=tx.committing)
                            tx.stream = None
                        else:
                            self.git.commit(paths, msg, self.author, on_parent=tx.committing)
                    except BaseException:
                        self.git.unstage(paths)
                        raise
            except BaseException:
                tx.rollback()
                raise
            else:
                tx.finish()   # outside the rollback: once committed, a failure here must not undo the files
            finally:
                self._tx = None
                tx.close()

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
        fmt.check_class(cls)
        self._class_dir(cls)
        if not isinstance(title, str) or not title.strip():
            raise ConfigError("An entity needs a non-empty title: put(cls, 'Alice Chen', ...).")
        title = " ".join(title.split())
        facts = list(facts or ())
        with self._op("put", None, source=source) as tx:
            slug, existing = self._choose_slug(cls, title, slug)
            entity_id = f"{cls}/{slug}"
            if existing:
                if not exist_ok:
                    raise EntityExistsError(
                        f"{entity_id} already exists: use update() to correct it, supersede() to record a change "
                        "from a date on, or put(..., exist_ok=True) to apply these fields to it."
                    )
                tx.forget_op("put")
                return self.update(entity_id, body=body or None, add_facts=facts, source=source,
                                   tags=list(tags) or None, confidence=confidence, valid_from=valid_from,
                                   valid_to=valid_to, meta=meta)
            tx.name_op("put", entity_id)
            now = fmt.now_iso()
            m: dict[str, Any] = {
                "id": entity_id, "class": cls, "title": title, "created": now, "updated": now,
                "valid_from": fmt.time_str(valid_from, "valid_from"),
                "valid_to": fmt.time_str(valid_to, "valid_to"),
                "recorded_at": now, "source": source, "tags": [str(t) for t in tags],
                "confidence": _confidence(confidence),
            }
            _check_range(m["valid_from"], m["valid_to"])
            for k, v in (meta or {}).items():
                if k in ("id", "class"):
                    raise ConfigError(f"meta may not set {k!r}: it follows from the class and slug.")
                m[str(k)] = v
            text = fmt.render(m, fmt.with_facts(body or "", facts, replace=True) if facts else (body or ""))
            path = self.root / cls / f"{slug}.md"
            tx.write(path, text)
            if _simple(m):  # what render() wrote reads back as exactly these values
                body_out = fmt.split_front_matter(text)[2]
                return Entity(entity_id, m, body_out, text, path, {}, self)
            meta_out, body_out = fmt.parse(text, str(path))
            return Entity(entity_id, meta_out, body_out, text, path, {}, self)

    def _choose_slug(self, cls: str, title: str, slug: str | None) -> tuple[str, bool]:
        if slug is not None:
            fmt.check_slug(slug)
            return slug, os.path.lexists(self.root / cls / f"{slug}.md")
        base = fmt.slugify(title)
        want = _norm_title(title)
        n = 1
        while True:
            cand = base if n == 1 else f"{base}-{n}"
            path = self.root / cls / f"{cand}.md"
            if not os.path.lexists(path):
                return cand, False
            try:
                existing = self.get(f"{cls}/{cand}")
                if _norm_title(existing.title) == want:
                    return cand, True
            except MalformedEntityError:
                pass
            n += 1

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
        entity_id = _id_of(ref)
        with self._op("update", entity_id, source=source, message=message) as tx:
            cur = self.get(entity_id)
            updates = self._key_updates(title=title, source=source, tags=tags, confidence=confidence,
                                        valid_from=valid_from, valid_to=valid_to, meta=meta)
            vf = updates.get("valid_from", cur.meta.get("valid_from"))
            vt = updates.get("valid_to", cur.meta.get("valid_to"))
            _check_range(vf, vt)
            text = self._edit_text(cur, updates, body=body, facts=facts, add_facts=add_facts)
            if text == cur.text:
                tx.forget_op("update", entity_id)
                return cur
            text = fmt.set_keys(text, {"updated": fmt.now_iso()}, str(cur.path))
            tx.write(cur.path, text)
            meta_out, body_out = fmt.parse(text, str(cur.path))
            return Entity(entity_id, meta_out, body_out, text, cur.path, cur.link_ids, self)

    def _key_updates(self, **kw: Any) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if kw.get("title") is not None:
            out["title"] = " ".join(str(kw["title"]).split())
        if kw.get("source") is not None:
            out["source"] = kw["source"]
        if kw.get("tags") is not None:
            out["tags"] = [str(t) for t in kw["tags"]]
        if kw.get("confidence") is not None:
            out["confidence"] = _confidence(kw["confidence"])
        if kw.get("valid_from") is not None:
            out["valid_from"] = fmt.time_str(kw["valid_from"], "valid_from")
        if kw.get("valid_to") is not None:
            out["valid_to"] = fmt.time_str(kw["valid_to"], "valid_to")
        for k, v in (kw.get("meta") or {}).items():
            if k in ("id", "class"):
                raise ConfigError(f"meta may not set {k!r}: it follows from the class and slug.")
            out[str(k)] = v
        return out

    def _edit_text(self, cur: Entity, updates: dict[str, Any], *, body: str | None,
                   facts: Iterable[str] | None, add_facts: Iterable[str]) -> str:
        text = cur.text
        changed = {k: v for k, v in updates.items() if cur.meta.get(k, ...) != v}
        if changed:
            text = fmt.set_keys(text, changed, str(cur.path))
        nl = fmt.newline_of(text)
        new_body = cur.body
        if body is not None:
            new_body = body
            if facts is None and cur.facts and not fmt.facts(body):
                new_body = fmt.with_facts(body, cur.facts, replace=True, nl=nl)
        if facts is not None:
            new_body = fmt.with_facts(new_body, list(facts), replace=True, nl=nl)
        add_facts = list(add_facts or ())
        if add_facts:
            new_body = fmt.with_facts(new_body, add_facts, replace=False, nl=nl)
        if new_body != cur.body:
            text = fmt.replace_body(text, new_body, str(cur.path))
        return text

    def supersede(self, ref: Any, *, valid_from: Any, body: str | None = None, facts: Iterable[str] | None = None,
                  add_facts: Iterable[str] = (), title: str | None = None, source: str | None = None,
                  reason: str | None = None, tags: Iterable[str] | None = None, confidence: float | None = None,
                  meta: dict[str, Any] | None = None) -> Entity:
        """Record that the entity changed in the world from `valid_from` on; never overwrites the past.

        The file now holds the new version (valid_from set, valid_to cleared);
        the previous version stays in git history and stays valid until this
        `valid_from`: `as_of(an earlier date)` and `history()` return it.
        """
        entity_id = _id_of(ref)
        vf = fmt.time_str(valid_from, "valid_from")
        if vf is None:
            raise ConfigError("supersede() needs valid_from: the date from which the new version is true.")
        with self._op("supersede", entity_id, source=source, reason=reason, **{"Valid-From": vf}) as tx:
            cur = self.get(entity_id)
            old_vf = fmt.parse_time(cur.meta.get("valid_from"), "valid_from") if cur.meta.get("valid_from") else None
            if old_vf is not None and fmt.parse_time(vf) <= old_vf:
                raise ConfigError(
                    f"supersede({entity_id}, valid_from={vf}) is not after the current version's valid_from "
                    f"{cur.meta.get('valid_from')}: pick a later date, or use update() to correct the current version."
                )
            head = self.git.log(self._rel(cur.path), limit=1)
            if head:
                tx.trailers.append(("Supersedes", head[0].sha))
            updates = self._key_updates(title=title, source=source, tags=tags, confidence=confidence, meta=meta)
            now = fmt.now_iso()
            updates.update({"valid_from": vf, "valid_to": None, "recorded_at": now})
            text = self._edit_text(cur, updates, body=body, facts=facts, add_facts=add_facts)
            text = fmt.set_keys(text, {"updated": now}, str(cur.path))
            tx.write(cur.path, text)
            meta_out, body_out = fmt.parse(text, str(cur.path))
            return Entity(entity_id, meta_out, body_out, text, cur.path, cur.link_ids, self)

    def link(self, src: Any, relation: str, dst: Any, *, source: str | None = None) -> Path:
        """Link `src` -[relation]-> `dst` with a relative symlink; idempotent. Returns the link's path."""
        fmt.check_relation(relation)
        sid, did = _id_of(src), _id_of(dst)
        scls, sslug, spath = self._paths(sid)
        dcls, dslug, dpath = self._paths(did)
        rdir = self._links_dir(scls, sslug) / relation
        target = f"../../../{dcls}/{dslug}.md"
        self._check_link_dirs(rdir)
        with self._op("link", f"{sid} -[{relation}]-> {did}", source=source) as tx:
            for eid, p in ((sid, spath), (did, dpath)):  # checked under the lock: no writer can forget them now
                if not p.is_file() or p.is_symlink():
                    raise EntityNotFoundError(
                        f"Cannot link {sid} -[{relation}]-> {did}: {eid} does not exist. Create it with put() first."
                    )
            for name in (f"{dslug}.md", f"{dcls}--{dslug}.md"):
                lp = rdir / name
                if os.path.islink(lp):
                    if self._target_id(lp) == f"{dcls}/{dslug}":
                        tx.forget_op("link", f"{sid} -[{relation}]-> {did}")
                        return lp
                    continue  # the name belongs to a same-slug entity of another class
                if os.path.lexists(lp):
                    continue
                tx.symlink(lp, target)
                return lp
            raise MemoryStoreError(f"{rdir} holds files that are not links; run check() and remove them.")

    def unlink(self, src: Any, relation: str, dst: Any, *, source: str | None = None) -> None:
        """Remove the link `src` -[relation]-> `dst`; EntityNotFoundError if there is none."""
        fmt.check_relation(relation)
        sid, did = _id_of(src), _id_of(dst)
        scls, sslug, _ = self._paths(sid)
        self._paths(did)
        rdir = self._links_dir(scls, sslug) / relation
        self._check_link_dirs(rdir)
        with self._op("unlink", f"{sid} -[{relation}]-> {did}", source=source) as tx:
            for name in sorted(os.listdir(rdir)) if rdir.is_dir() else []:
                if self._target_id(rdir / name) == did:
                    tx.remove(rdir / name)
                    return
            raise EntityNotFoundError(
                f"There is no link {sid} -[{relation}]-> {did}: `hutch mem show {sid}` lists its links."
            )

    def forget(self, ref: Any, *, reason: str, source: str | None = None) -> None:
        """Delete an entity, its links and the links to it, in one commit that records `reason`.

        The commit (author, date, reason) is the audit record. The old bytes
        remain in git history; `as_of()` no longer returns the entity.
        """
        if not isinstance(reason, str) or not reason.strip():
            raise ConfigError("forget() needs a reason: forget('actors/x', reason='asked to be removed').")
        entity_id = _id_of(ref)
        cls, slug, path = self._paths(entity_id)
        with self._op("forget", entity_id, source=source, reason=" ".join(reason.split())) as tx:
            if not path.is_file():
                raise EntityNotFoundError(f"There is no entity {entity_id} to forget: `hutch mem ls` lists them.")
            for src, rel, tid, lp in list(self.iter_links()):
                if tid == entity_id or src == entity_id:
                    tx.remove(lp)
            tx.remove(path)

    def _rel(self, path: Path) -> str:
        return path.relative_to(self.root).as_posix()

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
        fusion. A query of more than 4,096 characters is a ConfigError.

        Changes made to the files behind the API's back are indexed before the
        query answers. `classes` keeps those classes; `since` / `until` keep
        entities whose time (valid_from, else recorded_at, else created) is in
        range; `as_of` keeps what was valid then; `expand` adds entities up to
        that many links away. A hit on a conversation turn has `anchor` = its
        dia_id; `channels` says which channels found it, with rank and score.
        A time expression in the query ("in May 2023", "last week", "two days
        ago", "since March") adds the `time` channel; relative ones are read
        against `as_of` if given, else `now` (an ISO date/date-time; default:
        the current time), e.g. mem.search("what did we decide last week?",
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


# ==================================================================== helpers

def _parse_author(author: str | None) -> tuple[str, str]:
    author = author or os.environ.get("HUTCH_AUTHOR")
    if not author:
        return DEFAULT_AUTHOR
    if "<" in author and author.rstrip().endswith(">"):
        name, email = author.rsplit("<", 1)
        return name.strip() or DEFAULT_AUTHOR[0], email.rstrip()[:-1].strip()
    return author.strip(), DEFAULT_AUTHOR[1]


def _simple(m: dict[str, Any]) -> bool:
    for v in m.values():
        if isinstance(v, list):
            if not all(type(x) is str for x in v):
                return False
        elif v is not None and type(v) not in (str, float, int):
            return False
    return True


def _confidence(value: Any) -> float | None:
    if value is None:
        return None
    try:
        v = float(value)
    except (TypeError, ValueError):
        v = -1.0
    if not 0.0 <= v <= 1.0:
        raise ConfigError(f"confidence {value!r} is not a number between 0 and 1: pass e.g. confidence=0.8.")
    return v


def _check_range(vf: Any, vt: Any) -> None:
    if vf and vt and fmt.parse_time(vt, "valid_to") <= fmt.parse_time(vf, "valid_from"):
        raise ConfigError(f"valid_to {vt} is not after valid_from {vf}: a version must be valid for some time.")


def _subject(tx: Transaction) -> str:
    ops = [o for o in tx.ops if o[1]]
    if len(ops) == 1:
        return f"{ops[0][0]} {ops[0][1]}"
    return f"transaction: {len(ops)} operations"


def _message(op: str, subject: str, ops: list, tx: Transaction | None = None,
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
