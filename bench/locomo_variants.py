"""Variants of the fusion and of the second stage on LoCoMo, scored by leave-one-conversation-out without asking again.

    .venv/bin/python bench/locomo_variants.py [--data DIR] [--stores DIR]

Every question of categories 1-4 is asked once with bench/locomo.py's settings, first stage alone
(`SearchIndex.search(collect=...)`): every candidate's channel contributions (a row sums to its fused score), the
question's vector and the store's snapshot. Each variant then recomputes the fused list and the learned second
stage (`_rerank.fit`, the shipped features plus the variant's), fitted on two conversations' questions and scored
on the third, in turn ("rotated"). A variant with a free choice (a constant, a feature set) is also scored
"nested": the choice is made on the two training conversations (each fitted on one, scored on the other), then
scored on the held-out third; that is the figure that may keep it. The first line must equal bench/locomo.py's
"second stage, shipped features, ROTATED" (the same pools). docs/retrieval.md, "Sixth round", has the figures.
With lightgbm importable (not a dependency) it also scores LambdaMART over the same features.
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import locomo  # noqa: E402
from hutch.memory._index import _rank, _rerank  # noqa: E402

SHIP = list(_rerank.SHIPPED)


def ask(stores) -> list[dict]:
    out = []
    for f, mem in stores:
        for q in locomo.questions(f):
            got: dict = {}
            mem.index.search(q["q"], k=20, classes=["interactions"], fusion="weighted", collect=got)
            out.append({**q, "conv": Path(f).stem, "snap": mem.index.snap, "C": got["contributions"],
                        "mask": got["mask"], "qv": got["query_vector"]})
    return out


def top_k(score: np.ndarray, mask: np.ndarray, k: int) -> np.ndarray:
    return np.asarray(_rank.top_k(score, mask, k), np.int64)


def dist_norm(x: np.ndarray, mask: np.ndarray) -> np.ndarray:
    return _rank.dist_norm(x, mask)


class Pools:
    """Each question's pool (POOL best by a variant's fused score) with the shipped features and `extra` columns."""

    def __init__(self, qs, score_fn=None, extra=None, pool: int = _rerank.POOL):
        self.qs, self.items = qs, []
        for q in qs:
            s = q["snap"]
            score = q["C"].sum(1) if score_fn is None else score_fn(q)
            top = top_k(score, q["mask"], max(20, pool))
            P = top[:pool]
            X = _rerank.features(SimpleNamespace(text=q["q"], mentioned=()), s, None, [], {}, score, list(P), SHIP)
            cols = {f: X[:, _rerank.FEATURES.index(f)] for f in SHIP}
            if extra is not None:
                cols.update(extra(q, score, P))
            self.items.append({"cols": cols, "anchors": [s.anchor[p] for p in P]})

    def matrix(self, i: int, names) -> np.ndarray:
        return np.column_stack([self.items[i]["cols"][n] for n in names])

    def labels(self, i: int) -> np.ndarray:
        return np.array([a in self.qs[i]["ev"] for a in self.items[i]["anchors"]], float)


def fit(pools: Pools, idx, names) -> _rerank.Ranker:
    """The shipped fit (logistic regression, each question weighing the same) on both settings' pools: here the
    same pools twice, as bench/locomo.py fits them (the API's defaults rank a conversation as the bench's settings)."""
    X = np.vstack([pools.matrix(i, names) for i in idx] * 2)
    y = np.concatenate([pools.labels(i) for i in idx] * 2)
    g = np.concatenate([[i] * len(pools.items[i]["anchors"]) for i in idx]
                       + [[i + len(pools.qs)] * len(pools.items[i]["anchors"]) for i in idx])
    return _rerank.fit_columns(X, y, g, names=tuple(names))


def order(pools: Pools, i: int, model, names) -> list[str]:
    Z = (pools.matrix(i, names) - model.mean) / model.scale
    return [pools.items[i]["anchors"][j] for j in np.argsort(-(Z @ model.weights + model.bias), kind="stable")]


def by_conv(qs) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for i, q in enumerate(qs):
        out.setdefault(q["conv"], []).append(i)
    return out


def rotated(pools: Pools, names, convs=None) -> dict[int, list[str]]:
    groups = by_conv(pools.qs)
    convs = sorted(groups) if convs is None else convs
    ranked = {}
    for held in convs:
        model = fit(pools, [i for c in convs if c != held for i in groups[c]], names)
        for i in groups[held]:
            ranked[i] = order(pools, i, model, names)
    return ranked


def recall(qs, ranked: dict[int, list[str]], idx=None) -> dict:
    idx = sorted(ranked) if idx is None else idx
    res: dict = {}
    for i in idx:
        q = qs[i]
        for key in ("all", locomo.CATS[q["cat"]]):
            for k in (5, 10):
                res.setdefault(key, {}).setdefault(k, []).append(len(set(ranked[i][:k]) & q["ev"]) / len(q["ev"]))
    return {c: {k: 100 * float(np.mean(v)) for k, v in d.items()} for c, d in res.items()}


def line(qs, tag: str, ranked: dict[int, list[str]]) -> None:
    r = recall(qs, ranked)
    per = [f"{c} {s['all'][5]:.1f} / {s['all'][10]:.1f}" for c, idx in sorted(by_conv(qs).items())
           for s in [recall(qs, ranked, idx)]]
    cats = " ".join(f"{c} {r[c][10]:5.1f}" for c in locomo.CATS.values() if c in r)
    print(f"{tag:62s} R@5 {r['all'][5]:5.1f} R@10 {r['all'][10]:5.1f} | {cats} | " + ", ".join(per), flush=True)


def nested(qs, choices: dict, make) -> dict[int, list[str]]:
    """For each held-out conversation, the choice whose rotation over the two others scores best (mean of R@5 and
    R@10), then scored on the held-out one. `make(choice, train_convs, test_convs) -> ranked`."""
    groups = by_conv(qs)
    out: dict[int, list[str]] = {}
    for held in sorted(groups):
        train = [c for c in sorted(groups) if c != held]
        def inner(ch):
            r = recall(qs, make(ch, train, train))["all"]
            return (r[5] + r[10]) / 2
        best = max(choices, key=lambda ch: (round(inner(ch), 9), -list(choices).index(ch)))
        print(f"    nested: held out {held}: {best}", flush=True)
        got = make(best, sorted(groups), [held])
        out.update({i: got[i] for i in groups[held]})
    return out


def diversity(q, score, P):
    """How many better pool units of the same entity (a turn's session) precede it."""
    ent = q["snap"].epos[P]
    above = np.array([np.count_nonzero(ent[:j] == ent[j]) for j in range(len(P))])
    return {"same_entity_above": np.log1p(above)}


def prf_score(beta: float, m: int, w: float):
    """Pseudo-relevance feedback on the embedding channel: the question's vector plus beta x the centroid of the
    fused top m, its cosines scaled as the dense channel's, added at weight w."""
    def fn(q):
        score = q["C"].sum(1)
        if q["qv"] is None:
            return score
        V = q["snap"].V[:len(score)]
        c = V[top_k(score, q["mask"], m)].mean(0)
        qn = q["qv"] + beta * c
        return score + w * dist_norm((V @ (qn / np.linalg.norm(qn))).astype(np.float64), q["mask"])
    return fn


def weighted(ch: str, w: float):
    col = _rerank.CHANNELS.index(ch)
    return lambda q: q["C"].sum(1) + (w - 1) * q["C"][:, col]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default=str(locomo.DEFAULT_DATA))
    ap.add_argument("--stores", help="reuse (or make) the conversations' stores here, as bench/locomo.py --stores")
    args = ap.parse_args()
    files = sorted(glob.glob(os.path.join(args.data, "*.json")))
    tmp = args.stores or tempfile.mkdtemp(prefix="hutch-locomo-")
    try:
        stores, _ = locomo.build(files, tmp)
        qs = ask(stores)
        base = Pools(qs)
        line(qs, "shipped features (= bench/locomo.py's rotated)", rotated(base, SHIP))
        div = Pools(qs, extra=diversity)
        line(qs, "+ same-session units above (learned diversity)", rotated(div, SHIP + ["same_entity_above"]))

        def cascade(head, train, test):
            a = rotated(div, SHIP, train if test == train else None)
            b = rotated(div, SHIP + ["same_entity_above"], train if test == train else None)
            return {i: a[i][:head] + [x for x in b[i] if x not in a[i][:head]] for i in a}
        line(qs, "cascade: the shipped order's first 5, then the diversity model's", cascade(5, None, None))
        line(qs, "  the same, head in 0..10 chosen nested", nested(qs, {h: h for h in range(11)},
                                                                 lambda h, tr, te: cascade(h, tr, te)))
        grid = {(b, m): (b, m) for b in (0.5, 1.0, 2.0) for m in (3, 5, 10)}
        prf = {key: Pools(qs, score_fn=prf_score(*key, 0.5)) for key in grid}
        best = max(grid, key=lambda key: recall(qs, rotated(prf[key], SHIP))["all"][10])
        line(qs, f"PRF in the first stage, +0.5, best of 9 in-sample (beta, m = {best})", rotated(prf[best], SHIP))
        line(qs, "  PRF, (beta, m) chosen nested", nested(qs, grid, lambda key, tr, te: rotated(
            prf[key], SHIP, tr if te == tr else None)))
        ws = {(c, w): (c, w) for c in ("bm25", "dense", "entity", "mention") for w in (0.5, 0.75, 1.0, 1.25, 1.5)}
        wp = {key: Pools(qs, score_fn=weighted(*key)) for key in ws}
        line(qs, "entity channel x0.75", rotated(wp[("entity", 0.75)], SHIP))
        line(qs, "  one channel's weight chosen nested (4 channels x 5 weights)", nested(
            qs, ws, lambda key, tr, te: rotated(wp[key], SHIP, tr if te == tr else None)))
        try:
            import lightgbm
        except ImportError:
            print("LambdaMART: lightgbm is not installed (pip install lightgbm to score it)")
        else:
            groups = by_conv(qs)
            ranked = {}
            for held in sorted(groups):
                tr = [i for c in groups if c != held for i in groups[c]]
                data = lightgbm.Dataset(np.vstack([base.matrix(i, SHIP) for i in tr]),
                                        np.concatenate([base.labels(i) for i in tr]),
                                        group=[len(base.items[i]["anchors"]) for i in tr])
                booster = lightgbm.train({"objective": "lambdarank", "num_leaves": 3, "learning_rate": 0.03,
                                          "min_data_in_leaf": 100, "verbose": -1, "num_threads": 1, "seed": 1,
                                          "deterministic": True}, data, num_boost_round=200)
                for i in groups[held]:
                    s = booster.predict(base.matrix(i, SHIP))
                    ranked[i] = [base.items[i]["anchors"][j] for j in np.argsort(-s, kind="stable")]
            line(qs, f"LambdaMART (lightgbm {lightgbm.__version__}), shipped features, 3 leaves x 200", ranked)
        for _, mem in stores:
            mem.index.close()
    finally:
        if not args.stores:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
