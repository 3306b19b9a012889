"""Bulk embedding (one single-threaded ONNX session per thread, batches side by side) gives the very vectors of
the one multi-threaded session, in the caller's order (real model)."""

import numpy as np

from hutch.memory._index import _embed


def test_bulk_sessions_give_the_same_vectors_in_order(monkeypatch):
    words = "harbour sourdough marathon violin compost invoice glacier lantern orchard telescope".split()
    # lengths vary so that batches are regrouped by length and split over the sessions
    texts = [" ".join(words[(i * 7 + j) % len(words)] for j in range(1 + i % 23)) for i in range(150)]
    p = _embed.MiniLMProvider(threads=2)
    bulk = p.embed(texts, batch=16)
    assert len(p._bulk) == 2  # the bulk path ran, on two sessions
    monkeypatch.setattr(_embed, "BULK_MIN", 10**9)
    single = p.embed(texts, batch=16)
    assert bulk.shape == (150, p.dim)
    assert np.allclose(bulk, single, atol=1e-6)
    assert np.allclose(np.linalg.norm(bulk, axis=1), 1.0, atol=1e-5)
    # each row belongs to its own text: embedding one text alone gives the same row
    for i in (0, 37, 149):
        assert np.allclose(p.embed([texts[i]])[0], bulk[i], atol=1e-5)
