"""The approximate dense channel of large stores (sign-bit shortlist + exact cosines), forced on small stores
by lowering `_rank.APPROX_MIN_UNITS`: it must answer like the exact channel (real files, SQLite, model)."""

import itertools
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest

import hutch
from hutch.memory._index import _rank

TOPICS = {
    "sailing": ["The boat left the harbour at dawn", "We trimmed the mainsail against the wind",
                "The regatta course rounds the island twice"],
    "baking": ["The sourdough starter needs feeding every morning", "Bake the loaf until the crust is dark",
               "Knead the dough for ten minutes"],
    "churn": ["Many subscribers cancelled their plans this quarter", "Renewals fell after the price change",
              "Customers who leave cite missing features"],
    "hiring": ["We interviewed three backend engineers", "The offer letter goes out on Friday",
               "Onboarding takes two weeks for new staff"],
    "garden": ["The tomatoes need staking before they flower", "Compost the leaves in autumn",
               "Water the seedlings in the evening"],
    "running": ["The marathon training plan peaks at thirty kilometres", "Easy runs keep the legs fresh",
                "Shin splints ended the race early"],
    "music": ["The quartet rehearsed the second movement", "Tune the guitar before the concert",
              "Piano scales every morning improve speed"],
    "travel": ["The flight to Lisbon was delayed by storms", "Book the hotel near the conference centre",
               "The night train crosses the mountains"],
}


def _texts() -> list[tuple[str, str]]:
    out = []
    for topic, sents in TOPICS.items():
        for i, (a, b) in enumerate(itertools.permutations(sents, 2)):
            for j in range(6):
                out.append((f"{topic} note {i}-{j}", f"{a}. {b}. Entry {j} of the {topic} log."))
    return out


@pytest.fixture(scope="module")
def big():
    d = Path(tempfile.mkdtemp(prefix="hutch-search-test-"))
    try:
        mem = hutch.Memory(d / "mem")
        (mem.root / "notes").mkdir()
        for i, (title, body) in enumerate(_texts()):
            (mem.root / "notes" / f"n{i}.md").write_text(f"---\ntitle: {title}\n---\n{body}\n")
        mem.reindex()
        yield mem
        mem.index.close()
    finally:
        shutil.rmtree(d, ignore_errors=True)


QUERIES = ["people cancelling their subscription", "bread in the oven", "vegetables in the backyard",
           "a long distance race", "recruiting programmers", "a trip abroad", "rehearsal before the show",
           "wind and waves"]


def _answers(mem, queries, **kw):
    return [[(h.entity_id, h.anchor, h.score, {c: dict(v) for c, v in h.channels.items()})
             for h in mem.search(q, k=10, **kw)] for q in queries]


def _approx(monkeypatch, shortlist, sample):
    monkeypatch.setattr(_rank, "APPROX_MIN_UNITS", 0)
    monkeypatch.setattr(_rank, "SHORTLIST", shortlist)
    monkeypatch.setattr(_rank, "SAMPLE", sample)


def test_store_is_large_enough_to_matter(big):
    assert big.index.snap.n == len(_texts()) == 288


def test_shortlist_covering_every_unit_answers_as_the_exact_channel(big, monkeypatch):
    exact = _answers(big, QUERIES)
    exact_f = _answers(big, QUERIES[:3], classes=["notes"], fusion="rrf")
    _approx(monkeypatch, 10_000, 10_000)
    snap = big.index.snap
    qv = big.index.provider.embed(["anything"])[0]
    assert _rank.DenseQuery(snap, qv, np.ones(snap.n, bool)).exact is not None  # the approximate path runs
    for got, want in zip(_answers(big, QUERIES) + _answers(big, QUERIES[:3], classes=["notes"], fusion="rrf"),
                         exact + exact_f):
        assert [h[:2] for h in got] == [h[:2] for h in want]
        for g, w in zip(got, want):
            assert g[2] == pytest.approx(w[2], abs=1e-5)
            assert {c: v.get("rank") for c, v in g[3].items()} == {c: v.get("rank") for c, v in w[3].items()}


def test_small_shortlist_keeps_the_top_hits(big, monkeypatch):
    exact = _answers(big, QUERIES)
    _approx(monkeypatch, 24, 10_000)  # 10% of the units shortlisted, plus what BM25 finds
    approx = _answers(big, QUERIES)
    for got, want in zip(approx, exact):
        assert [h[0] for h in got[:5]] == [h[0] for h in want[:5]]
        for g, w in zip(got[:5], want[:5]):  # the hits carry exact cosines
            assert g[3]["dense"]["score"] == pytest.approx(w[3]["dense"]["score"], abs=1e-5)


def _topic(entity_id: str) -> str:
    return _texts()[int(entity_id.rsplit("/n", 1)[1])][0].split()[0]


def test_sampled_moments_keep_the_best_hits(big, monkeypatch):
    exact = _answers(big, QUERIES)
    _approx(monkeypatch, 24, 48)  # mean and sd from 48 of the 288 units: scores move a little, not the topics
    for got, want in zip(_answers(big, QUERIES), exact):
        assert [_topic(h[0]) for h in got[:5]] == [_topic(h[0]) for h in want[:5]]


def _snapshot(V: np.ndarray) -> _rank.Snapshot:
    snap = _rank.Snapshot(V.shape[1])
    snap._grow(len(V))
    snap.V[:len(V)] = V
    snap.has_vec[:len(V)] = True
    snap.alive[:len(V)] = True
    snap.n = len(V)
    return snap


def _clustered(n, dim=384, seed=3):
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(40, dim)) + 2.0  # a shared offset, like a real model's mean direction
    V = centres[rng.integers(0, 40, n)] + rng.normal(size=(n, dim)) * 0.8
    return (V / np.linalg.norm(V, axis=1, keepdims=True)).astype(np.float32)


def test_dense_query_exact_where_it_says_and_shortlist_holds_the_nearest():
    V = _clustered(3000)
    rng = np.random.default_rng(5)
    mask = rng.random(3000) < 0.8
    # ten queries, each with 20 near neighbours planted among the candidates
    cand = np.flatnonzero(mask)
    planted = rng.choice(cand, (10, 20), replace=False)
    for qi in range(10):
        near = V[planted[qi]] * 0.6 + V[planted[qi, 0]] * 1.5
        V[planted[qi]] = near / np.linalg.norm(near, axis=1, keepdims=True)
    snap = _snapshot(V)
    for qi in range(10):
        q = V[planted[qi, 0]] + rng.normal(size=384).astype(np.float32) * 0.02
        q = (q / np.linalg.norm(q)).astype(np.float32)
        d = _rank.DenseQuery(snap, q, mask, min_units=0, shortlist=300, sample=256)
        truth = (V @ q).astype(np.float64)
        assert np.allclose(d.values[d.exact], truth[d.exact], atol=1e-6)
        assert not d.exact[~mask].any()
        assert d.exact.sum() <= 300 + 256
        top = np.flatnonzero(mask)[np.argsort(-truth[mask])[:20]]
        assert d.exact[top].all()  # the 20 nearest candidates got their exact cosine
        samp = truth[mask][np.linspace(0, mask.sum() - 1, 256).round().astype(int)]
        assert d.moments == pytest.approx((samp.mean(), samp.std()))
        # make_exact replaces estimates, nearest by Hamming distance first when capped
        want = mask & ~d.exact
        before = int(d.exact.sum())
        d.make_exact(want, cap=100)
        added = np.flatnonzero(d.exact & want)
        assert int(d.exact.sum()) == before + 100
        assert d.h[added].max() <= d.h[want & ~d.exact].min()
        assert np.allclose(d.values[d.exact], truth[d.exact], atol=1e-6)


def test_dense_query_covering_everything_is_exact():
    V = _clustered(500)
    snap = _snapshot(V)
    q = V[7]
    mask = np.ones(500, bool)
    d = _rank.DenseQuery(snap, q, mask, min_units=0, shortlist=500, sample=500)
    truth = (V @ q).astype(np.float64)
    assert d.exact.all()
    assert np.allclose(d.values, truth, atol=1e-6)
    assert d.moments == pytest.approx((truth.mean(), truth.std()))
    exact = _rank.DenseQuery(snap, q, mask)  # below APPROX_MIN_UNITS: the plain product
    assert exact.exact is None and exact.moments is None
    assert np.allclose(exact.values, truth, atol=1e-6)


def test_sign_bits_follow_edits_and_new_units(mem, monkeypatch):
    monkeypatch.setattr(_rank, "APPROX_MIN_UNITS", 0)
    monkeypatch.setattr(_rank, "SHORTLIST", 2)
    monkeypatch.setattr(_rank, "SAMPLE", 2)
    for title, body in [("Boat", "We sailed to the island."), ("Bread", "The sourdough rose overnight."),
                        ("Garden", "Tomatoes ripen in August."), ("Race", "The marathon starts at nine.")]:
        mem.put("notes", title, body=body)
    assert mem.search("sailing trip", k=1)[0].entity_id == "notes/boat"
    snap = mem.index.snap
    assert snap.bits is not None  # built by the approximate query
    mem.put("notes", "Concert", body="The orchestra played Brahms to a full hall.")
    (mem.root / "notes" / "bread.md").write_text("---\ntitle: Bread\n---\nThe violinist tuned her instrument.\n")
    hits = mem.search("classical music performance", k=2)
    assert {h.entity_id for h in hits} == {"notes/concert", "notes/bread"}
    snap = mem.index.snap
    alive = np.flatnonzero(snap.alive[:snap.n])
    assert np.array_equal(snap.bits[:, alive], _rank._pack(snap.V[alive], snap.center).T)


def test_filter_leaving_few_candidates_scores_just_those(mem, monkeypatch):
    for i, (title, body) in enumerate([("Boat", "We sailed to the island."), ("Bread", "The sourdough rose."),
                                       ("Garden", "Tomatoes ripen in August."), ("Race", "The marathon starts.")]):
        mem.put("notes", title, body=body)
        mem.put("decisions", f"Decision {i}", body=f"We decided: {body.lower()}")
    queries = ["sailing trip", "baking bread", "vegetables", "running"]
    exact = [_answers(mem, [q], classes=["decisions"])[0] for q in queries]
    monkeypatch.setattr(_rank, "APPROX_MIN_UNITS", 5)  # 8 units: above; 4 decisions: a filtered exact channel
    snap = mem.index.snap
    d = _rank.DenseQuery(snap, mem.index.provider.embed(["x"])[0], np.array(
        [snap.ecls[e] == "decisions" for e in snap.epos[:snap.n]]))
    assert d.exact is None and snap.bits is None  # exact, and no sign bits were needed
    for q, want in zip(queries, exact):
        got = _answers(mem, [q], classes=["decisions"])[0]
        assert [h[0] for h in got] == [h[0] for h in want]
        assert [h[2] for h in got] == pytest.approx([h[2] for h in want], abs=1e-5)
