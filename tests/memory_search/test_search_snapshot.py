"""The snapshot's lookup arrays (uid -> position, the units that are their entity's only one) stay equal to their
definitions while entities are added, edited (one unit <-> several) and forgotten (real store, real SQLite)."""

import numpy as np

from _search_helpers import CONVERSATION


def check(mem):
    s = mem.index.snap
    assert s is not None
    live = np.flatnonzero(s.uid_pos >= 0)
    assert dict(zip(live.tolist(), s.uid_pos[live].tolist())) == s.upos
    uids = np.array(sorted(s.upos) + [0, -3, len(s.uid_pos) + 5], np.int64)
    assert s.positions(uids).tolist() == [s.upos.get(int(u), -1) for u in uids]
    alive = np.flatnonzero(s.alive[:s.n])
    per_entity = np.bincount(s.epos[alive], minlength=s.ne)
    want = np.full(s.n, -1)
    for p in alive:
        if per_entity[s.epos[p]] == 1:
            want[p] = s.epos[p]
    assert s.sole_units().tolist() == want.tolist()


def test_lookup_arrays_follow_the_index(mem):
    for i in range(5):
        mem.put("notes", f"Note {i}", body=f"Plain note number {i} about gardening.")
    mem.ingest_conversation(CONVERSATION, conv_id="conv-t")
    mem.search("gardening", k=3)
    check(mem)
    mem.update("notes/note-1", body="### D1:1 · Ann\nfirst turn\n\n### D1:2 · Bob\nsecond turn about gardening\n")
    mem.search("gardening", k=3)  # note-1 has two units now
    check(mem)
    mem.update("notes/note-1", body="Back to one unit about gardening.")
    mem.forget("notes/note-3", reason="test")
    mem.put("notes", "Note 9", body="A new note about gardening.")
    hits = mem.search("gardening", k=10)
    check(mem)
    assert {h.entity_id for h in hits} >= {"notes/note-1", "notes/note-9"}
    assert "notes/note-3" not in {h.entity_id for h in hits}


def test_one_to_one_store_answers_as_the_general_path(mem, monkeypatch):
    # In a store whose unit p is entity p the entity channel skips the mapping between them: the same answers
    # (hits, scores, per-channel ranks) as the general path, with and without filters
    for i in range(40):
        topic, thing = ("gardening" if i % 2 else "sailing"), ("boats" if i % 5 else "roses")
        mem.put("notes" if i % 3 else "ideas", f"Item {i}",
                body=f"Item {i} is about {topic} and {thing} in week {i % 7}.")
    mem.search("warm up", k=1)
    s = mem.index.snap
    assert s.one_to_one()
    queries = [("gardening roses", {}), ("sailing boats week 3", {"k": 5}), ("Item 7", {"classes": ["ideas"]}),
               ("what about roses", {"k": 20, "classes": ["notes"]})]

    def answers():
        return [[(h.entity_id, h.score, dict(h.channels)) for h in mem.search(q, **kw)] for q, kw in queries]
    fast = answers()
    monkeypatch.setattr(type(s), "one_to_one", lambda self: False)
    assert answers() == fast
    monkeypatch.undo()
    mem.update("notes/item-1", body="Item 1 is about sailing now.")
    mem.search("warm up", k=1)
    assert not mem.index.snap.one_to_one()  # the edited entity's unit moved to the end


def test_unsorted_bm25_read_is_the_sorted_one(mem, monkeypatch):
    # unit_bm25(few=True) reads the matches unsorted when they are all within LEXICAL_LIMIT, and falls back to
    # the sorted, limited query when there are more: the same rows and scores either way
    from hutch.memory._index import _fts, _rank, _units

    for i in range(30):
        crop = "tomatoes" if i % 3 else "beans"
        mem.put("notes", f"Garden {i}", body=f"The garden {'roses ' * (i % 4)}and {crop} {i}.")
    mem.search("warm up", k=1)
    si, n = mem.index, mem.index.snap.n
    for query in ("garden roses", "tomatoes", "beans roses"):
        fq = _units.fts_query(query)
        for limit in (5, 12, 100):
            monkeypatch.setattr(_rank, "LEXICAL_LIMIT", limit)
            matches = si.idx.db.execute("select count(*) from units_fts where units_fts match ?", (fq,)).fetchone()[0]
            sorted_ = _fts.unit_bm25(si.idx.db, si.snap, fq, n)
            assert np.count_nonzero(sorted_) == min(limit, matches)
            assert np.array_equal(_fts.unit_bm25(si.idx.db, si.snap, fq, n, True), sorted_)
