"""`SearchIndex`: hybrid search over an SMF store that never drifts from its files.

`Memory.search / reindex / doctor` delegate here. Every query first brings
the index up to date with the files (see _db.sync), then ranks units with
the query's reading (_query), the channels (_channels) and fusion (_rank), then (with
`expand`) adds the link neighbourhood.
"""

from __future__ import annotations

import os
import sqlite3
import stat
import time
import warnings
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path
from types import MappingProxyType
from typing import Any, Iterable, Mapping

import numpy as np

from hutch._core.errors import ConfigError, MalformedEntityWarning, ReasonerWarning, SearchIndexError
from hutch.memory._format import LINKS_SUFFIX, is_name
from hutch.memory._index import _anchor, _channels, _lexicon, _query, _rank, _reason, _rerank, _units
from hutch.memory._index._db import IndexDB, SyncStats, file_digest
from hutch.memory._index._embed import default_provider

_FUSIONS = ("learned", "weighted", "rrf")


def _is_damage(e: sqlite3.DatabaseError) -> bool:
    """Whether an SQLite error means the file is damaged (rebuild it), not that it is busy or a write lost a race."""
    if isinstance(e, sqlite3.IntegrityError):
        return False
    msg = str(e).lower()
    return not (isinstance(e, sqlite3.OperationalError) and ("locked" in msg or "busy" in msg))


#: What a hit reads of its file for `head` / `text` / `title` / `speaker`: the part the index splits into units.
HEAD_BYTES = _units.UNIT_BYTES


@dataclass(frozen=True)
class Hit:
    """One search result: an entity (and for a conversation turn, the turn's anchor), its fused score,
    and what each channel said about it: `channels[name] = {"rank": r, "score": s}` (graph hits from
    `expand` carry `{"hops": n, "via": "<entity> -[rel]-> <entity>"}`)."""

    entity_id: str
    score: float
    channels: Mapping[str, Mapping[str, Any]]
    anchor: str | None = None
    _store: Any = field(default=None, repr=False, compare=False)

    @cached_property
    def entity(self):
        """The entity, read from its file (hutch.Entity): all of the file, however large (`head`, `text`,
        `title` and `speaker` read at most its first MiB)."""
        return self._store.get(self.entity_id)

    @cached_property
    def head(self):
        """The entity as its file's first MiB reads (hutch.Entity; the whole entity when the file is no larger):
        the part search splits into units, so every turn a hit can be anchored at is in it. A hit on a 200 MB
        file costs a MiB of reading here, not 200 MB."""
        return self._store.head(self.entity_id, HEAD_BYTES)

    @property
    def title(self) -> str:
        """The entity's title (its slug if it has none), read from the head of its file."""
        return _units.valid_text(self.head.title)

    @property
    def text(self) -> str:
        """The hit's text: the turn for an anchored hit, else the entity's body, from the head of its file (the
        first MiB; `entity.body` is all of it). Bytes that are not UTF-8 read as U+FFFD, as the index reads
        them; `entity.text` keeps them as they are."""
        e = self.head
        if self.anchor:
            return _units.valid_text(e.section(self.anchor) or "")
        return _units.valid_text(e.body)

    @property
    def speaker(self) -> str | None:
        """Who said an anchored turn (the name in its heading, `### D3:12 · Caroline`); None for other hits."""
        if not self.anchor:
            return None
        for heading in self.head.sections:
            at, _, who = heading.partition(" · ")
            if at.strip() == self.anchor:
                return _units.valid_text(who.strip()) or None
        return None

    def __repr__(self) -> str:
        at = f"#{self.anchor}" if self.anchor else ""
        return f"Hit({self.entity_id}{at}, score={self.score:.3f}, channels={sorted(self.channels)})"


@dataclass(frozen=True)
class IndexReport:
    """The exact state of a store's index (from doctor() or reindex())."""

    path: Path
    ok: bool
    entities: int
    units: int
    vectors: int
    pending_vectors: int
    model: str
    model_revision: str
    dim: int
    space_changed_from: str | None
    stale: tuple[str, ...]  # entity ids whose file differs from what the index holds
    missing: tuple[str, ...]  # files not in the index
    extra: tuple[str, ...]  # index entries whose file is gone
    unreadable: tuple[str, ...]  # files whose front matter is malformed: search leaves them out (check() says why)
    recovered: tuple[str, ...]  # when and why the index file was discarded and rebuilt
    embed_error: str | None = None  # the embedder's last failure (search then used the lexical channels only)
    seconds: float = 0.0
    lexicon: str | None = None  # the WordNet directory the category channel reads; None: that channel is off
    partial: tuple[str, ...] = ()  # files larger than UNIT_BYTES: only their start is units (the rest: words only)
    reasoner_error: str | None = None  # the reasoner's last failure (search then answered without it)
    fresh: bool = True  # the index holds exactly what the files hold (nothing stale, missing, extra or pending)
    #: what is wrong in the store's files, one line each ("path: what. Fix: how"): files whose front matter is
    #: malformed, links that dangle or lead out of the store. `ok` is fresh and no problems.
    problems: tuple[str, ...] = ()

    def state(self) -> str:
        """'ok', else what is wrong: the index out of date, and how many problems the files have."""
        if self.ok:
            return "ok"
        parts = [] if self.fresh else ["NOT OK: the index is out of date (run `hutch mem reindex`)"]
        if self.problems:
            n = len(self.problems)
            parts.append(f"{n} problem{'s' if n != 1 else ''} in the store's files (each below, with its fix)")
        return "; ".join(parts) or "NOT OK"

    def lines(self) -> list[str]:
        """Human-readable report, one fact per line."""
        out = [f"index: {self.path}",
               f"state: {self.state()}",
               f"entities: {self.entities}  units: {self.units}",
               f"model: {self.model} rev {self.model_revision} dim {self.dim}",
               f"vectors: {self.vectors}  pending: {self.pending_vectors}"
               + ("  (dense channel off until done; run `hutch mem reindex`)" if self.pending_vectors else "")]
        if self.space_changed_from:
            out.append(f"vector space replaced; previous model: {self.space_changed_from}")
        for name in ("stale", "missing", "extra", "unreadable"):
            items = getattr(self, name)
            if items:
                out.append(f"{name}: {len(items)}: " + ", ".join(items[:10]) + (" ..." if len(items) > 10 else ""))
        if self.partial:
            out.append(f"partly indexed: {len(self.partial)}: " + ", ".join(self.partial[:10])
                       + (" ..." if len(self.partial) > 10 else "")
                       + f"  (past {_units.UNIT_BYTES >> 20} MiB by their words only, past "
                       f"{_units.LEXICAL_BYTES >> 20} MiB not at all: split such files)")
        for p in self.problems[:_MAX_PROBLEM_LINES]:
            out.append(f"problem: {p}")
        if len(self.problems) > _MAX_PROBLEM_LINES:
            out.append(f"problem: ... and {len(self.problems) - _MAX_PROBLEM_LINES} more: `hutch mem check` lists "
                       "every one")
        for r in self.recovered:
            out.append(f"recovered: {r}")
        if self.embed_error:
            out.append(f"embedder failed: {self.embed_error}")
        if self.reasoner_error:
            out.append(f"reasoner failed (search answered without it): {self.reasoner_error}")
        out.append(f"lexicon: WordNet at {self.lexicon}" if self.lexicon else
                   "lexicon: none (category channel off: install Debian's wordnet-base, or set HUTCH_WORDNET_DIR)")
        return out


#: doctor's text lists at most this many problems (the report holds them all; check() says the same of each)
_MAX_PROBLEM_LINES = 50


def _problems(root: Path, files: dict, linkdirs: dict, errors: dict[str, str],
              left_out: list = (), unopened: list = ()) -> tuple[str, ...]:
    """What is wrong in the files doctor() looked at, one line each with its fix: each `*.md` in a class that
    search leaves out because it is no entity file (`left_out`: (class, name, path) from the scan: a name that is
    no slug or not UTF-8, a symbolic link, a directory...), each file whose front matter does not parse
    (`errors`: id -> the index's reason), each link whose target is not an entity file of the store (dangling)
    or is not inside it. check() finds these and more (hutch/memory/_check.py)."""
    from hutch.memory import _check
    from hutch.memory._layout import Layout
    from hutch.memory._links import link_entries

    out = []
    for entity_id, e in unopened:  # entity files this process may not read (mode 000): search leaves them out
        rel = f"{entity_id}.md"
        out.append(f"{rel}: cannot be read ({e.strerror}). Fix: {_check.unreadable_fix(rel)}")
    for cls, name, path in sorted(left_out):
        if not name:  # a class directory that cannot be listed
            try:
                os.listdir(path)
                continue
            except OSError as e:
                _, rel, what, fix = _check.unreadable_dir(cls, e)
                out.append(f"{_check.shown(rel)}: {what} Fix: {fix}")
                continue
        why = _check.left_out(cls, name, path)
        if why is not None:
            _, rel, what, fix = why
            out.append(f"{_check.shown(rel)}: {what} Fix: {fix}")
    for entity_id in sorted(errors):
        rel = f"{entity_id}.md"
        why = errors[entity_id].removeprefix(f"{root / rel} ").removeprefix(f"{rel} ")
        out.append(f"{rel}: {why} Fix: {_check.front_matter_fix(rel)}")
    layout = Layout(root)
    for src in sorted(linkdirs):
        ldir = Path(linkdirs[src][0])
        for rel, name, tid in link_entries(layout, ldir):
            lrel = f"{src}{LINKS_SUFFIX}/{rel}/{name}"
            if tid is None:
                out.append(f"{lrel}: {_check.escape_message(ldir / rel / name)} Fix: {_check.escape_fix(lrel)}")
            elif tid not in files:
                out.append(f"{lrel}: {_check.dangling_message(tid)} Fix: {_check.dangling_fix(src, rel, tid, lrel)}")
    return tuple(out)


def _classes(classes: Any) -> tuple[str, ...] | None:
    """search()'s `classes=` as a tuple of class names (a generator is read once, here), or None for all; a
    ConfigError naming the fix for what no class could be: a name that is not a class name (a-z, 0-9, '_', '-'),
    something that is not a string, more than MAX_CLASSES names."""
    if classes is None:
        return None
    if isinstance(classes, str):
        classes = (classes,)
    limit = _units.MAX_CLASSES
    if hasattr(classes, "__len__") and len(classes) > limit:
        raise ConfigError(f"classes= names {len(classes):,} classes; search takes at most {limit:,}: name the few "
                          "classes to search, or leave classes=None to search them all.")
    try:
        got = []
        for c in classes:
            got.append(c)
            if len(got) > limit:
                raise ConfigError(f"classes= names more than {limit:,} classes; search takes at most {limit:,}: "
                                  "name the few classes to search, or leave classes=None to search them all.")
    except TypeError:
        raise ConfigError(f"classes={classes!r:.80} is not a list of class names: pass e.g. classes=['notes'] "
                          "or classes='notes'.") from None
    for c in got:
        if not is_name(c):
            raise ConfigError(f"classes= holds {c!r:.80}, which is not a class name (1-64 characters of a-z, 0-9, "
                              "'_' or '-'): name classes as `hutch mem ls` shows them, e.g. classes=['notes'].")
    return tuple(dict.fromkeys(got))


def _passage(h: Hit) -> str:
    """What the reasoner is shown of a hit (bounded: _reason.passage)."""
    try:
        return _reason.passage(h.text, h.speaker, h.head.valid_from)
    except Exception:  # the file went away or broke since it was indexed: the reasoner sees it empty
        return ""


class SearchIndex:
    """The search index of one store. `provider` embeds texts (default: the local MiniLM model)."""

    def __init__(self, store: Any, provider: Any = None, reasoner: Any = None):
        self.store = store
        self.reasoner = reasoner  # optional LLM that rewrites questions and re-ranks the top hits (_reason)
        self.reasoner_error: str | None = None  # its last failure (search then answered without it)
        self._reasoner_down = False  # it failed and has not answered since (one warning per outage)
        self._reasoner_retry_at = 0.0  # time.monotonic() before which search leaves it out (its cooldown)
        self.root = Path(store.root)
        self.provider = provider or default_provider()
        self.idx = IndexDB(self.root, self.provider)
        self.snap: _rank.Snapshot | None = None
        self.last_sync: SyncStats | None = None
        self._counts = _query.WordCounts()  # word -> units holding it (which words the lexical query leaves out)
        self._sense_vecs: dict[str, np.ndarray] = {}  # WordNet sense text -> its vector (see _channels.category)
        self._named_bad: set[str] = set()  # files with malformed front matter a warning has named (_name_malformed)
        self._bad_gen: str | None = None

    # ------------------------------------------------------------ keeping fresh

    def refresh(self, *, embed_budget: float | None = 5.0) -> SyncStats:
        """Bring index and snapshot up to date with the files (cheap when nothing changed)."""
        for attempt in (1, 2):
            try:
                return self._refresh(embed_budget)
            except sqlite3.DatabaseError as e:
                if not _is_damage(e):
                    raise SearchIndexError(f"The search index {self.idx.path} is busy or refused a write ({e}): "
                                           "retry; if it persists, run `hutch mem doctor`.") from e
                if attempt == 2:
                    raise SearchIndexError(f"The search index {self.idx.path} cannot be used ({e}): delete the "
                                           "file and run `hutch mem reindex`.") from e
                self.idx.recover(e)
                self.snap = None
        raise AssertionError("unreachable")

    def _refresh(self, embed_budget):
        self.idx.open()
        before = self.idx.generation()
        stale_snapshot = self.snap is None or self.snap.gen != before
        mine = self.idx.own_bumps
        stats, removed, added = self.idx.sync(embed_budget=embed_budget)
        db = self.idx.db
        if int(self.idx.generation()) != int(before) + (self.idx.own_bumps - mine):
            stale_snapshot = True  # another process changed the index meanwhile: our patch would miss it
        dim = int(self.provider.dim) if self.idx.model_known else int(self.idx.meta("model_dim") or 0)
        if stale_snapshot or self.snap.dim != dim:
            snap = _rank.Snapshot(dim)
            snap.load_entities(db, None)
            snap.add_units(db, None)
            self.snap = snap
        elif stats.changed:
            snap = self.snap
            snap.remove_units(removed)
            if stats.removed:
                snap.forget_entities(set(stats.removed))
            ids = stats.reindexed
            eids = [r[0] for chunk in _rank.batches(ids) for r in db.execute(
                f"select eid from files where entity_id in ({','.join('?' * len(chunk))})", chunk)]
            snap.load_entities(db, eids)
            snap.add_units(db, sorted(added))
            if stats.embedded:
                snap.fill_vectors(db)
        self.snap.gen = self.idx.generation()
        self.last_sync = stats
        return stats

    # ------------------------------------------------------------ search

    def search(self, query: str, *, k: int = 10, classes: Iterable[str] | str | None = None,
               since: Any = None, until: Any = None, as_of: Any = None, expand: int = 0,
               fusion: str = "learned", now: Any = None, collect: dict | None = None) -> list[Hit]:
        """Hybrid search; see Memory.search. `collect` (bench/locomo.py): a dict that gets the second stage's
        pool and features, and every candidate's channel contributions (see _search)."""
        if not isinstance(query, str) or not query.strip():
            raise ConfigError("search() needs a non-empty query string, e.g. mem.search('customer churn').")
        if len(query) > _units.MAX_QUERY_CHARS:
            raise ConfigError(f"The query is {len(query):,} characters long; search takes at most "
                              f"{_units.MAX_QUERY_CHARS:,}: ask with the words that matter (the embedding model reads "
                              "the first ~600 characters of a query).")
        query = _units.valid_text(query)
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ConfigError(f"k={k!r} is not a positive integer: ask for at least one hit, e.g. k=10.")
        if not isinstance(expand, int) or not 0 <= expand <= 3:
            raise ConfigError(f"expand={expand!r} must be 0..3 (hops over links from each hit).")
        if fusion not in _FUSIONS:
            raise ConfigError(f"fusion={fusion!r} is unknown: use one of {', '.join(_FUSIONS)}.")
        classes = _classes(classes)
        since_t = _units.epoch_of(since, "since")
        until_t = _units.epoch_of(until, "until")
        as_of_t = _units.epoch_of(as_of, "as_of")
        now_t = _units.epoch_of(now, "now")
        # what "last week" in the question is read against: as_of if given, else now, else (None) the newest
        # time among the candidates, at most the clock (see _reference)
        ref = as_of_t if as_of_t is not None else now_t
        self.refresh()
        self._name_malformed()
        reason = self.reasoner is not None and collect is None
        want = max(k, _reason.RERANK) if reason else k
        args = (classes, since_t, until_t, as_of_t, 0 if reason else expand, fusion, ref)
        try:
            hits = self._search(query, want, *args, collect)
        except sqlite3.DatabaseError as e:
            if not _is_damage(e):
                raise SearchIndexError(f"The search index {self.idx.path} is busy ({e}): retry the query.") from e
            self.idx.recover(e)
            self.snap = None
            self.refresh()
            hits = self._search(query, want, *args, collect)
        if not reason:
            return hits
        hits = self._reasoned(query, hits, want, args)[:k]
        if expand:
            hits += self._expand(hits, expand, self._mask(classes, since_t, until_t, as_of_t), classes)
        return hits

    def _reasoned(self, query: str, hits: list[Hit], want: int, args) -> list[Hit]:
        """The question's hits merged with those of the reasoner's rewritten searches (reciprocal rank), the
        best RERANK re-ordered by it. Its failure (any exception, an unusable answer) leaves the question's own
        hits, warns once per outage and leaves the reasoner out for its `cooldown` seconds (_reason)."""
        if time.monotonic() < self._reasoner_retry_at:
            return hits
        try:
            subs = _reason.queries(self.reasoner.rewrite(query), query)
        except Exception as e:
            return self._reasoner_failed(e, hits)
        lists = [hits] + [self._search(_units.valid_text(sub), want, *args) for sub in subs]
        by_key: dict = {}
        for hs in lists:
            for h in hs:
                by_key.setdefault((h.entity_id, h.anchor), h)
        cands = [by_key[key] for key in _reason.merge([[(h.entity_id, h.anchor) for h in hs] for hs in lists])]
        top = cands[:_reason.RERANK]
        try:
            order = _reason.reorder(len(top), self.reasoner.rerank(query, [_passage(h) for h in top]))
        except Exception as e:
            return self._reasoner_failed(e, hits)
        cands = [top[i] for i in order] + cands[len(top):]
        self.reasoner_error = None
        self._reasoner_down = False
        n = len(cands)
        return [replace(h, score=round((n - i) / n, 6), channels=MappingProxyType(
            {**h.channels, "reasoner": MappingProxyType({"rank": i + 1, "score": round((n - i) / n, 6)})}))
            for i, h in enumerate(cands)]

    def _reasoner_failed(self, e: Exception, hits: list[Hit]) -> list[Hit]:
        why = str(e) if isinstance(e, SearchIndexError) else f"it raised {type(e).__name__}: {e}"
        why = why[:500].rstrip(".") + "."
        self.reasoner_error = why
        cooldown = getattr(self.reasoner, "cooldown", _reason.COOLDOWN)
        self._reasoner_retry_at = time.monotonic() + cooldown
        if not self._reasoner_down:
            self._reasoner_down = True
            warnings.warn(f"search answered without its reasoner {self.reasoner!r}: {why} It is left out for "
                          f"{cooldown:g} s; doctor() keeps its last failure.", ReasonerWarning, stacklevel=4)
        return hits

    def _name_malformed(self) -> None:
        """A warning naming the files search leaves out because their front matter is malformed (a hit's entity
        could not be read): each once, when this index first sees it broken (fixed and broken again: again)."""
        s = self.snap
        if s is None or s.gen == self._bad_gen:
            return
        self._bad_gen = s.gen
        bad = {s.entity_id[p] for p in np.flatnonzero(s.e_bad[:s.ne] & s.e_alive[:s.ne])}
        new, self._named_bad = sorted(bad - self._named_bad), bad
        if not new:
            return
        first = self.idx.db.execute("select error from files where entity_id = ?", (new[0],)).fetchone()
        rel = f"{new[0]}.md"
        # the file by its path in the store (an index made before this commit kept its absolute path)
        why = f"{rel} {first[0].removeprefix(f'{self.root / rel} ').removeprefix(f'{rel} ')}" if first else rel
        more = f"; and {', '.join(f'{e}.md' for e in new[1:6])}{' ...' if len(new) > 6 else ''}" if len(new) > 1 else ""
        warnings.warn(f"search leaves out {len(new)} file{'s' if len(new) > 1 else ''} whose front matter is "
                      f"malformed, until fixed (`hutch mem check` lists them): {why}{more}",
                      MalformedEntityWarning, stacklevel=3)

    def _reference(self, mask: np.ndarray) -> float:
        """What relative time words in a question are read against when the caller gives no now= or as_of: the
        newest time among the candidates (their entity's valid_from, else recorded_at, else created), at most the
        clock. A store that is written as things happen has that time near the clock, so "last week" is last
        week; in a conversation ingested later it is its last session: a question about a conversation is asked
        from its end (as LoCoMo's are), not from the day it was imported. _search asks it twice: over all the
        candidates (for every unit that is not a turn) and over the candidate turns alone (for the turns), so a
        note written today does not move a conversation's "last week" to the clock's (the defaults then read a
        turn's time as `classes=` naming the turns' class does)."""
        s = self.snap
        key = ("reference", s.gen, len(mask), hash(mask.tobytes()))
        if key not in s.memo:
            if len(s.memo) >= 256:
                s.memo.clear()
            with np.errstate(invalid="ignore"):
                tr = s.t_rec[:s.ne][s.epos[:s.n][mask]]
            newest = float(np.nanmax(tr)) if len(tr) and not np.isnan(tr).all() else np.inf
            s.memo[key] = newest
        return min(time.time(), s.memo[key])

    def _turn_references(self, turns: np.ndarray) -> list[tuple[np.ndarray, float]]:
        """Per conversation that has candidate turns (`_anchor.conversations`: the sessions with the same
        speakers), newest first: (the positions of its turns, what they read relative time words against: the
        newest time among its candidate turns, at most the clock). One conversation's end is not another's: in a
        store holding several, "last week" about each is the week before its own last session. Asked only when
        the question has a relative time word (_query.read)."""
        s = self.snap
        key = ("turn-references", s.gen, len(turns), hash(turns.tobytes()))
        got = s.memo.get(key)
        if got is None:
            conv = _anchor.conversations(s)[:len(turns)]
            with np.errstate(invalid="ignore"):
                tr = s.t_rec[:s.ne][s.epos[:len(turns)]]
            cand = turns & (conv >= 0) & ~np.isnan(tr)
            newest = np.full(int(conv.max()) + 1 if len(conv) else 0, -np.inf)
            np.maximum.at(newest, conv[cand], tr[cand])
            # every conversation's turn positions, from one sort
            by = np.argsort(conv, kind="stable")
            cut = np.searchsorted(conv[by], np.arange(len(newest) + 1))
            got = [(by[cut[c]:cut[c + 1]], float(newest[c])) for c in np.argsort(-newest, kind="stable").tolist()
                   if np.isfinite(newest[c])]
            if len(s.memo) >= 256:
                s.memo.clear()
            s.memo[key] = got
        clock = time.time()
        return [(where, min(clock, t)) for where, t in got]

    def _mask(self, classes, since_t, until_t, as_of_t) -> np.ndarray:
        s = self.snap
        n = s.n
        mask = s.alive[:n].copy()
        ep = s.epos[:n]
        # a file whose front matter is malformed is never a hit (its entity cannot be read): _name_malformed
        mask &= (s.e_alive[:s.ne] & ~s.e_bad[:s.ne])[ep] if s.ne else False
        if classes is not None:
            wanted = set(classes)
            ok = np.array([c in wanted for c in s.ecls], bool)
            mask &= ok[ep]
        if as_of_t is not None:
            tf, tt = s.t_from[:s.ne][ep], s.t_to[:s.ne][ep]
            mask &= (np.isnan(tf) | (tf <= as_of_t)) & (np.isnan(tt) | (as_of_t < tt))
        if since_t is not None or until_t is not None:
            # a unit's time is its entity's valid_from (else recorded_at, else created); none -> filtered out
            tr = s.t_rec[:s.ne][ep]
            ok = ~np.isnan(tr)
            if since_t is not None:
                ok &= np.nan_to_num(tr, nan=-np.inf) >= since_t
            if until_t is not None:
                ok &= np.nan_to_num(tr, nan=np.inf) <= until_t
            mask &= ok
        return mask

    def _search(self, query, k, classes, since_t, until_t, as_of_t, expand, fusion, ref,
                collect: dict | None = None) -> list[Hit]:
        """One query's trip, forward: the filters' candidate mask, the reading, the channels, fusion, the learned
        second stage (fusion="learned"), the hits. `collect` (bench/locomo.py) gets the second stage's pool and
        features."""
        s = self.snap
        if s.n == 0:
            return []
        db = self.idx.db
        # in a store of turns, a person, a day or an event linked to a session is searched through its turns
        mask = _anchor.turn_side(s, db, self._mask(classes, since_t, until_t, as_of_t))
        if not mask.any():
            return []
        if ref is None:
            turns = mask & s.is_turn[:s.n]
            reading = _query.read(query, db, self._reference(mask), self._reference(turns) if turns.any() else None,
                                  (lambda: self._turn_references(turns)) if turns.any() else None)
        else:
            reading = _query.read(query, db, ref)
        trip = _channels.Trip(s, db, mask, self.provider, self.idx.model_known and s.dense_ready(), self._counts,
                              self._sense_vecs)
        channels = _channels.run(reading, trip)
        if trip.embed_error is not None:
            self.idx.embed_error = trip.embed_error
        scales: dict = {}
        score = _rank.fuse(channels, mask, "rrf" if fusion == "rrf" else "weighted", scales)
        model = _rerank.shipped() if fusion == "learned" else None
        if model is None and collect is None:
            top = _rank.top_k(score, mask, k)
            final = score[top]
        else:
            # the second stage re-orders the fused list's best POOL units; past them the fused order stays
            top = _rank.top_k(score, mask, max(k, _rerank.POOL))
            pool = top[:_rerank.POOL]
            X = _rerank.features(reading, s, db, channels, scales, score, pool,
                                 _rerank.FEATURES if collect is not None else model.names)
            if collect is not None:
                collect.update(pool=pool, X=X, anchors=[s.anchor[p] for p in pool],
                               entities=[s.entity_id[s.epos[p]] for p in pool], mask=mask,
                               contributions=_rerank.contributions(channels, scales, mask),
                               query_vector=next((ch.parts["query"].qv for ch in channels if ch.name == "dense"),
                                                 None))
            final = score[top]
            if model is not None:
                # the model's probability that the unit is what the question asks for; past the pool, the fused
                # order, scored below the pool's lowest
                second = 1 / (1 + np.exp(-model.score(X)))
                order = np.argsort(-second, kind="stable")
                rest = top[len(pool):]
                low = float(second.min()) if len(second) else 0.0
                final = second[order]
                if rest and score[pool[-1]] > 0:
                    final = np.r_[final, low * np.maximum(score[rest], 0) / score[pool[-1]]]
                top = [pool[i] for i in order] + rest
            top, final = top[:k], final[:k]
        ranks = {}
        for ch in channels:
            found = [p for p in top if ch.present[p]]
            if found:
                ranks[ch.name] = dict(zip(found, ch.ranks(mask, found)))
        hits = []
        for p, sc in zip(top, final):
            chans = {ch.name: MappingProxyType({"rank": ranks[ch.name][p], "score": round(float(ch.scores[p]), 6)})
                     for ch in channels if p in ranks.get(ch.name, ())}
            hits.append(Hit(s.entity_id[s.epos[p]], round(float(sc), 6), MappingProxyType(chans), s.anchor[p],
                            self.store))
        if expand:
            hits += self._expand(hits, expand, mask, classes)
        return hits

    def _expand(self, hits: list[Hit], hops: int, mask: np.ndarray, classes) -> list[Hit]:
        """Entities linked (either direction) to the hits, up to `hops` away, scored down by distance."""
        seen = {h.entity_id for h in hits}
        frontier = [(h.entity_id, h.score) for h in hits]
        wanted = set(classes) if classes else None
        out: list[Hit] = []
        db = self.idx.db
        for hop in range(1, hops + 1):
            nxt = []
            for src, base in frontier:
                rows = [(src, rel, dst) for rel, dst in db.execute("select rel, dst from links where src=?", (src,))]
                rows += [(s_, rel, src) for s_, rel in db.execute("select src, rel from links where dst=?", (src,))]
                for a, rel, b in rows:
                    other = b if a == src else a
                    p = self.snap.pos_of_id.get(other)
                    if other in seen or p is None or self.snap.e_bad[p] or not (self.root / f"{other}.md").is_file():
                        continue
                    if wanted and other.split("/", 1)[0] not in wanted:
                        continue
                    seen.add(other)
                    sc = round(base * 0.5 ** hop, 6)
                    out.append(Hit(other, sc, MappingProxyType({"graph": MappingProxyType(
                        {"hops": hop, "via": f"{a} -[{rel}]-> {b}"})}), None, self.store))
                    nxt.append((other, sc))
            frontier = nxt
        return out

    # ------------------------------------------------------------ maintenance

    def reindex(self, *, full: bool = False) -> IndexReport:
        """Bring the index fully up to date, embedding everything pending. `full=True` starts from an empty file."""
        if full:
            self.idx._discard("reindex(full=True) was asked for")
            self.idx.recovered.pop()
            self.snap = None
        self.refresh(embed_budget=None)
        return self.doctor()

    def doctor(self) -> IndexReport:
        """Verify the index against the files without changing either: every file's stat and, where they
        differ, its hash; the model identity; vectors pending. (An unreadable index file is rebuilt first.)"""
        t0 = time.perf_counter()
        try:
            self.idx.open()
            db = self.idx.db
            left_out: list = []
            files, linkdirs = self.idx.scan(left_out=left_out)
            rows = {r[0]: r[1:] for r in db.execute("select entity_id, mtime_ns, size, hash, linkstamp, error from files")}
        except sqlite3.DatabaseError as e:
            self.idx.recover(e)
            self.snap = None
            return self.doctor()
        stale, missing, unopened = [], [], []
        for entity_id, (path, mtime, size) in sorted(files.items()):
            row = rows.get(entity_id)
            if row is None:
                try:  # a file this process may not read is no index that is out of date: check() says why
                    os.close(os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC))
                except PermissionError as e:
                    unopened.append((entity_id, e))
                    continue
                except OSError:
                    pass
                missing.append(entity_id)
                continue
            if (row[0], row[1]) != (mtime, size):
                try:  # never through a link, never blocking on a FIFO (either may replace the file since the scan)
                    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
                    with os.fdopen(fd, "rb") as f:
                        st = os.fstat(f.fileno())
                        digest = file_digest(f, st.st_size) if stat.S_ISREG(st.st_mode) else None
                except OSError:
                    digest = None
                if digest != row[2]:
                    stale.append(entity_id)
                    continue
            ls = linkdirs[entity_id][1] if entity_id in linkdirs else None
            if ls != row[3]:
                stale.append(entity_id)
        extra = sorted(e for e in rows if e not in files)
        unreadable = sorted(e for e, r in rows.items() if r[4])
        partial = sorted(e for e, (_, size, *_) in rows.items() if size is not None and size > _units.UNIT_BYTES)
        name, rev, dim = (self.idx.model_identity() if self.idx.model_known else
                          (self.idx.meta("model_name") or "?", self.idx.meta("model_revision") or "?",
                           int(self.idx.meta("model_dim") or 0)))
        units = db.execute("select count(*) from units").fetchone()[0]
        vectors = db.execute("select count(*) from vectors").fetchone()[0]
        pending = db.execute("select count(distinct u.dense_hash) from units u left join vectors v "
                             "on v.dense_hash = u.dense_hash where v.dense_hash is null").fetchone()[0]
        fresh = not (stale or missing or extra or pending or self.idx.embed_error)
        problems = _problems(self.store.root, files, linkdirs,
                             {e: r[4] for e, r in rows.items() if r[4] and e in files}, left_out, unopened)
        return IndexReport(self.idx.path, fresh and not problems, len(rows), units, vectors, pending, name, rev, dim,
                           self.idx.meta("space_changed_from"), tuple(stale), tuple(missing), tuple(extra),
                           tuple(unreadable), tuple(self.idx.recovered), self.idx.embed_error,
                           time.perf_counter() - t0, str(wn.root) if (wn := _lexicon.wordnet()) else None,
                           tuple(partial), self.reasoner_error, fresh, problems)

    def close(self) -> None:
        self.idx.close()
        self.snap = None
