"""Ranking: an in-memory snapshot of the index (arrays + the vector matrix) and the fused score.

Channels (each scaled to about 0..1 over the candidates: the zero-based ones by their best
score, the dense one by its distribution, mean +- 3 sd; then added with equal weight;
docs/retrieval.md has the measurements behind every choice):

- `bm25`:    FTS5 BM25 over the unit's text (weight 1) and its context (0.3); with pairs of adjacent content
             words in the question, mixed with the BM25 of those pairs as phrases and within a window
             (the sequential dependence model, SDM_WEIGHTS);
- `dense`:   cosine of the query (named entities stripped) and the unit's embedded text;
- `entity`:  the unit's whole entity: BM25 over the entity text + the best dense score of its units
             (a turn inherits the strength of its session);
- `mention`: the question names an entity (by title): units spoken by it, about it or linked to it;
- `time`:    the question names a date, month or year: units whose time falls in it.

The alternative fusion, reciprocal rank fusion, is kept for comparison (`fusion="rrf"`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np

from hutch.memory._index import _units

#: Weight of the unit's context column (neighbouring turns) in BM25 relative to its own text.
CONTEXT_WEIGHT = 0.3
#: The bm25 channel when the question has adjacent content words: single words, the pairs as phrases, the pairs
#: within SDM_WINDOW tokens (Metzler & Croft's sequential dependence model, their published default weights and
#: window; not tuned here: 0.8/0.1/0.1 and 0.7/0.2/0.1 gave the same LoCoMo dev R@10, docs/retrieval.md).
SDM_WEIGHTS = (0.85, 0.1, 0.05)
SDM_WINDOW = 8
#: FTS5 rows read per lexical channel (BM25 ranks beyond this add nothing to a top-k list).
LEXICAL_LIMIT = 2000
RRF_K = 60
#: A query word found in more than this share of units is dropped from the lexical query: its BM25 weight
#: (idf) is near zero, and scoring every unit that contains it is what makes FTS5 slow at scale.
MAX_DF_SHARE = 0.2
#: A capitalised word that is part of more titles than this is not taken as naming any of them.
MAX_NAME_SHARERS = 20
#: Pass entity-level BM25 along outgoing links into the entity channel (see _channels._propagated). Off:
#: on the LoCoMo dev set it moved R@5 75.7 -> 75.8 and R@10 83.2 -> 83.2 (docs/retrieval.md), so not worth a query.
LINK_PROPAGATION = False
#: The dense channel's scale: mean +- this many standard deviations maps to 0..1 (see dist_norm).
DIST_SD = 3.0
#: Below this many units every word is kept (shares are meaningless in tiny stores).
MIN_UNITS_FOR_DF = 200
#: Above this many candidate units the dense channel is approximate (see DenseQuery); up to it every cosine is
#: computed, so small stores (a LoCoMo conversation is ~500 units) answer exactly.
APPROX_MIN_UNITS = 30_000
#: Units the approximate path shortlists by Hamming distance for their exact cosine (n / 25 if that is more).
SHORTLIST = 4000
#: Candidate units, at a fixed stride, whose exact cosines give the approximate dense channel its mean and sd.
SAMPLE = 2048
#: At most this many units found by other channels get their exact cosine afterwards (nearest by Hamming first).
EXTRA_EXACT = 6000


class Snapshot:
    """Arrays over the alive units, patched in place as the index changes (rows are never moved)."""

    def __init__(self, dim: int):
        self.dim = dim
        self.n = 0
        self.cap = 0
        self.gen: str | None = None
        self.memo: dict[tuple, object] = {}  # answers of the index's current generation (keys start (name, gen))
        self.uid = np.zeros(0, np.int64)
        self.epos = np.zeros(0, np.int64)
        self.alive = np.zeros(0, bool)
        self.has_vec = np.zeros(0, bool)
        self.V = np.zeros((0, dim), np.float32)
        self.bits: np.ndarray | None = None  # sign bits of V - center, (words, cap) uint64; built by binary()
        self.center = np.zeros(dim, np.float32)
        self.speaker = np.zeros(0, np.int64)  # code of the normalised speaker name, -1 for none
        self.speaker_code: dict[str, int] = {}
        self.ev_from = np.zeros(0)  # the time a turn speaks of ("yesterday" in a session of 8 May), NaN: none
        self.ev_to = np.zeros(0)
        self.anchor: list[str | None] = []
        self.hash: list[str] = []
        self.upos: dict[int, int] = {}
        self.uid_pos = np.zeros(0, np.int64)  # upos as an array: uid -> position of its alive unit, -1 for none
        # entities
        self.ne = 0
        self.eid_pos: dict[int, int] = {}
        self.pos_of_id: dict[str, int] = {}
        self.entity_id: list[str] = []
        self.ecls: list[str] = []
        self.e_alive = np.zeros(0, bool)
        self.e_bad = np.zeros(0, bool)  # its front matter is malformed: search leaves it out (see SearchIndex)
        self.t_from = np.zeros(0)
        self.t_to = np.zeros(0)
        self.t_rec = np.zeros(0)
        self.is_turn = np.zeros(0, bool)

    def _grow(self, need: int) -> None:
        if need <= self.cap:
            return
        cap = max(need, 2 * self.cap, 1024)
        for name, fill in (("uid", 0), ("epos", 0), ("alive", False), ("has_vec", False), ("is_turn", False),
                           ("speaker", -1), ("ev_from", np.nan), ("ev_to", np.nan)):
            old = getattr(self, name)
            new = np.full(cap, fill, dtype=old.dtype)
            new[:len(old)] = old
            setattr(self, name, new)
        V = np.zeros((cap, self.dim), np.float32)
        V[:self.V.shape[0]] = self.V
        self.V = V
        if self.bits is not None:
            bits = np.zeros((self.bits.shape[0], cap), np.uint64)
            bits[:, :self.bits.shape[1]] = self.bits
            self.bits = bits
        self.cap = cap

    def _grow_entities(self, need: int) -> None:
        if need <= len(self.e_alive):
            return
        cap = max(need, 2 * len(self.e_alive), 256)
        for name, fill in (("e_alive", False), ("e_bad", False), ("t_from", np.nan), ("t_to", np.nan),
                           ("t_rec", np.nan)):
            old = getattr(self, name)
            new = np.full(cap, fill, dtype=old.dtype)
            new[:len(old)] = old
            setattr(self, name, new)

    def load_entities(self, db, eids: list[int] | None) -> None:
        q = "select eid, entity_id, cls, t_from, t_to, t_rec, error is not null from files"
        rows = db.execute(q).fetchall() if eids is None else [
            r for chunk in batches(eids) for r in db.execute(q + f" where eid in ({','.join('?' * len(chunk))})", chunk)]
        for eid, entity_id, cls, tf, tt, tr, bad in rows:
            pos = self.eid_pos.get(eid)
            if pos is None:
                pos = self.ne
                self._grow_entities(pos + 1)
                self.eid_pos[eid] = pos
                self.pos_of_id[entity_id] = pos
                self.entity_id.append(entity_id)
                self.ecls.append(cls)
                self.ne += 1
            self.e_alive[pos] = True
            self.e_bad[pos] = bool(bad)
            self.t_from[pos] = np.nan if tf is None else tf
            self.t_to[pos] = np.nan if tt is None else tt
            self.t_rec[pos] = np.nan if tr is None else tr

    def forget_entities(self, entity_ids: set[str]) -> None:
        """Entities deleted from the index: dead, and their eids forgotten, because SQLite hands a deleted row's
        eid to the next entity inserted; kept, it would bring the deleted entity's name back with it."""
        dead = {self.pos_of_id.pop(e) for e in entity_ids if e in self.pos_of_id}
        for pos in dead:
            self.e_alive[pos] = False
        for eid in [eid for eid, pos in self.eid_pos.items() if pos in dead]:
            del self.eid_pos[eid]

    def drop_entities(self, eids: list[int]) -> None:
        for eid in eids:
            pos = self.eid_pos.get(eid)
            if pos is not None:
                self.e_alive[pos] = False

    def add_units(self, db, uids: list[int] | None) -> None:
        """Append units (all of them when `uids` is None) with their vectors, in uid order.

        Vectors are read once per distinct text and gathered with numpy: a per-row loop over
        100,000 blobs took seconds on a process's first query."""
        q = "select uid, eid, anchor, speaker, dense_hash, ev_from, ev_to from units"
        rows = db.execute(q + " order by uid").fetchall() if uids is None else sorted(
            r for chunk in batches(sorted(uids)) for r in db.execute(
                q + f" where uid in ({','.join('?' * len(chunk))})", chunk))
        rows = [r for r in rows if r[0] not in self.upos and r[1] in self.eid_pos]
        if not rows:
            return
        start, m = self.n, len(rows)
        self._grow(start + m)
        sl = slice(start, start + m)
        uid_l, eid_l, anchor_l, speaker_l, hash_l, evf_l, evt_l = (list(c) for c in zip(*rows))
        self.uid[sl] = uid_l
        self.epos[sl] = [self.eid_pos[e] for e in eid_l]
        self.alive[sl] = True
        self.ev_from[sl] = [np.nan if v is None else v for v in evf_l]
        self.ev_to[sl] = [np.nan if v is None else v for v in evt_l]
        self.is_turn[sl] = [a is not None and sp is not None for a, sp in zip(anchor_l, speaker_l)]
        codes = self.speaker_code
        self.speaker[sl] = [codes.setdefault(_units.norm_title(sp), len(codes)) if sp else -1 for sp in speaker_l]
        self.anchor.extend(anchor_l)
        self.hash.extend(hash_l)
        self.upos.update(zip(uid_l, range(start, start + m)))
        top = max(uid_l) + 1
        if top > len(self.uid_pos):
            grown = np.full(max(top, 2 * len(self.uid_pos), 1024), -1, np.int64)
            grown[:len(self.uid_pos)] = self.uid_pos
            self.uid_pos = grown
        self.uid_pos[uid_l] = np.arange(start, start + m)
        self.n += m
        self._load_vectors(db, np.arange(start, start + m))

    def _load_vectors(self, db, positions: np.ndarray) -> None:
        """Fill V and has_vec at `positions` from the vectors table (by the units' text hashes)."""
        wanted = sorted({self.hash[p] for p in positions})
        if len(wanted) > 5000:
            got = db.execute("select dense_hash, vec from vectors").fetchall()
        else:
            got = [r for chunk in batches(wanted) for r in db.execute(
                f"select dense_hash, vec from vectors where dense_hash in ({','.join('?' * len(chunk))})", chunk)]
        got = [(h, v) for h, v in got if len(v) == 4 * self.dim]
        if not got:
            return
        row_of = {h: i for i, (h, _) in enumerate(got)}
        mat = np.frombuffer(b"".join(v for _, v in got), np.float32).reshape(len(got), self.dim)
        idx = np.array([row_of.get(self.hash[p], -1) for p in positions], np.int64)
        ok = idx >= 0
        self.V[positions[ok]] = mat[idx[ok]]
        self.has_vec[positions[ok]] = True
        if self.bits is not None:
            self._set_bits(positions[ok])

    def binary(self) -> np.ndarray:
        """The sign bits of the approximate dense path, (words, cap) uint64: bit j of a unit is whether its vector
        exceeds the mean vector (`center`) in dimension j. Word-major, so that a Hamming distance is a few passes
        over contiguous memory. Built on first use (the mean fixed then), patched with V afterwards."""
        if self.bits is None:
            n = self.n
            have = self.has_vec[:n]
            if have.any():
                self.center = (have.astype(np.float32) @ self.V[:n]) / np.float32(have.sum())
            self.bits = np.zeros((_words(self.dim), self.cap), np.uint64)
            for s in range(0, n, 8192):  # slices, not a gather: 100,000 units in ~0.1-0.3 s
                e = min(n, s + 8192)
                self.bits[:, s:e] = _pack(self.V[s:e], self.center).T
        return self.bits

    def _set_bits(self, positions: np.ndarray) -> None:
        for s in range(0, len(positions), 8192):
            p = positions[s:s + 8192]
            self.bits[:, p] = _pack(self.V[p], self.center).T

    def remove_units(self, uids) -> None:
        for uid in uids:
            p = self.upos.pop(uid, None)
            if p is not None:
                self.alive[p] = False
                self.uid_pos[uid] = -1

    def fill_vectors(self, db) -> None:
        """Load vectors for alive units that have none yet (after embedding caught up)."""
        need = np.nonzero(self.alive[:self.n] & ~self.has_vec[:self.n])[0]
        if len(need):
            self._load_vectors(db, need)

    def segments(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(alive positions, start of each entity's run among them, entity position of each run).

        An entity's units are always appended together and die together, so its alive units are
        one contiguous run: per-entity maxima are one `reduceat`, not a scatter. Cached per change."""
        key = (self.n, self.gen, len(self.upos))
        if getattr(self, "_seg_key", None) != key:
            ap = np.flatnonzero(self.alive[:self.n])
            e = self.epos[ap]
            starts = np.flatnonzero(np.r_[True, e[1:] != e[:-1]]) if len(ap) else np.zeros(0, np.int64)
            self._seg = (ap, starts, e[starts] if len(ap) else np.zeros(0, np.int64))
            self._seg_key = key
        return self._seg

    def one_to_one(self) -> bool:
        """Whether unit p is entity p for every p (every unit alive, one per entity, in the same order): a store of
        single-unit entities as loaded. Per-entity sums then need no mapping between the two. Cached per change."""
        key = (self.n, self.gen, len(self.upos), self.ne)
        if getattr(self, "_o2o_key", None) != key:
            n = self.n
            self._o2o = bool(n == self.ne and len(self.upos) == n and self.e_alive[:n].all()
                             and np.array_equal(self.epos[:n], np.arange(n)))
            self._o2o_key = key
        return self._o2o

    def sole_units(self) -> np.ndarray:
        """Per unit position: its entity's position if it is that entity's only alive unit, else -1. Cached per
        change, like segments()."""
        key = (self.n, self.gen, len(self.upos))
        if getattr(self, "_sole_key", None) != key:
            ap, starts, seg_e = self.segments()
            one = np.diff(np.r_[starts, len(ap)]) == 1  # runs of one alive unit
            sole = np.full(self.n, -1, np.int64)
            sole[ap[starts[one]]] = seg_e[one]
            self._sole, self._sole_key = sole, key
        return self._sole

    def positions(self, uids: np.ndarray) -> np.ndarray:
        """The positions of the alive units with these uids (int64), -1 for any other uid."""
        out = np.full(len(uids), -1, np.int64)
        ok = (uids >= 0) & (uids < len(self.uid_pos))
        out[ok] = self.uid_pos[uids[ok]]
        return out

    def dense_ready(self) -> bool:
        n = self.n
        return bool(n) and bool(np.all(self.has_vec[:n] | ~self.alive[:n]))


def _words(dim: int) -> int:
    return (dim + 63) // 64


def _pack(M: np.ndarray, center: np.ndarray) -> np.ndarray:
    """(rows, words) uint64: the sign bits of each row minus `center` (1 where above), zero-padded to whole
    64-bit words."""
    b = np.packbits(M > center, axis=1)
    pad = 8 * _words(M.shape[1]) - b.shape[1]
    if pad:
        b = np.pad(b, ((0, 0), (0, pad)))
    return np.ascontiguousarray(b).view(np.uint64)


class DenseQuery:
    """The dense channel of one query: `values[p]` is the cosine of the query with unit p's vector.

    In a store of up to APPROX_MIN_UNITS units every cosine is computed: one matrix-vector product (in a larger
    store whose filter leaves at most that many candidates, the candidates' cosines only). Above, that
    product is memory-bound (100,000 x 384 float32 is 154 MB read per query), so the channel is approximate:
    units are ranked by the Hamming distance of their sign bits to the query's (48 bytes per unit, ~0.5 ms at
    100,000), the SHORTLIST nearest and a fixed sample of SAMPLE candidates get their exact cosine, every other
    unit an estimate (a line in the Hamming distance fitted on the sample), and `make_exact` then computes the
    exact cosine of the units the other channels found. The channel's mean and sd (`moments`, see dist_norm)
    come from the sample. `exact` is None when every value is exact. Measured in docs/retrieval.md ("Speed"):
    on real sentence vectors at 100,000 units the shortlist holds 99.9-100% of the exact top 100."""

    def __init__(self, snap: Snapshot, qv: np.ndarray, mask: np.ndarray, *, min_units: int | None = None,
                 shortlist: int | None = None, sample: int | None = None):
        n = len(mask)
        self.snap, self.qv = snap, qv
        self.moments: tuple[float, float] | None = None
        self.exact: np.ndarray | None = None
        self.h: np.ndarray | None = None
        limit = APPROX_MIN_UNITS if min_units is None else min_units
        if n <= limit:
            self.values = (snap.V[:n] @ qv).astype(np.float64)
            return
        cand = np.flatnonzero(mask)
        if len(cand) <= limit:
            # a filter (classes, time) leaves few candidates in a large store: exact cosines for just those
            # (the channel ignores every other unit)
            self.values = np.zeros(n)
            self.values[cand] = _dot(snap.V[cand], qv)
            return
        bits = snap.binary()
        qb = _pack(qv[None, :], snap.center)[0]
        h = np.zeros(n, np.uint16)
        x, c = np.empty(n, np.uint64), np.empty(n, np.uint8)  # reused: no temporaries per word
        for w in range(len(qb)):
            np.bitwise_xor(bits[w, :n], qb[w], out=x)
            h += np.bitwise_count(x, out=c)
        far = 64 * len(qb) + 1  # beyond any distance: what the units outside the mask are given
        near = _smallest(h if len(cand) == n else np.where(mask, h, np.uint16(far)),
                         max(SHORTLIST if shortlist is None else shortlist, n // 25), far)
        size = SAMPLE if sample is None else sample
        samp = cand if len(cand) <= size else cand[np.linspace(0, len(cand) - 1, size).round().astype(np.int64)]
        exact = np.zeros(n, bool)
        exact[near] = True
        exact[samp] = True
        idx = np.flatnonzero(exact)
        cos = _dot(snap.V[idx], qv)
        sv = cos[np.searchsorted(idx, samp)]
        self.moments = (float(sv.mean()), float(sv.std()))
        hs = h[samp].astype(np.float64)
        slope = float(np.cov(hs, sv)[0, 1] / hs.var()) if len(sv) > 1 and hs.var() > 0 else 0.0
        values = (self.moments[0] - slope * hs.mean()) + slope * h.astype(np.float64)
        values[idx] = cos
        self.exact, self.values, self.h = exact, values, h

    def make_exact(self, want: np.ndarray, cap: int | None = None) -> None:
        """Replace the estimates of the units in `want` (bool) by exact cosines, at most `cap` (EXTRA_EXACT)
        of them, nearest by Hamming distance first."""
        if self.exact is None:
            return
        pos = np.flatnonzero(want & ~self.exact)
        cap = EXTRA_EXACT if cap is None else cap
        if len(pos) > cap:
            pos = np.sort(pos[np.argsort(self.h[pos], kind="stable")[:cap]])
        if len(pos):
            self.values[pos] = _dot(self.snap.V[pos], self.qv)
            self.exact[pos] = True


def _dot(M: np.ndarray, q: np.ndarray) -> np.ndarray:
    """Row-wise dot products of a few thousand gathered rows, as float64. numpy's own loop, not BLAS: OpenBLAS
    hands a product this small to its second thread, and on a busy machine waiting for that thread to wake took
    12 ms against 0.3 ms for 6,000 x 384 (measured, docs/retrieval.md)."""
    return np.vecdot(M, q).astype(np.float64)


def _smallest(h: np.ndarray, k: int, far: int) -> np.ndarray:
    """Positions of the k smallest values of h below `far` (small integers), ties to lower positions."""
    cum = np.cumsum(np.bincount(h, minlength=far + 1)[:far])
    if not len(cum) or cum[-1] <= k:
        return np.flatnonzero(h < far)
    thr = int(np.searchsorted(cum, k))  # the smallest distance with at least k units at or below it
    below = np.flatnonzero(h < thr)
    return np.concatenate([below, np.flatnonzero(h == thr)[:k - len(below)]])


def batches(items, size: int = 900):
    """`items` in lists of at most `size`: an SQL `in (...)` list stays below SQLite's limit of variables."""
    items = list(items)
    for i in range(0, len(items), size):
        yield items[i:i + size]


def minmax(x: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Scale x to [0, 1] over the masked candidates (0 elsewhere); a constant channel contributes nothing."""
    if not mask.any():
        return np.zeros_like(x)
    full = bool(mask.all())  # no filter: no gathered copy, no select
    xs = x if full else x[mask]
    lo, hi = xs.min(), xs.max()
    if hi <= lo:
        return np.zeros_like(x)
    return (x - lo) / (hi - lo) if full else np.where(mask, (x - lo) / (hi - lo), 0.0)


def maxnorm(x: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Scale a non-negative score whose zero means "no match" (BM25) by its maximum over the candidates."""
    if not mask.any():
        return np.zeros_like(x)
    if mask.all():
        hi = x.max()
        return x / hi if hi > 0 else np.zeros_like(x)
    hi = x[mask].max()
    return np.where(mask, x / hi, 0.0) if hi > 0 else np.zeros_like(x)


def ranks_of(x: np.ndarray, mask: np.ndarray, positions) -> list[int]:
    """1-based rank of each position among the masked candidates by x (ties share the better rank)."""
    vals = x[np.asarray(positions, dtype=np.int64)]
    # only values above the lowest of them can be above any of them: compare with those, not every candidate
    lowest = np.min(vals, initial=np.inf, where=~np.isnan(vals))  # NaN is above nothing and has nothing above it
    xs = x[mask & (x > lowest)]
    return [int(r) + 1 for r in (xs[None, :] > vals[:, None]).sum(1)]


@dataclass(frozen=True)
class Channel:
    """What one channel found for a query (see _channels): a score for every unit position, and which units."""

    name: str
    scores: np.ndarray  # raw scores over all unit positions (0 where the channel has nothing)
    present: np.ndarray  # bool: the channel found the unit at all
    zero_based: bool = True  # 0 means "nothing": scale by the maximum; else min-max (cosines)
    moments: tuple[float, float] | None = None  # (mean, sd) for dist_norm when known (approximate dense)
    unit_scale: bool = False  # the scores are already on 0..1 as meant (time: a share): added as they are
    parts: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)  # for the channels after it

    def ranks(self, mask: np.ndarray, positions: list[int]) -> list[int]:
        """The 1-based rank of each position among the candidates this channel found (ties share the better)."""
        return ranks_of(self.scores, mask & self.present, positions)


def fuse(channels: list[Channel], mask: np.ndarray, fusion: str, scales: dict | None = None) -> np.ndarray:
    """Weighted sum of min-max normalised channels (default), or reciprocal rank fusion.

    Zero-based channels (BM25, entity, mention, time) are divided by their best score (`maxnorm`), the dense
    channel is scaled by its distribution (`dist_norm`). Written without boolean-indexed copies: at 100,000
    units 3.5 -> 1.4 ms for three channels (docs/retrieval.md). `scales` (weighted fusion) gets, per channel
    that contributed, (offset, divisor): its contribution to a unit found is (score - offset) / divisor."""
    total = np.zeros(len(mask))
    full = bool(mask.all())
    for ch in channels:
        cand = mask & ch.present
        if not cand.any():
            continue
        if fusion == "rrf":
            order = np.argsort(-np.where(cand, ch.scores, -np.inf), kind="stable")
            r = np.empty(len(mask))
            r[order] = np.arange(1, len(mask) + 1)
            total += np.where(cand, 1.0 / (RRF_K + r), 0.0)
            continue
        if ch.unit_scale:
            total += np.where(cand, ch.scores, 0.0)
            if scales is not None:
                scales[ch.name] = (0.0, 1.0)
            continue
        count = int(np.count_nonzero(cand))
        if ch.zero_based and count <= len(mask) // 8:
            # few units found (BM25 keeps at most LEXICAL_LIMIT): the same sums on just those positions
            at = np.flatnonzero(cand)
            vals = ch.scores[at]
            hi = vals.max()
            if hi > 0:
                total[at] += vals / hi
                if scales is not None:
                    scales[ch.name] = (0.0, float(hi))
            continue
        vals = ch.scores if count == len(mask) else np.where(cand, ch.scores, 0.0)
        if ch.zero_based:
            # vals is 0 outside cand (a subset of mask), so its maximum is the maximum over the masked candidates
            # whenever that is positive, the only case that contributes
            hi = vals.max()
            if hi > 0:
                total += vals / hi
                if scales is not None:
                    scales[ch.name] = (0.0, float(hi))
        else:
            total += dist_norm(vals, mask, full, ch.moments)
            if scales is not None:
                mu, sd = ch.moments if ch.moments is not None else _moments(vals, mask, full)
                if sd > 0:
                    scales[ch.name] = (float(mu - DIST_SD * sd), float(2 * DIST_SD * sd))
    return total


def _moments(x: np.ndarray, mask: np.ndarray, full: bool) -> tuple[float, float]:
    v = x if full else x[mask]
    return (float(v.mean()), float(v.std())) if len(v) else (0.0, 0.0)


def dist_norm(x: np.ndarray, mask: np.ndarray, full: bool | None = None,
              moments: tuple[float, float] | None = None) -> np.ndarray:
    """Distribution-based scaling of a dense (cosine) channel: mean - 3 sd -> 0, mean + 3 sd -> 1, over the
    masked candidates (0 elsewhere; a constant channel contributes nothing).

    Min-max over 100,000 cosines is set by the two most extreme units; the mean and spread of all of them
    are not, so a cosine means the same in a store with one odd outlier. Measured against min-max on the
    LoCoMo dev set: R@5 75.7 -> 76.1, R@10 83.2 -> 83.9, better or equal in every conversation
    (docs/retrieval.md). The 3 is the rule's constant (distribution-based score fusion), not tuned."""
    full = bool(mask.all()) if full is None else full
    if moments is not None:  # estimated from a sample of the candidates (DenseQuery)
        mu, sd = moments
    else:
        v = x if full else x[mask]
        if not len(v):
            return np.zeros_like(x, dtype=np.float64)
        mu, sd = v.mean(), v.std()
    if not sd > 0:
        return np.zeros_like(x, dtype=np.float64)
    scaled = (x - (mu - DIST_SD * sd)) / (2 * DIST_SD * sd)
    return scaled if full else np.where(mask, scaled, 0.0)


def top_k(score: np.ndarray, mask: np.ndarray, k: int) -> list[int]:
    """Positions of the k best masked scores, best first (ties: lower position first)."""
    if mask.all():
        cand, s = None, score  # no filter: skip gathering a copy of every score
    else:
        cand = np.flatnonzero(mask)
        s = score[cand]
    if not len(s):
        return []
    if len(s) > k:
        part = np.argpartition(-s, k - 1)[:k]
        # argpartition picks any of the units tied at the k-th score: take the lowest positions, so that
        # the same index always answers the same list
        kth = s[part].min()
        above = np.flatnonzero(s > kth)
        part = np.concatenate([above, np.flatnonzero(s == kth)[:k - len(above)]])
    else:
        part = np.arange(len(s))
    pos = part if cand is None else cand[part]
    part = part[np.lexsort((pos, -s[part]))]
    return [int(i) for i in (part if cand is None else cand[part])]
