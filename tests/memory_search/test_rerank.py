"""The learned second stage (issue 16) and the reference time of relative words when no now= is given. Real
store, real index; the model is the one shipped in the package (hutch/memory/_index/ranker.json)."""

import copy
from datetime import datetime, timezone

import numpy as np

from hutch.memory._index import _rerank
from _search_helpers import CONVERSATION


def _conversation():
    c = copy.deepcopy(CONVERSATION)
    c["session_2"][0]["text"] = "The boat is finally in the water, we sailed to the island last Saturday."
    return c


def test_the_shipped_model_loads_and_scores_with_numpy():
    model = _rerank.shipped()
    assert model is not None and set(model.names) == set(_rerank.SHIPPED) <= set(_rerank.FEATURES)
    assert model.meta["fitted_on"] == ["conv-26", "conv-30", "conv-41"]
    X = np.random.default_rng(1).random((7, len(_rerank.FEATURES)))
    cols = [_rerank.FEATURES.index(f) for f in model.names]
    want = ((X[:, cols] - model.mean) / model.scale) @ model.weights + model.bias
    assert np.allclose(model.score(X), want)
    assert _rerank.Ranker.from_json(model.to_json()).names == model.names


def test_fit_learns_a_rule_from_the_features():
    rng = np.random.default_rng(0)
    X = rng.random((600, len(_rerank.FEATURES)))
    turn = _rerank.FEATURES.index("turn")
    X[:, turn] = rng.random(600) < 0.5
    y = (X[:, turn] > 0) & (rng.random(600) < 0.6)  # only turns are ever relevant
    model = _rerank.fit(X, y.astype(float), np.arange(600) // 20)
    w = dict(zip(model.names, model.weights))
    assert w["turn"] > 1 and all(abs(v) < 0.5 for k, v in w.items() if k != "turn")


def test_the_second_stage_reorders_the_fused_pool(mem):
    mem.ingest_conversation(_conversation(), conv_id="c1")
    mem.reindex()
    q = "What is the name of Nadia's puppy?"
    got: dict = {}
    first = mem.index.search(q, k=20, fusion="weighted", collect=got)
    hits = mem.search(q, k=10)  # the default: fusion="learned"
    model = _rerank.shipped()
    order = np.argsort(-model.score(got["X"]), kind="stable")
    want = [(got["entities"][i], got["anchors"][i]) for i in order][:10]
    assert [(h.entity_id, h.anchor) for h in hits] == want
    assert [h.score for h in hits] == sorted((h.score for h in hits), reverse=True)
    assert all(0 < h.score < 1 for h in hits)  # the model's probability
    assert {(h.entity_id, h.anchor) for h in hits} <= {(h.entity_id, h.anchor) for h in first}
    # a turn is what a question about a conversation asks for: the evidence turn leads, not the person or the day
    assert hits[0].anchor in ("D1:3", "D1:5")
    assert [h.anchor for h in mem.search(q, k=3, fusion="weighted")] == [h.anchor for h in first[:3]]


def test_the_collected_contributions_add_up_to_the_fused_score(mem):
    """bench/locomo_variants.py re-fuses from them: a row sums to the unit's fused score, the pool is its best."""
    mem.ingest_conversation(_conversation(), conv_id="c1")
    mem.reindex()
    got: dict = {}
    first = mem.index.search("Where did they sail last Saturday?", k=20, fusion="weighted", collect=got)
    C, mask = got["contributions"], got["mask"]
    assert C.shape == (len(mask), len(_rerank.CHANNELS)) and not C[~mask].any()
    total = C.sum(1)
    assert np.allclose([total[p] for p in got["pool"]], [h.score for h in first][:len(got["pool"])], atol=1e-6)
    assert list(got["pool"][:5]) == sorted(np.flatnonzero(mask), key=lambda p: (-total[p], p))[:5]
    assert got["query_vector"] is not None and got["query_vector"].shape == (mem.index.snap.dim,)
    # fit_columns is fit on the named columns, taken as they are
    rng = np.random.default_rng(2)
    X, y, g = rng.random((200, len(_rerank.FEATURES))), rng.random(200) < 0.3, np.arange(200) // 10
    cols = [_rerank.FEATURES.index(f) for f in _rerank.SHIPPED]
    a, b = _rerank.fit(X, y.astype(float), g), _rerank.fit_columns(X[:, cols], y.astype(float), g)
    assert np.allclose(a.weights, b.weights) and a.bias == b.bias


def test_relative_words_are_read_from_the_newest_entry_without_now(mem):
    # the conversation's last session is 20 June 2023: "last week" is 12..18 June 2023, when the boat sailed
    # ("last Saturday", said on 20 June); read against the clock it would be a week of today, which has nothing
    mem.ingest_conversation(_conversation(), conv_id="c1")
    q = "Where did Tomas sail last week?"
    hits = mem.search(q, k=3, classes=["interactions"])
    sailed = next(h for h in hits if h.anchor == "D2:1")
    assert "time" in sailed.channels
    now = datetime.now(timezone.utc).isoformat()
    assert all("time" not in h.channels for h in mem.search(q, k=3, classes=["interactions"], now=now))
    assert "time" in mem.search(q, k=3, classes=["interactions"], now="2023-06-20")[0].channels


def test_a_turn_reads_relative_words_from_its_conversation_a_note_from_the_newest_entry(mem):
    """One rule for the reference time without now=: the newest time among the candidates of a unit's kind. A turn
    reads "last week" from the newest candidate turn (the conversation's end), anything else from the newest
    candidate (here a note of today: the clock), so the defaults read a turn's time as classes= naming its class."""
    from hutch.memory._index import _time

    mem.ingest_conversation(_conversation(), conv_id="c1")
    clock_week = _time.find("last week", datetime.now(timezone.utc))
    day = datetime.fromtimestamp(clock_week.start + 86400, timezone.utc).strftime("%Y-%m-%d")
    note = mem.put("notes", "Harbour inspection", body="The harbour master inspected the moorings.", valid_from=day)
    mem.put("notes", "Today", body="A note written today: the newest entry of the store.")
    q = "Where did Tomas sail last week?"
    hits = mem.search(q, k=10)
    sailed = next(h for h in hits if h.anchor == "D2:1")
    assert "time" in sailed.channels  # 12..18 June 2023: the week before the conversation's last session
    with_class = next(h for h in mem.search(q, k=10, classes=["interactions"]) if h.anchor == "D2:1")
    assert sailed.channels["time"] == with_class.channels["time"]
    # the note is read against the newest entry (today): its day is in the clock's last week
    inspected = next(h for h in mem.search("What was inspected last week?", k=10) if h.entity_id == note.id)
    assert "time" in inspected.channels
    # given now=, every unit reads against it: the clock's last week holds no turn
    assert all("time" not in h.channels for h in mem.search(q, k=10, now=datetime.now(timezone.utc).isoformat())
               if h.anchor)


def _second_conversation():
    """Other people, a later end (5 March 2024): its "last week" is 26 February .. 3 March 2024."""
    return {
        "speaker_a": "Ines", "speaker_b": "Bruno",
        "session_1_date_time": "9:00 am on 12 January, 2024",
        "session_1": [{"speaker": "Ines", "dia_id": "D1:1", "text": "Did the kiln arrive at the studio?"},
                      {"speaker": "Bruno", "dia_id": "D1:2", "text": "It did, the pottery class starts soon."}],
        "session_2_date_time": "6:30 pm on 5 March, 2024",
        "session_2": [{"speaker": "Bruno", "dia_id": "D2:1", "text": "We sailed along the coast last Saturday."},
                      {"speaker": "Ines", "dia_id": "D2:2", "text": "You and your boats."}],
        "qa": [],
    }


def test_each_conversation_reads_relative_words_from_its_own_end(mem):
    """Two conversations in one store, of other people, ending 20 June 2023 and 5 March 2024: without now=,
    "last week" about each is the week before its own last session (one reference for the store read the first
    conversation's "last week" as 26 February .. 3 March 2024, where it has nothing). The sessions of one
    conversation (the same speakers) share its end: a session's own date is not its reference."""
    mem.ingest_conversation(_conversation(), conv_id="c1")
    mem.ingest_conversation(_second_conversation(), conv_id="c2")
    q = "Where did they sail last week?"
    for hits in (mem.search(q, k=10), mem.search(q, k=10, classes=["interactions"])):
        by = {(h.entity_id.split("/")[-1].split("-session")[0], h.anchor): h for h in hits}
        assert "time" in by["c1", "D2:1"].channels  # 12..18 June 2023 holds "last Saturday" said on 20 June
        assert "time" in by["c2", "D2:1"].channels  # 26 February .. 3 March 2024 holds its "last Saturday"
        assert by["c1", "D2:1"].channels["time"] == by["c2", "D2:1"].channels["time"]
    # D1:3's "yesterday" (7 May 2023) is in the week before its own session (8 May), not before c1's end
    adopted = next(h for h in mem.search("Who adopted a puppy last week?", k=10) if h.anchor == "D1:3"
                   and "c1" in h.entity_id)
    assert "time" not in adopted.channels
    # now= is one reference for every unit: 20 June 2023's last week is c1's only
    hits = mem.search(q, k=10, now="2023-06-20")
    assert [h.entity_id.split("/")[-1][:2] for h in hits if "time" in h.channels] == ["c1"]
