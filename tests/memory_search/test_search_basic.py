"""Search finds by meaning and by words, anchors conversation turns, filters and expands (real SQLite, files, git)."""

import pytest

import hutch
from _search_helpers import CONVERSATION


def test_finds_by_meaning_without_shared_words(mem):
    mem.put("notes", "Subscription cancellations", body="Many subscribers cancelled their plans this quarter.")
    mem.put("notes", "Office move", body="The team relocates to the third floor in spring.")
    mem.put("notes", "Lunch menu", body="Tacos on Tuesday, pasta on Thursday.")
    hits = mem.search("customer churn", k=3)
    assert hits[0].entity_id == "notes/subscription-cancellations"
    assert "dense" in hits[0].channels and "bm25" not in hits[0].channels  # no word in common: meaning found it
    assert hits[0].channels["dense"]["rank"] == 1
    assert hits[0].entity.title == "Subscription cancellations"


def test_words_and_channels_reported(mem):
    mem.put("notes", "Pricing", body="The pro plan costs 30 euros.")
    mem.put("notes", "Hiring", body="We hire two engineers.")
    hit = mem.search("pro plan euros", k=1)[0]
    assert hit.entity_id == "notes/pricing"
    assert hit.channels["bm25"]["rank"] == 1 and hit.channels["bm25"]["score"] > 0
    assert hit.score > 0


def test_turn_hits_carry_their_dia_id(mem):
    mem.ingest_conversation(CONVERSATION, conv_id="c1")
    hits = mem.search("What is the name of Nadia's dog?", k=5, classes=["interactions"])
    assert {h.anchor for h in hits} >= {"D1:5"} or {h.anchor for h in hits} >= {"D1:3"}
    for h in hits:
        assert h.entity_id.startswith("interactions/c1-session-")
        assert h.anchor and h.anchor.startswith("D")
        assert h.text  # the turn's own text, read back from the file
    top = mem.search("adopted a beagle puppy from the shelter", k=1, classes=["interactions"])[0]
    assert (top.entity_id, top.anchor) == ("interactions/c1-session-1", "D1:3")
    assert "beagle" in top.text
    assert top.speaker == "Nadia"  # who said it, from the turn's heading
    assert mem.search("sailing boat", k=1, classes=["interactions"])[0].speaker == "Tomas"
    assert all(h.speaker is None for h in mem.search("beagle", k=3, classes=["actors", "events"]))
    # one turn per hit
    assert len({(h.entity_id, h.anchor) for h in hits}) == len(hits)


def test_speaker_mention_prefers_their_turns(mem):
    mem.ingest_conversation(CONVERSATION, conv_id="c1")
    hits = mem.search("What hobby does Tomas have?", k=3, classes=["interactions"])
    assert hits[0].anchor in {"D1:2", "D2:1"}
    assert "mention" in hits[0].channels


def test_filters_classes_since_until_as_of(mem):
    mem.put("decisions", "Raise prices", body="We raise the price of the pro plan.", valid_from="2026-10-05")
    mem.put("decisions", "Old pricing", body="We keep the price of the pro plan.", valid_from="2026-01-10",
            valid_to="2026-10-05")
    mem.put("notes", "Price research", body="Competitors price their pro plan higher.", valid_from="2026-10-20")
    ids = lambda hits: {h.entity_id for h in hits}  # noqa: E731
    assert ids(mem.search("pro plan price", classes=["decisions"])) == {"decisions/raise-prices", "decisions/old-pricing"}
    assert ids(mem.search("pro plan price", since="2026-10-01")) == {"decisions/raise-prices", "notes/price-research"}
    assert ids(mem.search("pro plan price", until="2026-06-01")) == {"decisions/old-pricing"}
    assert ids(mem.search("pro plan price", classes="decisions", since="2026-10-01")) == {"decisions/raise-prices"}
    assert ids(mem.search("pro plan price", as_of="2026-05-01", classes=["decisions"])) == {"decisions/old-pricing"}
    assert ids(mem.search("pro plan price", as_of="2026-11-01", classes=["decisions"])) == {"decisions/raise-prices"}
    with pytest.raises(hutch.ConfigError, match="ISO 8601"):
        mem.search("price", since="last tuesday")


def test_date_in_question_is_a_time_channel(mem):
    mem.ingest_conversation(CONVERSATION, conv_id="c1")
    hits = mem.search("What did Tomas say in June 2023?", k=3, classes=["interactions"])
    assert hits[0].entity_id == "interactions/c1-session-2"
    assert "time" in hits[0].channels


def test_expand_adds_the_link_neighbourhood(mem):
    acme = mem.put("orgs", "Acme", body="A maker of anvils.")
    alice = mem.put("actors", "Alice Chen", body="Head of data.")
    bob = mem.put("actors", "Bob Stone", body="Sales lead.")
    mem.link(alice, "works_at", acme)
    mem.link(bob, "reports_to", alice)
    plain = mem.search("anvils", k=1)
    assert [h.entity_id for h in plain] == ["orgs/acme"]
    wide = mem.search("anvils", k=1, expand=2)
    graph = {h.entity_id: h.channels["graph"] for h in wide[1:]}
    assert graph["actors/alice-chen"]["hops"] == 1
    assert graph["actors/alice-chen"]["via"] == "actors/alice-chen -[works_at]-> orgs/acme"
    assert graph["actors/bob-stone"]["hops"] == 2
    assert wide[1].score < wide[0].score


def test_bad_arguments_are_clear_errors(mem):
    mem.put("notes", "A", body="x")
    for kw, msg in [({"k": 0}, "positive"), ({"expand": 9}, "expand"), ({"fusion": "max"}, "fusion")]:
        with pytest.raises(hutch.ConfigError, match=msg):
            mem.search("x", **kw)
    with pytest.raises(hutch.ConfigError, match="non-empty"):
        mem.search("  ")


def test_link_propagation_lifts_the_linked_entity(mem, monkeypatch):
    """The optional propagation (off by default, see docs/retrieval.md) passes an entity's BM25 along its links."""
    from hutch.memory._index import _rank

    mem.ingest_conversation(CONVERSATION, conv_id="c1")
    ev = mem.put("events", "Lake picnic", body="A picnic by the lake with friends.")
    mem.link(ev, "in_session", "interactions/c1-session-2")
    def entity_score(hits):
        return max(h.channels["entity"]["score"] for h in hits if h.entity_id == "interactions/c1-session-2")

    plain = mem.search("picnic lake", k=8, classes=["interactions"])
    monkeypatch.setattr(_rank, "LINK_PROPAGATION", True)
    lifted = mem.search("picnic lake", k=8, classes=["interactions"])
    assert entity_score(lifted) > entity_score(plain) + 0.5  # the event's BM25 (max-normalised: 1) arrived
    assert lifted[0].entity_id == "interactions/c1-session-2"


def test_one_unit_entities_take_their_entity_bm25_from_the_unit(mem):
    import sqlite3
    mem.put("notes", "Harbour crane", body="The harbour crane was repaired in March.")
    mem.put("notes", "Lunch", body="Tacos on Tuesday.")
    mem.ingest_conversation(CONVERSATION, conv_id="c1")
    hits = mem.search("harbour crane repaired", k=3)
    assert hits[0].entity_id == "notes/harbour-crane"
    # the entity channel still scores a one-unit entity by its words, though only conversations are in ent_fts
    assert hits[0].channels["entity"]["rank"] == 1 and hits[0].channels["bm25"]["rank"] == 1
    db = sqlite3.connect(mem.index.idx.path)
    try:
        ent_rows = {r[0] for r in db.execute("select f.entity_id from ent_fts e join files f on f.eid = e.rowid")}
    finally:
        db.close()
    assert ent_rows == {e for e in ent_rows if e.startswith("interactions/")} and ent_rows
    # a conversation turn still gets its session's entity-level score
    turn = mem.search("sailing boat restoring", k=1, classes=["interactions"])[0]
    assert turn.anchor and "entity" in turn.channels
