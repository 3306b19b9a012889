"""Adjacent question words as phrases in the bm25 channel (the sequential dependence model; real store, real SQLite
FTS5)."""

import pytest

from hutch.memory._index import _rank, _units


@pytest.mark.parametrize("question, names, pairs", [
    ("When did Melanie sign up for a pottery class?", ["melanie"], [("pottery", "class")]),
    ("When did Caroline go to the LGBTQ support group?", ["caroline"], [("lgbtq", "support"), ("support", "group")]),
    ("What is Melanie's hand-painted bowl a reminder of?", ["melanie"], [("painted", "bowl")]),  # not across "-"
    ("What did Jon Smith paint?", ["jon smith", "jon"], []),  # the name is the mention channel's
    ("Art, music and books?", [], []),  # punctuation and function words separate
    ("What did she paint?", [], []),
    ("pottery class or pottery class", [], [("pottery", "class")]),  # each pair once
])
def test_pairs_of_adjacent_content_words(question, names, pairs):
    assert _units.phrases(question, names) == pairs


def test_fts_expressions_quote_their_words():
    assert _units.fts_phrase_query([]) is None
    assert _units.fts_phrase_query([("pottery", "class")]) == '"pottery class"'
    assert _units.fts_phrase_query([("a", "b"), ("c", 'd"')], near=8) == 'NEAR("a" "b", 8) OR NEAR("c" "d""", 8)'


def _bm25_rank(mem, query, entity_id):
    hit = next(h for h in mem.search(query, k=20, classes=["notes"]) if h.entity_id == entity_id)
    return hit.channels["bm25"]["rank"]


def test_a_phrase_match_outranks_the_same_words_apart(mem, monkeypatch):
    mem.put("notes", "Glazing", body="We glazed bowls at the pottery class and then cleaned all of the wheels and "
                                     "tables.")
    # the same two words, more than SDM_WINDOW tokens apart, in a shorter note: plain BM25 prefers this one
    mem.put("notes", "Trip", body="Our class cancelled the trip because snow closed the roads, so pottery waited.")
    for i, topic in enumerate(["sailing on the lake", "tax forms due in May", "the garden fence", "a new laptop",
                               "train tickets to Lyon", "the dentist on Friday", "soup recipes", "a chess club"]):
        mem.put("notes", f"Filler {i}", body=f"Something about {topic}.")
    query = "Who runs the pottery class?"
    assert _units.phrases(query) == [("pottery", "class")]
    assert _bm25_rank(mem, query, "notes/glazing") == 1
    monkeypatch.setattr(_rank, "SDM_WEIGHTS", (1.0, 0.0, 0.0))  # single words only: the old channel
    assert _bm25_rank(mem, query, "notes/trip") == 1
    assert _bm25_rank(mem, query, "notes/glazing") == 2


def test_a_question_of_common_words_only_still_answers(mem):
    for i in range(3):
        mem.put("notes", f"Day {i}", body="A really great day at the beach.")
    hits = mem.search("really great day", k=5)
    assert len(hits) == 3
    assert all("bm25" in h.channels for h in hits)
