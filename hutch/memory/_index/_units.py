"""Pure logic of the index: what an entity file is indexed as, and how a query is read.

No I/O here. An entity becomes one or more *units* (the things a hit points
at): a conversation (an entity whose level-3 headings are turns,
`### D1:3 · Caroline`) gives one unit per turn, anchored by its dia_id, and
indexed with its context (the neighbouring turns, the speaker, the session's
time); any other entity is one unit, its title and body.

What an entity is indexed as is bounded, whatever its size (a sandbox may write a 64 MiB file through
its memory mount): only the first UNIT_BYTES of the file are split into units; the rest, up to
LEXICAL_BYTES, is searchable by its words in pieces of at most CHUNK_BYTES (see _db), and of a unit at
most DENSE_CHARS characters are embedded (a model reads a few hundred tokens of it).
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Any

from hutch.memory import _format
from hutch.memory._index import _time

#: The bytes of an entity file (front matter included) that are split into units and embedded.
UNIT_BYTES = 1 << 20
#: Past UNIT_BYTES, a file is searchable by its words (BM25, entity level) in pieces of at most this many bytes ...
CHUNK_BYTES = 64 << 10
#: ... up to this many bytes of the file; beyond, it is not indexed (`doctor` names such files).
LEXICAL_BYTES = 64 << 20
#: The characters of a unit's text that are embedded: MiniLM reads 128 tokens (~600 characters) and an
#: OpenAI-style endpoint ~8,000; more would only cost memory (a tokenizer takes ~100 bytes per character).
DENSE_CHARS = 8192
#: How far back from a piece's end a cut looks for white space (so that no word is split in two).
_CUT_WINDOW = 4096

_TURN_RE = re.compile(r"^(\S+:\S+)\s+·\s+(.+)$")
_IMAGE_RE = re.compile(r"^>\s*\[image:\s*(.*?)\]\s*$", re.M)
_WORD_RE = re.compile(r"[^\W_]+", re.U)

# English function words: dropped from lexical queries so that "what did she do" does not match everything.
STOPWORDS = frozenset("""
a an the and or but if of at by for with about against between into through during before after above below to from
up down in out on off over under again further then once here there when where why how all any both each few more most
other some such no nor not only own same so than too very s t can will just don should now i me my myself we our ours
ourselves you your yours yourself yourselves he him his himself she her hers herself it its itself they them their
theirs themselves what which who whom this that these those am is are was were be been being have has had having do
does did doing would could
""".split())


@dataclass(frozen=True)
class Unit:
    """One searchable piece of an entity: the whole entity (anchor None) or one turn of a conversation."""

    anchor: str | None
    body: str  # lexical text (weight 1)
    context: str  # lexical context: neighbouring turns (lower weight)
    dense: str  # what is embedded
    speaker: str | None
    event: tuple[float, float] | None = None  # the time a turn speaks of ("yesterday"), read against its session

    def __post_init__(self):
        if len(self.dense) > DENSE_CHARS:
            object.__setattr__(self, "dense", self.dense[:DENSE_CHARS])

    @property
    def dense_hash(self) -> str:
        return hashlib.sha256(self.dense.encode("utf-8", "surrogateescape")).hexdigest()[:32]


def cut(data: bytes, limit: int) -> int:
    """Where to end a piece of at most `limit` bytes taken from the start of `data` (all of it if it fits):
    after the last white space near the limit, else at the last UTF-8 character boundary before it."""
    if len(data) <= limit:
        return len(data)
    window = data[max(0, limit - _CUT_WINDOW):limit]
    at = max(window.rfind(sep) for sep in (b"\n", b" ", b"\t"))
    if at >= 0:
        return limit - len(window) + at + 1
    end = limit
    while end > limit - 4 and end > 0 and 0x80 <= data[end] < 0xC0:  # inside a multi-byte character
        end -= 1
    return end


def _turn_text(section: str) -> tuple[str, str]:
    """(plain text, image caption) of a turn section."""
    caps = _IMAGE_RE.findall(section)
    text = _IMAGE_RE.sub("", section).strip()
    return text, " ".join(c.strip() for c in caps if c.strip())


def units_of(meta: dict[str, Any], body: str, title: str) -> tuple[list[Unit], str]:
    """The units of an entity and its entity-level lexical text."""
    turns = []
    hs = _format.headings(body)
    for n, (off, level, text, content) in enumerate(hs):
        m = _TURN_RE.match(text) if level == 3 else None
        if m:
            end = hs[n + 1][0] if n + 1 < len(hs) else len(body)
            turns.append((m.group(1), m.group(2).strip(), body[content:end]))
    if not turns:
        full = f"{title}\n{body}".strip()
        return [Unit(None, full, _tags(meta), full, None)], full
    rendered = []
    said = _said_at(meta)
    for anchor, speaker, section in turns:
        text, cap = _turn_text(section)
        line = f"{speaker}: {text}" + (f" [image: {cap}]" if cap else "")
        rendered.append((anchor, speaker, line, _time.event_span(text, said) if said is not None else None))
    units = []
    for i, (anchor, speaker, line, event) in enumerate(rendered):
        prev = rendered[i - 1][2] if i > 0 else ""
        nxt = rendered[i + 1][2] if i + 1 < len(rendered) else ""
        # The previous turn is what a reply answers: it goes into the embedded text too.
        dense = f"{prev}\n{line}" if prev else line
        units.append(Unit(anchor, line, f"{prev} {nxt}".strip(), dense, speaker, event))
    whole = title + "\n" + "\n".join(r[2] for r in rendered)
    return units, whole


def _said_at(meta: dict[str, Any]) -> float | None:
    """When a conversation's turns were said: its valid_from (the session's date), else recorded_at."""
    t = to_epoch(meta.get("valid_from"))
    return t if t is not None else to_epoch(meta.get("recorded_at"))


def _tags(meta: dict[str, Any]) -> str:
    tags = meta.get("tags") or []
    return " ".join(str(t) for t in tags) if isinstance(tags, list) else str(tags)


# ------------------------------------------------------------------ time

def to_epoch(value: Any) -> float | None:
    """Seconds since the epoch of an ISO date/date-time (UTC if no zone); None if absent or unreadable."""
    if value is None or value == "":
        return None
    try:
        dt = _format.parse_time(value)
    except Exception:  # a hand-edited bad date must not break indexing; check() reports it
        return None
    return dt.timestamp() if dt else None


def epoch_of(value: Any, what: str) -> float | None:
    """Like to_epoch, but a value the caller gave must parse (ConfigError naming the fix otherwise)."""
    if value is None:
        return None
    return _format.parse_time(value, what).timestamp()


def time_window(query: str) -> tuple[float, float] | None:
    """The span an explicit date, month or year in the question names ("in May 2023", "on 8 May, 2023",
    "2023-05-08"). Kept for callers without a reference time: _time.find reads relative ones too."""
    return _time.explicit_window(query)


# ------------------------------------------------------------------ queries

#: The longest query search takes, in characters (~700 words). A query is read whole (time words, names, word
#: counts), so a 10 MB one took 14 s and 1.5 GB before it failed in SQLite; the embedding model reads its first
#: 128 tokens (~600 characters) and BM25 gains nothing from a page of words.
MAX_QUERY_CHARS = 4096
#: The most class names search's `classes=` takes (a store has a handful of classes; a list of millions cost
#: seconds and hundreds of MB in a set and a scan per name before it answered nothing).
MAX_CLASSES = 1024


def valid_text(text: str) -> str:
    """`text` as valid Unicode: the lone surrogates that stand for bytes that are not UTF-8 (a file read with
    surrogateescape, a command-line argument, a FUSE path) become U+FFFD, as the index stores such bytes (SQLite,
    the tokenizer and JSON refuse surrogates)."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        pass
    try:
        raw = text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:  # a surrogate that stands for no byte (\ud800): any encoding of it will do
        raw = text.encode("utf-8", "surrogatepass")
    return raw.decode("utf-8", "replace")

def terms(query: str) -> list[str]:
    """Lower-cased content words of a query, in order, without duplicates."""
    seen: dict[str, None] = {}
    for t in _WORD_RE.findall(query.lower()):
        if t not in STOPWORDS:
            seen.setdefault(t, None)
    return list(seen)


def fts_query(query: str | list[str]) -> str | None:
    """An FTS5 MATCH expression: any of the content words (BM25 ranks by how many and how rare)."""
    ts = terms(query) if isinstance(query, str) else query
    return " OR ".join('"' + t.replace('"', '""') + '"' for t in ts) if ts else None


def phrases(query: str, names: list[str] | tuple[str, ...] = ()) -> list[tuple[str, str]]:
    """Pairs of adjacent content words of the query ("support group", "pottery class"): the term dependencies of
    the sequential dependence model. Adjacent means only white space between them in the question (no function
    word, no punctuation); words of the names in `names` are left out (the mention channel covers them)."""
    named = {w for n in names for w in _WORD_RE.findall(n.lower())}
    toks = list(_WORD_RE.finditer(query))
    out: dict[tuple[str, str], None] = {}
    for a, b in zip(toks, toks[1:]):
        wa, wb = a.group(0).lower(), b.group(0).lower()
        if (wa in STOPWORDS or wb in STOPWORDS or wa in named or wb in named
                or not query[a.end():b.start()].isspace()):
            continue
        out.setdefault((wa, wb), None)
    return list(out)


def fts_phrase_query(pairs: list[tuple[str, str]], near: int | None = None) -> str | None:
    """An FTS5 MATCH expression for word pairs: any of them as a phrase (in order, adjacent), or with `near`
    any of them within `near` tokens of each other in either order."""
    def q(t: str) -> str:
        return '"' + t.replace('"', '""') + '"'
    if not pairs:
        return None
    if near is None:
        return " OR ".join(q(f"{a} {b}") for a, b in pairs)
    return " OR ".join(f"NEAR({q(a)} {q(b)}, {int(near)})" for a, b in pairs)


def norm_title(title: str) -> str:
    return " ".join(_WORD_RE.findall(title.lower()))


def title_keys(title: str) -> list[tuple[str, int]]:
    """(key, partial) under which a title can be mentioned: the whole normalised title, and for names of
    2-4 words each word on its own (partial: "Alice" names "Alice Chen" when written capitalised)."""
    norm = norm_title(title)
    if not norm:
        return []
    keys = [(norm, 0)]
    words = norm.split()
    if 2 <= len(words) <= 4:
        keys += [(w, 1) for w in dict.fromkeys(words) if len(w) >= 3 and w not in STOPWORDS and not w.isdigit()]
    return keys


def capitalised(query: str) -> list[str]:
    """Capitalised words of the query, normalised: candidates for partial (first- or last-name) mentions."""
    return [w.lower() for w in re.findall(r"\b[A-Z][^\W_]{2,}", query) if w.lower() not in STOPWORDS]


def ngrams(query: str, n: int = 4) -> list[str]:
    """Word n-grams (1..n) of the query, normalised like titles: the candidates for entity mentions."""
    words = _WORD_RE.findall(query.lower())
    out = []
    for size in range(1, n + 1):
        for i in range(len(words) - size + 1):
            gram = words[i:i + size]
            if size == 1 and (gram[0] in STOPWORDS or len(gram[0]) < 3):
                continue
            out.append(" ".join(gram))
    return out


def strip_mentions(query: str, titles: list[str]) -> str:
    """The query without the named entities (the mention channel covers them; the dense one then sees the topic)."""
    out = query
    for t in sorted(titles, key=len, reverse=True):
        out = re.sub(r"\b" + r"\W+".join(map(re.escape, t.split())) + r"(?:'s)?\b", " ", out, flags=re.I)
    out = re.sub(r"\s+", " ", out).strip()
    return out if terms(out) else query
