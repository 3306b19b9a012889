"""The channels of one query, each a small unit with one interface: `unit(reading, trip) -> Channel | None`.

Given the query's reading (_query.Reading) and the trip (the candidate mask, the snapshot, the index
connection, and what the channels that ran before it found), a unit returns what it found: a
`_rank.Channel` (a score for every unit position, which units it found, how fusion scales it), or None
when it has nothing to say. `run` takes a query through them forward, in the order of RUN, and hands the
channels to fusion in the order of FUSED:

- the dense channel's embedding starts first, in a worker thread (`start_dense`): embedding and the
  matrix product release the GIL, so they overlap the FTS5 reads of bm25, mention and category on the
  main thread (a measured win, docs/retrieval.md "Speed");
- `bm25` reads every lexical score (unit level with the word pairs, the chunks of large files, entity
  level) and hands the entity-level ones on in `parts`;
- `mention` and `time` are boolean; `category` waits for the question's vector (which sense of its word);
- `dense` waits for the worker; in a large store its cosines are estimates, made exact where bm25 found
  something; `entity` adds an entity's BM25 and its best unit's dense score;
- `settle_dense` makes the estimates exact where the boolean channels found something, just before fusion.
"""

from __future__ import annotations

import sqlite3
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from hutch._core.errors import SearchIndexError
from hutch.memory._index import _fts, _lexicon, _rank, _units
from hutch.memory._index._query import Reading, WordCounts
from hutch.memory._index._rank import Channel, Snapshot

_POOL = None


def _pool():
    """One worker thread for the dense channel of a query (created on first use)."""
    global _POOL
    if _POOL is None:
        from concurrent.futures import ThreadPoolExecutor

        _POOL = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hutch-embed")
    return _POOL


@dataclass
class Trip:
    """What the channels of one query share. Each unit reads what the units before it found (`found`) and adds
    its own; nothing is handed back."""

    snap: Snapshot
    db: sqlite3.Connection
    mask: np.ndarray  # the candidate units (the filters: classes, since / until, as_of)
    provider: Any  # the embedding provider
    dense_on: bool  # the model is known and every unit has its vector
    counts: WordCounts  # the index's word counts (which words the lexical query leaves out)
    senses: dict[str, np.ndarray]  # WordNet sense text -> its vector, kept per process (category)
    found: dict[str, Channel] = field(default_factory=dict)
    vectors: Future | None = None  # (the dense text's vector, the whole question's or None) once embedded
    job: Future | None = None  # the worker's _rank.DenseQuery
    embed_error: str | None = None  # the embedder failed: the dense channel is off for this query


# ------------------------------------------------------------------ the units

def start_dense(q: Reading, t: Trip) -> None:
    """Start the dense channel in the worker: embed the question without its names (and, when the category
    channel will rank its word's senses, the whole question beside it), then its cosine with every unit."""
    if not t.dense_on:
        return
    full = q.text if q.dense_text != q.text and _lexicon.ranks_senses(q.text) else None
    t.vectors = Future()
    t.job = _pool().submit(_dense_job, t.provider, t.snap, q.dense_text, t.mask, t.vectors, full)


def _dense_job(provider, snap: Snapshot, qtext: str, mask: np.ndarray, vecs: Future,
               full: str | None) -> _rank.DenseQuery:
    """(in the worker) `vecs` gets (qtext's vector, `full`'s or None) as soon as they are embedded, before the
    channel is computed: the category channel needs only those."""
    try:
        qv = provider.embed([qtext])[0].astype(np.float32)
    except BaseException as e:
        vecs.set_exception(e)
        raise
    fv = None
    if full is not None:
        try:
            fv = provider.embed([full])[0]
        except SearchIndexError:
            pass  # the sense ranker tries again itself, and without it takes the most frequent sense
    vecs.set_result((qv, fv))
    return _rank.DenseQuery(snap, qv, mask)


def bm25(q: Reading, t: Trip) -> Channel:
    """FTS5 BM25 of the question's words over the units' text and context; with adjacent content words, the
    sequential dependence model (`SDM_WEIGHTS`: "pottery class" as a phrase and within a window counts beyond
    "pottery" and "class" apart; LoCoMo dev R@10 84.8 -> 85.3, docs/retrieval.md). A phrase is specific even
    with a common word in it ("dance studio"); a window around a common word is not, and scanning it is what
    costs (p99 40 against 3 ms at 100,000 units): the window drops such words, like the words' query.

    `parts`: "entity", the entity-level BM25 by entity position (for the entity channel); "lexical", whether
    any word was asked at all."""
    s, db, n = t.snap, t.db, t.snap.n
    lq = t.counts.lexical(q, db, len(s.upos))
    lex = words = _fts.unit_bm25(db, s, lq.fts, n, lq.few)
    if q.pairs:
        w_word, w_phrase, w_window = _rank.SDM_WEIGHTS
        lex = (w_word * lex + w_phrase * _fts.unit_bm25(db, s, lq.phrases, n, True)
               + w_window * _fts.unit_bm25(db, s, lq.window, n, True))
    # the words of large files past their units: the entity's best chunk, for its sole unit here too
    chunks = _fts.chunk_bm25(db, s, lq.fts) if lq.fts else {}
    if chunks:
        sole = s.sole_units()[:n]
        best = np.zeros(s.ne)
        best[list(chunks)] = list(chunks.values())
        lex = np.maximum(lex, np.where(sole >= 0, best[np.maximum(sole, 0)], 0.0))
    elex = np.zeros(s.ne)
    if lq.fts:
        elex = _fts.entity_bm25(db, s, lq.fts)
        # an entity of one unit is not in ent_fts (its text is its unit's): the unit's BM25 over the same words
        # (repeating it at entity level cost ~5-7 ms per question at 100,000 one-unit entities)
        hit = np.flatnonzero(words > 0)
        ent_of = s.sole_units()[hit]
        one = ent_of >= 0
        elex[ent_of[one]] = words[hit[one]]
        for p, score in chunks.items():
            elex[p] = max(elex[p], score)
    return Channel("bm25", lex, lex > 0, parts={"entity": elex, "lexical": bool(lq.fts)})


def mention(q: Reading, t: Trip) -> Channel | None:
    """1 for the units related to an entity the question names: turns spoken by it; other units that are it or
    link to or from it. Only when that separates some candidates from the others."""
    if not q.mentioned:
        return None
    s, n = t.snap, t.snap.n
    names = set(q.names)
    related = set(q.mentioned)
    for chunk in _rank.batches(list(q.mentioned)):
        marks = ",".join("?" * len(chunk))
        related.update(r[0] for r in t.db.execute(f"select src from links where dst in ({marks})", chunk))
        related.update(r[0] for r in t.db.execute(f"select dst from links where src in ({marks})", chunk))
    ent_ok = np.zeros(s.ne, bool)
    ent_ok[[s.pos_of_id[e] for e in related if e in s.pos_of_id]] = True
    codes = [s.speaker_code[nm] for nm in names if nm in s.speaker_code]
    spoke = np.isin(s.speaker[:n], codes) if codes else np.zeros(n, bool)
    boost = np.where(s.is_turn[:n], spoke, ent_ok[s.epos[:n]])
    if 0 < (boost & t.mask).sum() < t.mask.sum():
        return Channel("mention", boost.astype(np.float64), boost)
    return None


def in_time(q: Reading, t: Trip) -> Channel | None:
    """How surely a unit's time is inside the span the question names: 1 when its time (its entity's valid_from,
    else recorded_at, else created) is; else the share of its event time (a turn's "yesterday", "last year", read
    against its session) inside the span: the chance that what it speaks of fell there, if it was anywhere in its
    event time alike (a turn's "last year" is 1 for a question about that year and 31/365 for one about a month of
    it). A turn is judged by the question's time as read against the newest candidate turn of its conversation
    (`turn_spans`; one conversation: `turn_span`), any other unit by it as read against the newest candidate
    (`span`; see _search.SearchIndex._reference and _turn_references). Only when
    that separates some candidates from the others; not rescaled (`unit_scale`)."""
    if q.span is None:
        return None
    s, n = t.snap, t.snap.n
    tr = s.t_rec[:s.ne][s.epos[:n]]
    ef, et = s.ev_from[:n], s.ev_to[:n]
    val = _in_span(q.span, tr, ef, et)
    if q.turn_span is not None and q.turn_span is not q.span:
        val = np.where(s.is_turn[:n], _in_span(q.turn_span, tr, ef, et), val)
    for where, span in q.turn_spans:  # several conversations: each one's turns as read against its own end
        if span is not None:
            val[where] = _in_span(span, tr[where], ef[where], et[where])
    tin = val > 0
    if 0 < (tin & t.mask).sum() < t.mask.sum():
        return Channel("time", val, tin, unit_scale=True)
    return None


def _in_span(span, tr: np.ndarray, ef: np.ndarray, et: np.ndarray) -> np.ndarray:
    """1 where a unit's time is inside `span`, else the share of its event time inside it (0: none)."""
    with np.errstate(invalid="ignore"):  # NaN (no time) compares False
        inside = (tr >= span.start) & (tr < span.end)
        share = np.nan_to_num((np.minimum(et, span.end) - np.maximum(ef, span.start)) / (et - ef), nan=0.0)
    return np.where(inside, 1.0, np.clip(share, 0.0, 1.0))


def category(q: Reading, t: Trip) -> Channel | None:
    """BM25 of the instances of the category a list question asks about ("What martial arts has John done?" ->
    taekwondo, judo, ...; see _lexicon), within the row budget (_fts.within_budget)."""
    cat_dense, qvec = t.dense_on, None  # qvec: the question's own vector once embedded (see _sense_ranker)
    if t.vectors is not None:
        try:
            qv, fv = t.vectors.result()
            qvec = qv if q.dense_text == q.text else fv
        except SearchIndexError:
            cat_dense = False  # the dense channel is off (below): senses are ranked as without a model
    found = _lexicon.category_terms(q.text, _sense_ranker(t, cat_dense, qvec))
    if found is None:
        return None
    words = _fts.within_budget(t.db, t.snap, found[1])
    # the words' units add up to at most LEXICAL_LIMIT (unless the rarest alone has more): read unsorted
    cat = _fts.unit_bm25(t.db, t.snap, _units.fts_query(words), t.snap.n, True) if words else None
    if cat is not None and (cat > 0).any():
        return Channel("category", cat, cat > 0)
    return None


def _sense_ranker(t: Trip, dense_on: bool, qvec: np.ndarray | None) -> Callable[[str, list[str]], int]:
    """Which of a word's senses a question means: the gloss the embedding model puts closest to the question
    (sense vectors are kept per process); WordNet's most frequent sense when there is no model. `qvec`: the
    question's vector when the dense channel already embedded it (alone, as here: the same vector)."""
    def rank(question: str, texts: list[str]) -> int:
        if not dense_on:
            return 0
        missing = [x for x in texts if x not in t.senses]
        if missing or qvec is None:
            try:
                vecs = t.provider.embed([question, *missing])
            except SearchIndexError:
                return 0
            t.senses.update(zip(missing, vecs[1:]))
            qv = vecs[0]
        else:
            qv = qvec  # embedding the question again cost ~5 ms per list question on the main thread
        return int(np.argmax([float(t.senses[x] @ qv) for x in texts]))
    return rank


def dense(q: Reading, t: Trip) -> Channel | None:
    """The cosine of the question (names stripped) with each unit's vector, from the worker. In a large store
    (approximate: estimates from sign bits) exact where bm25 found something, at unit or entity level."""
    if t.job is None:
        return None
    try:
        dq = t.job.result()
    except SearchIndexError as e:
        t.embed_error = str(e)
        return None
    if dq.exact is not None:
        s, n = t.snap, t.snap.n
        b = t.found["bm25"]
        ent_found = b.parts["entity"] > 0
        dq.make_exact((b.scores > 0) | (ent_found if s.one_to_one() else ent_found[s.epos[:n]]))
    return Channel("dense", dq.values, t.mask.copy(), zero_based=False, moments=dq.moments, parts={"query": dq})


def entity(q: Reading, t: Trip) -> Channel:
    """The unit's whole entity (a turn inherits the strength of its session): the entity-level BM25 (max-scaled)
    plus the best dense score among its units (min-max)."""
    s, n, mask = t.snap, t.snap.n, t.mask
    b, d = t.found["bm25"], t.found.get("dense")
    elex, lexical = b.parts["entity"], b.parts["lexical"]
    ne = s.ne
    ent = np.zeros(ne)
    o2o = s.one_to_one()  # unit p is entity p: the same sums without mapping between them
    if o2o:
        if lexical:
            ent += _rank.maxnorm(elex, mask)
        if d is not None:
            vals = np.where(mask, d.scores, -np.inf)
            ok = np.isfinite(vals)
            ent += _rank.minmax(np.where(ok, vals, 0.0), ok)
    if lexical and not o2o:
        emask = np.zeros(ne, bool)
        emask[s.epos[:n][mask]] = True
        ent += _rank.maxnorm(elex, emask)
    if d is not None and not o2o:
        ap, starts, seg_e = s.segments()
        if len(ap):
            dv = d.scores
            # all units alive (the usual case): ap is 0..n-1, so take views instead of gathered copies
            vals = np.where(mask, dv, -np.inf) if len(ap) == n else np.where(mask[ap], dv[ap], -np.inf)
            # every entity one unit (a store of notes): each run is its one value
            seg_max = vals if len(starts) == len(vals) else np.maximum.reduceat(vals, starts)
            edense = np.zeros(ne)
            emask = np.zeros(ne, bool)
            ok = np.isfinite(seg_max)
            edense[seg_e[ok]] = seg_max[ok]
            emask[seg_e[ok]] = True
            ent += _rank.minmax(edense, emask)
    if lexical and _rank.LINK_PROPAGATION:
        ent += _propagated(t, elex)
    unit_ent = ent if o2o else ent[s.epos[:n]]
    return Channel("entity", unit_ent, unit_ent > 0)


def _propagated(t: Trip, elex: np.ndarray, top: int = 50) -> np.ndarray:
    """Lexical evidence of the best-matching entities, passed along their outgoing links (an event
    summary that matches points at its session): per target entity the best source score, max-normalised."""
    s = t.snap
    out = np.zeros(s.ne)
    if not elex.any():
        return out
    best = [int(p) for p in np.argsort(-elex)[:top] if elex[p] > 0]
    ids = [s.entity_id[p] for p in best]
    score_of = {s.entity_id[p]: elex[p] for p in best}
    for chunk in _rank.batches(ids):
        for src, dst in t.db.execute(f"select src, dst from links where src in ({','.join('?' * len(chunk))})",
                                     chunk):
            p = s.pos_of_id.get(dst)
            if p is not None:
                out[p] = max(out[p], score_of[src])
    hi = out.max()
    return out / hi if hi > 0 else out


def settle_dense(t: Trip) -> None:
    """The approximate dense channel made exact where the boolean channels (mention, time, category) found
    something; the entity channel has used the estimates."""
    d = t.found.get("dense")
    dq = d.parts["query"] if d is not None else None
    if dq is None or dq.exact is None:
        return
    n = t.snap.n
    found = np.zeros(n, bool)
    for name, ch in t.found.items():
        if name not in ("dense", "entity", "bm25"):
            found |= ch.present[:n]
    dq.make_exact(found & t.mask)


# ------------------------------------------------------------------ the trip

#: The order the units run in: the dense one waits for the worker, so the FTS5 reads come before it; the entity
#: channel needs both the lexical and the dense scores.
RUN = (bm25, mention, in_time, category, dense, entity)
#: The order fusion adds them in (a floating-point sum depends on it: the order the measurements were made with).
FUSED = ("bm25", "dense", "entity", "mention", "time", "category")


def run(q: Reading, t: Trip) -> list[Channel]:
    """Every channel of the query, in fusion order."""
    start_dense(q, t)
    for unit in RUN:
        ch = unit(q, t)
        if ch is not None:
            t.found[ch.name] = ch
    settle_dense(t)
    return [t.found[name] for name in FUSED if name in t.found]
