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
