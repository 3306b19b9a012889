"""Changing entities: put, update, supersede, forget, each one operation of the write path (_writer.py).

What a change writes is the file's own bytes with only the asked-for parts edited (docs/smf-format.md,
"Byte preservation"): front matter keys are rewritten line by line, facts are inserted after the last
bullet, the body is replaced without touching the front matter. Slugs are chosen once, at creation.
"""

from __future__ import annotations

import os
from typing import Any, Iterable

from hutch._core.errors import ConfigError, EntityExistsError, EntityNotFoundError, MalformedEntityError
from hutch.memory import _format as fmt
from hutch.memory._entity import Entity
from hutch.memory._layout import Layout
from hutch.memory._links import Links
from hutch.memory._read import Reader
from hutch.memory._writer import Writer


class Edits:
    """The entity-changing operations of one store."""

    def __init__(self, layout: Layout, reader: Reader, links: Links, writer: Writer):
        self.layout = layout
        self.reader = reader
        self.links = links
        self.writer = writer

    def put(self, cls: str, title: str, *, body: str = "", facts: Iterable[str] = (), source: str | None = None,
            tags: Iterable[str] = (), confidence: float | None = None, valid_from: Any = None,
            valid_to: Any = None, slug: str | None = None, meta: dict[str, Any] | None = None,
            exist_ok: bool = False) -> Entity:
        fmt.check_class(cls)
        self.layout.class_dir(cls)
        if not isinstance(title, str) or not title.strip():
            raise ConfigError("An entity needs a non-empty title: put(cls, 'Alice Chen', ...).")
        title = " ".join(title.split())
        facts = list(facts or ())
        with self.writer.op("put", None, source=source) as tx:
            slug, existing = self._choose_slug(cls, title, slug)
            entity_id = f"{cls}/{slug}"
            if existing:
                if not exist_ok:
                    raise EntityExistsError(
                        f"{entity_id} already exists: use update() to correct it, supersede() to record a change "
                        "from a date on, or put(..., exist_ok=True) to apply these fields to it."
                    )
                tx.forget_op("put")
                return self.update(entity_id, body=body or None, add_facts=facts, source=source,
                                   tags=list(tags) or None, confidence=confidence, valid_from=valid_from,
                                   valid_to=valid_to, meta=meta)
            tx.name_op("put", entity_id)
            now = fmt.now_iso()
            m: dict[str, Any] = {
                "id": entity_id, "class": cls, "title": title, "created": now, "updated": now,
                "valid_from": fmt.time_str(valid_from, "valid_from"),
                "valid_to": fmt.time_str(valid_to, "valid_to"),
                "recorded_at": now, "source": source, "tags": [str(t) for t in tags],
                "confidence": _confidence(confidence),
            }
            _check_range(m["valid_from"], m["valid_to"])
            for k, v in (meta or {}).items():
                if k in ("id", "class"):
                    raise ConfigError(f"meta may not set {k!r}: it follows from the class and slug.")
                m[str(k)] = v
            text = fmt.render(m, fmt.with_facts(body or "", facts, replace=True) if facts else (body or ""))
            path = self.layout.root / cls / f"{slug}.md"
            tx.write(path, text)
            if _simple(m):  # what render() wrote reads back as exactly these values
                body_out = fmt.split_front_matter(text)[2]
                return Entity(entity_id, m, body_out, text, path, {}, self.reader.store)
            meta_out, body_out = fmt.parse(text, str(path))
            return Entity(entity_id, meta_out, body_out, text, path, {}, self.reader.store)

    def _choose_slug(self, cls: str, title: str, slug: str | None) -> tuple[str, bool]:
        """(slug, True if it names an existing entity of the same title) for a new entity `title`."""
        if slug is not None:
            fmt.check_slug(slug)
            return slug, os.path.lexists(self.layout.root / cls / f"{slug}.md")
        base = fmt.slugify(title)
        want = _norm_title(title)
        n = 1
        while True:
            cand = base if n == 1 else f"{base}-{n}"
            path = self.layout.root / cls / f"{cand}.md"
            if not os.path.lexists(path):
                return cand, False
            try:
                existing = self.reader.get(f"{cls}/{cand}")
                if _norm_title(existing.title) == want:
                    return cand, True
            except MalformedEntityError:
                pass
            n += 1

    def update(self, entity_id: str, *, title: str | None = None, body: str | None = None,
               facts: Iterable[str] | None = None, add_facts: Iterable[str] = (), source: str | None = None,
               tags: Iterable[str] | None = None, confidence: float | None = None, valid_from: Any = None,
               valid_to: Any = None, meta: dict[str, Any] | None = None, message: str | None = None) -> Entity:
        with self.writer.op("update", entity_id, source=source, message=message) as tx:
            cur = self.reader.get(entity_id)
            updates = _key_updates(title=title, source=source, tags=tags, confidence=confidence,
                                   valid_from=valid_from, valid_to=valid_to, meta=meta)
            vf = updates.get("valid_from", cur.meta.get("valid_from"))
            vt = updates.get("valid_to", cur.meta.get("valid_to"))
            _check_range(vf, vt)
            text = _edit_text(cur, updates, body=body, facts=facts, add_facts=add_facts)
            if text == cur.text:
                tx.forget_op("update", entity_id)
                return cur
            text = fmt.set_keys(text, {"updated": fmt.now_iso()}, str(cur.path))
            tx.write(cur.path, text)
            meta_out, body_out = fmt.parse(text, str(cur.path))
            return Entity(entity_id, meta_out, body_out, text, cur.path, cur.link_ids, self.reader.store)

    def supersede(self, entity_id: str, *, valid_from: Any, body: str | None = None,
                  facts: Iterable[str] | None = None, add_facts: Iterable[str] = (), title: str | None = None,
                  source: str | None = None, reason: str | None = None, tags: Iterable[str] | None = None,
                  confidence: float | None = None, meta: dict[str, Any] | None = None) -> Entity:
        vf = fmt.time_str(valid_from, "valid_from")
        if vf is None:
            raise ConfigError("supersede() needs valid_from: the date from which the new version is true.")
        with self.writer.op("supersede", entity_id, source=source, reason=reason, **{"Valid-From": vf}) as tx:
            cur = self.reader.get(entity_id)
            old_vf = fmt.parse_time(cur.meta.get("valid_from"), "valid_from") if cur.meta.get("valid_from") else None
            if old_vf is not None and fmt.parse_time(vf) <= old_vf:
                raise ConfigError(
                    f"supersede({entity_id}, valid_from={vf}) is not after the current version's valid_from "
                    f"{cur.meta.get('valid_from')}: pick a later date, or use update() to correct the current version."
                )
            head = self.writer.git.log(self.layout.rel(cur.path), limit=1)
            if head:
                tx.trailers.append(("Supersedes", head[0].sha))
            updates = _key_updates(title=title, source=source, tags=tags, confidence=confidence, meta=meta)
            now = fmt.now_iso()
            updates.update({"valid_from": vf, "valid_to": None, "recorded_at": now})
            text = _edit_text(cur, updates, body=body, facts=facts, add_facts=add_facts)
            text = fmt.set_keys(text, {"updated": now}, str(cur.path))
            tx.write(cur.path, text)
            meta_out, body_out = fmt.parse(text, str(cur.path))
            return Entity(entity_id, meta_out, body_out, text, cur.path, cur.link_ids, self.reader.store)

    def forget(self, entity_id: str, *, reason: str, source: str | None = None) -> None:
        if not isinstance(reason, str) or not reason.strip():
            raise ConfigError("forget() needs a reason: forget('actors/x', reason='asked to be removed').")
        cls, slug, path = self.layout.entity(entity_id)
        with self.writer.op("forget", entity_id, source=source, reason=" ".join(reason.split())) as tx:
            if not path.is_file():
                raise EntityNotFoundError(f"There is no entity {entity_id} to forget: `hutch mem ls` lists them.")
            for src, rel, tid, lp in list(self.links.iter_all()):
                if tid == entity_id or src == entity_id:
                    tx.remove(lp)
            tx.remove(path)


# ==================================================================== pure helpers

def _norm_title(title: str) -> str:
    return " ".join(str(title).split()).casefold()


def _key_updates(**kw: Any) -> dict[str, Any]:
    """The front matter keys a call's arguments set (None = not given)."""
    out: dict[str, Any] = {}
    if kw.get("title") is not None:
        out["title"] = " ".join(str(kw["title"]).split())
    if kw.get("source") is not None:
        out["source"] = kw["source"]
    if kw.get("tags") is not None:
        out["tags"] = [str(t) for t in kw["tags"]]
    if kw.get("confidence") is not None:
        out["confidence"] = _confidence(kw["confidence"])
    if kw.get("valid_from") is not None:
        out["valid_from"] = fmt.time_str(kw["valid_from"], "valid_from")
    if kw.get("valid_to") is not None:
        out["valid_to"] = fmt.time_str(kw["valid_to"], "valid_to")
    for k, v in (kw.get("meta") or {}).items():
        if k in ("id", "class"):
            raise ConfigError(f"meta may not set {k!r}: it follows from the class and slug.")
        out[str(k)] = v
    return out


def _edit_text(cur: Entity, updates: dict[str, Any], *, body: str | None,
               facts: Iterable[str] | None, add_facts: Iterable[str]) -> str:
    """`cur`'s text with the changed keys rewritten and the body or facts replaced, every other byte kept."""
    text = cur.text
    changed = {k: v for k, v in updates.items() if cur.meta.get(k, ...) != v}
    if changed:
        text = fmt.set_keys(text, changed, str(cur.path))
    nl = fmt.newline_of(text)
    new_body = cur.body
    if body is not None:
        new_body = body
        if facts is None and cur.facts and not fmt.facts(body):
            new_body = fmt.with_facts(body, cur.facts, replace=True, nl=nl)
    if facts is not None:
        new_body = fmt.with_facts(new_body, list(facts), replace=True, nl=nl)
    add_facts = list(add_facts or ())
    if add_facts:
        new_body = fmt.with_facts(new_body, add_facts, replace=False, nl=nl)
    if new_body != cur.body:
        text = fmt.replace_body(text, new_body, str(cur.path))
    return text


def _simple(m: dict[str, Any]) -> bool:
    for v in m.values():
        if isinstance(v, list):
            if not all(type(x) is str for x in v):
                return False
        elif v is not None and type(v) not in (str, float, int):
            return False
    return True


def _confidence(value: Any) -> float | None:
    if value is None:
        return None
    try:
        v = float(value)
    except (TypeError, ValueError):
        v = -1.0
    if not 0.0 <= v <= 1.0:
        raise ConfigError(f"confidence {value!r} is not a number between 0 and 1: pass e.g. confidence=0.8.")
    return v


def _check_range(vf: Any, vt: Any) -> None:
    if vf and vt and fmt.parse_time(vt, "valid_to") <= fmt.parse_time(vf, "valid_from"):
        raise ConfigError(f"valid_to {vt} is not after valid_from {vf}: a version must be valid for some time.")
