"""A LangGraph store (`BaseStore`) kept in an SMF store: LangGraph's long-term memory becomes files and git.

    from hutch.integrations.langgraph import HutchStore

    store = HutchStore("./agent-memory")                 # or HutchStore(hutch.Memory(...))
    graph = builder.compile(store=store)                 # or create_agent(..., store=store)
    store.put(("users", "u-42"), "prefs", {"text": "likes short answers"})
    store.search(("users", "u-42"), query="how should I answer?")   # hutch's hybrid search, scored

Layout: a namespace is an entity class, an item an entity. ("users", "u-42") is the class `users--u-42`
(parts of a-z, 0-9, '-' and '_' joined by '--'; other namespaces get a readable prefix and a hash,
`--x<16 hex>`); the key is the slug when it is a plain file name (else a readable prefix and `~<hash>`).
The entity's front matter holds `langgraph: {namespace, key}` and `value` (the item, exactly); its body
is the value's text, which search indexes. Every batch's writes are one commit (source "langgraph:store"
unless given), a delete is `forget` with its reason, and history keeps every version. Search without a
query lists newest first; `index=` and `ttl=` of a put are accepted and not used (everything is indexed,
nothing expires). Entities of other classes are not items and never show up.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import re
from datetime import datetime
from typing import Any, Iterable

from hutch.integrations._common import MAX_TEXT, as_memory, require

(_base,) = require("langchain", "langgraph.store.base")
BaseStore, Item, SearchItem = _base.BaseStore, _base.Item, _base.SearchItem
GetOp, PutOp, SearchOp, ListNamespacesOp = _base.GetOp, _base.PutOp, _base.SearchOp, _base.ListNamespacesOp

_PART = re.compile(r"^[a-z0-9]+(?:[-_][a-z0-9]+)*\Z")
_HASHED_PART = re.compile(r"^x[0-9a-f]{16}\Z")
_PLAIN_KEY = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.@+=-]{0,99}\Z")
_META = "langgraph"


def _h(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, ensure_ascii=False).encode()).hexdigest()[:16]


def class_of(namespace: tuple[str, ...]) -> str:
    """The entity class of a namespace: injective (two namespaces never share a class)."""
    plain = "--".join(namespace)
    if len(plain) <= 64 and all(_PART.match(p) and not _HASHED_PART.match(p) for p in namespace):
        return plain
    readable = re.sub(r"-{3,}", "--", re.sub(r"[^a-z0-9-]+", "-", plain.lower())).strip("-")[:40].strip("-")
    return f"{readable}--x{_h(list(namespace))}" if readable else f"x{_h(list(namespace))}"


def slug_of(key: str) -> str:
    """The slug of a key: the key itself when it is a plain file name, else readable~hash (injective)."""
    if _PLAIN_KEY.match(key) and not key.endswith((".md", ".links")):
        return key
    readable = re.sub(r"[^A-Za-z0-9_.@+=-]+", "-", key).strip(".-")[:60]
    return f"{readable}~{_h(key)}"


def _body(value: dict) -> str:
    """The value's text for search: its string leaves, one a line (else the JSON)."""
    out: list[str] = []

    def walk(v: Any) -> None:
        if isinstance(v, str):
            if v.strip():
                out.append(v.strip())
        elif isinstance(v, dict):
            for x in v.values():
                walk(x)
        elif isinstance(v, (list, tuple)):
            for x in v:
                walk(x)

    walk(value)
    return "\n\n".join(out) + "\n" if out else json.dumps(value, ensure_ascii=False) + "\n"


def _when(s: Any) -> datetime:
    return s if isinstance(s, datetime) else datetime.fromisoformat(str(s))


def _matches(item_value: Any, want: Any) -> bool:
    """LangGraph's filter semantics: nested equality, and $eq $ne $gt $gte $lt $lte."""
    if isinstance(want, dict):
        if any(k.startswith("$") for k in want):
            ops = {"$eq": lambda a, b: a == b, "$ne": lambda a, b: a != b,
                   "$gt": lambda a, b: float(a) > float(b), "$gte": lambda a, b: float(a) >= float(b),
                   "$lt": lambda a, b: float(a) < float(b), "$lte": lambda a, b: float(a) <= float(b)}
            for op, arg in want.items():
                if op not in ops:
                    raise ValueError(f"Unsupported filter operator {op!r}: use one of {sorted(ops)}.")
                try:
                    if not ops[op](item_value, arg):
                        return False
                except (TypeError, ValueError):
                    return False
            return True
        return isinstance(item_value, dict) and all(_matches(item_value.get(k), v) for k, v in want.items())
    if isinstance(want, (list, tuple)):
        return (isinstance(item_value, (list, tuple)) and len(item_value) == len(want)
                and all(_matches(a, b) for a, b in zip(item_value, want)))
    return item_value == want


def _ns_matches(cond, ns: tuple[str, ...]) -> bool:
    path = tuple(cond.path)
    if len(ns) < len(path):
        return False
    pairs = zip(ns, path) if cond.match_type == "prefix" else zip(reversed(ns), reversed(path))
    return all(p == "*" or k == p for k, p in pairs)


class HutchStore(BaseStore):
    """LangGraph's BaseStore over a hutch.Memory (or a store path). `source` is recorded on every commit."""

    supports_ttl = False

    def __init__(self, memory: Any, *, source: str = "langgraph:store") -> None:
        self.memory = as_memory(memory)
        if self.memory is None:
            raise ValueError("HutchStore needs a store: HutchStore(hutch.Memory(path)) or HutchStore(path).")
        self.source = source
        self._classes: dict[str, tuple[str, ...]] = {}   # class -> namespace, for classes that hold items

    # ------------------------------------------------------------ ops

    def batch(self, ops: Iterable[Any]) -> list[Any]:
        """Run the ops in order; each run of consecutive puts (and deletes) is one commit."""
        ops = list(ops)
        for op in ops:
            _base.validate_op_namespace(op)
        results: list[Any] = [None] * len(ops)
        i = 0
        while i < len(ops):
            op = ops[i]
            if isinstance(op, PutOp):
                j = i
                while j < len(ops) and isinstance(ops[j], PutOp):
                    j += 1
                self._puts(ops[i:j])
                i = j
                continue
            if isinstance(op, GetOp):
                results[i] = self._get(tuple(op.namespace), op.key)
            elif isinstance(op, SearchOp):
                results[i] = self._search(op)
            elif isinstance(op, ListNamespacesOp):
                results[i] = self._list_namespaces(op)
            else:
                raise ValueError(f"Unknown store operation {type(op).__name__}.")
            i += 1
        return results

    async def abatch(self, ops: Iterable[Any]) -> list[Any]:
        return await asyncio.to_thread(self.batch, list(ops))

    # ------------------------------------------------------------ items

    def _item(self, e, cls=Item, **kw):
        m = e.meta.get(_META)
        return cls(namespace=tuple(m["namespace"]), key=m["key"], value=e.meta.get("value") or {},
                   created_at=_when(e.meta.get("created")), updated_at=_when(e.meta.get("updated")), **kw)

    def _is_item(self, e, namespace=None, key=None) -> bool:
        m = e.meta.get(_META)
        if not isinstance(m, dict) or not isinstance(m.get("namespace"), list) or not isinstance(m.get("key"), str):
            return False
        ns = tuple(m["namespace"])
        return (e.cls == class_of(ns) and e.slug == slug_of(m["key"])
                and (namespace is None or ns == namespace) and (key is None or m["key"] == key))

    def _get(self, namespace: tuple[str, ...], key: str):
        import hutch

        try:
            e = self.memory.get(f"{class_of(namespace)}/{slug_of(key)}")
        except (hutch.EntityNotFoundError, hutch.MalformedEntityError):
            return None
        return self._item(e) if self._is_item(e, namespace, key) else None

    def _puts(self, ops: list) -> None:
        import hutch

        last = {}
        for op in ops:   # the last write of a (namespace, key) in a batch wins, as in LangGraph's own stores
            last[(tuple(op.namespace), op.key)] = op
        # one write is its own commit (op put / update / forget); several are one transaction
        many = len(last) > 1
        with (self.memory.transaction(f"langgraph store: {len(last)} writes", source=self.source) if many
              else contextlib.nullcontext()):
            for (ns, key), op in last.items():
                cls, slug = class_of(ns), slug_of(key)
                eid = f"{cls}/{slug}"
                if op.value is None:
                    if self.memory.exists(eid) and self._is_item(self.memory.get(eid), ns, key):
                        self.memory.forget(eid, reason="deleted through the LangGraph store", source=self.source)
                    continue
                value = self._checked(op.value)
                meta = {_META: {"namespace": list(ns), "key": key}, "value": value}
                if not self.memory.exists(eid):
                    self.memory.put(cls, key.strip() or "(empty key)", body=_body(value), slug=slug,
                                    source=self.source, meta=meta)
                elif self._is_item(self.memory.get(eid), ns, key):
                    self.memory.update(eid, body=_body(value), meta=meta, source=self.source)
                else:
                    raise hutch.EntityExistsError(
                        f"{eid} exists and is not an item of namespace {ns} (it was not written by HutchStore): "
                        "use another namespace or key, or move that entity.")
                self._classes[cls] = ns

    @staticmethod
    def _checked(value: Any) -> dict:
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise ValueError(f"A LangGraph store value is a dict with string keys, not {type(value).__name__}.")
        try:
            text = json.dumps(value, ensure_ascii=False, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise ValueError(f"The value cannot be stored as JSON ({e}): use strings, numbers, bools, None, "
                             "lists and dicts.") from None
        if len(text) > MAX_TEXT:
            raise ValueError(f"The value is {len(text):,} characters of JSON; at most {MAX_TEXT:,} are stored.")
        return json.loads(text)   # plain JSON types only, as the store will read them back

    # ------------------------------------------------------------ namespaces and search

    def _namespaces(self) -> dict[str, tuple[str, ...]]:
        """Every class that holds items, with its namespace (a class's first entity says which)."""
        out = {}
        for cls in self.memory.classes():
            if cls in self._classes:
                out[cls] = self._classes[cls]
                continue
            for eid in self.memory.ls(cls)[:1]:
                try:
                    e = self.memory.get(eid)
                except Exception:   # a malformed or odd file is not an item; check() reports it
                    continue
                if self._is_item(e):
                    out[cls] = self._classes[cls] = tuple(e.meta[_META]["namespace"])
        return out

    def _search(self, op) -> list:
        prefix = tuple(op.namespace_prefix)
        classes = [c for c, ns in self._namespaces().items() if ns[:len(prefix)] == prefix]
        if not classes or op.limit <= 0:
            return []
        want = op.offset + op.limit
        found = []
        if op.query:
            k = min(want if not op.filter else max(4 * want, 100), 1000)
            seen = set()
            for h in self.memory.search(op.query, k=k, classes=classes):
                if h.entity_id in seen:
                    continue
                seen.add(h.entity_id)
                e = h.entity
                if self._is_item(e) and all(_matches((e.meta.get("value") or {}).get(f), v)
                                            for f, v in (op.filter or {}).items()):
                    found.append(self._item(e, SearchItem, score=float(h.score)))
        else:
            for cls in classes:
                for eid in self.memory.ls(cls):
                    e = self.memory.get(eid)
                    if self._is_item(e) and all(_matches((e.meta.get("value") or {}).get(f), v)
                                                for f, v in (op.filter or {}).items()):
                        found.append(self._item(e, SearchItem))
            found.sort(key=lambda it: it.updated_at, reverse=True)
        return found[op.offset:want]

    def _list_namespaces(self, op) -> list[tuple[str, ...]]:
        spaces = set(self._namespaces().values())
        spaces = [ns for ns in spaces if all(_ns_matches(c, ns) for c in (op.match_conditions or ()))]
        if op.max_depth is not None:
            spaces = {ns[:op.max_depth] for ns in spaces}
        return sorted(spaces)[op.offset:op.offset + op.limit]
