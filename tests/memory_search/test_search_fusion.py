"""Fusion arithmetic: the fast paths of `_rank.fuse` / `_rank.top_k` against their plain definitions."""

import numpy as np
import pytest

from hutch.memory._index import _rank


def reference_fuse(channels, mask):
    """The definition: per channel, max-normalised (zero-based) or scaled by the mean and standard deviation
    of the masked candidates (mean - 3 sd -> 0, mean + 3 sd -> 1), summed."""
    total = np.zeros(len(mask))
    for ch in channels:
        cand = mask & ch.present
        if not cand.any():
            continue
        x = np.where(cand, ch.scores, 0.0)
        if ch.zero_based:
            total += _rank.maxnorm(x, mask)
        else:
            mu, sd = x[mask].mean(), x[mask].std()
            if sd > 0:
                total += np.where(mask, (x - (mu - 3 * sd)) / (6 * sd), 0.0)
    return total


def reference_top_k(score, mask, k):
    pos = [int(p) for p in np.flatnonzero(mask)]
    return sorted(pos, key=lambda p: (-score[p], p))[:k]


@pytest.mark.parametrize("share", [1.0, 0.7, 0.1, 0.0])
def test_fuse_and_top_k_match_their_definitions(share):
    rng = np.random.default_rng(int(share * 10))
    for _ in range(300):
        n = int(rng.integers(1, 80))
        mask = rng.random(n) < share
        channels = []
        for j in range(int(rng.integers(1, 5))):
            zero_based = bool(rng.random() < 0.6)
            # rounded scores: ties are common, as with binary channels and equal BM25 scores
            scores = np.round(rng.random(n) * 3, 1) if zero_based else np.round(rng.normal(size=n), 1)
            present = scores > 0 if zero_based else (mask.copy() if rng.random() < 0.5 else rng.random(n) < 0.5)
            channels.append(_rank.Channel(f"c{j}", scores, present, zero_based))
        fused = _rank.fuse(channels, mask, "weighted")
        assert np.array_equal(fused, reference_fuse(channels, mask))
        assert not fused[~mask].any()
        for k in (1, 3, 10, 100):
            assert _rank.top_k(fused, mask, k) == reference_top_k(fused, mask, k)


def test_ranks_and_scalings_match_their_definitions():
    # ranks_of compares with the values above the lowest asked for; minmax / maxnorm skip the select when
    # nothing is filtered: the same numbers as the plain definitions, ties and NaN included
    rng = np.random.default_rng(5)
    for _ in range(300):
        n = int(rng.integers(1, 60))
        x = np.round(rng.normal(size=n), 1)
        if rng.random() < 0.2:
            x[rng.integers(0, n)] = np.nan
        mask = np.ones(n, bool) if rng.random() < 0.5 else rng.random(n) < 0.6
        if not mask.any():
            continue
        pos = [int(p) for p in rng.choice(np.flatnonzero(mask), size=min(5, int(mask.sum())), replace=False)]
        assert _rank.ranks_of(x, mask, pos) == [1 + int(np.sum(x[mask] > x[p])) for p in pos]
        y = np.abs(np.nan_to_num(x))
        lo, hi = y[mask].min(), y[mask].max()
        want = np.where(mask, (y - lo) / (hi - lo), 0.0) if hi > lo else np.zeros(n)
        assert np.array_equal(_rank.minmax(y, mask), want)
        top = y[mask].max()
        want = np.where(mask, y / top, 0.0) if top > 0 else np.zeros(n)
        assert np.array_equal(_rank.maxnorm(y, mask), want)
