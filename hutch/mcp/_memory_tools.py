"""MCP tools over one memory store: search, get, list, put, link, history.

Each tool is a small function whose docstring and type hints are the contract
the model reads. Arguments carry the names models tend to use, and common
aliases are accepted (`query`/`q`, `id`/`entity_id`, `k`/`limit`). Results are
plain JSON: ids, titles, text, and the provenance of each change.
"""

from __future__ import annotations

from typing import Any

from hutch._core.errors import ConfigError
from hutch.mcp._tools import READ_ONLY, WRITE, first, tool


def _entity(e, *, text: bool = True) -> dict[str, Any]:
    out = {"id": e.id, "class": e.cls, "title": e.title, "facts": e.facts,
           "links": {rel: list(ids) for rel, ids in e.link_ids.items()},
           "valid_from": e.valid_from, "valid_to": e.valid_to, "source": e.source, "tags": e.tags}
    if text:
        out["body"] = e.body
    return out


def register(server, mem) -> None:
    """Add the memory tools for the store `mem` (a hutch.Memory) to `server`."""

    @tool(server, READ_ONLY)
    def memory_search(query: str | None = None, k: int = 10, classes: list[str] | None = None,
                      since: str | None = None, until: str | None = None, as_of: str | None = None,
                      expand: int = 0, now: str | None = None, q: str | None = None,
                      limit: int | None = None) -> dict[str, Any]:
        """Search the memory store by meaning, words, links and time; best hits first.

        query: what to look for, in plain words ("what did Alice decide about pricing?").
        k: how many hits (1-100). classes: keep only these entity classes, e.g. ["actors", "decisions"].
        since / until: keep entities whose time is in range (ISO dates, "2026-10-01").
        as_of: only what was valid on that date. expand: also return entities up to this many links away.
        now: the date that relative words in the query ("last week", "two days ago") are read against
        (ISO; default: as_of, else today).
        Each hit has the entity id (pass it to memory_get), title, score, the channels that found it
        (bm25, dense, graph, time ...) and, for a conversation turn, its anchor, its speaker and the turn's text.
        """
        text = first(query=query, q=q)
        if not text or not text.strip():
            raise ConfigError("memory_search needs a query, e.g. {\"query\": \"customer churn\"}.")
        n = limit if limit is not None else k
        if not 1 <= n <= 100:
            raise ConfigError(f"k={n} is out of range: ask for 1 to 100 hits.")
        hits = mem.search(text, k=n, classes=classes, since=since, until=until, as_of=as_of, expand=expand,
                          now=now)
        out = []
        for h in hits:
            snippet = h.text.strip()  # h.text and h.title read the head of the file: a hit never costs its size
            out.append({"id": h.entity_id, "title": h.title, "score": round(float(h.score), 4),
                        "channels": {c: dict(v) for c, v in h.channels.items()}, "anchor": h.anchor,
                        "speaker": h.speaker, "snippet": snippet[:500]})
        return {"query": text, "hits": out}

    @tool(server, READ_ONLY)
    def memory_get(id: str | None = None, entity_id: str | None = None, as_of: str | None = None) -> dict[str, Any]:
        """Read one entity: its title, facts, body, links and provenance.

        id: the entity id "<class>/<slug>", e.g. "actors/alice-chen" (as memory_search returns it).
        as_of: read the version that was valid on that date instead of the current one.
        """
        ref = first(id=id, entity_id=entity_id)
        if not ref:
            raise ConfigError("memory_get needs an id such as \"actors/alice-chen\" (memory_search returns ids).")
        e = (mem.as_of(as_of) if as_of else mem).get(ref)
        return _entity(e)

    @tool(server, READ_ONLY)
    def memory_list(entity_class: str | None = None, kind: str | None = None) -> dict[str, Any]:
        """List entity ids, all of them or those of one class (e.g. "actors"), and the classes that exist."""
        cls = first(entity_class=entity_class, kind=kind)
        return {"classes": mem.classes(), "ids": mem.ls(cls)}

    @tool(server, WRITE)
    def memory_put(title: str | None = None, entity_class: str | None = None, body: str | None = None,
                   facts: list[str] | None = None, source: str | None = None, tags: list[str] | None = None,
                   valid_from: str | None = None, name: str | None = None, kind: str | None = None,
                   content: str | None = None, text: str | None = None) -> dict[str, Any]:
        """Remember something: create an entity, or add to it if one with that title exists in that class.

        title: what the entity is called ("Alice Chen"). entity_class: its class, a lower-case plural such
        as "actors", "orgs", "decisions", "events", "topics" (any name works).
        body: Markdown text. facts: short statements to add to its Facts list.
        source: where this came from ("chat:2026-11-02#14"), recorded with the change.
        Returns the entity id; every call is one commit in the store's history.
        """
        t = first(title=title, name=name)
        cls = first(entity_class=entity_class, kind=kind)
        if not t or not cls:
            raise ConfigError("memory_put needs a title and an entity_class, e.g. "
                              "{\"title\": \"Alice Chen\", \"entity_class\": \"actors\"}.")
        before = set(mem.ls(cls)) if cls in mem.classes() else set()
        e = mem.put(cls, t, body=first(body=body, content=content, text=text) or "", facts=facts or (),
                    source=source or "mcp", tags=tags or (), valid_from=valid_from, exist_ok=True)
        return {"id": e.id, "created": e.id not in before, "entity": _entity(e, text=False)}

    @tool(server, WRITE)
    def memory_link(from_id: str | None = None, relation: str | None = None, to_id: str | None = None,
                    source_id: str | None = None, target_id: str | None = None, src: str | None = None,
                    dst: str | None = None, source: str | None = None) -> dict[str, Any]:
        """Relate two entities: from_id -[relation]-> to_id, e.g. "actors/alice-chen" works_at "orgs/acme".

        relation: a lower-case name such as works_at, decided_by, about, part_of. Linking twice is harmless.
        source: where this came from, recorded with the change.
        """
        a = first(from_id=from_id, source_id=source_id, src=src)
        b = first(to_id=to_id, target_id=target_id, dst=dst)
        if not (a and b and relation):
            raise ConfigError("memory_link needs from_id, relation and to_id, e.g. "
                              "{\"from_id\": \"actors/alice-chen\", \"relation\": \"works_at\", \"to_id\": \"orgs/acme\"}.")
        mem.link(a, relation, b, source=source or "mcp")
        return {"from_id": a.removesuffix(".md"), "relation": relation, "to_id": b.removesuffix(".md")}

    @tool(server, READ_ONLY)
    def memory_history(id: str | None = None, entity_id: str | None = None, limit: int = 20) -> dict[str, Any]:
        """Every committed version of an entity, newest first: when, who, what (op), from which source, why."""
        ref = first(id=id, entity_id=entity_id)
        if not ref:
            raise ConfigError("memory_history needs an id such as \"actors/alice-chen\".")
        versions = mem.history(ref)[:max(1, limit)]
        return {"id": ref.removesuffix(".md"), "versions": [
            {"commit": v.commit[:12], "date": v.date, "author": v.author, "op": v.op, "source": v.source,
             "reason": v.reason, "valid_from": v.valid_from, "valid_to": v.valid_to, "facts": v.facts}
            for v in versions]}
