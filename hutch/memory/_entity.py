"""Value objects the memory store hands out: Entity, Neighbor, Version, CheckReport."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Mapping

from hutch.memory import _format

if TYPE_CHECKING:  # pragma: no cover
    from hutch.memory._store import Memory


@dataclass(frozen=True, eq=False)
class Entity:
    """One entity: a Markdown file with YAML front matter, read exactly as it is on disk.

    `text` is the file's exact content; `meta` its front matter; `body` the
    Markdown after it. `links` maps each relation to the entities it points
    to (loaded on first use); `link_ids` holds the same as ids.
    """

    id: str
    meta: Mapping[str, Any]
    body: str
    text: str
    path: Path
    link_ids: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    _store: Any = field(default=None, repr=False, compare=False)

    @property
    def cls(self) -> str:
        """The entity class (its directory), e.g. 'actors'."""
        return self.id.split("/", 1)[0]

    @property
    def slug(self) -> str:
        """The file name without '.md', e.g. 'alice-chen'."""
        return self.id.split("/", 1)[1]

    @property
    def title(self) -> str:
        return str(self.meta.get("title") or self.slug)

    @property
    def source(self) -> str | None:
        v = self.meta.get("source")
        return None if v is None else str(v)

    @property
    def tags(self) -> list[str]:
        v = self.meta.get("tags") or []
        return [str(t) for t in v] if isinstance(v, list) else [str(v)]

    @property
    def valid_from(self) -> str | None:
        v = self.meta.get("valid_from")
        return None if v is None else str(v)

    @property
    def valid_to(self) -> str | None:
        v = self.meta.get("valid_to")
        return None if v is None else str(v)

    @cached_property
    def facts(self) -> list[str]:
        """The bullets of the body's `## Facts` section."""
        return _format.facts(self.body)

    @cached_property
    def sections(self) -> Mapping[str, str]:
        """Anchor (level-2/3 heading text, e.g. a dia_id 'D1:3 · Caroline' -> see `section`) -> text."""
        return MappingProxyType(_format.sections(self.body))

    def section(self, anchor: str) -> str | None:
        """The text under the level-2/3 heading `anchor`; for conversations the dia_id alone works ('D1:3')."""
        secs = self.sections
        if anchor in secs:
            return secs[anchor]
        for heading, text in secs.items():
            if heading.split(" · ", 1)[0] == anchor:
                return text
        return None

    @cached_property
    def links(self) -> Mapping[str, list["Entity"]]:
        """Relation -> the entities this one links to (targets that no longer exist are left out)."""
        out: dict[str, list[Entity]] = {}
        store: Memory | None = self._store
        for rel, ids in self.link_ids.items():
            targets = []
            for tid in ids:
                if store is None:
                    continue
                try:
                    targets.append(store.get(tid))
                except Exception:  # a dangling link: check() reports it
                    continue
            out[rel] = targets
        return MappingProxyType(out)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Entity) and (self.id, self.text) == (other.id, other.text)

    def __hash__(self) -> int:
        return hash((self.id, self.text))

    def __repr__(self) -> str:
        return f"Entity {self.id}"


@dataclass(frozen=True)
class Neighbor:
    """A typed edge seen from one entity: `direction` is 'out' (it links to `id`) or 'in' (`id` links to it)."""

    relation: str
    direction: str
    id: str


@dataclass(frozen=True)
class Version:
    """One committed version of an entity (newest first in `Memory.history`).

    `op` is what the commit did (put, update, supersede, link, forget, ...);
    `valid_to` is the file's own valid_to or, for a superseded version, the
    valid_from of the version that superseded it. `text` is None when the
    commit removed the file (forget).
    """

    commit: str
    date: str
    author: str
    op: str
    message: str
    source: str | None
    reason: str | None
    text: str | None
    valid_from: str | None
    valid_to: str | None

    @property
    def facts(self) -> list[str]:
        if self.text is None:
            return []
        parts = _format.split_front_matter(self.text)
        return _format.facts(parts[2] if parts else self.text)


@dataclass(frozen=True)
class CheckIssue:
    """One problem `Memory.check()` found: where (a path relative to the store), what, and the fix."""

    severity: str  # "error" or "warning"
    code: str
    path: str
    message: str
    fix: str

    def __str__(self) -> str:
        return f"{self.severity}: {self.path}: {self.message} Fix: {self.fix}"


@dataclass(frozen=True)
class CheckReport:
    """The result of `Memory.check()`: `ok` is True when there is no error (warnings allowed)."""

    entities: int
    links: int
    issues: tuple[CheckIssue, ...]

    @property
    def ok(self) -> bool:
        return not self.errors

    @property
    def errors(self) -> list[CheckIssue]:
        return [i for i in self.issues if i.severity == "error"]

    @property
    def warnings(self) -> list[CheckIssue]:
        return [i for i in self.issues if i.severity == "warning"]

    def by_code(self, code: str) -> list[CheckIssue]:
        """The issues with this code, e.g. 'dangling-link'."""
        return [i for i in self.issues if i.code == code]
