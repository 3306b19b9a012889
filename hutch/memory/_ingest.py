"""Ingest: multi-session conversations (LoCoMo JSON) and Markdown/text documents.

Both are deterministic and need no model; an optional `extractor` (see
_extract.py) may add entities, facts and links it proposes. Each call is one
transaction (one commit) and re-running it on the same input changes nothing.
The layout they produce is specified in docs/smf-format.md.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hutch._core.errors import ConfigError, MemoryStoreError
from hutch.memory import _format as fmt

if TYPE_CHECKING:  # pragma: no cover
    from hutch.memory._store import Memory

_LOCOMO_TIME = "%I:%M %p on %d %B, %Y"
_LOCOMO_DATE = "%d %B, %Y"


@dataclass
class IngestResult:
    """What an ingest call wrote: entity ids by class, link count, the commit (None if nothing changed)."""

    entities: dict[str, list[str]] = field(default_factory=dict)
    links: int = 0
    commit: str | None = None

    def add(self, entity_id: str) -> None:
        cls = entity_id.split("/", 1)[0]
        ids = self.entities.setdefault(cls, [])
        if entity_id not in ids:
            ids.append(entity_id)

    @property
    def count(self) -> int:
        return sum(len(v) for v in self.entities.values())


# ====================================================================== conversations

def _load_json(data: Any) -> tuple[dict, str | None]:
    if isinstance(data, dict):
        return data, None
    if isinstance(data, os.PathLike) or (isinstance(data, str) and not data.lstrip().startswith("{")):
        path = Path(data)
        try:
            return json.loads(path.read_text(encoding="utf-8")), path.stem
        except FileNotFoundError:
            raise ConfigError(f"{path} does not exist: give the path of a LoCoMo JSON file.") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path} is not valid JSON ({e}): give a LoCoMo conversation file.") from None
    if isinstance(data, (str, bytes)):
        try:
            return json.loads(data), None
        except json.JSONDecodeError as e:
            raise ConfigError(f"The conversation is not valid JSON ({e}).") from None
    raise ConfigError("ingest_conversation() takes a path, a JSON string or a dict in LoCoMo form.")


def _parse_locomo_time(value: str, where: str) -> datetime:
    for f in (_LOCOMO_TIME, _LOCOMO_DATE):
        try:
            return datetime.strptime(value.strip(), f)
        except ValueError:
            continue
    try:
        return datetime.fromisoformat(value.strip())
    except ValueError:
        raise ConfigError(
            f"{where}: {value!r} is not a date hutch can read: use LoCoMo's '1:56 pm on 8 May, 2023' or ISO 8601."
        ) from None


def _turn_lines(text: str) -> str:
    # a turn line that starts with '#' would become a heading and break the turn's section
    return "\n".join("\\" + ln if ln.lstrip().startswith("#") else ln for ln in str(text).splitlines())


def render_session(conv_id: str, n: int, when_human: str, turns: list[dict]) -> str:
    """The Markdown body of one session: a title, then one `### dia_id · speaker` section per turn."""
    out = [f"# {conv_id} · session {n} · {when_human}", ""]
    for t in turns:
        out += [f"### {t['dia_id']} · {t['speaker']}", "", _turn_lines(t.get("text", ""))]
        if t.get("blip_caption"):
            out += ["", f"> [image: {' '.join(str(t['blip_caption']).split())}]"]
        out.append("")
    return "\n".join(out)


def _session_numbers(d: dict) -> list[int]:
    nums = []
    for k, v in d.items():
        m = re.fullmatch(r"session_(\d+)", k)
        if m and isinstance(v, list) and v:
            nums.append(int(m.group(1)))
    return sorted(nums)


def ingest_conversation(mem: "Memory", data: Any, *, conv_id: str | None = None, source_prefix: str = "locomo",
                        extractor: Any = None) -> IngestResult:
    """Ingest one multi-session conversation in LoCoMo form (path, JSON text or dict); one commit.

    Sessions -> interactions/<conv>-session-<n>, speakers -> actors/,
    dates -> time/<yyyy-mm-dd>, events_session_<n> -> events/, all linked and
    carrying `source: <prefix>:<conv>#session-<n>`; each turn is a section
    whose anchor is its dia_id.
    """
    d, stem = _load_json(data)
    if "conversation" in d and isinstance(d["conversation"], dict):  # the full LoCoMo file's per-sample form
        conv_id = conv_id or d.get("sample_id")
        d = d["conversation"]
    conv_id = conv_id or d.get("sample_id") or stem
    if not conv_id:
        raise ConfigError("ingest_conversation() needs conv_id= when the input is not a file named after it.")
    conv_slug = fmt.slugify(str(conv_id))
    sessions = _session_numbers(d)
    if not sessions:
        raise ConfigError(
            f"{conv_id} has no sessions: LoCoMo input needs 'session_1': [turns...] and 'session_1_date_time'."
        )
    res = IngestResult()
    prefix = f"{source_prefix}:{conv_id}"
    with mem.transaction(f"ingest conversation {conv_id}", source=prefix) as tx:
        tx.kind = "ingest"
        actors: dict[str, str] = {}

        def actor(name: str) -> str:
            if name not in actors:
                e = mem.put("actors", name, source=prefix, tags=["speaker"], exist_ok=True)
                actors[name] = e.id
            res.add(actors[name])
            return actors[name]

        def day(dt: datetime) -> str:
            ymd = dt.strftime("%Y-%m-%d")
            tid = f"time/{ymd}"
            if not mem.exists(tid):
                mem.put("time", ymd, slug=ymd, body=dt.strftime("%A, %d %B %Y").replace(" 0", " ") + "\n",
                        valid_from=ymd, valid_to=(dt + timedelta(days=1)).strftime("%Y-%m-%d"))
            res.add(tid)
            return tid

        for n in sessions:
            turns = d[f"session_{n}"]
            human = str(d.get(f"session_{n}_date_time") or "")
            where = f"{conv_id} session {n}"
            when = _parse_locomo_time(human, where) if human else None
            speakers = []
            for t in turns:
                if not isinstance(t, dict) or "dia_id" not in t or "speaker" not in t:
                    raise ConfigError(f"{where}: every turn needs 'speaker', 'dia_id' and 'text'; got {t!r:.80}.")
                if t["speaker"] not in speakers:
                    speakers.append(t["speaker"])
            body = render_session(str(conv_id), n, human or "undated", turns)
            slug = f"{conv_slug}-session-{n}"
            sid = _upsert(mem, "interactions", f"{conv_id} session {n}", slug, body,
                          source=f"{prefix}#session-{n}", valid_from=when.isoformat() if when else None,
                          meta={"session_date": human or None, "participants": speakers,
                                "conversation": str(conv_id), "session": n})
            res.add(sid)
            for sp in speakers:
                mem.link(sid, "participants", actor(sp))
                res.links += 1
            if when is not None:
                mem.link(sid, "on_date", day(when))
                res.links += 1
            events = d.get(f"events_session_{n}") or {}
            if isinstance(events, dict):
                edate = events.get("date")
                edt = _parse_locomo_time(edate, where) if isinstance(edate, str) else when
                k = 0
                for who, items in events.items():
                    if who == "date" or not isinstance(items, list):
                        continue
                    for item in items:
                        if not str(item).strip():
                            continue
                        k += 1
                        eid = _upsert(mem, "events", str(item), f"{slug}-event-{k}", str(item).strip() + "\n",
                                      source=f"{prefix}#session-{n}",
                                      valid_from=edt.strftime("%Y-%m-%d") if edt else None,
                                      meta={"conversation": str(conv_id), "session": n})
                        res.add(eid)
                        mem.link(eid, "about", actor(who))
                        mem.link(eid, "in_session", sid)
                        res.links += 2
                        if edt is not None:
                            mem.link(eid, "on_date", day(edt))
                            res.links += 1
            if extractor is not None:
                _apply_extractor(mem, extractor, body, f"{prefix}#session-{n}", sid, res)
    res.commit = _last_commit_if_changed(mem, tx)
    return res


def _upsert(mem: "Memory", cls: str, title: str, slug: str, body: str, *, source: str | None,
            valid_from: str | None, meta: dict) -> str:
    meta = {k: v for k, v in meta.items() if v is not None}
    entity_id = f"{cls}/{slug}"
    if mem.exists(entity_id):
        mem.update(entity_id, title=title, body=body, source=source, valid_from=valid_from, meta=meta)
    else:
        mem.put(cls, title, slug=slug, body=body, source=source, valid_from=valid_from, meta=meta)
    return entity_id


def _last_commit_if_changed(mem: "Memory", tx) -> str | None:
    if not tx.paths:
        return None
    return mem.git.run("rev-parse", "HEAD").strip()


def _apply_extractor(mem: "Memory", extractor: Any, text: str, source: str, anchor_id: str, res: IngestResult) -> None:
    from hutch.memory._extract import apply_extraction

    extraction = extractor.extract(text, source=source)
    for eid in apply_extraction(mem, extraction, source=source, mentioned_in=anchor_id):
        res.add(eid)


# ====================================================================== documents

def ingest_text(mem: "Memory", path_or_str: Any, *, title: str | None = None, cls: str = "documents",
                split_level: int = 2, source: str | None = None, tags: list[str] | tuple = (),
                extractor: Any = None) -> IngestResult:
    """Ingest a Markdown or plain-text document, split along its headings; one commit.

    `path_or_str` is a path (str or Path) of an existing file, or the text
    itself. The text before the first heading of level <= `split_level`
    becomes `<cls>/<doc-slug>`; each such section becomes
    `<cls>/<doc-slug>--<section-slug>` (its body is the section verbatim,
    heading included), linked `part_of` -> the document and `next` -> the
    following part. A leading lone level-1 heading is the document's title.
    """
    if not 1 <= int(split_level) <= 6:
        raise ConfigError(f"split_level {split_level!r} must be a heading level from 1 to 6.")
    text, path = _read_text(path_or_str)
    text = text.replace("\r\n", "\n")
    hs = fmt.headings(text)
    h1 = [h for h in hs if h[1] == 1]
    doc_title_heading = h1[0] if len(h1) == 1 and hs and hs[0] is h1[0] else None
    if title is None:
        if doc_title_heading is not None:
            title = doc_title_heading[2]
        elif path is not None:
            title = path.stem
        else:
            first = next((ln.strip() for ln in text.splitlines() if ln.strip()), "")
            title = first.lstrip("#").strip()[:80] or "untitled"
    src = source or (f"file:{path}" if path is not None else None)
    cuts = [h for h in hs if h[1] <= split_level and h is not doc_title_heading]
    preamble = text[: cuts[0][0]] if cuts else text
    parts = []
    for i, (off, _level, heading, _) in enumerate(cuts):
        end = cuts[i + 1][0] if i + 1 < len(cuts) else len(text)
        parts.append((heading, text[off:end]))
    res = IngestResult()
    fmt.check_class(cls)
    doc_slug = fmt.slugify(title)
    with mem.transaction(f"ingest text {title}", source=src) as tx:
        tx.kind = "ingest"
        doc_id = _upsert(mem, cls, title, doc_slug, preamble, source=src, valid_from=None,
                         meta={"tags": list(tags)} if tags else {})
        res.add(doc_id)
        prev = None
        used: set[str] = set()
        for n, (heading, body) in enumerate(parts, 1):
            pslug = f"{doc_slug}--{fmt.slugify(heading)}"
            base, k = pslug, 2
            while pslug in used:
                pslug, k = f"{base}-{k}", k + 1
            used.add(pslug)
            pid = _upsert(mem, cls, heading, pslug, body, source=f"{src}#{heading}" if src else None,
                          valid_from=None, meta={"document": doc_id, "position": n})
            res.add(pid)
            mem.link(pid, "part_of", doc_id)
            res.links += 1
            if prev is not None:
                mem.link(prev, "next", pid)
                res.links += 1
            prev = pid
            if extractor is not None:
                _apply_extractor(mem, extractor, body, f"{src or doc_id}#{heading}", pid, res)
        if extractor is not None and not parts:
            _apply_extractor(mem, extractor, preamble, src or doc_id, doc_id, res)
    res.commit = _last_commit_if_changed(mem, tx)
    return res


def _read_text(path_or_str: Any) -> tuple[str, Path | None]:
    if isinstance(path_or_str, os.PathLike):
        p = Path(path_or_str)
    elif isinstance(path_or_str, str):
        if "\n" not in path_or_str and len(path_or_str) < 4096 and os.path.isfile(path_or_str):
            p = Path(path_or_str)
        else:
            return path_or_str, None
    else:
        raise ConfigError("ingest_text() takes a file path or the text itself.")
    try:
        return p.read_text(encoding="utf-8"), p
    except FileNotFoundError:
        raise ConfigError(f"{p} does not exist: give an existing file or the text itself.") from None
    except UnicodeDecodeError:
        raise MemoryStoreError(f"{p} is not UTF-8 text: convert it (iconv -t utf-8) before ingesting.") from None
