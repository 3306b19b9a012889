"""`SearchIndex`: hybrid search over an SMF store that never drifts from its files.

`Memory.search / reindex / doctor` delegate here. Every query first brings
the index up to date with the files (see _db.sync), then ranks units with
the channels of _rank, then (with `expand`) adds the link neighbourhood.
"""

from __future__ import annotations

import itertools
import sqlite3
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from types import MappingProxyType
from typing import Any, Iterable, Mapping

import numpy as np

from hutch._core.errors import ConfigError, SearchIndexError
from hutch.memory._index import _lexicon, _rank, _time, _units
from hutch.memory._index._db import IndexDB, SyncStats, file_digest
from hutch.memory._index._embed import default_provider

_FUSIONS = ("weighted", "rrf")
_POOL = None


def _is_damage(e: sqlite3.DatabaseError) -> bool:
    """Whether an SQLite error means the file is damaged (rebuild it), not that it is busy or a write lost a race."""
    if isinstance(e, sqlite3.IntegrityError):
        return False
    msg = str(e).lower()
    return not (isinstance(e, sqlite3.OperationalError) and ("locked" in msg or "busy" in msg))


def _pool():
    """One worker thread for the dense channel of a query (created on first use)."""
    global _POOL
    if _POOL is None:
        from concurrent.futures import ThreadPoolExecutor

        _POOL = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hutch-embed")
    return _POOL


@dataclass(frozen=True)
class Hit:
    """One search result: an entity (and for a conversation turn, the turn's anchor), its fused score,
    and what each channel said about it: `channels[name] = {"rank": r, "score": s}` (graph hits from
    `expand` carry `{"hops": n, "via": "<entity> -[rel]-> <entity>"}`)."""

    entity_id: str
    score: float
    channels: Mapping[str, Mapping[str, Any]]
    anchor: str | None = None
    _store: Any = field(default=None, repr=False, compare=False)

    @cached_property
    def entity(self):
        """The entity, read from its file (hutch.Entity)."""
        return self._store.get(self.entity_id)

    @property
    def text(self) -> str:
        """The hit's text: the turn for an anchored hit, else the entity's body."""
        e = self.entity
        if self.anchor:
            return e.section(self.anchor) or ""
        return e.body

    @property
    def speaker(self) -> str | None:
        """Who said an anchored turn (the name in its heading, `### D3:12 · Caroline`); None for other hits."""
        if not self.anchor:
            return None
        for heading in self.entity.sections:
            at, _, who = heading.partition(" · ")
            if at.strip() == self.anchor:
                return who.strip() or None
        return None

    def __repr__(self) -> str:
        at = f"#{self.anchor}" if self.anchor else ""
        return f"Hit({self.entity_id}{at}, score={self.score:.3f}, channels={sorted(self.channels)})"


@dataclass(frozen=True)
class IndexReport:
    """The exact state of a store's index (from doctor() or reindex())."""

    path: Path
    ok: bool
    entities: int
    units: int
    vectors: int
    pending_vectors: int
    model: str
    model_revision: str
    dim: int
    space_changed_from: str | None
    stale: tuple[str, ...]  # entity ids whose file differs from what the index holds
    missing: tuple[str, ...]  # files not in the index
    extra: tuple[str, ...]  # index entries whose file is gone
    unreadable: tuple[str, ...]  # files indexed as plain text because their front matter is malformed
    recovered: tuple[str, ...]  # when and why the index file was discarded and rebuilt
    embed_error: str | None = None  # the embedder's last failure (search then used the lexical channels only)
    seconds: float = 0.0
    lexicon: str | None = None  # the WordNet directory the category channel reads; None: that channel is off
    partial: tuple[str, ...] = ()  # files larger than UNIT_BYTES: only their start is units (the rest: words only)

    def lines(self) -> list[str]:
        """Human-readable report, one fact per line."""
        out = [f"index: {self.path}",
               f"state: {'ok' if self.ok else 'NOT OK'}",
               f"entities: {self.entities}  units: {self.units}",
               f"model: {self.model} rev {self.model_revision} dim {self.dim}",
               f"vectors: {self.vectors}  pending: {self.pending_vectors}"
               + ("  (dense channel off until done; run `hutch mem reindex`)" if self.pending_vectors else "")]
        if self.space_changed_from:
            out.append(f"vector space replaced; previous model: {self.space_changed_from}")
        for name in ("stale", "missing", "extra", "unreadable"):
            items = getattr(self, name)
            if items:
                out.append(f"{name}: {len(items)}: " + ", ".join(items[:10]) + (" ..." if len(items) > 10 else ""))
        if self.partial:
            out.append(f"partly indexed: {len(self.partial)}: " + ", ".join(self.partial[:10])
                       + (" ..." if len(self.partial) > 10 else "")
                       + f"  (past {_units.UNIT_BYTES >> 20} MiB by their words only, past "
                       f"{_units.LEXICAL_BYTES >> 20} MiB not at all: split such files)")
        for r in self.recovered:
            out.append(f"recovered: {r}")
        if self.embed_error:
            out.append(f"embedder failed: {self.embed_error}")
        out.append(f"lexicon: WordNet at {self.lexicon}" if self.lexicon else
                   "lexicon: none (category channel off: install Debian's wordnet-base, or set HUTCH_WORDNET_DIR)")
        return out


class SearchIndex:
    """The search index of one store. `provider` embeds texts (default: the local MiniLM model)."""

    def __init__(self, store: Any, provider: Any = None):
        self.store = store
        self.root = Path(store.root)
        self.provider = provider or default_provider()
        self.idx = IndexDB(self.root, self.provider)
        self.snap: _rank.Snapshot | None = None
        self.last_sync: SyncStats | None = None
        self._df: dict[str, int] = {}  # word -> units containing it (approximate; reset when the store grows 10%)
        self._df_n = 0
        self._sense_vecs: dict[str, np.ndarray] = {}  # WordNet sense text -> its vector (see _sense_ranker)

    # ------------------------------------------------------------ keeping fresh

    def refresh(self, *, embed_budget: float | None = 5.0) -> SyncStats:
        """Bring index and snapshot up to date with the files (cheap when nothing changed)."""
        for attempt in (1, 2):
            try:
                return self._refresh(embed_budget)
            except sqlite3.DatabaseError as e:
                if not _is_damage(e):
                    raise SearchIndexError(f"The search index {self.idx.path} is busy or refused a write ({e}): "
                                           "retry; if it persists, run `hutch mem doctor`.") from e
                if attempt == 2:
                    raise SearchIndexError(f"The search index {self.idx.path} cannot be used ({e}): delete the "
                                           "file and run `hutch mem reindex`.") from e
                self.idx.recover(e)
                self.snap = None
        raise AssertionError("unreachable")

    def _refresh(self, embed_budget):
        self.idx.open()
        before = self.idx.generation()
        stale_snapshot = self.snap is None or self.snap.gen != before
        mine = self.idx.own_bumps
        stats, removed, added = self.idx.sync(embed_budget=embed_budget)
        db = self.idx.db
        if int(self.idx.generation()) != int(before) + (self.idx.own_bumps - mine):
            stale_snapshot = True  # another process changed the index meanwhile: our patch would miss it
        dim = int(self.provider.dim) if self.idx.model_known else int(self.idx.meta("model_dim") or 0)
        if stale_snapshot or self.snap.dim != dim:
            snap = _rank.Snapshot(dim)
            snap.load_entities(db, None)
            snap.add_units(db, None)
            self.snap = snap
        elif stats.changed:
            snap = self.snap
            snap.remove_units(removed)
            if stats.removed:
                dead = set(stats.removed)
                for pos, entity_id in enumerate(snap.entity_id):
                    if entity_id in dead:
                        snap.e_alive[pos] = False
            ids = stats.reindexed
            eids = [r[0] for chunk in _rank._chunks(ids) for r in db.execute(
                f"select eid from files where entity_id in ({','.join('?' * len(chunk))})", chunk)]
            snap.load_entities(db, eids)
            snap.add_units(db, sorted(added))
            if stats.embedded:
                snap.fill_vectors(db)
        self.snap.gen = self.idx.generation()
        self.last_sync = stats
        return stats

    # ------------------------------------------------------------ search

    def search(self, query: str, *, k: int = 10, classes: Iterable[str] | str | None = None,
               since: Any = None, until: Any = None, as_of: Any = None, expand: int = 0,
               fusion: str = "weighted", now: Any = None) -> list[Hit]:
        """Hybrid search; see Memory.search."""
        if not isinstance(query, str) or not query.strip():
            raise ConfigError("search() needs a non-empty query string, e.g. mem.search('customer churn').")
        if not isinstance(k, int) or k < 1:
            raise ConfigError(f"k={k!r} is not a positive integer: ask for at least one hit, e.g. k=10.")
        if not isinstance(expand, int) or not 0 <= expand <= 3:
            raise ConfigError(f"expand={expand!r} must be 0..3 (hops over links from each hit).")
        if fusion not in _FUSIONS:
            raise ConfigError(f"fusion={fusion!r} is unknown: use one of {', '.join(_FUSIONS)}.")
        if isinstance(classes, str):
            classes = [classes]
        since_t = _units.epoch_of(since, "since")
        until_t = _units.epoch_of(until, "until")
        as_of_t = _units.epoch_of(as_of, "as_of")
        now_t = _units.epoch_of(now, "now")
        # what "last week" in the question is read against: as_of if given, else now (default: the clock)
        ref = as_of_t if as_of_t is not None else now_t if now_t is not None else time.time()
        self.refresh()
        try:
            return self._search(query, k, classes, since_t, until_t, as_of_t, expand, fusion, ref)
        except sqlite3.DatabaseError as e:
            if not _is_damage(e):
                raise SearchIndexError(f"The search index {self.idx.path} is busy ({e}): retry the query.") from e
            self.idx.recover(e)
            self.snap = None
            self.refresh()
            return self._search(query, k, classes, since_t, until_t, as_of_t, expand, fusion, ref)

    def _lexical_terms(self, query: str) -> list[str]:
        """The query's content words minus those too common to discriminate (see _rank.MAX_DF_SHARE)."""
        words = _units.terms(query)
        n = len(self.snap.upos)
        if n < _rank.MIN_UNITS_FOR_DF or not words:
            return words
        if abs(n - self._df_n) > 0.1 * max(self._df_n, 1):
            self._df, self._df_n = {}, n
        db = self.idx.db
        for w in words:
            if w not in self._df:
                self._df[w] = db.execute("select count(*) from units_fts where units_fts match ?",
                                         (_units.fts_query([w]),)).fetchone()[0]
        # If every word is that common, the lexical channels have nothing to say: dense and the rest answer.
        return [w for w in words if self._df[w] <= _rank.MAX_DF_SHARE * n]

    def _mask(self, classes, since_t, until_t, as_of_t) -> np.ndarray:
        s = self.snap
        n = s.n
        mask = s.alive[:n].copy()
        ep = s.epos[:n]
        mask &= s.e_alive[:s.ne][ep] if s.ne else False
        if classes is not None:
            wanted = set(classes)
            ok = np.array([c in wanted for c in s.ecls], bool)
            mask &= ok[ep]
        if as_of_t is not None:
            tf, tt = s.t_from[:s.ne][ep], s.t_to[:s.ne][ep]
            mask &= (np.isnan(tf) | (tf <= as_of_t)) & (np.isnan(tt) | (as_of_t < tt))
        if since_t is not None or until_t is not None:
            # a unit's time is its entity's valid_from (else recorded_at, else created); none -> filtered out
            tr = s.t_rec[:s.ne][ep]
            ok = ~np.isnan(tr)
            if since_t is not None:
                ok &= np.nan_to_num(tr, nan=-np.inf) >= since_t
            if until_t is not None:
                ok &= np.nan_to_num(tr, nan=np.inf) <= until_t
            mask &= ok
        return mask

    def _search(self, query, k, classes, since_t, until_t, as_of_t, expand, fusion, ref=None) -> list[Hit]:
        s = self.snap
        db = self.idx.db
        n = s.n
        if n == 0:
            return []
        mask = self._mask(classes, since_t, until_t, as_of_t)
        if not mask.any():
            return []
        channels: list[_rank.Channel] = []
        eidpos = s.eid_pos
        # mentions first: the dense query is the question without the names it mentions
        mentioned, titles = self._mentions(query)
        dense_on = self.idx.model_known and s.dense_ready()
        future = vecs = None
        if dense_on:
            # Embedding and the matrix product release the GIL: they overlap the FTS5 queries below.
            qtext = _units.strip_mentions(query, titles) if titles else query
            # the category channel compares the whole question with its word's senses: embed it there too
            full = query if qtext != query and _lexicon.ranks_senses(query) else None
            vecs = Future()
            future = _pool().submit(self._dense_scores, qtext, mask, vecs, full)
        words = self._lexical_terms(query)
        fq = _units.fts_query(words)
        # lexical, per unit
        few = sum(self._df.get(w, _rank.LEXICAL_LIMIT + 1) for w in words) <= _rank.LEXICAL_LIMIT
        lex = lex_words = self._unit_bm25(fq, n, few)
        pairs = _units.phrases(query, titles)
        if pairs:
            # the sequential dependence model: "pottery class" as a phrase and within a window counts beyond
            # "pottery" and "class" apart (LoCoMo dev R@10 84.8 -> 85.3, docs/retrieval.md). A phrase is specific
            # even with a common word in it ("dance studio"); a window around a common word is not, and scanning
            # it is what costs (p99 40 against 3 ms at 100,000 units): the window drops them, like `words`.
            kept = set(words)
            near = [(a, b) for a, b in pairs if a in kept and b in kept]
            w_word, w_phrase, w_window = _rank.SDM_WEIGHTS
            lex = (w_word * lex + w_phrase * self._unit_bm25(_units.fts_phrase_query(pairs), n, True)
                   + w_window * self._unit_bm25(_units.fts_phrase_query(near, _rank.SDM_WINDOW), n, True))
        # the words of large files past their units: the entity's best chunk, for its sole unit here too
        chunks = self._chunk_bm25(fq) if fq else {}
        if chunks:
            sole = s.sole_units()[:n]
            best = np.zeros(s.ne)
            best[list(chunks)] = list(chunks.values())
            lex = np.maximum(lex, np.where(sole >= 0, best[np.maximum(sole, 0)], 0.0))
        channels.append(_rank.Channel("bm25", lex, lex > 0))
        # entity level, lexical part (the dense part needs the dense scores)
        ne = s.ne
        elex = np.zeros(ne)
        if fq:
            for eid, score in db.execute(
                    f"select rowid, -bm25(ent_fts) from ent_fts where ent_fts match ? order by bm25(ent_fts) "
                    f"limit {_rank.LEXICAL_LIMIT}", (fq,)):
                p = eidpos.get(eid)
                if p is not None:
                    elex[p] = score
            # an entity of one unit is not in ent_fts (its text is its unit's): the unit's BM25 over the same words
            # (repeating it at entity level cost ~5-7 ms per question at 100,000 one-unit entities)
            hit = np.flatnonzero(lex_words > 0)
            ent_of = s.sole_units()[hit]
            one = ent_of >= 0
            elex[ent_of[one]] = lex_words[hit[one]]
            for p, score in chunks.items():
                elex[p] = max(elex[p], score)
        # the channels that need no dense scores, while the worker computes them (added below, in this order)
        boost = self._mention_units(mentioned, titles) if mentioned else None
        span = _time.find(query, ref)
        tin = self._in_span(span) if span is not None else None
        cat_dense, qvec = dense_on, None  # qvec: the question's own vector once embedded (see _sense_ranker)
        if vecs is not None:
            try:
                qv, fv = vecs.result()
                qvec = qv if qtext == query else fv
            except SearchIndexError:
                cat_dense = False  # the dense channel is off (below): senses are ranked as without a model
        cat = self._category(query, n, cat_dense, qvec)
        dense, dq = np.zeros(n), None
        if future is not None:
            try:
                dq = future.result()
                dense = dq.values
            except SearchIndexError as e:
                self.idx.embed_error = str(e)
                dense_on = False
        o2o = s.one_to_one()  # unit p is entity p: the same sums below without mapping between them
        if dense_on:
            if dq.exact is not None:  # approximate dense channel (large store): exact where BM25 found something
                dq.make_exact((lex > 0) | ((elex > 0) if o2o else (elex > 0)[s.epos[:n]]))
            channels.append(_rank.Channel("dense", dense, mask.copy(), zero_based=False, moments=dq.moments))
        # entity level: BM25 over the whole entity + its best unit's dense score
        ent = np.zeros(ne)
        if o2o:
            if fq:
                ent += _rank.maxnorm(elex, mask)
            if dense_on:
                vals = np.where(mask, dense, -np.inf)
                ok = np.isfinite(vals)
                ent += _rank.minmax(np.where(ok, vals, 0.0), ok)
        if fq and not o2o:
            emask = np.zeros(ne, bool)
            emask[s.epos[:n][mask]] = True
            ent += _rank.maxnorm(elex, emask)
        if dense_on and not o2o:
            ap, starts, seg_e = s.segments()
            if len(ap):
                # all units alive (the usual case): ap is 0..n-1, so take views instead of gathered copies
                vals = (np.where(mask, dense, -np.inf) if len(ap) == n else
                        np.where(mask[ap], dense[ap], -np.inf))
                # every entity one unit (a store of notes): each run is its one value
                seg_max = vals if len(starts) == len(vals) else np.maximum.reduceat(vals, starts)
                edense = np.zeros(ne)
                emask = np.zeros(ne, bool)
                ok = np.isfinite(seg_max)
                edense[seg_e[ok]] = seg_max[ok]
                emask[seg_e[ok]] = True
                ent += _rank.minmax(edense, emask)
        if fq and _rank.LINK_PROPAGATION:
            ent += self._propagated(elex)
        unit_ent = ent if o2o else ent[s.epos[:n]]
        channels.append(_rank.Channel("entity", unit_ent, unit_ent > 0))
        if boost is not None:
            hit = boost & mask
            if 0 < hit.sum() < mask.sum():
                channels.append(_rank.Channel("mention", boost.astype(np.float64), boost))
        if tin is not None:
            if 0 < (tin & mask).sum() < mask.sum():
                channels.append(_rank.Channel("time", tin.astype(np.float64), tin))
        if cat is not None and (cat > 0).any():
            channels.append(_rank.Channel("category", cat, cat > 0))
        if dq is not None and dq.exact is not None:
            # ... and where the boolean channels found something (the entity channel used the estimates)
            found = np.zeros(n, bool)
            for ch in channels:
                if ch.name not in ("dense", "entity", "bm25"):
                    found |= ch.present[:n]
            dq.make_exact(found & mask)
        score = _rank.fuse(channels, mask, fusion)
        top = _rank.top_k(score, mask, k)
        per_channel = {}
        for ch in channels:
            found = [p for p in top if ch.present[p]]
            if found:
                per_channel[ch.name] = dict(zip(found, _rank.ranks_of(ch.scores, mask & ch.present, found)))
        hits = []
        for p in top:
            chans = {}
            for ch in channels:
                if p in per_channel.get(ch.name, ()):
                    chans[ch.name] = MappingProxyType({
                        "rank": per_channel[ch.name][p], "score": round(float(ch.scores[p]), 6)})
            hits.append(Hit(s.entity_id[s.epos[p]], round(float(score[p]), 6), MappingProxyType(chans),
                            s.anchor[p], self.store))
        if expand:
            hits += self._expand(hits, expand, mask, classes)
        return hits

    def _in_span(self, span: _time.TimeSpan) -> np.ndarray:
        """Units whose time (their entity's valid_from, else recorded_at, else created) is inside the span,
        or whose event time (a turn's "yesterday", read against its session) overlaps it."""
        s = self.snap
        n = s.n
        tr = s.t_rec[:s.ne][s.epos[:n]]
        with np.errstate(invalid="ignore"):  # NaN (no time) compares False
            inside = (tr >= span.start) & (tr < span.end)
            return inside | ((s.ev_from[:n] < span.end) & (s.ev_to[:n] > span.start))

    def _propagated(self, elex: np.ndarray, top: int = 50) -> np.ndarray:
        """Lexical evidence of the best-matching entities, passed along their outgoing links (an event
        summary that matches points at its session): per target entity the best source score, max-normalised."""
        s = self.snap
        out = np.zeros(s.ne)
        if not elex.any():
            return out
        best = np.argsort(-elex)[:top]
        best = [int(p) for p in best if elex[p] > 0]
        ids = [s.entity_id[p] for p in best]
        score_of = {s.entity_id[p]: elex[p] for p in best}
        for chunk in _rank._chunks(ids):
            for src, dst in self.idx.db.execute(
                    f"select src, dst from links where src in ({','.join('?' * len(chunk))})", chunk):
                p = s.pos_of_id.get(dst)
                if p is not None:
                    out[p] = max(out[p], score_of[src])
        hi = out.max()
        return out / hi if hi > 0 else out

    def _chunk_bm25(self, fq: str) -> dict[int, float]:
        """{entity position: BM25 of its best chunk} over the words of large files past their units (_db: chunks)."""
        db = self.idx.db
        if not db.execute("select 1 from chunks limit 1").fetchone():
            return {}
        eidpos = self.snap.eid_pos
        out: dict[int, float] = {}
        for eid, score in db.execute(
                "select c.eid, -bm25(chunks_fts) from chunks_fts join chunks c on c.cid = chunks_fts.rowid "
                f"where chunks_fts match ? order by bm25(chunks_fts) limit {_rank.LEXICAL_LIMIT}", (fq,)):
            p = eidpos.get(eid)
            if p is not None and score > out.get(p, 0.0):
                out[p] = score
        return out

    def _unit_bm25(self, fq: str | None, n: int, few: bool = False) -> np.ndarray:
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
            rows = self.idx.db.execute(f"select rowid, {bm} from units_fts where units_fts match ? limit {limit + 1}",
                                       (fq,)).fetchall()
            if len(rows) > limit:
                rows = None
        if rows is None:
            rows = self.idx.db.execute(f"select rowid, {bm} as s from units_fts where units_fts match ? order by s "
                                       f"limit {limit}", (fq,)).fetchall()
        if rows:
            uid, bm = np.fromiter(itertools.chain.from_iterable(rows), np.float64, 2 * len(rows)).reshape(-1, 2).T
            p = self.snap.positions(uid.astype(np.int64))
            ok = (p >= 0) & (p < n)
            out[p[ok]] = -bm[ok]
        return out

    def _dense_scores(self, qtext: str, mask: np.ndarray, vecs: Future | None = None,
                      full: str | None = None) -> _rank.DenseQuery:
        """The dense channel (run in the worker). `vecs` gets (qtext's vector, `full`'s or None) as soon as they are
        embedded, before the channel is computed: the category channel needs only those."""
        try:
            qv = self.provider.embed([qtext])[0].astype(np.float32)
        except BaseException as e:
            if vecs is not None:
                vecs.set_exception(e)
            raise
        fv = None
        if full is not None:
            try:
                fv = self.provider.embed([full])[0]
            except SearchIndexError:
                pass  # the sense ranker tries again itself, and without it takes the most frequent sense
        if vecs is not None:
            vecs.set_result((qv, fv))
        return _rank.DenseQuery(self.snap, qv, mask)

    def _category(self, query: str, n: int, dense_on: bool, qvec: np.ndarray | None = None) -> np.ndarray | None:
        """BM25 of the instances of the category a list question asks about ("What martial arts has John
        done?" -> taekwondo, judo, ...; see _lexicon), or None when the question names no category."""
        found = _lexicon.category_terms(query, self._sense_ranker(dense_on, qvec))
        if found is None:
            return None
        words = self._within_budget(found[1])
        # the words' units add up to at most LEXICAL_LIMIT (unless the rarest alone has more): read unsorted
        return self._unit_bm25(_units.fts_query(words), n, True) if words else None

    def _within_budget(self, words: list[str]) -> list[str]:
        """The words the store has, rarest first, while the units they are in add up to at most LEXICAL_LIMIT.

        A category lists up to 1,000 instance words; FTS5 scores every unit that holds any of them before it
        keeps the best LEXICAL_LIMIT, so common instance words ("piano" in 3% of 100,000 units) cost ~17 ms
        per question and can only crowd out the specific ones. Document frequencies come from FTS5's own
        vocabulary (the words go through the same porter tokenizer in a temp table): ~2 ms, so the answer is kept
        until the index changes (a category's words are asked again in every question about it)."""
        s = self.snap
        if s is None:
            return self._rarest_within_budget(words)
        key = ("budget", s.gen, _rank.LEXICAL_LIMIT, tuple(words))
        if key not in s.memo:
            if len(s.memo) >= 256 or any(k[1] != s.gen for k in s.memo):
                s.memo.clear()
            s.memo[key] = self._rarest_within_budget(words)
        return list(s.memo[key])

    def _rarest_within_budget(self, words: list[str]) -> list[str]:
        db = self.idx.db
        db.execute("create virtual table if not exists temp.hutch_stem using fts5(x, tokenize='porter unicode61')")
        db.execute("create virtual table if not exists temp.hutch_stem_v using fts5vocab('temp', 'hutch_stem', "
                   "'instance')")
        db.execute("create virtual table if not exists temp.hutch_units_v using fts5vocab('main', 'units_fts', 'row')")
        db.execute("delete from temp.hutch_stem")
        db.execute("insert into temp.hutch_stem(rowid, x) values (1, ?)", (" ".join(words),))
        stem = {off: term for term, off in db.execute("select term, offset from temp.hutch_stem_v")}
        terms = sorted(set(stem.values()))
        df: dict[str, int] = {}
        for chunk in _rank._chunks(terms):
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

    def _sense_ranker(self, dense_on: bool, qvec: np.ndarray | None = None):
        """Which of a word's senses a question means: the gloss the embedding model puts closest to the question
        (sense vectors are cached per process); WordNet's most frequent sense when there is no model. `qvec`: the
        question's vector when the dense channel already embedded it (alone, as here: the same vector)."""
        def rank(question: str, texts: list[str]) -> int:
            if not dense_on:
                return 0
            missing = [t for t in texts if t not in self._sense_vecs]
            if missing or qvec is None:
                try:
                    vecs = self.provider.embed([question, *missing])
                except SearchIndexError:
                    return 0
                self._sense_vecs.update(zip(missing, vecs[1:]))
                q = vecs[0]
            else:
                q = qvec  # embedding the question again cost ~5 ms per list question on the main thread
            return int(np.argmax([float(self._sense_vecs[t] @ q) for t in texts]))
        return rank

    def _mentions(self, query: str) -> tuple[set[str], list[str]]:
        """(ids of entities the query names, the names as written and in full)."""
        grams = _units.ngrams(query)
        caps = _units.capitalised(query)
        if not grams and not caps:
            return set(), []
        db = self.idx.db
        q = "select t.norm, f.entity_id, f.title from titles t join files f on f.eid = t.eid where t.partial = ? and t.norm in ({})"
        rows = db.execute(q.format(",".join("?" * len(grams))), [0, *grams]).fetchall() if grams else []
        if caps:
            # a first name shared by many entities names none of them
            common = {r[0] for r in db.execute(
                f"select norm from titles where partial = 1 and norm in ({','.join('?' * len(caps))}) "
                f"group by norm having count(*) > {_rank.MAX_NAME_SHARERS}", caps)}
            caps = [c for c in caps if c not in common]
            if caps:
                rows += db.execute(q.format(",".join("?" * len(caps))), [1, *caps]).fetchall()
        names = {r[0] for r in rows} | {_units.norm_title(r[2] or "") for r in rows}
        return {r[1] for r in rows}, sorted(n for n in names if n)

    def _mention_units(self, mentioned: set[str], titles: list[str]) -> np.ndarray:
        """Units related to a mentioned entity: turns spoken by it; other units that are it or link to/from it."""
        s = self.snap
        n = s.n
        names = set(titles)
        related = set(mentioned)
        ids = list(mentioned)
        for chunk in _rank._chunks(ids):
            q = ",".join("?" * len(chunk))
            related.update(r[0] for r in self.idx.db.execute(f"select src from links where dst in ({q})", chunk))
            related.update(r[0] for r in self.idx.db.execute(f"select dst from links where src in ({q})", chunk))
        ent_ok = np.zeros(s.ne, bool)
        ent_ok[[s.pos_of_id[e] for e in related if e in s.pos_of_id]] = True
        codes = [s.speaker_code[nm] for nm in names if nm in s.speaker_code]
        spoke = np.isin(s.speaker[:n], codes) if codes else np.zeros(n, bool)
        turn = s.is_turn[:n]
        return np.where(turn, spoke, ent_ok[s.epos[:n]])

    def _expand(self, hits: list[Hit], hops: int, mask: np.ndarray, classes) -> list[Hit]:
        """Entities linked (either direction) to the hits, up to `hops` away, scored down by distance."""
        seen = {h.entity_id for h in hits}
        frontier = [(h.entity_id, h.score) for h in hits]
        wanted = set(classes) if classes else None
        out: list[Hit] = []
        db = self.idx.db
        for hop in range(1, hops + 1):
            nxt = []
            for src, base in frontier:
                rows = [(src, rel, dst) for rel, dst in db.execute("select rel, dst from links where src=?", (src,))]
                rows += [(s_, rel, src) for s_, rel in db.execute("select src, rel from links where dst=?", (src,))]
                for a, rel, b in rows:
                    other = b if a == src else a
                    if other in seen or not (self.root / f"{other}.md").is_file():
                        continue
                    if wanted and other.split("/", 1)[0] not in wanted:
                        continue
                    seen.add(other)
                    sc = round(base * 0.5 ** hop, 6)
                    out.append(Hit(other, sc, MappingProxyType({"graph": MappingProxyType(
                        {"hops": hop, "via": f"{a} -[{rel}]-> {b}"})}), None, self.store))
                    nxt.append((other, sc))
            frontier = nxt
        return out

    # ------------------------------------------------------------ maintenance

    def reindex(self, *, full: bool = False) -> IndexReport:
        """Bring the index fully up to date, embedding everything pending. `full=True` starts from an empty file."""
        if full:
            self.idx._discard("reindex(full=True) was asked for")
            self.idx.recovered.pop()
            self.snap = None
        self.refresh(embed_budget=None)
        return self.doctor()

    def doctor(self) -> IndexReport:
        """Verify the index against the files without changing either: every file's stat and, where they
        differ, its hash; the model identity; vectors pending. (An unreadable index file is rebuilt first.)"""
        t0 = time.perf_counter()
        try:
            self.idx.open()
            db = self.idx.db
            files, linkdirs = self.idx.scan()
            rows = {r[0]: r[1:] for r in db.execute("select entity_id, mtime_ns, size, hash, linkstamp, error from files")}
        except sqlite3.DatabaseError as e:
            self.idx.recover(e)
            self.snap = None
            return self.doctor()
        stale, missing = [], []
        for entity_id, (path, mtime, size) in sorted(files.items()):
            row = rows.get(entity_id)
            if row is None:
                missing.append(entity_id)
                continue
            if (row[0], row[1]) != (mtime, size):
                try:
                    with open(path, "rb") as f:
                        digest = file_digest(f)
                except OSError:
                    digest = None
                if digest != row[2]:
                    stale.append(entity_id)
                    continue
            ls = linkdirs[entity_id][1] if entity_id in linkdirs else None
            if ls != row[3]:
                stale.append(entity_id)
        extra = sorted(e for e in rows if e not in files)
        unreadable = sorted(e for e, r in rows.items() if r[4])
        partial = sorted(e for e, (_, size, *_) in rows.items() if size is not None and size > _units.UNIT_BYTES)
        name, rev, dim = (self.idx.model_identity() if self.idx.model_known else
                          (self.idx.meta("model_name") or "?", self.idx.meta("model_revision") or "?",
                           int(self.idx.meta("model_dim") or 0)))
        units = db.execute("select count(*) from units").fetchone()[0]
        vectors = db.execute("select count(*) from vectors").fetchone()[0]
        pending = db.execute("select count(distinct u.dense_hash) from units u left join vectors v "
                             "on v.dense_hash = u.dense_hash where v.dense_hash is null").fetchone()[0]
        ok = not (stale or missing or extra or pending or self.idx.embed_error)
        return IndexReport(self.idx.path, ok, len(rows), units, vectors, pending, name, rev, dim,
                           self.idx.meta("space_changed_from"), tuple(stale), tuple(missing), tuple(extra),
                           tuple(unreadable), tuple(self.idx.recovered), self.idx.embed_error,
                           time.perf_counter() - t0, str(wn.root) if (wn := _lexicon.wordnet()) else None,
                           tuple(partial))

    def close(self) -> None:
        self.idx.close()
        self.snap = None
