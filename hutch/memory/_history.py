"""History and time: versions from git, and `as_of` views over valid time and recorded time."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from hutch._core.errors import EntityNotFoundError, MalformedEntityError
from hutch.memory import _format as fmt
from hutch.memory._entity import Entity, Version
from hutch.memory._layout import Layout
from hutch.memory._links import link_ids

if TYPE_CHECKING:  # pragma: no cover
    from hutch.memory._store import Memory

EMPTY_TREE = "4b825dc642cb6eb9a060e54bf8d69288fbee4904"


def _versions(mem: "Memory", entity_id: str, known_at=None):
    """(commit, text or None) for each commit touching the entity's file, newest first."""
    cls, slug = fmt.split_id(entity_id)
    rel = f"{cls}/{slug}.md"
    out = []
    for c in mem.git.log(rel):
        if known_at is not None and fmt.parse_time(c.date) > known_at:
            continue
        out.append((c, mem.git.show(c.sha, rel)))
    return out


def _meta(text: str | None) -> dict:
    if text is None:
        return {}
    try:
        return fmt.parse(text)[0]
    except MalformedEntityError:
        return {}


def history(mem: "Memory", entity_id: str) -> list[Version]:
    """Every commit that touched the entity's file or its links, newest first."""
    cls, slug = fmt.split_id(entity_id)
    rel = f"{cls}/{slug}.md"
    commits = mem.git.log(rel, f"{cls}/{slug}.links")
    if not commits:
        raise EntityNotFoundError(
            f"{entity_id} has no history: it was never committed. `hutch mem ls` lists the entities."
        )
    rows = []
    for c in reversed(commits):  # oldest first, so supersede can close the version before it
        text = mem.git.show(c.sha, rel)
        m = _meta(text)
        rows.append({
            "commit": c.sha, "date": c.date, "author": f"{c.author} <{c.email}>",
            "op": c.trailer("Hutch-Op") or "edit", "message": c.message.strip(),
            "source": c.trailer("Hutch-Source"), "reason": c.trailer("Hutch-Reason"), "text": text,
            "valid_from": _s(m.get("valid_from")), "valid_to": _s(m.get("valid_to")),
        })
    # a supersede closes the version before it (and the link-only commits that carried the same text)
    group: list[dict] = []
    for r in rows:
        if r["op"] == "supersede":
            for g in group:
                if g["valid_to"] is None and g["text"] is not None:
                    g["valid_to"] = r["valid_from"]
            group = []
        if group and r["text"] == group[-1]["text"]:
            group.append(r)
        else:
            group = [r]
    return [Version(**r) for r in reversed(rows)]


def _s(v: Any) -> str | None:
    return None if v is None else str(v)


class MemoryView:
    """A read-only view of a store as of a moment (see docs/smf-format.md, "Time").

    `when` is valid time: the version whose [valid_from, valid_to) contains
    it wins; among several, the one recorded last. `known_at` (optional) is
    recorded time: only commits made by then count ("what we believed then").
    """

    def __init__(self, mem: "Memory", when: Any, known_at: Any = None):
        self.mem = mem
        self.when = fmt.parse_time(when, "date")
        self.known_at = fmt.parse_time(known_at, "known_at") if known_at is not None else None
        if self.when is None:
            from hutch._core.errors import ConfigError

            raise ConfigError("as_of() needs a date, for example as_of('2026-11-01').")

    def __repr__(self) -> str:
        return f"MemoryView({str(self.mem.root)!r}, as_of={fmt.iso(self.when)})"

    def get(self, ref: Any) -> Entity:
        """The version of `ref` valid at this view's date."""
        entity_id = ref.id if isinstance(ref, Entity) else str(ref).removesuffix(".md")
        cls, slug = fmt.split_id(entity_id)
        versions = _versions(self.mem, entity_id, self.known_at)
        for commit, text in versions:
            if text is None:
                break  # forgotten (or deleted) after every older version: they are gone
            m = _meta(text)
            vf = fmt.parse_time(m.get("valid_from")) if m.get("valid_from") else None
            vt = fmt.parse_time(m.get("valid_to")) if m.get("valid_to") else None
            if (vf is None or vf <= self.when) and (vt is None or self.when < vt):
                meta, body = fmt.parse(text, f"{entity_id} at {commit.sha[:12]}")
                return Entity(entity_id, meta, body, text, self.mem.root / cls / f"{slug}.md",
                              self._links(cls, slug), self)
        raise EntityNotFoundError(
            f"{entity_id} has no version valid on {fmt.iso(self.when)}"
            + (f" as known at {fmt.iso(self.known_at)}" if self.known_at else "")
            + ": `hutch mem log` shows its versions and their valid_from dates."
        )

    def _links(self, cls: str, slug: str) -> dict[str, tuple[str, ...]]:
        if self.known_at is None:
            return link_ids(Layout(self.mem.root), cls, slug)
        commits = [c for c in self.mem.git.log() if fmt.parse_time(c.date) <= self.known_at]
        if not commits:
            return {}
        out: dict[str, list[str]] = {}
        for mode, obj, path in self.mem.git.ls_tree(commits[0].sha, f"{cls}/{slug}.links"):
            parts = path.split("/")
            if mode != "120000" or len(parts) != 4:
                continue
            target = self.mem.git.run("cat-file", "-p", obj)
            full = os.path.normpath(os.path.join(os.path.dirname(path), target))
            tparts = full.split("/")
            if len(tparts) == 2 and tparts[1].endswith(".md"):
                out.setdefault(parts[2], []).append(f"{tparts[0]}/{tparts[1][:-3]}")
        return {k: tuple(sorted(v)) for k, v in out.items()}

    def exists(self, ref: Any) -> bool:
        """True if `ref` has a version valid at this view's date."""
        try:
            self.get(ref)
            return True
        except EntityNotFoundError:
            return False

    def ls(self, cls: str | None = None) -> list[str]:
        """Ids of every entity with a version valid at this view's date."""
        out = self.mem.git.run("log", "--format=", "--name-only", "--diff-filter=A", "HEAD", check=False)
        ids = set()
        for line in out.splitlines():
            parts = line.split("/")
            if len(parts) == 2 and parts[1].endswith(".md") and not parts[0].startswith("."):
                if cls is None or parts[0] == cls:
                    ids.add(f"{parts[0]}/{parts[1][:-3]}")
        return sorted(i for i in ids if self.exists(i))


def diff(mem: "Memory", entity_id: str | None, since: str) -> str:
    """`git diff` from `since` to the working tree (for one entity: its file and its links)."""
    paths: list[str] = []
    if entity_id is not None:
        cls, slug = fmt.split_id(entity_id)
        paths = [f"{cls}/{slug}.md", f"{cls}/{slug}.links"]
    if not mem.git.ok("rev-parse", "-q", "--verify", f"{since}^{{commit}}"):
        since = EMPTY_TREE
    return mem.git.run("diff", "--no-ext-diff", "--no-textconv", since, "--", *paths)
