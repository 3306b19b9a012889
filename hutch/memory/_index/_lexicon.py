"""Category words in a question, read through WordNet's noun hierarchy.

"What martial arts has John done?" is answered by turns that say "taekwondo"
and "judo", never "martial arts"; a 6-layer embedding model connects a
category to its instances only weakly. WordNet (Princeton, the Debian package
`wordnet-base`, installed by scripts/setup.sh) lists the instances: the
hyponyms of the category's sense. `category_terms` finds the category word of a
list question ("What/Which [kind of] <noun> <verb>...", "How many <noun>..."),
picks the sense of it the question means (the caller ranks the glosses by the
embedding model), and returns the single-word hyponyms up to three levels down.

The files are read in place: `index.noun` once per process (~0.2 s, only when a
question has a category word), synsets by their byte offset in `data.noun`
(WordNet's synset offset is that byte offset), so nothing is loaded up front.
Without the files the channel is simply off (`available()` is False).
"""

from __future__ import annotations

import mmap
import os
import re
import threading
from dataclasses import dataclass
from pathlib import Path

from hutch._core import settings

#: Where Debian's wordnet-base puts the database; HUTCH_WORDNET_DIR overrides.
DEFAULT_DIR = str(settings.WORDNET_DIR.default)
#: Levels of hyponyms followed below the category's sense.
DEPTH = 3
#: A sense with more single-word hyponyms than this within DEPTH ("thing", "act") names no useful category.
MAX_TERMS = 1000

_AUX = r"(?:has|have|had|does|do|did|is|are|was|were|might|would|could|can|will|should)"
# "What [kind|type|sort of] <one to three words> <auxiliary verb>" and "How many <one or two words> ..."
_HEAD_RE = re.compile(
    r"^\s*(?:what|which)\s+(?:(?:kinds?|types?|sorts?)\s+of\s+)?((?:[a-z][a-z'-]*\s+){0,2}?[a-z][a-z'-]*)\s+" + _AUX
    + r"\b|^\s*how\s+many\s+((?:[a-z][a-z'-]*\s+)?[a-z][a-z'-]*?)\s+" + _AUX + r"\b", re.I)
_SUFFIXES = (("ies", "y"), ("ches", "ch"), ("shes", "sh"), ("ses", "s"), ("xes", "x"), ("zes", "z"),
             ("men", "man"), ("s", ""))


@dataclass(frozen=True)
class Sense:
    offset: int
    words: tuple[str, ...]
    gloss: str

    @property
    def text(self) -> str:
        """What is embedded to compare the sense with the question."""
        return f"{', '.join(w.replace('_', ' ') for w in self.words[:3])}: {self.gloss}"


def category_word(question: str) -> list[str]:
    """Candidate WordNet lemmas for the category a list question asks about, longest first
    ("What martial arts has ..." -> ["martial_art", "art"]); [] when the question has no such word."""
    m = _HEAD_RE.match(question)
    if not m:
        return []
    words = (m.group(1) or m.group(2)).lower().split()
    return ["_".join(words[i:]) for i in range(len(words))]


class WordNet:
    """Read-only noun lookups on the WordNet 3.0 database files."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)
        self._index: dict[str, list[int]] | None = None
        self._exc: dict[str, str] = {}
        self._data: mmap.mmap | None = None
        self._hypo: dict[tuple, list[str] | None] = {}
        self._lock = threading.Lock()

    def _load(self) -> dict[str, list[int]]:
        with self._lock:
            if self._index is None:
                index: dict[str, list[int]] = {}
                with open(self.root / "index.noun", encoding="latin-1") as f:
                    for line in f:
                        if line.startswith(" "):
                            continue  # the licence header
                        p = line.split()
                        n = int(p[2])
                        index[p[0]] = [int(x) for x in p[-n:]]
                exc = self.root / "noun.exc"
                if exc.exists():
                    for line in exc.read_text(encoding="latin-1").splitlines():
                        p = line.split()
                        if len(p) >= 2:
                            self._exc.setdefault(p[0], p[1])
                # mapped, not held open: the process-wide cache keeps no file object (one would be left
                # unclosed at exit), and a synset is a slice, no seek shared between threads
                with open(self.root / "data.noun", "rb") as f:
                    self._data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
                self._index = index
        return self._index

    def lemma(self, word: str) -> str | None:
        """The noun lemma of a word form ("countries" -> "country"), or None if WordNet has no such noun."""
        index = self._index if self._index is not None else self._load()
        w = word.lower()
        if w in self._exc:
            return self._exc[w]
        if w in index:
            return w
        for suf, rep in _SUFFIXES:
            if w.endswith(suf) and w[:-len(suf)] + rep in index:
                return w[:-len(suf)] + rep
        return None

    def senses(self, lemma: str) -> list[Sense]:
        index = self._index if self._index is not None else self._load()
        return [self._synset(o)[0] for o in index.get(lemma, [])]

    def _synset(self, offset: int) -> tuple[Sense, list[int]]:
        data = self._data
        assert data is not None, "_load() maps the data file first"
        end = data.find(b"\n", offset)
        line = data[offset:end if end >= 0 else len(data)].decode("latin-1")
        head, _, gloss = line.partition(" | ")
        p = head.split()
        wc = int(p[3], 16)
        words = tuple(p[4 + 2 * i].lower() for i in range(wc))
        i = 4 + 2 * wc
        hypo = []
        for _ in range(int(p[i])):
            sym, off, pos = p[i + 1], int(p[i + 2]), p[i + 3]
            if pos == "n" and sym in ("~", "~i"):  # hyponym, instance hyponym
                hypo.append(off)
            i += 4
        return Sense(offset, words, gloss.split(";")[0].strip()), hypo

    def hyponym_words(self, sense: Sense, depth: int = DEPTH, limit: int | None = None) -> list[str] | None:
        """Single-word lemmas of the hyponyms of `sense`, nearest levels first (multi-word and hyphenated lemmas
        are left out: the lexical channel matches words, and their parts alone mean something else); None as soon
        as there are more than `limit` (a category that broad is not worth reading to the end). Cached per process."""
        key = (sense.offset, depth, limit)
        if key not in self._hypo:
            if len(self._hypo) > 4096:
                self._hypo.clear()
            self._hypo[key] = self._hyponym_words(sense, depth, limit)
        return self._hypo[key]

    def _hyponym_words(self, sense: Sense, depth: int, limit: int | None) -> list[str] | None:
        out: dict[str, None] = {}
        frontier, seen = [sense.offset], {sense.offset}
        for _ in range(depth):
            nxt = []
            for off in frontier:
                for h in self._synset(off)[1]:
                    if h not in seen:
                        seen.add(h)
                        nxt.append(h)
            for off in nxt:
                for w in self._synset(off)[0].words:
                    w = re.sub(r"\(.*\)$", "", w)  # adjective markers such as "(a)"
                    if w.isalpha():
                        out.setdefault(w, None)
                if limit is not None and len(out) > limit:
                    return None
            frontier = nxt
        return list(out)


_wordnets: dict[Path, WordNet] = {}
_wn_lock = threading.Lock()


def wordnet() -> WordNet | None:
    """The process's WordNet (HUTCH_WORDNET_DIR, else /usr/share/wordnet), or None when it is not installed."""
    root = settings.WORDNET_DIR.get()
    with _wn_lock:
        wn = _wordnets.get(root)
        if wn is None:
            if not ((root / "index.noun").is_file() and (root / "data.noun").is_file()):
                return None
            wn = _wordnets[root] = WordNet(root)
        return wn


def available() -> bool:
    return wordnet() is not None


def ranks_senses(question: str) -> bool:
    """Whether category_terms(question, ...) will ask its caller to rank senses (its category word has several),
    so that the caller can embed the question early."""
    wn = wordnet()
    if wn is None:
        return False
    for cand in category_word(question):
        lemma = wn.lemma(cand)
        senses = wn.senses(lemma) if lemma is not None else []
        if senses:
            return len(senses) > 1
    return False


def category_terms(question: str, rank_senses) -> tuple[str, list[str]] | None:
    """(the category lemma, its instance words) for a list question, or None.

    `rank_senses(question, [sense texts])` returns the index of the sense the question means (the search uses the
    embedding model: the gloss closest to the question)."""
    wn = wordnet()
    if wn is None:
        return None
    for cand in category_word(question):
        lemma = wn.lemma(cand)
        if lemma is None:
            continue
        senses = wn.senses(lemma)
        if not senses:
            continue
        sense = senses[rank_senses(question, [s.text for s in senses])] if len(senses) > 1 else senses[0]
        words = wn.hyponym_words(sense, limit=MAX_TERMS)
        if not words:
            return None
        return lemma, words
    return None
