"""The category channel: a list question's category word read through WordNet's noun hierarchy (real WordNet files
from Debian's wordnet-base, real store, real SQLite)."""

import shutil
from pathlib import Path

import pytest

from hutch.memory._index import _fts, _lexicon

needs_wordnet = pytest.mark.skipif(not _lexicon.available(), reason="WordNet is not installed: bash scripts/setup.sh")


@pytest.mark.parametrize("question, lemmas", [
    ("What martial arts has John done?", ["martial_arts", "arts"]),
    ("What kind of art does Caroline make?", ["art"]),
    ("Which European countries has Maria been to?", ["european_countries", "countries"]),
    ("How many children does Melanie have?", ["children"]),
    ("What types of yoga has Maria practiced?", ["yoga"]),
    ("When did Melanie paint a sunrise?", []),
    ("What did Caroline research?", []),  # no category word: "what did ..."
    ("Where has Melanie camped?", []),
])
def test_category_word_of_a_question(question, lemmas):
    assert _lexicon.category_word(question) == lemmas


@needs_wordnet
def test_lemmas_and_instances():
    wn = _lexicon.wordnet()
    assert wn.lemma("countries") == "country"
    assert wn.lemma("children") == "child"  # an irregular plural, from noun.exc
    assert wn.lemma("martial_arts") == "martial_art"
    assert wn.lemma("xyzzyq") is None
    (sense,) = wn.senses("martial_art")
    words = wn.hyponym_words(sense)
    assert {"judo", "karate", "taekwondo", "aikido"} <= set(words)
    assert all(w.isalpha() for w in words)


@needs_wordnet
def test_the_question_picks_the_sense():
    # "instrument" is first a device; a question about playing music means the musical one
    def by_word(question, texts):
        return next(i for i, t in enumerate(texts) if "musical" in t)
    lemma, words = _lexicon.category_terms("What instruments does Melanie play?", by_word)
    assert lemma == "instrument"
    assert {"piano", "guitar", "drum", "accordion"} <= set(words)
    assert "hammer" not in words and "screwdriver" not in words  # the device sense's instances
    # a category so broad that it names nothing useful ("thing") gives no channel
    assert _lexicon.category_terms("What things has John done?", lambda q, t: 0) is None


@needs_wordnet
def test_search_finds_instances_of_the_category(mem):
    mem.put("notes", "Tuesday", body="John went to his first taekwondo class and loved the kicks.")
    mem.put("notes", "Thursday", body="John tried judo with his cousin at the community centre.")
    mem.put("notes", "Groceries", body="John bought apples, rice and coffee for the week.")
    mem.put("notes", "Car", body="John took the car to the garage for new brakes.")
    mem.put("notes", "Reading", body="John finished a novel about sailors and storms.")
    hits = mem.search("What martial arts has John done?", k=5)
    assert mem.index.doctor().lexicon == _lexicon.DEFAULT_DIR
    top2 = {h.entity_id for h in hits[:2]}
    assert top2 == {"notes/tuesday", "notes/thursday"}
    assert all("category" in h.channels for h in hits[:2])
    assert all("category" not in h.channels for h in hits[2:])


@needs_wordnet
def test_without_wordnet_search_still_answers(mem, monkeypatch, tmp_path):
    mem.put("notes", "Tuesday", body="John went to his first taekwondo class.")
    mem.put("notes", "Groceries", body="John bought apples and rice.")
    monkeypatch.setenv("HUTCH_WORDNET_DIR", str(tmp_path / "nowhere"))
    assert not _lexicon.available()
    assert mem.index.doctor().lexicon is None
    assert any("category channel off" in line for line in mem.index.doctor().lines())
    hits = mem.search("What martial arts has John done?", k=2)
    assert hits and all("category" not in h.channels for h in hits)
    # a damaged copy (index present, data missing) is "not installed" too, never a crash
    part = tmp_path / "part"
    part.mkdir()
    shutil.copy(Path(_lexicon.DEFAULT_DIR) / "index.noun", part / "index.noun")
    monkeypatch.setenv("HUTCH_WORDNET_DIR", str(part))
    assert mem.search("What martial arts has John done?", k=2)


@needs_wordnet
def test_category_words_rarest_first_within_the_row_budget(mem, monkeypatch):
    from hutch.memory._index import _rank
    for i in range(6):
        mem.put("notes", f"Piano {i}", body=f"Someone played the piano in room {i}.")
    mem.put("notes", "Accordion", body="John played the accordion at the fair.")
    mem.put("notes", "Drums", body="John played the drums twice.")
    mem.search("warm up the index", k=1)
    si = mem.index
    words = ["piano", "accordion", "drum", "theremin"]  # theremin: in no unit
    assert _fts.within_budget(si.idx.db, si.snap, words) == ["accordion", "drum", "piano"]  # rarest first, absent words dropped
    monkeypatch.setattr(_rank, "LEXICAL_LIMIT", 3)
    assert _fts.within_budget(si.idx.db, si.snap, words) == ["accordion", "drum"]  # piano's 6 units would pass the budget
    monkeypatch.setattr(_rank, "LEXICAL_LIMIT", 1)
    assert _fts.within_budget(si.idx.db, si.snap, words) == ["accordion"]  # always at least the rarest word
    hits = mem.search("What instruments does John play?", k=3)
    assert {h.entity_id for h in hits if "category" in h.channels} == {"notes/accordion"}


@needs_wordnet
def test_the_question_is_embedded_once_for_dense_and_senses(mem, monkeypatch):
    # The sense of "instruments" is chosen with the whole question's vector. Without a name in it, that is the dense
    # channel's vector; with one, the dense channel embeds the question without the name and the whole question is
    # embedded beside it in the worker. Either way the answer is the first search's, which embedded the question
    # together with the senses' glosses.
    import threading

    mem.put("people", "John Smith", body="A friend from the choir.")
    mem.put("notes", "Fair", body="John played the accordion at the fair.")
    mem.put("notes", "Shed", body="John fixed the shed with a hammer and a screwdriver.")
    named, unnamed = "What instruments does John play?", "What instruments does he play?"
    assert _lexicon.ranks_senses(named) and not _lexicon.ranks_senses("What martial arts has John done?")
    first = {q: mem.search(q, k=3) for q in (named, unnamed)}
    prov = mem.index.provider
    calls, real = [], prov.embed
    monkeypatch.setattr(prov, "embed", lambda texts, *a, **kw: calls.append(
        (threading.current_thread().name, list(texts))) or real(texts, *a, **kw))
    for q in (named, unnamed):
        calls.clear()
        again = mem.search(q, k=3)
        assert [(h.entity_id, h.score, dict(h.channels)) for h in again] == \
            [(h.entity_id, h.score, dict(h.channels)) for h in first[q]]
        assert {h.entity_id for h in again if "category" in h.channels} == {"notes/fair"}  # musical, not the hammer
        assert all(name.startswith("hutch-embed") and len(texts) == 1 for name, texts in calls)
        assert len(calls) == (2 if q == named else 1) and [q] in [texts for _, texts in calls]


@needs_wordnet
def test_the_row_budget_follows_the_index(mem):
    # within_budget's answer is kept per index generation: an edit that changes which word is rarer changes it
    for i in range(3):
        mem.put("notes", f"Piano {i}", body=f"Someone played the piano in room {i}.")
    mem.put("notes", "Accordion", body="John played the accordion at the fair.")
    mem.search("warm up the index", k=1)
    si = mem.index
    words = ["piano", "accordion"]
    assert _fts.within_budget(si.idx.db, si.snap, words) == ["accordion", "piano"]
    assert _fts.within_budget(si.idx.db, si.snap, words) == ["accordion", "piano"]  # kept
    for i in range(4):
        mem.put("notes", f"Accordion {i}", body=f"An accordion played in hall {i}.")
    mem.search("warm up the index", k=1)
    assert _fts.within_budget(si.idx.db, si.snap, words) == ["piano", "accordion"]  # 3 pianos against 5 accordions now
    for i in range(4):
        mem.forget(f"notes/accordion-{i}", reason="test")
    mem.search("warm up the index", k=1)
    assert _fts.within_budget(si.idx.db, si.snap, words) == ["accordion", "piano"]
