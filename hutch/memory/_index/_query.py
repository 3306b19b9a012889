"""How a query is read, once, before any channel runs: `Reading`, one frozen value every channel is given.

What the question says (its content words, adjacent word pairs, the time it names) is pure text work
(_units, _time); which entities it names is looked up in the index's `titles` table. How the lexical
channel then asks FTS5 (which words are too common in this store to be worth asking) depends on the
index's word counts, so it is the bm25 channel's own step (`WordCounts.lexical`, run while the worker
embeds the question).
"""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass

from hutch.memory._index import _rank, _time, _units


@dataclass(frozen=True)
class Reading:
    """One query, read: what every channel is given."""

    text: str  # the question as asked
    words: tuple[str, ...]  # its content words (lower-cased, in order, no duplicates; stop words dropped)
    mentioned: frozenset[str]  # ids of the entities it names (by title, or a capitalised first / last name)
    names: tuple[str, ...]  # those names, as written in the question and in full (normalised, sorted)
    pairs: tuple[tuple[str, str], ...]  # adjacent content words, names left out (the sequential dependence model)
    dense_text: str  # what the dense channel embeds: the question without the names it mentions
    span: _time.TimeSpan | None  # the time it names ("last week" read against `ref`)
    ref: float  # what relative time words were read against (epoch seconds)
    # the same time as it reads for a conversation turn: against `turn_ref`, the newest candidate turn (see
    # _search.SearchIndex._reference); `span` itself when the two references are the same
    turn_span: _time.TimeSpan | None = None
    turn_ref: float | None = None
    # in a store of several conversations, a relative time as each conversation reads it, against its own end:
    # ((its turns' positions, the span), ...), newest conversation first; empty for one conversation (turn_span)
    turn_spans: tuple = ()


#: At most this many conversations' ends (distinct days) are each a reference of their own; the turns of the
#: older ones read relative words as the newest conversation does (`turn_span`). Each costs a parse (~0.1 ms).
MAX_REFERENCES = 64


def read(text: str, db: sqlite3.Connection, ref: float, turn_ref: float | None = None,
         conversations=None) -> Reading:
    """The question read once; relative time words against `ref`, and for conversation turns against `turn_ref`
    (None: `ref` too), or, when `conversations` (a callable giving [(turn positions, reference)], newest first;
    see _search.SearchIndex._turn_references) names more than one, each conversation's turns against its own."""
    mentioned, names = mentions(db, text)
    span = _time.find(text, ref)
    turn_ref = ref if turn_ref is None else turn_ref
    turn_span = span if turn_ref == ref or span is None or not span.relative else _time.find(text, turn_ref)
    turn_spans: tuple = ()
    if conversations is not None and span is not None and span.relative:
        groups = conversations()
        if len(groups) > 1:
            by_day: dict[int, _time.TimeSpan | None] = {}
            got = []
            for where, r in groups:
                day = int(r // 86400)
                if day not in by_day:
                    if len(by_day) >= MAX_REFERENCES:
                        break
                    by_day[day] = _time.find(text, r)
                got.append((where, by_day[day]))
            turn_spans = tuple(got)
    return Reading(text, tuple(_units.terms(text)), frozenset(mentioned), tuple(names),
                   tuple(_units.phrases(text, names)),
                   _units.strip_mentions(text, names) if names else text, span, ref, turn_span, turn_ref, turn_spans)


def mentions(db: sqlite3.Connection, query: str) -> tuple[set[str], list[str]]:
    """(ids of entities the query names, the names as written and in full)."""
    grams = _units.ngrams(query)
    caps = _units.capitalised(query)
    if not grams and not caps:
        return set(), []
    q = ("select t.norm, f.entity_id, f.title from titles t join files f on f.eid = t.eid where t.partial = ? "
         "and t.norm in ({})")
    rows = db.execute(q.format(",".join("?" * len(grams))), [0, *grams]).fetchall() if grams else []
    if caps:
        # a first name shared by many entities names none of them
        common = {r[0] for r in db.execute(
            f"select norm from titles where partial = 1 and norm in ({','.join('?' * len(caps))}) "
            f"group by norm having count(*) > {_rank.MAX_NAME_SHARERS}", caps)}
        caps = [c for c in caps if c not in common]
        if caps:
            rows += db.execute(q.format(",".join("?" * len(caps))), [1, *caps]).fetchall()
    names = {r[0] for r in rows} | {_units.norm_title(r[2] or "") for r in rows}
    return {r[1] for r in rows}, sorted(n for n in names if n)


@dataclass(frozen=True)
class LexicalQuery:
    """How the bm25 channel asks FTS5: the words worth asking (those not too common in the store), as one
    MATCH expression, and the word pairs as phrases and within a window."""

    words: tuple[str, ...]
    fts: str | None  # any of the words (None: no word left)
    few: bool  # the words' units add up to at most LEXICAL_LIMIT: read unsorted (see _fts.unit_bm25)
    phrases: str | None  # the pairs as phrases (None: the question has no pair)
    window: str | None  # the pairs both of whose words are kept, within SDM_WINDOW tokens


class WordCounts:
    """How many units hold a word (approximate: counted once per process, reset when the store grows or
    shrinks by 10%), to leave out of the lexical query the words too common to discriminate (MAX_DF_SHARE)."""

    def __init__(self):
        self.df: dict[str, int] = {}
        self.n = 0

    def lexical(self, q: Reading, db: sqlite3.Connection, n: int) -> LexicalQuery:
        words = self._kept(list(q.words), db, n)
        few = sum(self.df.get(w, _rank.LEXICAL_LIMIT + 1) for w in words) <= _rank.LEXICAL_LIMIT
        kept = set(words)
        near = [(a, b) for a, b in q.pairs if a in kept and b in kept]
        return LexicalQuery(tuple(words), _units.fts_query(words), few, _units.fts_phrase_query(list(q.pairs)),
                            _units.fts_phrase_query(near, _rank.SDM_WINDOW))

    def _kept(self, words: list[str], db: sqlite3.Connection, n: int) -> list[str]:
        if n < _rank.MIN_UNITS_FOR_DF or not words:
            return words
        if abs(n - self.n) > 0.1 * max(self.n, 1):
            self.df, self.n = {}, n
        for w in words:
            if w not in self.df:
                self.df[w] = db.execute("select count(*) from units_fts where units_fts match ?",
                                        (_units.fts_query([w]),)).fetchone()[0]
        # If every word is that common, the lexical channels have nothing to say: dense and the rest answer.
        return [w for w in words if self.df[w] <= _rank.MAX_DF_SHARE * n]
