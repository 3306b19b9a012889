"""Time readings the LoCoMo dev conversations do not show (issue 16): session date strings in other formats,
relative words in turns that point further back than a month, questions asked with "in <year>", "during
<month>", "in the summer", and how the time channel weighs a turn whose event time is only partly inside the
question's span. The pure parser against a pinned reference, then end to end on a real store."""

from datetime import datetime, timezone

import pytest

from hutch.memory._index import _time
from _search_helpers import CONVERSATION

# Wednesday 10 May 2023, noon UTC
REF = datetime(2023, 5, 10, 12, 0, tzinfo=timezone.utc)


def days(start, end):
    def d(t):
        return None if t in (float("inf"), float("-inf")) else datetime.fromtimestamp(t, timezone.utc).date().isoformat()
    return d(start), d(end)


# how a session's date may be written: LoCoMo's header and the variants other sources use
HEADERS = ["1:56 pm on 8 May, 2023", "1:56pm on 8 May, 2023", "13:56 on 8 May 2023", "8 May, 2023", "8 May 2023",
           "May 8, 2023", "May 8 2023", "May 8th, 2023", "8th of May 2023", "Monday, 8 May 2023", "Mon 8 May 2023",
           "2023-05-08", "2023-05-08 13:56", "2023-05-08T13:56:00Z", "2023-05-08T13:56:00+02:00", "8 May. 2023"]


@pytest.mark.parametrize("text", HEADERS)
def test_a_session_date_in_any_common_format_is_its_day(text):
    got = _time.find(text)  # explicit: no reference needed
    assert got is not None and days(got.start, got.end) == ("2023-05-08", "2023-05-09"), text
    assert not got.relative
    # said in a turn, it is that turn's event time (the reference is some other day)
    assert days(*_time.event_span(f"We met on {text}.", datetime(2023, 6, 1, tzinfo=timezone.utc))) == \
        ("2023-05-08", "2023-05-09")


READINGS = [
    # relative words that point further back than a month (read against Wednesday 10 May 2023)
    ("Last year I moved here.", "2022-01-01", "2023-01-01"),
    ("I started two months ago.", "2023-03-01", "2023-04-01"),
    ("We met a couple of months ago.", "2023-02-01", "2023-04-01"),
    ("We went camping last summer.", "2022-06-01", "2022-09-01"),
    ("My dad passed away three years ago.", "2020-01-01", "2021-01-01"),
    ("I quit six months ago.", "2022-11-01", "2022-12-01"),
    # colloquial forms of the short ones
    ("I saw a great concert last night!", "2023-05-09", "2023-05-10"),
    ("I adopted her two weeks back.", "2023-04-24", "2023-05-01"),
    ("I went there a couple weeks ago.", "2023-04-17", "2023-05-01"),
    ("We moved couple weeks ago.", "2023-04-17", "2023-05-01"),
]


@pytest.mark.parametrize("text,start,end", READINGS, ids=[r[0] for r in READINGS])
def test_turn_event_times(text, start, end):
    assert days(*_time.event_span(text, REF)) == (start, end)


QUESTIONS = [
    ("What did Caroline do in 2022?", "2022-01-01", "2023-01-01"),
    ("What did John do during 2022?", "2022-01-01", "2023-01-01"),
    ("What did Maria do during June?", "2022-06-01", "2022-07-01"),  # the latest June that began by the reference
    ("What did Maria do during May 2023?", "2023-05-01", "2023-06-01"),
    ("Where did they go in the summer?", "2022-06-01", "2022-09-01"),
    ("What did Jon do over the summer?", "2022-06-01", "2022-09-01"),
    ("What did Jon do during the summer of 2022?", "2022-06-01", "2022-09-01"),
    ("What did Gina do in the spring?", "2023-03-01", "2023-06-01"),  # this spring: it began by the reference
    ("What did Melanie read the month before June 2023?", "2023-05-01", "2023-06-01"),
    ("What did Nate buy the year before 2023?", "2022-01-01", "2023-01-01"),
    ("What did Joanna watch the week before 8 May 2023?", "2023-05-01", "2023-05-08"),
    ("What did Tim do last night?", "2023-05-09", "2023-05-10"),
    ("Who called two weeks back?", "2023-04-24", "2023-05-01"),
]


@pytest.mark.parametrize("text,start,end", QUESTIONS, ids=[q[0] for q in QUESTIONS])
def test_question_spans(text, start, end):
    got = _time.find(text, REF)
    assert got is not None and days(got.start, got.end) == (start, end), text


def test_seasons_without_a_year_are_no_event_time_and_need_a_lead_word():
    assert _time.event_span("We go camping in the summer.", REF) is None  # a habit or a plan as likely
    assert _time.find("The summer was hot.", REF) is None  # "the summer" alone is not a date


def _long_ago():
    c = {k: v for k, v in CONVERSATION.items() if not k.startswith("session_2")}
    c["session_1"] = [
        {"speaker": "Nadia", "dia_id": "D1:1", "text": "Last year I hiked across the Alps with my brother."},
        {"speaker": "Tomas", "dia_id": "D1:2", "text": "I hiked there in March 2022 too, what a trip."},
        {"speaker": "Nadia", "dia_id": "D1:3", "text": "Last week I hiked a small hill near home."},
        {"speaker": "Tomas", "dia_id": "D1:4", "text": "Hiking is my favourite thing to do."},
    ]
    return c


def test_a_turn_is_in_time_by_the_share_of_its_event_time_inside_the_question(mem):
    # the session is 8 May 2023; "last year" there is all of 2022
    mem.ingest_conversation(_long_ago(), conv_id="c1")
    hits = mem.search("Where did Nadia hike in 2022?", k=4, classes=["interactions"])
    timed = {h.anchor: h.channels["time"]["score"] for h in hits if "time" in h.channels}
    assert timed == {"D1:1": 1.0, "D1:2": 1.0}  # "last year" inside 2022 whole; "March 2022" too
    assert hits[0].anchor == "D1:1"
    # about March 2022, "last year" may be it (31 of 365 days); "in March 2022" is
    hits = mem.search("Where did Nadia hike in March 2022?", k=4, classes=["interactions"])
    timed = {h.anchor: h.channels["time"]["score"] for h in hits if "time" in h.channels}
    assert timed["D1:2"] == 1.0 and timed["D1:1"] == pytest.approx(31 / 365, abs=1e-6)
    assert "D1:3" not in timed and "D1:4" not in timed


def test_an_index_of_schema_5_reads_its_turns_again_keeping_its_vectors(store_dir):
    import sqlite3

    import hutch
    from hutch.memory._index import _db

    m = hutch.Memory(store_dir)
    m.ingest_conversation(_long_ago(), conv_id="c1")
    m.put("notes", "hiking boots", body="Boots for the Alps, bought last year.")
    m.reindex()
    m.index.close()
    # what schema 5 held: no event time for a "last year" (it kept spans of at most 31 days)
    con = sqlite3.connect(store_dir / ".hutch" / "index.sqlite")
    con.execute("update units set ev_from = null, ev_to = null")
    con.execute("update meta set value='5' where key='schema'")
    vectors = {r[0] for r in con.execute("select dense_hash from vectors")}
    con.commit()
    con.close()
    m2 = hutch.Memory(store_dir)
    try:
        hits = m2.search("Where did Nadia hike in 2022?", k=2, classes=["interactions"])
        assert hits[0].anchor == "D1:1" and hits[0].channels["time"]["score"] == 1.0
        db = m2.index.idx.db
        assert m2.index.idx.meta("schema") == _db.SCHEMA_VERSION
        assert not any("schema" in r for r in m2.doctor().recovered), "upgraded, not rebuilt"
        assert {r[0] for r in db.execute("select dense_hash from vectors")} == vectors
        assert db.execute("select count(*) from pending").fetchone()[0] == 0  # nothing embedded again
        assert m2.doctor().ok
    finally:
        m2.index.close()
