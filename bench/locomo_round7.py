"""Seventh round (issue 16): what else could reach multi-hop and open-domain @10 >= 65, scored as the sixth.

    .venv/bin/python bench/locomo_round7.py [--data DIR] [--stores DIR]

Every question is asked once (bench/locomo_variants.py's `ask`: the first stage's channel contributions, the
question's vector, the store's snapshot); each variant recomputes the fused list and refits the shipped second
stage by leave-one-conversation-out ("rotated"), and a variant with a free choice is also scored "nested" (the
choice made on the two training conversations). The first line must equal bench/locomo.py's "second stage,
shipped features, ROTATED". Then the ceiling: what a perfect second stage could reach at R@10 by re-ordering the
first stage's best N, and where the missed evidence ranks. docs/retrieval.md, "Seventh round", has the figures.

Variants (none kept): speaker-conditioned dense scaling; a question naming two people decomposed into one
search per person, interleaved; the fused list interleaved with a session-free one (no `entity` channel:
coverage across sessions); the second stage given list-question interactions, or the unit's own score
beside its session's (a learned gate on the session prior), or a pool widened by the best units without the
session prior; lexical pseudo-relevance feedback (terms of the fused top m turns, BM25 over the units); graph
expansion from the entities linked to one session (LoCoMo's event summaries, days) to that session's turns;
broader WordNet categories; the `time` channel left out.
"""

from __future__ import annotations

import argparse
import glob
import math
import os
import re
import shutil
import sqlite3
import sys
import tempfile
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import locomo  # noqa: E402
import locomo_variants as V  # noqa: E402
from hutch.memory._index import _anchor, _fts, _lexicon, _query, _rank, _rerank, _units  # noqa: E402

SHIP = V.SHIP
COL = {c: i for i, c in enumerate(("bm25", "dense", "entity", "mention", "time", "category"))}
LIST = re.compile(r"^\s*(what|which)\s+(\w+\s+){0,3}?\w+s\b|\bhow many\b|\bboth\b|\bin common\b"
                  r"|\bwhat (kind|type|sort)s? of\b", re.I)


class Store:
    """What the variants need of one conversation's store beyond the pools: its index read-only, each unit's
    words and their document frequencies, and the non-turn entities linked to exactly one session."""

    def __init__(self, mem):
        self.db = sqlite3.connect(f"file:{mem.index.idx.path}?mode=ro", uri=True)
        s = self.snap = mem.index.snap
        body = dict(self.db.execute("select rowid, body from units_fts"))
        self.words = [_units.terms(body.get(int(s.uid[p])) or "") for p in range(s.n)]
        self.df = Counter(w for t in self.words for w in set(t))
        src, dst = _anchor._pairs(s, self.db)
        once = Counter(src.tolist())
        keep = np.array([once[e] == 1 for e in src.tolist()], bool)
        ent_unit = {int(s.epos[p]): p for p in range(s.n) if s.alive[p] and not s.is_turn[p]}
        pairs = [(ent_unit[e], d) for e, d in zip(src[keep].tolist(), dst[keep].tolist()) if e in ent_unit]
        self.linked_unit = np.array([u for u, _ in pairs], np.int64)
        self.linked_session = np.array([d for _, d in pairs], np.int64)


def speakers_named(q, store: Store) -> list[int]:
    _, names = _query.mentions(store.db, q["q"])
    return sorted({store.snap.speaker_code[n] for n in names if n in store.snap.speaker_code})


def interleave(lists, k: int = 60) -> list[str]:
    out, seen = [], set()
    for j in range(k):
        for L in lists:
            if j < len(L) and L[j] not in seen:
                seen.add(L[j])
                out.append(L[j])
    return out


def speaker_dense(mode: str):
    """The dense channel scaled by the named person's turns' distribution (mean +- 3 sd) instead of all units':
    "replace" for every unit, "add" on top of the shipped dense for the person's turns."""
    def fn(q):
        C = q["C"].copy()
        s, n = q["snap"], len(q["C"])
        if q["qv"] is None or len(q["codes"]) != 1:
            return C.sum(1)
        cos = (s.V[:n] @ q["qv"]).astype(np.float64)
        spoke = np.isin(s.speaker[:n], q["codes"]) & q["mask"]
        if spoke.sum() < 5 or not cos[spoke].std() > 0:
            return C.sum(1)
        mu, sd = cos[spoke].mean(), cos[spoke].std()
        d2 = np.where(q["mask"], (cos - (mu - 3 * sd)) / (6 * sd), 0.0)
        C[:, COL["dense"]] = d2 if mode == "replace" else C[:, COL["dense"]] + np.where(spoke, d2, 0.0)
        return C.sum(1)
    return fn


def one_person(which: int):
    """For a question naming two or more people: the fused score with `mention` for one of them alone."""
    def fn(q):
        base = q["C"].sum(1)
        if len(q["codes"]) < 2:
            return base
        s, n = q["snap"], len(base)
        return base + (np.isin(s.speaker[:n], [q["codes"][which]]) & q["mask"])
    return fn


def list_features(q, score, P):
    L = float(bool(LIST.search(q["q"])) or q["C"][:, COL["category"]].any())
    C = q["C"]
    return {"L_entity": L * C[P, COL["entity"]], "L_dense": L * C[P, COL["dense"]],
            "L_bm25": L * C[P, COL["bm25"]]}


def own_features(q, score, P):
    """The unit's own evidence beside its session's: bm25 + dense + category, its rank in the pool, and its
    interactions with the entity (session) channel (a learned gate on the session prior)."""
    C = q["C"]
    own, ent = C[P, COL["bm25"]] + C[P, COL["dense"]] + C[P, COL["category"]], C[P, COL["entity"]]
    rank = np.empty(len(P))
    rank[np.argsort(-own, kind="stable")] = np.arange(1, len(P) + 1)
    return {"own": own, "own_rank": np.log1p(rank), "entity_x_own": ent * own,
            "entity_min_own": np.minimum(ent / 2, own / 2)}


class UnionPools(V.Pools):
    """The pool widened: the fused list's best 50 and the best `more` by the channels without the session prior
    (bm25 + dense + mention + category), ordered by the fused score."""

    def __init__(self, qs, more: int, extra=None):
        self.qs, self.items = qs, []
        for q in qs:
            s, C = q["snap"], q["C"]
            score = C.sum(1)
            top = V.top_k(score, q["mask"], 50).tolist()
            free = C[:, COL["bm25"]] + C[:, COL["dense"]] + C[:, COL["mention"]] + C[:, COL["category"]]
            seen = set(top)
            P = np.array(sorted(top + [p for p in V.top_k(free, q["mask"], more).tolist() if p not in seen],
                                key=lambda p: -score[p]), np.int64)
            X = _rerank.features(SimpleNamespace(text=q["q"], mentioned=()), s, None, [], {}, score, list(P), SHIP)
            cols = {f: X[:, _rerank.FEATURES.index(f)] for f in SHIP}
            if extra is not None:
                cols.update(extra(q, score, P))
            self.items.append({"cols": cols, "anchors": [s.anchor[p] for p in P]})


def lexical_prf(stores: dict, m: int, nterms: int, w: float):
    """RM3-like: the nterms words of the fused top m turns weighed by share x fused score x idf (the question's
    words, words in > 20% of units, short words and numbers left out), their BM25 over the units (max-scaled)
    added at weight w."""
    def fn(q):
        base = q["C"].sum(1)
        st = stores[q["conv"]]
        n = len(base)
        asked = set(_units.terms(q["q"]))
        wt: Counter = Counter()
        for p in V.top_k(base, q["mask"], m):
            t = st.words[p]
            for word, c in Counter(t).items():
                if word in asked or st.df[word] > 0.2 * n or len(word) < 3 or word.isdigit():
                    continue
                wt[word] += c / len(t) * base[p] * math.log(n / st.df[word])
        terms = [word for word, _ in wt.most_common(nterms)]
        if not terms:
            return base
        return base + w * _rank.maxnorm(_fts.unit_bm25(st.db, st.snap, _units.fts_query(terms), n), q["mask"])
    return fn


def linked_expansion(stores: dict, mode: str, w: float):
    """Graph expansion: an entity linked to one session only (an event summary, a day) scores its cosine to the
    question (scaled by its distribution over such entities) and passes it to that session's turns: all of them
    ("session"), or the two whose vectors are closest to the entity's ("turn")."""
    def fn(q):
        base = q["C"].sum(1)
        st = stores[q["conv"]]
        s, n = q["snap"], len(base)
        if q["qv"] is None or not len(st.linked_unit):
            return base
        lu, ls = st.linked_unit, st.linked_session
        esc = _rank.dist_norm((s.V[lu] @ q["qv"]).astype(np.float64), np.ones(len(lu), bool))
        turn = q["mask"] & s.is_turn[:n]
        add = np.zeros(n)
        if mode == "session":
            best = np.zeros(s.ne)
            np.maximum.at(best, ls, esc)
            add = np.where(turn, best[s.epos[:n]], 0.0)
        else:
            for j in range(len(lu)):
                units = np.flatnonzero(turn & (s.epos[:n] == ls[j]))
                if len(units):
                    top = units[np.argsort(-(s.V[units] @ s.V[lu[j]]))[:2]]
                    add[top] = np.maximum(add[top], esc[j])
        return base + w * add
    return fn


HYPOTHETICAL = re.compile(r"^\s*(would|could|might)\b|\b(might|would|likely)\b", re.I)


def hypothetical(qs) -> None:
    """Open-domain questions nearly all ask what would or might be; the first stage's recall of those questions
    with the channels weighed otherwise (bm25, dense, entity, mention, time, category)."""
    idx = [i for i, q in enumerate(qs) if HYPOTHETICAL.search(q["q"])]
    cats = Counter(locomo.CATS[qs[i]["cat"]] for i in idx)
    print(f"hypothetical questions (would / might / likely): {len(idx)}, {dict(cats)}; their first-stage R@10 / R@50:")
    for name, w in (("as shipped", (1, 1, 1, 1, 1, 1)), ("no entity", (1, 1, 0, 1, 1, 1)),
                    ("entity x0.5", (1, 1, .5, 1, 1, 1)), ("dense x2", (1, 2, 1, 1, 1, 1)),
                    ("no bm25", (0, 1, 1, 1, 1, 1)), ("dense x2, entity x0.5", (1, 2, .5, 1, 1, 1)),
                    ("dense and mention only", (0, 1, 0, 1, 0, 0))):
        r = {10: [], 50: []}
        for i in idx:
            q, s = qs[i], qs[i]["snap"]
            top = [s.anchor[p] for p in V.top_k(q["C"] @ np.array(w, float), q["mask"], 50)]
            for k in r:
                r[k].append(len(set(top[:k]) & q["ev"]) / len(q["ev"]))
        print(f"  {name:24s} {100 * np.mean(r[10]):5.1f} / {100 * np.mean(r[50]):5.1f}", flush=True)


def ceiling(qs) -> None:
    for pool in (10, 20, 50, 100, 200):
        res: dict = {}
        for q in qs:
            s = q["snap"]
            found = len({s.anchor[p] for p in V.top_k(q["C"].sum(1), q["mask"], pool)} & q["ev"])
            for key in ("all", locomo.CATS[q["cat"]]):
                res.setdefault(key, []).append(min(10, found) / len(q["ev"]))
        print(f"ceiling: R@10 of a perfect re-ordering of the first stage's best {pool:3d}: "
              + " ".join(f"{c} {100 * np.mean(v):5.1f}" for c, v in res.items()), flush=True)
    for cat in (1, 3):
        ranks = []
        for q in qs:
            if q["cat"] == cat:
                s = q["snap"]
                top = [s.anchor[p] for p in V.top_k(q["C"].sum(1), q["mask"], len(q["C"]))]
                ranks += [top.index(a) + 1 if a in top else 10 ** 6 for a in q["ev"]]
        r = np.array(ranks)
        print(f"  {locomo.CATS[cat]}: {len(r)} evidence turns at first-stage rank 1-10 {(r <= 10).sum()}, 11-20 "
              f"{((r > 10) & (r <= 20)).sum()}, 21-50 {((r > 20) & (r <= 50)).sum()}, 51-100 "
              f"{((r > 50) & (r <= 100)).sum()}, below {(r > 100).sum()}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default=str(locomo.DEFAULT_DATA))
    ap.add_argument("--stores", help="reuse (or make) the conversations' stores here, as bench/locomo.py --stores")
    args = ap.parse_args()
    files = sorted(glob.glob(os.path.join(args.data, "*.json")))
    tmp = args.stores or tempfile.mkdtemp(prefix="hutch-locomo-")
    try:
        built, _ = locomo.build(files, tmp)
        qs = V.ask(built)
        stores = {Path(f).stem: Store(mem) for f, mem in built}
        for q in qs:
            q["codes"] = speakers_named(q, stores[q["conv"]])
        base = V.Pools(qs)
        shipped = V.rotated(base, SHIP)
        V.line(qs, "shipped features (= bench/locomo.py's rotated)", shipped)
        V.line(qs, "the time channel left out", V.rotated(V.Pools(qs, score_fn=lambda q: q["C"].sum(1)
                                                                 - q["C"][:, COL["time"]]), SHIP))
        for mode in ("replace", "add"):
            V.line(qs, f"speaker-conditioned dense ({mode})", V.rotated(V.Pools(qs, score_fn=speaker_dense(mode)),
                                                                       SHIP))
        two = [i for i, q in enumerate(qs) if len(q["codes"]) >= 2]
        ra, rb = (V.rotated(V.Pools(qs, score_fn=one_person(w)), SHIP) for w in (0, 1))
        dec = {i: interleave([ra[i], rb[i]]) if i in two else shipped[i] for i in shipped}
        V.line(qs, f"two people named ({len(two)} questions): one search each, interleaved", dec)
        print(f"    on those {len(two)} questions, R@5 / R@10: shipped "
              f"{V.recall(qs, shipped, two)['all'][5]:.1f} / {V.recall(qs, shipped, two)['all'][10]:.1f}, "
              f"decomposed {V.recall(qs, dec, two)['all'][5]:.1f} / {V.recall(qs, dec, two)['all'][10]:.1f}")
        free = V.Pools(qs, score_fn=lambda q: q["C"].sum(1) - q["C"][:, COL["entity"]])
        V.line(qs, "session-free list alone (no entity channel)", V.rotated(free, SHIP))

        def mixed(head, train=None, test=None):
            convs = train if test == train else None
            a, b = V.rotated(base, SHIP, convs), V.rotated(free, SHIP, convs)
            return {i: a[i][:head] + [x for x in interleave([a[i][head:], b[i]]) if x not in a[i][:head]]
                    for i in a}
        for head in (0, 3, 5, 7):
            V.line(qs, f"shipped / session-free interleaved after the first {head}", mixed(head))
        V.line(qs, "  the head chosen nested among 0..10", V.nested(qs, {h: h for h in range(11)}, mixed))
        lp = V.Pools(qs, extra=list_features)
        sets = {"L_entity": ["L_entity"], "L_dense": ["L_dense"], "L_entity+L_dense": ["L_entity", "L_dense"],
                "L_entity+L_dense+L_bm25": ["L_entity", "L_dense", "L_bm25"]}
        for key, extra in sets.items():
            V.line(qs, f"+ list question x {key}", V.rotated(lp, SHIP + extra))
        V.line(qs, "  the feature set chosen nested (or none)", V.nested(
            qs, {k: k for k in ["none", *sets]},
            lambda k, tr, te: V.rotated(lp, SHIP + sets.get(k, []), tr if te == tr else None)))
        op = V.Pools(qs, extra=own_features)
        gates = {"own": ["own"], "own_rank": ["own_rank"], "entity_x_own": ["entity_x_own"],
                 "entity_min_own": ["entity_min_own"], "own+entity_x_own": ["own", "entity_x_own"]}
        for key, extra in gates.items():
            V.line(qs, f"+ the unit's own score: {key}", V.rotated(op, SHIP + extra))
        V.line(qs, "  the gate chosen nested (or none)", V.nested(
            qs, {k: k for k in ["none", *gates]},
            lambda k, tr, te: V.rotated(op, SHIP + gates.get(k, []), tr if te == tr else None)))
        for more in (20, 50):
            up = UnionPools(qs, more, extra=own_features)
            V.line(qs, f"pool + the best {more} without the session prior", V.rotated(up, SHIP))
            V.line(qs, "  the same, + own_rank", V.rotated(up, SHIP + ["own_rank"]))
        grid = {(m, t, w): (m, t, w) for m in (5, 10) for t in (5, 10) for w in (0.3, 0.5)}
        prf = {key: V.Pools(qs, score_fn=lexical_prf(stores, *key)) for key in grid}
        best = max(grid, key=lambda key: V.recall(qs, V.rotated(prf[key], SHIP))["all"][10])
        V.line(qs, f"lexical PRF, best of 8 by rotated R@10 (m, terms, w = {best})", V.rotated(prf[best], SHIP))
        V.line(qs, "  lexical PRF, the setting chosen nested", V.nested(
            qs, grid, lambda key, tr, te: V.rotated(prf[key], SHIP, tr if te == tr else None)))
        for mode in ("session", "turn"):
            for w in (0.5, 1.0):
                V.line(qs, f"entities linked to one session -> its {mode}s, weight {w}",
                       V.rotated(V.Pools(qs, score_fn=linked_expansion(stores, mode, w)), SHIP))
        # broader categories ("activities", "events", "items": over 1,000 hyponyms) read through WordNet too
        depth, cap = _lexicon.DEPTH, _lexicon.MAX_TERMS
        try:
            _lexicon.DEPTH, _lexicon.MAX_TERMS = 5, 20000
            broad = V.ask(built)
        finally:
            _lexicon.DEPTH, _lexicon.MAX_TERMS = depth, cap
        fired = (sum(bool(q["C"][:, COL["category"]].any()) for q in qs),
                 sum(bool(q["C"][:, COL["category"]].any()) for q in broad))
        V.line(broad, f"category channel 5 levels, up to 20,000 words (fires on {fired[1]}, not {fired[0]})",
               V.rotated(V.Pools(broad), SHIP))
        hypothetical(qs)
        ceiling(qs)
        for st in stores.values():
            st.db.close()
        for _, mem in built:
            mem.index.close()
    finally:
        if not args.stores:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
