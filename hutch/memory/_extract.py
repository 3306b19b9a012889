"""Optional model-based extraction: an LLM proposes entities, facts and links; hutch writes them.

`Extractor` is the interface (one method). `OpenAIExtractor` implements it
against any OpenAI-compatible `/chat/completions` endpoint with httpx. Nothing
in hutch calls a model unless the caller passes an extractor; the default
ingest path is deterministic.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from hutch._core.errors import ConfigError, MemoryStoreError
from hutch.memory import _format as fmt

if TYPE_CHECKING:  # pragma: no cover
    from hutch.memory._store import Memory


@dataclass(frozen=True)
class ProposedEntity:
    """An entity a model proposes: class, title and facts (validated by `of`)."""

    cls: str
    title: str
    facts: tuple[str, ...] = ()

    @classmethod
    def of(cls, value: dict) -> "ProposedEntity":
        try:
            klass = fmt.check_class(fmt.slugify(str(value["class"])).replace("-", "_"))
            title = " ".join(str(value["title"]).split())
        except (KeyError, TypeError) as e:
            raise MemoryStoreError(f"The extractor proposed an entity without class/title: {value!r:.200}.") from e
        if not title:
            raise MemoryStoreError(f"The extractor proposed an entity with an empty title: {value!r:.200}.")
        facts = tuple(" ".join(str(f).split()) for f in value.get("facts") or () if str(f).strip())
        return cls(klass, title, facts)


@dataclass(frozen=True)
class ProposedLink:
    """A relation a model proposes between two proposed (or existing) entities, by (class, title)."""

    src: tuple[str, str]
    relation: str
    dst: tuple[str, str]


@dataclass(frozen=True)
class Extraction:
    """What an extractor returns: entities and links to add."""

    entities: tuple[ProposedEntity, ...] = ()
    links: tuple[ProposedLink, ...] = ()

    @classmethod
    def from_json(cls, data: Any) -> "Extraction":
        """Validate the JSON shape {"entities": [{class, title, facts}], "links": [{from, relation, to}]}."""
        if not isinstance(data, dict):
            raise MemoryStoreError("The extractor's answer is not a JSON object with 'entities' and 'links'.")
        ents = tuple(ProposedEntity.of(e) for e in data.get("entities") or [] if isinstance(e, dict))
        links = []
        for ln in data.get("links") or []:
            try:
                s, d = ProposedEntity.of(ln["from"]), ProposedEntity.of(ln["to"])
                rel = fmt.check_relation(fmt.slugify(str(ln["relation"])).replace("-", "_"))
            except (KeyError, TypeError, MemoryStoreError):
                continue  # a malformed link proposal is dropped, not fatal
            links.append(ProposedLink((s.cls, s.title), rel, (d.cls, d.title)))
        return cls(ents, tuple(links))


@runtime_checkable
class Extractor(Protocol):
    """Proposes entities, facts and links found in a text. `source` says where the text came from."""

    def extract(self, text: str, *, source: str | None = None) -> Extraction: ...


PROMPT = """You extract long-term memory from text for an agent.
Return only a JSON object: {"entities": [{"class": "...", "title": "...", "facts": ["..."]}],
"links": [{"from": {"class": "...", "title": "..."}, "relation": "...", "to": {"class": "...", "title": "..."}}]}.
Classes: actors (people, organisations), events, topics, decisions, rationale, time, or another plural noun.
Facts are short, self-contained sentences. Relations are snake_case verbs like works_at, attended, decided."""


class OpenAIExtractor:
    """An Extractor that asks an OpenAI-compatible chat endpoint (`base_url` ends before /chat/completions)."""

    def __init__(self, base_url: str, model: str, *, api_key: str | None = None, timeout: float = 60.0,
                 prompt: str = PROMPT):
        if not base_url.startswith(("http://", "https://")):
            raise ConfigError(f"base_url {base_url!r} must be an http(s) URL such as http://127.0.0.1:8000/v1.")
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.api_key = api_key
        self.timeout = timeout
        self.prompt = prompt

    def extract(self, text: str, *, source: str | None = None) -> Extraction:
        import httpx

        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        payload = {
            "model": self.model,
            "temperature": 0,
            "response_format": {"type": "json_object"},
            "messages": [
                {"role": "system", "content": self.prompt},
                {"role": "user", "content": (f"Source: {source}\n\n" if source else "") + text},
            ],
        }
        try:
            r = httpx.post(f"{self.base_url}/chat/completions", json=payload, headers=headers, timeout=self.timeout)
            r.raise_for_status()
            content = r.json()["choices"][0]["message"]["content"]
        except httpx.HTTPError as e:
            raise MemoryStoreError(
                f"The extractor endpoint {self.base_url} failed ({e}): check that it is running and the model "
                f"{self.model!r} exists, or ingest without an extractor."
            ) from e
        except (KeyError, IndexError, ValueError) as e:
            raise MemoryStoreError(f"The extractor endpoint {self.base_url} answered without a chat completion.") from e
        try:
            data = json.loads(_strip_fence(content))
        except (TypeError, ValueError) as e:
            raise MemoryStoreError(f"The model's answer is not JSON: {str(content)[:200]!r}.") from e
        return Extraction.from_json(data)


def _strip_fence(s: str) -> str:
    s = (s or "").strip()
    if s.startswith("```"):
        s = s.split("\n", 1)[-1].rsplit("```", 1)[0]
    return s


def apply_extraction(mem: "Memory", extraction: Extraction, *, source: str | None = None,
                     mentioned_in: str | None = None) -> list[str]:
    """Write an Extraction (inside the caller's transaction, if any); returns the ids touched.

    Entities are matched by (class, title); facts are added, never removed.
    Each entity is linked `mentioned_in` -> the entity the text came from.
    """
    ids: dict[tuple[str, str], str] = {}
    with mem.transaction("apply extraction", source=source):
        for pe in extraction.entities:
            e = mem.put(pe.cls, pe.title, facts=pe.facts, source=source, exist_ok=True)
            ids[(pe.cls, pe.title)] = e.id
            if mentioned_in:
                mem.link(e.id, "mentioned_in", mentioned_in)
        for pl in extraction.links:
            for end in (pl.src, pl.dst):
                if end not in ids:
                    ids[end] = mem.put(end[0], end[1], source=source, exist_ok=True).id
            mem.link(ids[pl.src], pl.relation, ids[pl.dst], source=source)
    return list(dict.fromkeys(ids.values()))
