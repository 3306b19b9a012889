"""The learned second stage: a small linear model re-ranks the best POOL units of the fused list.

Its features are what the first stage already knows about a candidate (no model, no text at query time):
each channel's contribution to the fused score and its rank in the pool, the fused score and rank, whether
the unit is a conversation turn, how strong its entity (a turn's session) is in the pool, its neighbouring
turns' fused scores, whether the turn speaks of a time and the question asks "when", whether a name in the
question is its speaker, and how linked its entity is (FEATURES). The shipped model (`ranker.json`, package
data) uses SHIPPED of them: leave-one-conversation-out on the LoCoMo dev questions (bench/locomo.py) showed
that these generalize to a conversation the model was not fitted on and the others do not add to them
(docs/retrieval.md, "Learned second stage"). Scoring is one product with numpy.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

from hutch.memory._index._query import Reading
from hutch.memory._index._rank import Channel, Snapshot

#: How many of the fused list's best units the second stage re-ranks.
POOL = 50
MODEL = Path(__file__).with_name("ranker.json")
CHANNELS = ("bm25", "dense", "entity", "mention", "time", "category")
_WHEN = re.compile(r"^\s*(when\b|how long ago\b|(in )?what (year|month|day|date|time)\b|which (year|month|day)\b)",
                   re.I)

FEATURES = (
    *(f"{c}" for c in CHANNELS),  # the channel's contribution to the fused score (0 when it did not find the unit)
    "bm25_rank", "dense_rank", "entity_rank",  # log(1 + rank in the pool by the channel's own score)
    "fused", "fused_rank",  # the fused score over the pool's best; log(1 + rank)
    "turn",  # the unit is a conversation turn (else an entity of its own: a note, a person, an event)
    "entity_best", "entity_share",  # its entity's best fused score in the pool over the pool's best; its share
    "neighbour_max", "neighbour_mean",  # the fused scores of the turns before and after it (same entity)
    "speaks_of_time", "when_x_time",  # the turn's own words name a time; and the question asks when
    "named_speaker", "other_speaker",  # the question names someone: the turn is theirs / a turn of someone else
    "degree",  # log(1 + links of its entity, either direction)
)


def asks_when(text: str) -> bool:
    return bool(_WHEN.search(text))


#: The features the shipped model uses (chosen by leave-one-conversation-out, docs/retrieval.md): what a turn is
#: worth against other entities, and how much its neighbours count. The others are computed for bench/locomo.py.
SHIPPED = ("fused", "fused_rank", "turn", "neighbour_max", "neighbour_mean")


@dataclass(frozen=True)
class Ranker:
    """A linear model over some of FEATURES (`names`): score = ((x - mean) / scale) @ weights + bias."""

    names: tuple[str, ...]
    mean: np.ndarray
    scale: np.ndarray
    weights: np.ndarray
    bias: float
    meta: dict

    def score(self, X: np.ndarray) -> np.ndarray:
        """X: (candidates, len(FEATURES))."""
        Z = X[:, [FEATURES.index(f) for f in self.names]]
        return ((Z - self.mean) / self.scale) @ self.weights + self.bias

    def to_json(self) -> str:
        return json.dumps({"features": list(self.names), "mean": self.mean.round(6).tolist(),
                           "scale": self.scale.round(6).tolist(), "weights": self.weights.round(6).tolist(),
                           "bias": round(self.bias, 6), "meta": self.meta}, indent=1) + "\n"

    @classmethod
    def from_json(cls, text: str) -> "Ranker":
        d = json.loads(text)
        names = tuple(d["features"])
        if not set(names) <= set(FEATURES):
            raise ValueError(f"the ranker's features {names} are not all among this code's {FEATURES}")
        return cls(names, np.array(d["mean"]), np.array(d["scale"]), np.array(d["weights"]), float(d["bias"]),
                   d.get("meta", {}))


@lru_cache(maxsize=1)
def shipped() -> Ranker | None:
    """The model shipped with the package, None if there is none."""
    try:
        return Ranker.from_json(MODEL.read_text())
    except FileNotFoundError:
        return None


def features(q: Reading, snap: Snapshot, db, channels: list[Channel], scales: dict, score: np.ndarray,
             pool: list[int], need: tuple[str, ...] = FEATURES) -> np.ndarray:
    """(len(pool), len(FEATURES)) for the pool's units, best first by the fused score (the link counts, which
    cost a query, only when `need` has "degree")."""
    m = len(pool)
    P = np.asarray(pool, np.int64)
    X = np.zeros((m, len(FEATURES)))
    col = {name: i for i, name in enumerate(FEATURES)}
    by = {ch.name: ch for ch in channels}
    fused = score[P]
    top = fused[0] if m and fused[0] > 0 else 1.0
    for c in CHANNELS:
        ch = by.get(c)
        if ch is None or c not in scales:
            continue
        off, div = scales[c]
        found = ch.present[P]
        X[:, col[c]] = np.where(found, (ch.scores[P] - off) / div, 0.0)
        if c + "_rank" in col:
            order = np.argsort(-np.where(found, ch.scores[P], -np.inf), kind="stable")
            r = np.empty(m)
            r[order] = np.arange(1, m + 1)
            X[:, col[c + "_rank"]] = np.log1p(np.where(found, r, m + 1))
    for c in ("bm25_rank", "dense_rank", "entity_rank"):
        if not X[:, col[c]].any():
            X[:, col[c]] = math.log1p(m + 1)
    X[:, col["fused"]] = fused / top
    X[:, col["fused_rank"]] = np.log1p(np.arange(1, m + 1))
    turn = snap.is_turn[P]
    X[:, col["turn"]] = turn
    ent = snap.epos[P]
    best: dict[int, float] = {}
    count: dict[int, int] = {}
    for e, f in zip(ent.tolist(), fused.tolist()):
        best[e] = max(best.get(e, -np.inf), f)
        count[e] = count.get(e, 0) + 1
    X[:, col["entity_best"]] = [best[e] / top for e in ent.tolist()]
    X[:, col["entity_share"]] = [count[e] / m for e in ent.tolist()]
    n = snap.n
    nb = np.zeros((m, 2))
    for j, d in enumerate((-1, 1)):
        o = P + d
        ok = (o >= 0) & (o < n)
        o = np.clip(o, 0, n - 1)
        ok &= snap.alive[o] & (snap.epos[o] == ent) & turn
        nb[:, j] = np.where(ok, score[o] / top, 0.0)
    X[:, col["neighbour_max"]] = nb.max(1)
    X[:, col["neighbour_mean"]] = nb.mean(1)
    timed = turn & ~np.isnan(snap.ev_from[P])
    X[:, col["speaks_of_time"]] = timed
    X[:, col["when_x_time"]] = timed & asks_when(q.text)
    if q.mentioned:
        mention = by.get("mention")
        named = mention.present[P] if mention is not None else np.zeros(m, bool)
        X[:, col["named_speaker"]] = turn & named
        X[:, col["other_speaker"]] = turn & ~named
    if "degree" not in need:
        return X
    ids = sorted({snap.entity_id[e] for e in ent.tolist()})
    deg = dict.fromkeys(ids, 0)
    if ids:
        marks = ",".join("?" * len(ids))
        for col_name in ("src", "dst"):
            for eid, c in db.execute(f"select {col_name}, count(*) from links where {col_name} in ({marks}) "
                                     f"group by {col_name}", ids):
                deg[eid] += c
    X[:, col["degree"]] = np.log1p([deg[snap.entity_id[e]] for e in ent.tolist()])
    return X


def contributions(channels: list[Channel], scales: dict, mask: np.ndarray) -> np.ndarray:
    """(units, len(CHANNELS)): each channel's contribution to every unit's fused score (0 outside `mask` and where
    the channel found nothing); a row sums to the fused score. For bench/locomo_variants.py: variants of the
    fusion and of the second stage scored without asking again."""
    n = len(mask)
    C = np.zeros((n, len(CHANNELS)))
    for ch in channels:
        if ch.name in scales and ch.name in CHANNELS:
            off, div = scales[ch.name]
            C[:, CHANNELS.index(ch.name)] = np.where(mask & ch.present[:n], (ch.scores[:n] - off) / div, 0.0)
    return C


def fit(X: np.ndarray, y: np.ndarray, groups: np.ndarray, l2: float = 1.0, meta: dict | None = None,
        names: tuple[str, ...] = SHIPPED) -> Ranker:
    """Logistic regression (L2, Newton's method) on the standardised `names` columns of X (candidates x
    FEATURES); each question weighs the same (its candidates' weights sum to one). For bench/locomo.py:
    training needs numpy only."""
    return fit_columns(X[:, [FEATURES.index(f) for f in names]], y, groups, l2, meta, names)


def fit_columns(X: np.ndarray, y: np.ndarray, groups: np.ndarray, l2: float = 1.0, meta: dict | None = None,
                names: tuple[str, ...] = SHIPPED) -> Ranker:
    """`fit` on X's columns as they are, named `names` (bench/locomo_variants.py: features this code does not
    compute; such a Ranker is not for Ranker.score)."""
    mean = X.mean(0)
    scale = X.std(0)
    scale[scale == 0] = 1.0
    Z = (X - mean) / scale
    _, inv, counts = np.unique(groups, return_inverse=True, return_counts=True)
    sw = 1.0 / counts[inv]
    sw *= len(np.unique(groups)) / sw.sum()
    A = np.hstack([Z, np.ones((len(Z), 1))])
    w = np.zeros(A.shape[1])
    reg = np.full(A.shape[1], l2)
    reg[-1] = 0.0
    for _ in range(50):
        p = 1 / (1 + np.exp(-(A @ w)))
        g = A.T @ (sw * (p - y)) + reg * w
        H = (A * (sw * p * (1 - p))[:, None]).T @ A + np.diag(reg) + 1e-9 * np.eye(len(w))
        step = np.linalg.solve(H, g)
        w -= step
        if np.abs(step).max() < 1e-8:
            break
    return Ranker(tuple(names), mean, scale, w[:-1], float(w[-1]), meta or {})
