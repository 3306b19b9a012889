"""In a store of conversation turns, the entities hanging off the conversation (people, days, event summaries:
linked to or from a session) are searched through its turns (issue 16): `mem.search(q)` ranks exactly as with
the turns' class named, a note linked to no turn stays a hit, and a store of notes ranks as before. Real store,
real index, real git."""

import copy

import numpy as np

from hutch.memory._index import _anchor
from _search_helpers import CONVERSATION

QUESTIONS = ["What is the name of Nadia's puppy?", "When did Nadia adopt a puppy?", "What is Tomas restoring?",
             "Who is training for a marathon?", "What did Tomas do in June 2023?", "Nadia", "8 May 2023"]


def _conversation():
    c = copy.deepcopy(CONVERSATION)
    # LoCoMo's event summaries: each becomes an events/ entity linked to its session, its person and its day
    c["events_session_1"] = {"Nadia": ["Nadia adopts a beagle puppy named Biscuit from the shelter."],
                             "Tomas": ["Tomas buys an old sailing boat to restore."], "date": "8 May, 2023"}
    c["events_session_2"] = {"Tomas": ["Tomas sails his restored boat to the island."],
                             "Nadia": ["Nadia trains for an October marathon."], "date": "20 June, 2023"}
    return c


def _key(hits):
    return [(h.entity_id, h.anchor, h.score) for h in hits]


def test_the_defaults_rank_a_conversation_as_with_its_class(mem):
    mem.ingest_conversation(_conversation(), conv_id="c1")
    mem.reindex()
    for q in QUESTIONS:
        for fusion in ("learned", "weighted", "rrf"):
            hits = mem.search(q, k=10, fusion=fusion)
            assert _key(hits) == _key(mem.search(q, k=10, fusion=fusion, classes=["interactions"])), (q, fusion)
            # a person, a day or an event is never a hit of its own here: its turns are
            assert hits and all(h.anchor for h in hits), (q, [h.entity_id for h in hits])
    assert {"actors", "time", "events", "interactions"} <= set(mem.index.snap.ecls)
    # named alone, those classes are searched as they are (no turn among the candidates)
    ev = mem.search("Who adopted a beagle?", k=3, classes=["events"])
    assert ev and ev[0].entity_id.startswith("events/") and ev[0].anchor is None
    people = mem.search("Nadia", k=2, classes=["actors"])
    assert [h.entity_id for h in people][:1] == ["actors/nadia"]


def test_an_entity_linked_to_no_turn_stays_a_hit(mem):
    mem.ingest_conversation(_conversation(), conv_id="c1")
    note = mem.put("notes", "Biscuit at the vet", body="Biscuit the beagle sees the vet about his vaccinations.")
    q = "When does Biscuit see the vet about vaccinations?"
    hits = mem.search(q, k=5)
    assert hits[0].entity_id == note.id and hits[0].anchor is None
    # linked to a session, the note is searched through that session's turns
    mem.link(note.id, "about", "interactions/c1-session-1")
    hits = mem.search(q, k=5)
    assert note.id not in [h.entity_id for h in hits] and all(h.anchor for h in hits)
    assert _key(hits) == _key(mem.search(q, k=5, classes=["interactions"]))


def test_a_store_of_notes_ranks_as_before(mem, monkeypatch):
    notes = [("Quarterly churn review", "Customer churn rose in March; the retention team blamed pricing."),
             ("Pricing change", "We raised the starter plan's price in February."),
             ("Retention team", "Alice Chen leads retention; weekly meeting on Mondays."),
             ("Alice Chen", "Head of retention since 2022."),
             ("Onboarding survey", "New users asked for a shorter setup and better docs.")]
    ids = [mem.put("notes", t, body=b).id for t, b in notes]
    mem.link(ids[0], "mentions", ids[1])
    mem.link(ids[2], "led_by", ids[3])
    questions = ["Why did churn rise?", "Who leads retention?", "What did users ask for?", "Alice Chen",
                 "price change in February"]
    got = {q: _key(mem.search(q, k=5)) for q in questions}
    s = mem.index.snap
    mask = s.alive[:s.n].copy()
    assert _anchor.turn_side(s, mem.index.idx.db, mask) is mask  # no turns: the rule does nothing at all
    monkeypatch.setattr(_anchor, "turn_side", lambda snap, db, m: m)
    assert {q: _key(mem.search(q, k=5)) for q in questions} == got


def test_the_rule_follows_the_filters(mem):
    mem.ingest_conversation(_conversation(), conv_id="c1")
    # named with the turns' class, the events are searched through their sessions' turns
    both = mem.search("beagle puppy Biscuit shelter", k=10, classes=["interactions", "events"])
    assert both and all(h.entity_id.startswith("interactions/") for h in both)
    # a note linked only to the first session, which `since` leaves out: no candidate turn, so it stays a hit
    note = mem.put("notes", "Biscuit's checkup", body="Biscuit the beagle had his puppy checkup at the shelter.",
                   valid_from="2023-07-01")
    mem.link(note.id, "about", "interactions/c1-session-1")
    late = mem.search("beagle puppy Biscuit shelter checkup", k=10, since="2023-06-01")
    assert late[0].entity_id == note.id
    assert not any(h.entity_id == "interactions/c1-session-1" for h in late)
    s = mem.index.snap
    side = _anchor.turn_side(s, mem.index.idx.db, mem.index._mask(None, None, None, None))
    kept = {s.entity_id[s.epos[p]].split("/")[0] for p in np.flatnonzero(side)}
    assert kept == {"interactions"}  # the note is linked to a session, so without filters it goes too
