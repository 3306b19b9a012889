"""A pairwise second stage against the shipped pointwise one, by leave-one-conversation-out, from saved pools.

    .venv/bin/python bench/locomo.py --stores DIR --pools pools.pkl     # once: the questions, pools and features
    .venv/bin/python bench/locomo_pairwise.py pools.pkl

Pairwise: logistic regression on the feature differences of every (evidence, other) pair of a question's pool,
each question weighing the same, no bias, L2 on the standardised differences (numpy, Newton's method). Pointwise:
`_rerank.fit`, as shipped. Both over SETS of features and L2 in L2S, fitted on the pools of both settings of two
conversations and scored on the third, in turn (ROTATED), then with the set and L2 chosen nested (on the two
training conversations: fitted on one, scored on the other, by the mean of R@5 and R@10). Prints R@5, R@10, @10 per
category and per conversation for the bench's settings. docs/retrieval.md, "Ninth round", has the figures.
"""

from __future__ import annotations

import pickle
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import locomo  # noqa: E402
from hutch.memory._index import _rerank  # noqa: E402

SH = _rerank.SHIPPED
SETS = {"shipped": SH, "all": _rerank.FEATURES, "+dense": SH + ("dense",),
        "+entity": SH + ("entity_best", "entity_share"), "+ranks": SH + ("bm25_rank", "dense_rank", "entity_rank"),
        "+speaker": SH + ("named_speaker", "other_speaker"), "+degree": SH + ("degree",),
        "+channels": SH + _rerank.CHANNELS}
L2S = (0.1, 1.0, 10.0, 100.0)


def cols(names) -> list[int]:
    return [_rerank.FEATURES.index(n) for n in names]


def fit_pairwise(D, idx, names, l2):
    diffs, weights = [], []
    for pools in (D["pools_b"], D["pools_d"]):
        for i in idx:
            d = pools[i]
            if not len(d["X"]):
                continue
            y = np.array([a in D["qs"][i]["ev"] for a in d["anchors"]])
            if y.all() or not y.any():
                continue
            Z = d["X"][:, cols(names)]
            diff = (Z[y][:, None, :] - Z[~y][None, :, :]).reshape(-1, Z.shape[1])
            diffs.append(diff)
            weights.append(np.full(len(diff), 1.0 / len(diff)))
    X, sw = np.vstack(diffs), np.concatenate(weights)
    sw *= len(weights) / sw.sum()
    scale = X.std(0)
    scale[scale == 0] = 1.0
    Z = X / scale
    w = np.zeros(X.shape[1])
    for _ in range(50):
        p = 1 / (1 + np.exp(-(Z @ w)))
        g = Z.T @ (sw * (p - 1)) + l2 * w
        H = (Z * (sw * p * (1 - p))[:, None]).T @ Z + l2 * np.eye(len(w))
        step = np.linalg.solve(H, g)
        w -= step
        if np.abs(step).max() < 1e-8:
            break
    wx = w / scale
    return lambda X: X[:, cols(names)] @ wx


def fit_pointwise(D, idx, names, l2):
    parts = [locomo.training(p, D["qs"], idx) for p in (D["pools_b"], D["pools_d"])]
    X = np.vstack([p[0] for p in parts])
    y = np.concatenate([p[1] for p in parts])
    g = np.concatenate([p[2] + k * len(D["qs"]) for k, p in enumerate(parts)])
    return _rerank.fit(X, y, g, l2=l2, names=names).score


def ranked(D, i, scorer) -> list[str]:
    d = D["pools_b"][i]
    if not len(d["X"]):
        return []
    return [d["anchors"][j] for j in np.argsort(-scorer(d["X"]), kind="stable")]


def held_out(D, fitter, train_convs, test_convs, names, l2) -> dict[int, list[str]]:
    convs = D["convs"]
    scorer = fitter(D, [i for i, c in enumerate(convs) if c in train_convs], names, l2)
    return {i: ranked(D, i, scorer) for i, c in enumerate(convs) if c in test_convs}


def objective(D, got: dict[int, list[str]]) -> float:
    ii = sorted(got)
    r = locomo.score([got[i] for i in ii], [D["qs"][i] for i in ii])
    return (r["all"][5] + r["all"][10]) / 2


def rotated(D, fitter, names, l2) -> list[list[str]]:
    out: dict[int, list[str]] = {}
    for held in sorted(set(D["convs"])):
        out.update(held_out(D, fitter, set(D["convs"]) - {held}, {held}, names, l2))
    return [out[i] for i in range(len(D["qs"]))]


def nested(D, fitter) -> tuple[list[list[str]], list]:
    out: dict[int, list[str]] = {}
    chosen = []
    for held in sorted(set(D["convs"])):
        train = set(D["convs"]) - {held}
        best = None
        for tag, names in SETS.items():
            for l2 in L2S:
                got = sum(objective(D, held_out(D, fitter, train - {inner}, {inner}, names, l2)) for inner in train)
                if best is None or got > best[0] + 1e-9:
                    best = (got, tag, names, l2)
        chosen.append((held, best[1], best[3]))
        out.update(held_out(D, fitter, train, {held}, best[2], best[3]))
    return [out[i] for i in range(len(D["qs"]))], chosen


def line(D, ranked_lists) -> str:
    qs, convs = D["qs"], D["convs"]
    s = locomo.score(ranked_lists, qs)
    per = []
    for c in sorted(set(convs)):
        ii = [i for i, x in enumerate(convs) if x == c]
        r = locomo.score([ranked_lists[i] for i in ii], [qs[i] for i in ii])
        per.append(f"{r['all'][5]:.1f} / {r['all'][10]:.1f}")
    cats = " ".join(f"{k} {s[k][10]:5.1f}" for k in locomo.CATS.values())
    return f"{s['all'][5]:5.1f} {s['all'][10]:5.1f} | {cats} | " + ", ".join(per)


def main() -> None:
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    D = pickle.loads(Path(sys.argv[1]).read_bytes())
    print("ROTATED, bench settings: R@5 R@10 | @10 per category | per conversation R@5 / R@10")
    for fitter, tag in ((fit_pointwise, "pointwise"), (fit_pairwise, "pairwise")):
        for name, names in SETS.items():
            for l2 in L2S:
                print(f"{tag:9s} {name:10s} L2 {l2:<5g} {line(D, rotated(D, fitter, names, l2))}", flush=True)
        got, chosen = nested(D, fitter)
        print(f"{tag:9s} chosen nested ({'; '.join(f'without {h}: {t}, L2 {l:g}' for h, t, l in chosen)}): "
              f"{line(D, got)}", flush=True)


if __name__ == "__main__":
    main()
