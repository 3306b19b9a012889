"""What the mount shows besides the store's own files (search results, .explain, profile.md), and which
mount paths are the store's own.

Pure: rendering over values the store hands out (hits, entities, commits) and the reading of mount
paths, so it is unit-testable without a mount.
"""

from __future__ import annotations

import re
from collections import Counter
from datetime import datetime, timezone

from hutch._core.errors import ConfigError
from hutch.memory import _format as fmt

#: Top-level names the view adds to the store's tree (a class of that name is hidden behind them).
SEARCH_DIR = "search"
AS_OF_DIR = "as-of"
PROFILE = "profile.md"
EXPLAIN = ".explain"
RESERVED = frozenset({SEARCH_DIR, AS_OF_DIR, PROFILE})
#: How many hits a query directory holds.
SEARCH_K = 10

_UNSAFE = re.compile(r"[/\x00]")


def parts(path: str) -> list[str]:
    """The components of a mount path: '/actors/a.md' -> ['actors', 'a.md']."""
    return [p for p in path.split("/") if p]


def is_store_path(parts: list[str]) -> bool:
    """A path of the store's own tree that the view shows (no dot names at the top: .git, .hutch)."""
    return bool(parts) and not parts[0].startswith(".") and parts[0] not in RESERVED


def entity_id(parts: list[str]) -> str | None:
    """The entity a path names ('<class>/<slug>.md'), None if it names none."""
    if len(parts) == 2 and parts[1].endswith(".md") and not parts[1].startswith("."):
        try:
            fmt.split_id(f"{parts[0]}/{parts[1][:-3]}")
        except ConfigError:
            return None
        return f"{parts[0]}/{parts[1][:-3]}"
    return None


def hit_name(rank: int, entity_id: str, anchor: str | None) -> str:
    """'01-actors-alice-chen.md'; a turn-level hit adds its anchor: '03-interactions-s3@D3:12.md'."""
    cls, slug = entity_id.split("/", 1)
    at = f"@{_UNSAFE.sub('-', anchor)}" if anchor else ""
    return f"{rank:02d}-{cls}-{slug}{at}.md"


def _channel(name: str, info) -> str:
    if "hops" in info:
        return f"{name}(hops={info['hops']} via {info.get('via', '?')})"
    rank, score = info.get("rank"), info.get("score")
    s = f"{name}#{rank}" if rank is not None else name
    if isinstance(score, (int, float)):
        s += f"({score:.3f})"
    return s


def explain(query: str, hits) -> bytes:
    """The `.explain` file of a query directory: one line per hit, best first, with its channels."""
    lines = [f"# query: {query}", f"# {len(hits)} hits; file  score  channels (rank, score)  [anchor]"]
    for i, h in enumerate(hits, 1):
        chans = " ".join(_channel(n, h.channels[n]) for n in sorted(h.channels))
        anchor = f"  anchor={h.anchor}" if h.anchor else ""
        lines.append(f"{hit_name(i, h.entity_id, h.anchor)}  {h.score:.4f}  {chans}{anchor}")
    return ("\n".join(lines) + "\n").encode("utf-8", "surrogateescape")


def profile(mem, *, commits, ids, links) -> bytes:
    """profile.md: a digest of the store (classes, links, most linked, tags, recent changes)."""
    now = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    head = commits[0].sha[:12] if commits else "none"
    by_class = Counter(i.split("/", 1)[0] for i in ids)
    rels = Counter(rel for _, rel, _, _ in links)
    inbound = Counter(t for _, _, t, _ in links if t)
    out = [f"# Memory profile: {mem.root.name}", "",
           f"Generated {now} at commit {head}: {len(ids)} entities, {len(links)} links, "
           f"{len(by_class)} classes.", "", "## Classes", ""]
    out += [f"- {c}: {n}" for c, n in sorted(by_class.items())] or ["- (none yet)"]
    out += ["", "## Relations", ""]
    out += [f"- {r}: {n}" for r, n in rels.most_common()] or ["- (none yet)"]
    out += ["", "## Most linked", ""]
    out += [f"- {t} ({n} in)" for t, n in inbound.most_common(10)] or ["- (none yet)"]
    out += ["", "## Recent changes", ""]
    for c in commits:
        src = c.trailer("Hutch-Source")
        out.append(f"- {c.date} {c.trailer('Hutch-Op') or 'edit'}: {c.subject}" + (f" (source: {src})" if src else ""))
    if not commits:
        out.append("- (none yet)")
    out.append("")
    return "\n".join(out).encode("utf-8", "surrogateescape")  # a name that is not UTF-8
