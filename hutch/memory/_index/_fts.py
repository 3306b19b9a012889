"""The FTS5 reads the lexical channels make: BM25 of a MATCH expression over units, entities and the chunks of
large files, by snapshot position; and which of a category's instance words are worth asking."""

from __future__ import annotations

import itertools
import sqlite3

import numpy as np

from hutch.memory._index import _rank
from hutch.memory._index._rank import Snapshot


def unit_bm25(db: sqlite3.Connection, snap: Snapshot, fq: str | None, n: int, few: bool = False) -> np.ndarray:
    """BM25 of an FTS5 MATCH expression over the units' text and context, by snapshot position (0: no match):
    the best LEXICAL_LIMIT units. `few`: the caller expects at most that many matches, so they are first read
    unsorted, and if they are all there, they are the same rows and scores without SQLite's sorter (~20% of the
    query); only if there are more is the query run again, sorted."""
    out = np.zeros(n)
    if not fq:
        return out
    # bm25() once per row (as the sort key and the value) and the rows as arrays, not a Python loop over them
    bm, limit = f"bm25(units_fts, 1.0, {_rank.CONTEXT_WEIGHT})", _rank.LEXICAL_LIMIT
    rows = None
    if few:
        rows = db.execute(f"select rowid, {bm} from units_fts where units_fts match ? limit {limit + 1}",
                          (fq,)).fetchall()
        if len(rows) > limit:
            rows = None
    if rows is None:
        rows = db.execute(f"select rowid, {bm} as s from units_fts where units_fts match ? order by s "
                          f"limit {limit}", (fq,)).fetchall()
    if rows:
        uid, bm = np.fromiter(itertools.chain.from_iterable(rows), np.float64, 2 * len(rows)).reshape(-1, 2).T
        p = snap.positions(uid.astype(np.int64))
        ok = (p >= 0) & (p < n)
        out[p[ok]] = -bm[ok]
    return out


def chunk_bm25(db: sqlite3.Connection, snap: Snapshot, fq: str) -> dict[int, float]:
    """{entity position: BM25 of its best chunk} over the words of large files past their units (_db: chunks)."""
    if not db.execute("select 1 from chunks limit 1").fetchone():
        return {}
    eidpos = snap.eid_pos
    out: dict[int, float] = {}
    for eid, score in db.execute(
            "select c.eid, -bm25(chunks_fts) from chunks_fts join chunks c on c.cid = chunks_fts.rowid "
            f"where chunks_fts match ? order by bm25(chunks_fts) limit {_rank.LEXICAL_LIMIT}", (fq,)):
        p = eidpos.get(eid)
        if p is not None and score > out.get(p, 0.0):
            out[p] = score
    return out


def entity_bm25(db: sqlite3.Connection, snap: Snapshot, fq: str) -> np.ndarray:
    """BM25 over the entity-level text of entities of several units (ent_fts), by entity position."""
    elex = np.zeros(snap.ne)
    eidpos = snap.eid_pos
    for eid, score in db.execute(
            f"select rowid, -bm25(ent_fts) from ent_fts where ent_fts match ? order by bm25(ent_fts) "
            f"limit {_rank.LEXICAL_LIMIT}", (fq,)):
        p = eidpos.get(eid)
        if p is not None:
            elex[p] = score
    return elex


def within_budget(db: sqlite3.Connection, snap: Snapshot | None, words: list[str]) -> list[str]:
    """The words the store has, rarest first, while the units they are in add up to at most LEXICAL_LIMIT.

    A category lists up to 1,000 instance words; FTS5 scores every unit that holds any of them before it
    keeps the best LEXICAL_LIMIT, so common instance words ("piano" in 3% of 100,000 units) cost ~17 ms
    per question and can only crowd out the specific ones. Document frequencies come from FTS5's own
    vocabulary (the words go through the same porter tokenizer in a temp table): ~2 ms, so the answer is kept
    until the index changes (a category's words are asked again in every question about it)."""
    if snap is None:
        return _rarest_within_budget(db, words)
    key = ("budget", snap.gen, _rank.LEXICAL_LIMIT, tuple(words))
    if key not in snap.memo:
        if len(snap.memo) >= 256 or any(k[1] != snap.gen for k in snap.memo):
            snap.memo.clear()
        snap.memo[key] = _rarest_within_budget(db, words)
    return list(snap.memo[key])


def _rarest_within_budget(db: sqlite3.Connection, words: list[str]) -> list[str]:
    db.execute("create virtual table if not exists temp.hutch_stem using fts5(x, tokenize='porter unicode61')")
    db.execute("create virtual table if not exists temp.hutch_stem_v using fts5vocab('temp', 'hutch_stem', "
               "'instance')")
    db.execute("create virtual table if not exists temp.hutch_units_v using fts5vocab('main', 'units_fts', 'row')")
    db.execute("delete from temp.hutch_stem")
    db.execute("insert into temp.hutch_stem(rowid, x) values (1, ?)", (" ".join(words),))
    stem = {off: term for term, off in db.execute("select term, offset from temp.hutch_stem_v")}
    terms = sorted(set(stem.values()))
    df: dict[str, int] = {}
    for chunk in _rank.batches(terms):
        marks = ",".join("?" * len(chunk))
        df.update(db.execute(f"select term, doc from temp.hutch_units_v where term in ({marks})", chunk).fetchall())
    kept, total, seen = [], 0, set()
    for i in sorted(stem, key=lambda i: (df.get(stem[i], 0), i)):
        t = stem[i]
        d = df.get(t, 0)
        if d == 0 or t in seen:
            continue
        if total + d > _rank.LEXICAL_LIMIT and kept:
            break
        seen.add(t)
        kept.append(words[i])
        total += d
    return kept
