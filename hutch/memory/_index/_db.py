"""The derived search index of a store: one SQLite file under <store>/.hutch/, a cache of the files.

Tables: `files` (one row per entity file: stat, content hash, class, title,
time), `units` (searchable pieces, see _units), `units_fts` / `ent_fts`
(FTS5, BM25), `vectors` (embeddings keyed by the hash of the embedded text,
all in the one vector space named in `meta`), `links` (the symlink graph),
`titles` (normalised titles, for entity mentions in a query).

Freshness: before each query `sync()` stats every entity file and links
directory; only where (mtime, size) differ is the file read and hashed, and
only where the hash differs is it re-indexed. Deleting the file loses
nothing: it is rebuilt from the store. A file that SQLite cannot read, or a
schema or header that does not add up, is deleted and rebuilt.

A file is read in blocks, never whole: its hash is streamed, its first
_units.UNIT_BYTES become units, and the bytes after them, up to
_units.LEXICAL_BYTES, go into `chunks_fts` in pieces of _units.CHUNK_BYTES
(searched at the entity level), so indexing a file of any size holds about
UNIT_BYTES of it in memory at a time.
"""

from __future__ import annotations

import hashlib
import os
import sqlite3
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import numpy as np

from hutch._core.atomic import TEMP_PREFIX
from hutch._core.errors import MalformedEntityError, SearchIndexError
from hutch.memory import _format
from hutch.memory._index import _units
from hutch.memory._tx import check_derived_dir

SCHEMA_VERSION = "6"  # 3: units.ev_from / ev_to (the time a turn speaks of); 4: ent_fts holds only entities of
# several units (an entity of one unit is its unit: search reads its BM25 from units_fts); 5: chunks / chunks_fts
# (the words of a file past UNIT_BYTES), units embed at most DENSE_CHARS; 6: a turn's event time may span up to a
# year (_time.MAX_EVENT_S) and reads more forms. A 4 or a 5 is upgraded in place, keeping its vectors (_upgrade).
INDEX_NAME = "index.sqlite"
LINKS_SUFFIX = _format.LINKS_SUFFIX
#: On the query path, embedding missing vectors stops after this many seconds (the rest waits for the next query
#: or reindex()); until every unit has a vector in the current space, search uses the lexical channels only.
QUERY_EMBED_BUDGET_S = 5.0

_SCHEMA = """
create table if not exists meta(key text primary key, value text);
create table if not exists files(
  eid integer primary key, entity_id text unique not null, cls text not null, title text,
  mtime_ns integer, size integer, hash text, t_from real, t_to real, t_rec real, linkstamp text, error text);
create table if not exists units(
  uid integer primary key, eid integer not null, anchor text, speaker text, dense_hash text not null,
  ev_from real, ev_to real);
create index if not exists units_eid on units(eid);
create virtual table if not exists units_fts using fts5(body, context, tokenize='porter unicode61');
create virtual table if not exists ent_fts using fts5(body, tokenize='porter unicode61');
create index if not exists units_hash on units(dense_hash);
create table if not exists vectors(dense_hash text primary key, vec blob not null);
create table if not exists pending(dense_hash text primary key, text text not null);
create table if not exists links(src text not null, rel text not null, dst text not null);
create index if not exists links_src on links(src);
create index if not exists links_dst on links(dst);
create table if not exists chunks(cid integer primary key, eid integer not null);
create index if not exists chunks_eid on chunks(eid);
create virtual table if not exists chunks_fts using fts5(body, tokenize='porter unicode61');
create table if not exists titles(norm text not null, eid integer not null, partial integer not null default 0);
create index if not exists titles_norm on titles(norm);
create index if not exists titles_eid on titles(eid);
"""


#: How often the cheap checks of an index file are made before a damage they see is believed (see _verify_file).
VERIFY_TRIES = 4


@dataclass
class SyncStats:
    """What one freshness pass did."""

    scanned: int = 0
    reindexed: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    relinked: list[str] = field(default_factory=list)
    embedded: int = 0
    pending_vectors: int = 0
    embed_error: str | None = None
    seconds: float = 0.0

    @property
    def changed(self) -> bool:
        return bool(self.reindexed or self.removed or self.relinked or self.embedded)


class IndexDB:
    """The SQLite file and the freshness logic. Not thread-safe; one per Memory instance."""

    def __init__(self, root: Path, provider: Any):
        self.root = root
        self.dir = root / ".hutch"
        self.path = self.dir / INDEX_NAME
        self.provider = provider
        self.db: sqlite3.Connection | None = None
        self.recovered: list[str] = []  # why the index file was discarded (corruption, schema), newest last
        self.space_changed: str | None = None  # previous model identity if the vector space was replaced
        self._files: dict[str, tuple] | None = None  # entity_id -> (eid, mtime_ns, size, hash, linkstamp)
        self._gen_seen: str | None = None
        self.own_bumps = 0  # changes this process made (a snapshot may be patched only across its own)
        self.embed_error: str | None = None  # the last failure of the embedder on the query path
        self._model_ok = False
        self.watcher = None  # _watch.Watcher once a full scan has been done (None: scan every time)
        self.watch_error: str | None = None

    # ------------------------------------------------------------ open / verify / recover

    def open(self) -> sqlite3.Connection:
        if self.db is not None:
            return self.db
        check_derived_dir(self.dir)
        self.dir.mkdir(exist_ok=True)
        problem = self._verify_file()
        if problem:
            self._discard(problem)
        try:
            self.db = self._connect()
        except sqlite3.DatabaseError as e:
            self._discard(f"SQLite could not open it ({e})")
            self.db = self._connect()
        self._check_model()
        return self.db

    @property
    def model_known(self) -> bool:
        """False while the provider cannot say who it is (an endpoint down): the dense channel stays off."""
        return self._model_ok

    def _connect(self) -> sqlite3.Connection:
        db = sqlite3.connect(self.path, timeout=30, isolation_level=None, check_same_thread=False)
        db.execute("pragma journal_mode=wal")
        db.execute("pragma synchronous=normal")
        db.executescript(_SCHEMA)
        # read and set the version in one write transaction: processes opening a new store at once both saw
        # no version, and the second's insert failed (a UNIQUE constraint), which discarded everyone's index
        db.execute("begin immediate")
        try:
            ver = db.execute("select value from meta where key='schema'").fetchone()
            if ver is None:
                db.execute("insert into meta values('schema', ?)", (SCHEMA_VERSION,))
                db.execute("insert or replace into meta values('generation', '0')")
            elif ver[0] in ("4", "5"):
                _upgrade(db, ver[0])
            elif ver[0] != SCHEMA_VERSION:
                raise sqlite3.DatabaseError(f"schema version {ver[0]} is not {SCHEMA_VERSION}")
            _reparse(db)
            db.execute("commit")
        except BaseException:
            db.execute("rollback")
            db.close()
            raise
        return db

    def _verify_file(self) -> str | None:
        """Why the index file cannot be trusted, or None. Cheap checks first, then SQLite's quick_check."""
        for suffix in ("", "-wal", "-shm", "-journal"):  # SQLite would write where a planted link points
            if os.path.islink(str(self.path) + suffix):
                return f"{self.path.name}{suffix} is a symbolic link"
        if not self.path.exists():
            return None
        try:
            # another process may be making the file or checkpointing into it right now (its header names the
            # new size before the file has it, and its WAL goes once it is done): only a problem that stays is one
            for attempt in range(VERIFY_TRIES):
                problem = self._cheap_problem()
                if problem is None:
                    break
                time.sleep(0.05 * (attempt + 1))
            else:
                return problem
            if not self.path.exists():
                return None
            db = sqlite3.connect(self.path, timeout=30)
            try:
                row = db.execute("pragma quick_check(1)").fetchone()
            finally:
                db.close()
            if not row or row[0] != "ok":
                return f"SQLite's quick_check failed ({row[0] if row else 'no answer'})"
        except (sqlite3.DatabaseError, OSError) as e:
            return f"it cannot be read ({e})"
        return None

    def _cheap_problem(self) -> str | None:
        """The header and size checks: why the file looks damaged now, or None."""
        try:
            with open(self.path, "rb") as f:
                header = f.read(100)
                size = os.fstat(f.fileno()).st_size
        except FileNotFoundError:
            return None
        if size == 0:
            return None
        if len(header) < 100 or not header.startswith(b"SQLite format 3\x00"):
            return "its header is not an SQLite header"
        page_size = int.from_bytes(header[16:18], "big")
        page_size = 65536 if page_size == 1 else page_size
        pages = int.from_bytes(header[28:32], "big")
        wal = self.path.with_name(INDEX_NAME + "-wal")
        if pages and size < pages * page_size and not (wal.exists() and wal.stat().st_size):
            return f"it is truncated ({size} bytes, header says {pages * page_size})"
        return None

    def _discard(self, reason: str) -> None:
        """Delete the index file (and its WAL) so that it is rebuilt from the files; remember why."""
        if self.db is not None:
            try:
                self.db.close()
            except sqlite3.Error:
                pass
            self.db = None
        for suffix in ("", "-wal", "-shm", "-journal"):
            try:
                os.unlink(str(self.path) + suffix)
            except FileNotFoundError:
                pass
        self._files = None
        self._gen_seen = None
        if self.watcher is not None:
            self.watcher.close()
            self.watcher = None
        self.recovered.append(f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())} rebuilt: {reason}")

    def recover(self, err: Exception) -> None:
        """Called when SQLite raised during use: the file is discarded and reopened empty."""
        self._discard(f"SQLite failed during use ({err})")
        self.open()

    def close(self) -> None:
        if self.watcher is not None:
            self.watcher.close()
            self.watcher = None
        if self.db is not None:
            self.db.close()
            self.db = None

    # ------------------------------------------------------------ meta and the vector space

    def meta(self, key: str) -> str | None:
        row = self.open().execute("select value from meta where key=?", (key,)).fetchone()
        return row[0] if row else None

    def _set_meta(self, key: str, value: str) -> None:
        self.db.execute("insert or replace into meta values(?, ?)", (key, value))

    def generation(self) -> str:
        return self.meta("generation") or "0"

    def _bump(self) -> None:
        """Count a change (inside a write transaction). Our file table stays current only if nobody else
        changed the index since we loaded it; otherwise the next _load_files() reloads it."""
        before = self.generation()
        self.db.execute("update meta set value = cast(value as integer) + 1 where key='generation'")
        self.own_bumps += 1
        if before == self._gen_seen:
            self._gen_seen = self.generation()

    def model_identity(self) -> tuple[str, str, int]:
        p = self.provider
        return p.name, p.revision, int(p.dim)

    def _check_model(self) -> None:
        """A provider other than the one the vectors were made with: drop the vectors (a new space)."""
        try:
            name, rev, dim = self.model_identity()
        except SearchIndexError as e:
            self._model_ok = False
            self.embed_error = str(e)
            return
        self._model_ok = True
        old = (self.meta("model_name"), self.meta("model_revision"), self.meta("model_dim"))
        if old == (name, rev, str(dim)):
            return
        db = self.db
        db.execute("begin immediate")
        try:
            # again under the lock: another process may have set it since (then there is nothing to drop)
            old = (self.meta("model_name"), self.meta("model_revision"), self.meta("model_dim"))
            if old == (name, rev, str(dim)):
                db.execute("commit")
                return
            if old[0] is not None:
                self.space_changed = f"{old[0]} rev {old[1]} dim {old[2]}"
                db.execute("delete from vectors")
            self._set_meta("model_name", name)
            self._set_meta("model_revision", rev)
            self._set_meta("model_dim", str(dim))
            if old[0] is not None:
                self._set_meta("space_changed_from", self.space_changed)
                self._set_meta("requeue", "1")
            self._bump()
            db.execute("commit")
        except BaseException:
            db.execute("rollback")
            raise

    # ------------------------------------------------------------ freshness

    def _load_files(self) -> None:
        gen = self.generation()
        if self._files is not None and gen == self._gen_seen:
            return
        self._files = {r[0]: tuple(r[1:]) for r in self.db.execute(
            "select entity_id, eid, mtime_ns, size, hash, linkstamp from files")}
        self._gen_seen = gen

    def scan(self, only: set[str] | None = None, left_out: list | None = None
             ) -> tuple[dict[str, tuple[str, int, int]], dict[str, tuple[str, str]]]:
        """Stat every entity file and links directory (of the classes `only`, if given):
        ({id: (path, mtime_ns, size)}, {id: (links dir, stamp)}). `left_out` gets (class, name, path) of each
        `*.md` entry of a class that is no entity file (a name that is no slug, a link, a directory...)."""
        files: dict[str, tuple[Path, int, int]] = {}
        links: dict[str, tuple[Path, str]] = {}
        try:
            top = list(os.scandir(self.root))
        except FileNotFoundError:
            raise SearchIndexError(f"The store {self.root} is gone: recreate it or point Memory at another path.")
        for d in top:
            # a class is a valid class name, an entity file a valid slug (check() names the others): no hit whose
            # entity cannot be read
            if not _format.is_name(d.name) or not d.is_dir(follow_symlinks=False):
                continue
            if only is not None and d.name not in only:
                continue
            cls = d.name
            try:
                it = os.scandir(d.path)
            except OSError:  # unreadable (mode 000 for a user without the capability), or gone: no entity in it
                if left_out is not None and os.path.isdir(d.path):
                    left_out.append((cls, "", d.path))
                continue
            with it:
                for e in it:
                    name = e.name
                    if name.startswith(".") or not _utf8(name):
                        if left_out is not None and name.endswith(".md") and not name.startswith(TEMP_PREFIX):
                            left_out.append((cls, name, e.path))
                        continue
                    if name.endswith(".md"):
                        if _format.is_slug(name[:-3]) and e.is_file(follow_symlinks=False):
                            try:
                                st = e.stat(follow_symlinks=False)
                            except OSError:  # removed since the listing: the next pass sees it gone
                                continue
                            # plain str paths: 100,000 Path objects cost 1.5 s here
                            files[f"{cls}/{name[:-3]}"] = (e.path, st.st_mtime_ns, st.st_size)
                        elif left_out is not None:
                            left_out.append((cls, name, e.path))
                    elif name.endswith(LINKS_SUFFIX) and e.is_dir(follow_symlinks=False):
                        try:
                            links[f"{cls}/{name[:-len(LINKS_SUFFIX)]}"] = (e.path, _linkstamp(e.path))
                        except OSError:  # removed since the listing
                            continue
        return files, links

    def sync(self, *, embed_budget: float | None = QUERY_EMBED_BUDGET_S) -> tuple[SyncStats, set[int], set[int]]:
        """Bring the index up to date with the files. Returns (stats, removed unit ids, added unit ids)."""
        t0 = time.perf_counter()
        self.open()
        self._load_files()
        stats = SyncStats()
        files, linkdirs, cand_f, cand_l = self._changes()
        stats.scanned = len(files)
        removed_uids: set[int] = set()
        added_uids: set[int] = set()

        def plan():
            known = self._files
            if cand_f is None:  # full scan: (mtime, size) decide what to read
                todo = [eid for eid, (p, m, s) in files.items()
                        if eid not in known or known[eid][1] != m or known[eid][2] != s]
                gone = [eid for eid in known if eid not in files]
                cl = set(known) | set(linkdirs)
            else:  # notified: re-check exactly the named entities (the hash decides)
                todo = [eid for eid in cand_f if eid in files]
                gone = [eid for eid in cand_f if eid not in files and eid in known]
                cl = cand_l
            relink = [eid for eid in cl
                      if (linkdirs[eid][1] if eid in linkdirs else None) != (known[eid][4] if eid in known else None)]
            return todo, gone, [e for e in relink if e in files or e in known]

        todo, gone, relink = plan()
        if todo or gone or relink:
            db = self.db
            db.execute("begin immediate")
            if self.generation() != self._gen_seen:
                # another process indexed something between our read and our lock: plan again on its result
                self._load_files()
                todo, gone, relink = plan()
            try:
                for entity_id in todo:
                    path, mtime, size = files[entity_id]
                    self._refresh_file(entity_id, path, mtime, size, stats, removed_uids, added_uids)
                for entity_id in gone:
                    removed_uids |= self._delete_entity(entity_id)
                    stats.removed.append(entity_id)
                for entity_id in relink:
                    if entity_id in self._files or entity_id in linkdirs:
                        self._relink(entity_id, linkdirs.get(entity_id))
                        stats.relinked.append(entity_id)
                if stats.changed:
                    self._bump()
                db.execute("commit")
            except BaseException:
                db.execute("rollback")
                self._files = None
                if self.watcher is not None:
                    self.watcher.broken = True  # the drained events are lost: scan everything next time
                raise
        if not self._model_ok:
            self._check_model()  # the provider may be reachable again
        try:
            if not self._model_ok:
                raise SearchIndexError(self.embed_error or "The embedding provider cannot say which model it is.")
            self.embed_missing(stats, budget=embed_budget)
        except SearchIndexError as e:
            if embed_budget is None:
                raise
            # On the query path a failing embedder must not fail the query: the lexical channels still answer.
            stats.embed_error = self.embed_error = str(e)
            stats.pending_vectors = self.missing_vectors()
        else:
            self.embed_error = None
        stats.seconds = time.perf_counter() - t0
        return stats, removed_uids, added_uids

    def _changes(self):
        """What to look at: (files, linkdirs, candidate file ids, candidate link ids); candidates None = all."""
        w = self.watcher
        if w is not None and not w.broken:
            fchg, lchg, classes = w.drain()
            if not w.broken:
                files: dict[str, tuple[Path, int, int]] = {}
                linkdirs: dict[str, tuple[Path, str]] = {}
                if classes:
                    files, linkdirs = self.scan(only=classes)
                    inside = [e for e in self._files if e.split("/", 1)[0] in classes]
                    fchg |= set(files) | set(inside)
                    lchg |= set(linkdirs) | set(inside)
                for eid in fchg - set(files):
                    if not _utf8(eid) or not _valid_id(eid):
                        continue
                    p = self.root / f"{eid}.md"
                    try:
                        st = os.lstat(p)
                    except OSError:
                        continue
                    if stat.S_ISREG(st.st_mode):
                        files[eid] = (p, st.st_mtime_ns, st.st_size)
                for eid in lchg - set(linkdirs):
                    if not _utf8(eid):
                        continue
                    ldir = self.root / (eid + LINKS_SUFFIX)
                    try:
                        if stat.S_ISDIR(os.lstat(ldir).st_mode):
                            linkdirs[eid] = (ldir, _linkstamp(str(ldir)))
                    except OSError:
                        continue
                return files, linkdirs, fchg, lchg
        # First query of this process, or the watch broke: watch first, then scan, so nothing falls between.
        if w is not None:
            w.close()
        self.watcher = None
        try:
            from hutch.memory._index._watch import Watcher

            self.watcher = Watcher(self.root)
            if self.watcher.broken:
                self.watch_error = "inotify watches could not be added (fs.inotify.max_user_watches?)"
                self.watcher.close()
                self.watcher = None
        except OSError as e:
            self.watch_error = f"inotify is unavailable ({e})"
        files, linkdirs = self.scan()
        return files, linkdirs, None, None

    def _refresh_file(self, entity_id: str, path: Path, mtime: int, size: int, stats: SyncStats,
                      removed: set[int], added: set[int]) -> None:
        try:  # the file may have become a symlink or a FIFO since the scan: never follow or block
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:  # deleted (or replaced) between scan and read: the next pass sees what it is
            return
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode):
                return
            digest = file_digest(f, st.st_size)
            old = self._files.get(entity_id)
            if old is not None and old[3] == digest:
                self.db.execute("update files set mtime_ns=?, size=? where eid=?", (mtime, size, old[0]))
                self._files[entity_id] = (old[0], mtime, size, digest, old[4])
                return
            f.seek(0)  # the same open file: a rename over it meanwhile changes nothing of what is read
            head, carry = read_head(f)
            self._index_file(entity_id, path, mtime, size, digest, head, old, stats, removed, added)
            eid = self._files[entity_id][0]
            self._add_chunks(eid, f, carry, len(head))
            now = os.fstat(f.fileno())
            if (now.st_mtime_ns, now.st_size) != (mtime, size) or (st.st_mtime_ns, st.st_size) != (mtime, size):
                # written to while it was read (or since the scan): what is indexed may be neither the old nor
                # the new text, and may match the digest of neither; the next pass reads it again
                self.db.execute("update files set mtime_ns=-1, hash='' where eid=?", (eid,))
                e = self._files[entity_id]
                self._files[entity_id] = (e[0], -1, e[2], "", e[4])

    def _index_file(self, entity_id, path, mtime, size, digest, head: bytes, old, stats, removed, added) -> None:
        text = _text(head)
        cls = entity_id.split("/", 1)[0]
        error = None
        try:
            meta, body = _format.parse(text, f"{entity_id}.md")  # the reason names the file relative to the store
        except MalformedEntityError as e:
            # Indexed by its words (fixed, it answers at once), but search leaves it out of its hits (a hit's
            # entity could not be read) and names it; doctor and check() list it.
            meta, body, error = {}, text, str(e)
        title = str(meta.get("title") or entity_id.split("/", 1)[1])
        units, whole = _units.units_of(meta, body, title)
        t_from = _units.to_epoch(meta.get("valid_from"))
        t_to = _units.to_epoch(meta.get("valid_to"))
        t_rec = t_from
        for key in ("recorded_at", "created"):
            t_rec = t_rec if t_rec is not None else _units.to_epoch(meta.get(key))
        db = self.db
        if old is not None:
            eid = old[0]
            removed |= self._drop_units(eid)
            db.execute("update files set title=?, mtime_ns=?, size=?, hash=?, t_from=?, t_to=?, t_rec=?, error=? "
                       "where eid=?", (title, mtime, size, digest, t_from, t_to, t_rec, error, eid))
            db.execute("delete from ent_fts where rowid=?", (eid,))
            db.execute("delete from titles where eid=?", (eid,))
            linkstamp = old[4]
        else:
            eid = db.execute("insert into files(entity_id, cls, title, mtime_ns, size, hash, t_from, t_to, t_rec, error) "
                             "values (?,?,?,?,?,?,?,?,?,?)",
                             (entity_id, cls, title, mtime, size, digest, t_from, t_to, t_rec, error)).lastrowid
            linkstamp = None
        if len(units) > 1:  # one unit: the same text is in units_fts, and search takes it from there
            db.execute("insert into ent_fts(rowid, body) values (?, ?)", (eid, whole))
        db.executemany("insert into titles(norm, eid, partial) values (?, ?, ?)",
                       [(t, eid, p) for t, p in _units.title_keys(title)])
        for u in units:
            ev = u.event or (None, None)
            uid = db.execute("insert into units(eid, anchor, speaker, dense_hash, ev_from, ev_to) "
                             "values (?,?,?,?,?,?)", (eid, u.anchor, u.speaker, u.dense_hash, *ev)).lastrowid
            db.execute("insert into units_fts(rowid, body, context) values (?,?,?)", (uid, u.body, u.context))
            db.execute("insert or ignore into pending(dense_hash, text) values (?, ?)", (u.dense_hash, u.dense))
            added.add(uid)
        self._files[entity_id] = (eid, mtime, size, digest, linkstamp)
        stats.reindexed.append(entity_id)

    def _add_chunks(self, eid: int, f, carry: bytes, done: int) -> None:
        """The words of the file past its head (`carry`, then the rest of `f`), up to LEXICAL_BYTES in all,
        in pieces of at most CHUNK_BYTES, read and inserted one at a time."""
        buf = carry
        while done < _units.LEXICAL_BYTES:
            want = min(_units.CHUNK_BYTES, _units.LEXICAL_BYTES - done)
            if len(buf) <= want:  # one byte more than a piece: whether the file goes on decides the cut
                buf += f.read(want + 1 - len(buf))
            if not buf:
                return
            end = _units.cut(buf, want)
            piece, buf = buf[:end], buf[end:]
            done += len(piece)
            cid = self.db.execute("insert into chunks(eid) values (?)", (eid,)).lastrowid
            self.db.execute("insert into chunks_fts(rowid, body) values (?, ?)", (cid, _text(piece)))

    def _drop_units(self, eid: int) -> set[int]:
        uids = {r[0] for r in self.db.execute("select uid from units where eid=?", (eid,))}
        if uids:
            q = ",".join("?" * len(uids))
            self.db.execute(f"delete from units_fts where rowid in ({q})", tuple(uids))
            self.db.execute("delete from units where eid=?", (eid,))
        if self.db.execute("select 1 from chunks where eid=? limit 1", (eid,)).fetchone():
            self.db.execute("delete from chunks_fts where rowid in (select cid from chunks where eid=?)", (eid,))
            self.db.execute("delete from chunks where eid=?", (eid,))
        return uids

    def _delete_entity(self, entity_id: str) -> set[int]:
        old = self._files.pop(entity_id, None)
        if old is None:
            return set()
        eid = old[0]
        uids = self._drop_units(eid)
        self.db.execute("delete from files where eid=?", (eid,))
        self.db.execute("delete from ent_fts where rowid=?", (eid,))
        self.db.execute("delete from titles where eid=?", (eid,))
        self.db.execute("delete from links where src=?", (entity_id,))
        return uids

    def _relink(self, entity_id: str, linkdir: tuple[Path, str] | None) -> None:
        self.db.execute("delete from links where src=?", (entity_id,))
        stamp = None
        if linkdir is not None:
            ldir, stamp = linkdir
            rows = [(entity_id, rel, dst) for rel, dst in _read_links(self.root, Path(ldir))]
            self.db.executemany("insert into links(src, rel, dst) values (?,?,?)", rows)
        if entity_id in self._files:
            eid, m, s, h, _ = self._files[entity_id]
            self.db.execute("update files set linkstamp=? where eid=?", (stamp, eid))
            self._files[entity_id] = (eid, m, s, h, stamp)

    # ------------------------------------------------------------ vectors

    def missing_vectors(self) -> int:
        return self.db.execute("select count(*) from pending").fetchone()[0]

    def embed_missing(self, stats: SyncStats, *, budget: float | None) -> None:
        """Embed the texts of units that have no vector in the current space, within `budget` seconds."""
        db = self.db
        t0 = time.perf_counter()
        # Pending rows are dropped once their hash is embedded or no unit needs it any more.
        if self.meta("requeue") == "1":
            # a new vector space (model change): the texts to embed are re-derived from the files
            self._requeue_all()
        if db.execute("select 1 from pending limit 1").fetchone():
            db.execute("delete from pending where dense_hash in (select dense_hash from vectors) "
                       "or dense_hash not in (select dense_hash from units)")
        while True:
            rows = db.execute("select dense_hash, text from pending limit 256").fetchall()
            if not rows:
                break
            vecs = self.provider.embed([r[1] for r in rows]).astype(np.float32)
            db.execute("begin immediate")
            try:
                db.executemany("insert or replace into vectors(dense_hash, vec) values (?, ?)",
                               [(r[0], v.tobytes()) for r, v in zip(rows, vecs)])
                db.executemany("delete from pending where dense_hash=?", [(r[0],) for r in rows])
                self._bump()
                db.execute("commit")
            except BaseException:
                db.execute("rollback")
                raise
            stats.embedded += len(rows)
            if budget is not None and time.perf_counter() - t0 > budget:
                break
        stats.pending_vectors = self.missing_vectors()

    def _requeue_all(self) -> None:
        """Queue every unit's dense text again (after the vector space changed) by re-reading its file."""
        db = self.db
        db.execute("begin immediate")
        try:
            for entity_id, cls in db.execute("select entity_id, cls from files").fetchall():
                path = self.root / f"{entity_id}.md"
                try:
                    with open(path, "rb") as f:
                        text = _text(read_head(f)[0])
                    meta, body = _format.parse(text, str(path))
                except (OSError, MalformedEntityError):
                    meta, body = {}, ""
                title = str(meta.get("title") or entity_id.split("/", 1)[1])
                units, _ = _units.units_of(meta, body, title)
                db.executemany("insert or ignore into pending(dense_hash, text) values (?, ?)",
                               [(u.dense_hash, u.dense) for u in units])
            self._set_meta("requeue", "0")
            db.execute("commit")
        except BaseException:
            db.execute("rollback")
            raise


def _text(data: bytes) -> str:
    """What is indexed of a file's bytes: bytes that are not UTF-8 become U+FFFD (SQLite refuses the surrogates
    that surrogateescape makes of them, and one such file made every search of the store fail)."""
    return data.decode("utf-8", errors="replace")


def file_digest(f, size: int) -> str:
    """sha256 of the `size` bytes of an open file from where it is (fewer if it ends first), read in blocks: a file
    of any size costs a block of memory, and one that a writer keeps growing while it is read ends at `size`
    (read to its end, it could keep the reader, and the index's write lock, forever)."""
    h = hashlib.sha256()
    while size > 0:
        block = f.read(min(1 << 20, size))
        if not block:
            break
        h.update(block)
        size -= len(block)
    return h.hexdigest()


def read_head(f) -> tuple[bytes, bytes]:
    """(the part of the file that becomes units: its first UNIT_BYTES, cut at white space; the bytes read
    past it), reading at most UNIT_BYTES + 1 bytes."""
    data = f.read(_units.UNIT_BYTES + 1)
    if len(data) <= _units.UNIT_BYTES:
        return data, b""
    end = _units.cut(data, _units.UNIT_BYTES)
    return data[:end], data[end:]


def _upgrade(db: sqlite3.Connection, old: str) -> None:
    """Schema 4 or 5 -> 6 in place, keeping the vectors (a rebuild would embed every unit again): the new tables
    exist already (_SCHEMA); a file that may now be indexed differently is marked changed, so the next pass indexes
    it anew: from 4, one past DENSE_CHARS (every unit's text was shorter than that); from 4 and 5, one that holds
    turns (their event times are read by schema 6's rule). Their unchanged texts keep their vectors.
    Inside the caller's write transaction (in which the old version was read)."""
    if old == "4":
        db.execute("update files set mtime_ns=-1, hash='' where size > ?", (_units.DENSE_CHARS,))
    db.execute("update files set mtime_ns=-1, hash='' where eid in "
               "(select distinct eid from units where anchor is not null and speaker is not null)")
    db.execute("update meta set value=? where key='schema'", (SCHEMA_VERSION,))
    db.execute("update meta set value = cast(value as integer) + 1 where key='generation'")


#: How front matter is read (_format.parse): 2 reads a leading byte order mark and caps front matter at
#: MAX_FRONT_MATTER. An index made under another rule reads again the files it may now read otherwise.
PARSER_VERSION = "2"


def _reparse(db: sqlite3.Connection) -> None:
    """If the index was made under another PARSER_VERSION: mark changed the files whose front matter it could
    not read and those large enough to hold more front matter than the cap, so the next pass reads them anew
    (a BOM file stayed 'malformed' until it was touched). Inside the caller's write transaction."""
    row = db.execute("select value from meta where key='parser'").fetchone()
    if row is not None and row[0] == PARSER_VERSION:
        return
    db.execute("update files set mtime_ns=-1, hash='' where error is not null or size > ?",
               (_format.MAX_FRONT_MATTER,))
    db.execute("insert or replace into meta values('parser', ?)", (PARSER_VERSION,))
    db.execute("update meta set value = cast(value as integer) + 1 where key='generation'")


def _valid_id(entity_id: str) -> bool:
    """True for '<a valid class>/<a valid slug>' (what scan() indexes)."""
    cls, _, slug = entity_id.partition("/")
    return _format.is_name(cls) and _format.is_slug(slug)


def _utf8(name: str) -> bool:
    """False for a file name that is not UTF-8 (os gives it with surrogates): SQLite cannot store it, and one
    such file (planted by hand, or by a clone) made every search of the store raise UnicodeEncodeError."""
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _linkstamp(path: str) -> str:
    """A cheap fingerprint of a links directory: its mtime and each relation directory's mtime and name."""
    parts = [str(os.lstat(path).st_mtime_ns)]
    try:
        with os.scandir(path) as it:
            for r in it:
                if r.is_dir(follow_symlinks=False):
                    # a name that is not UTF-8 (a relation directory made by hand) in a form SQLite can store:
                    # it made every search raise UnicodeEncodeError
                    name = os.fsencode(r.name).decode("utf-8", "backslashreplace")
                    parts.append(f"{name}:{r.stat(follow_symlinks=False).st_mtime_ns}")
    except OSError:
        pass
    return "|".join(sorted(parts))


def _read_links(root: Path, ldir: Path) -> Iterable[tuple[str, str]]:
    """(relation, target id) of every well-formed link in a links directory (targets read with readlink)."""
    try:
        rels = sorted(os.listdir(ldir))
    except OSError:
        return
    for rel in rels:
        rdir = ldir / rel
        if rdir.is_symlink() or not rdir.is_dir():
            continue
        try:
            names = sorted(os.listdir(rdir))
        except OSError:  # unreadable, or gone since the listing
            continue
        for name in names:
            try:
                target = os.readlink(rdir / name)
            except OSError:
                continue
            if os.path.isabs(target):
                continue
            full = Path(os.path.normpath(os.path.join(rdir, target)))
            try:
                rel_path = full.relative_to(root)
            except ValueError:
                continue
            if len(rel_path.parts) == 2 and rel_path.parts[1].endswith(".md") and _utf8(rel + target):
                yield rel, f"{rel_path.parts[0]}/{rel_path.parts[1][:-3]}"
