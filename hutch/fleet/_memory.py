"""`hutch.fleet.memory(name, remote=...)`: a memory store shared by a Ray cluster, with hutch.Memory's surface.

Writes go to the store's one writer (hutch/fleet/_memstore.py) and return once the remote holds them; reads
go to a reader (this process's node first, then any other) at least at the commit of this handle's last
acknowledged write, so a handle reads its own writes. docs/fleet.md ("Memory") has the whole design.
"""

from __future__ import annotations

import os
import random
import secrets
import time
from pathlib import Path
from typing import Any, Iterable

from hutch._core.errors import ConfigError, Error, MemoryStoreError, StateError
from hutch.fleet._memstore import MemoryWriter, check_name, check_remote, init_remote, reader_name, writer_name
from hutch.fleet._ops import join
from hutch.sandbox._fleet import NAMESPACE

DEFAULT_ROOT = Path("/var/lib/hutch-fleet/memory")
WRITE_TIMEOUT = 180.0   # seconds a write may wait for its writer (a restart on another node included)
READ_TIMEOUT = 60.0


def memory(name: str, remote: str | None = None, *, address: str = "auto", root: str | os.PathLike | None = None,
           author: str | None = None, embedder: Any = None, readers: bool = True,
           writer_options: dict | None = None, timeout: float = WRITE_TIMEOUT) -> "FleetMemory":
    """The memory store `name` of the Ray cluster at `address`; its writer is started if none runs.

    `remote`: the git URL of the store's replicated truth (a bare repository: hutch.fleet.init_remote(path)
    makes one on a shared file system; ssh:// or https:// for one on a git server); needed the first time,
    else it must name the same remote. `root`: where each node keeps its clones (default
    /var/lib/hutch-fleet/memory); `author` signs the writer's commits; `embedder`: the readers' embedding
    provider (default the local model); `readers=False`: no reader per node (searches then find none);
    `writer_options`: Ray actor options for the writer (`resources`, `scheduling_strategy`, ... : where it may
    run; it is started again on such a node when its node dies).
    `timeout`: how long a write may wait for its acknowledgement.
    """
    check_name(name)
    if remote is not None:
        check_remote(remote)
    ray = join(address)
    try:
        ray.get_actor(writer_name(name), namespace=NAMESPACE)
    except ValueError:
        if remote is None:
            raise ConfigError(f"no memory store {name!r} runs on this Ray cluster: start it with "
                              f"hutch.fleet.memory({name!r}, remote='/path/to/{name}.git').") from None
        fixed = {"name", "namespace", "lifetime", "max_restarts", "get_if_exists"} & set(writer_options or {})
        if fixed:
            raise ConfigError(f"writer_options may not set {', '.join(sorted(fixed))}: the store's writer is a named, "
                              "detached actor that Ray restarts.")
        options = {"root": str(Path(os.path.abspath(os.fspath(root))) if root else DEFAULT_ROOT), "author": author,
                   "embedder": embedder, "readers": readers}
        ray.remote(MemoryWriter).options(**{
            "num_cpus": 0, "max_concurrency": 16, **(writer_options or {}), "name": writer_name(name),
            "namespace": NAMESPACE, "lifetime": "detached", "max_restarts": -1, "get_if_exists": True,
        }).remote(name, remote, options)
    mem = FleetMemory(name, address, timeout)
    st = mem.status()
    if remote is not None and st["remote"] != remote:
        raise ConfigError(f"memory {name!r} runs with remote {st['remote']!r}, not {remote!r}: give that one "
                          "(or none), or another name.")
    return mem


def memory_down(name: str, *, address: str = "auto") -> list[dict]:
    """End the store's readers (each removes its clone) and its writer (its clone too); the remote is kept."""
    check_name(name)
    ray = join(address)
    try:
        w = ray.get_actor(writer_name(name), namespace=NAMESPACE)
    except ValueError:
        raise ConfigError(f"no memory store {name!r} runs on this Ray cluster.") from None
    out = _call(ray, lambda: w.stop.remote(), 120)
    ray.kill(w, no_restart=True)
    prefix = reader_name(name, "")   # the readers of nodes that died (their actor cannot come back) too
    for a in ray.util.list_named_actors(all_namespaces=True):
        if a["namespace"] == NAMESPACE and a["name"].startswith(prefix):
            try:
                ray.kill(ray.get_actor(a["name"], namespace=NAMESPACE), no_restart=True)
            except ValueError:
                pass
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            ray.get_actor(writer_name(name), namespace=NAMESPACE)
        except ValueError:
            break
        time.sleep(0.1)
    return out


def _call(ray, submit, timeout: float) -> Any:
    """ray.get of the call `submit` makes, with the Memory error it raised (not Ray's wrapping) re-raised."""
    try:
        return ray.get(submit(), timeout=timeout)
    except ray.exceptions.RayTaskError as e:
        cause = getattr(e, "cause", None)
        if isinstance(cause, Error):
            raise cause from None
        raise


class FleetMemory:
    """A handle on a fleet's memory store (hutch.fleet.memory): hutch.Memory's writes and reads.

    Entities it returns have `path` relative to the store and read their links through this handle; hits read
    their entity through it. `commit` is the remote's commit holding this handle's last acknowledged write.
    """

    def __init__(self, name: str, address: str = "auto", timeout: float = WRITE_TIMEOUT):
        self.name = name
        self.address = address
        self.timeout = timeout
        self.commit: str | None = None
        self._ray = join(address)
        self._nodes: tuple[float, list[str]] = (0.0, [])

    def __repr__(self) -> str:
        return f"FleetMemory({self.name!r})"

    # --- plumbing -----------------------------------------------------------------------

    def _write(self, op: str, args: tuple, kwargs: dict) -> Any:
        ray = self._ray
        rid = secrets.token_hex(16)   # the same for every try: the writer does it once
        deadline = time.monotonic() + self.timeout
        last: Exception | None = None
        while time.monotonic() < deadline:
            try:
                w = ray.get_actor(writer_name(self.name), namespace=NAMESPACE)
                r = _call(ray, lambda: w.write.remote(rid, op, args, kwargs), max(1.0, deadline - time.monotonic()))
                break
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError, ValueError) as e:
                last = e   # its node died (Ray starts it elsewhere), or it is starting: ask again
                time.sleep(0.2)
        else:
            raise MemoryStoreError(f"memory {self.name!r}: the {op} was not acknowledged in {self.timeout:.0f} s "
                                   f"(its writer did not answer: {last}); it may or may not be on the remote. "
                                   "Check with hutch.fleet.memory(name).status().")
        self.commit = r["commit"]
        return self._own(r["result"])

    def _read(self, op: str, args: tuple = (), kwargs: dict | None = None) -> Any:
        ray = self._ray
        errors = []
        for nid in self._reader_nodes():
            try:
                a = ray.get_actor(reader_name(self.name, nid), namespace=NAMESPACE)
            except ValueError:
                continue   # the writer has not started one there yet
            try:
                r = _call(ray, lambda: a.read.remote(op, args, kwargs or {}, self.commit), READ_TIMEOUT)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError, StateError) as e:
                errors.append(f"{nid[:16]}: {type(e).__name__}: {e}")
                continue
            return self._own(r["result"])
        raise MemoryStoreError(f"memory {self.name!r}: no reader answered ({'; '.join(errors) or 'none runs yet'}); "
                               "readers run on every Ray node once its writer started them (readers=True).")

    def _reader_nodes(self) -> list[str]:
        now = time.monotonic()
        if now - self._nodes[0] > 1.0:
            self._nodes = (now, [n["NodeID"] for n in self._ray.nodes() if n["Alive"]])
        nodes = list(self._nodes[1])
        random.shuffle(nodes)
        here = self._ray.get_runtime_context().get_node_id()
        return sorted(nodes, key=lambda n: n != here)   # this process's node first

    def _own(self, value: Any) -> Any:
        from hutch.memory._entity import Entity
        from hutch.memory._index import Hit

        if isinstance(value, (Entity, Hit)):
            object.__setattr__(value, "_store", self)
        elif isinstance(value, list):
            for v in value:
                self._own(v)
        return value

    def status(self) -> dict:
        """The writer (node, commit, clone, writes) and each node's reader (node, the commit it serves)."""
        w = self._ray.get_actor(writer_name(self.name), namespace=NAMESPACE)
        return _call(self._ray, lambda: w.status.remote(), self.timeout)

    # --- writes (hutch.Memory's; each returns once the remote holds it) -------------------

    def put(self, cls: str, title: str, **kw: Any):
        """Memory.put: create an entity; returns it."""
        return self._write("put", (cls, title), kw)

    def update(self, ref: Any, **kw: Any):
        """Memory.update: correct an entity in place; returns it."""
        return self._write("update", (_ref(ref),), kw)

    def supersede(self, ref: Any, *, valid_from: Any, **kw: Any):
        """Memory.supersede: the entity changed in the world from `valid_from` on; returns it."""
        return self._write("supersede", (_ref(ref),), {"valid_from": valid_from, **kw})

    def link(self, src: Any, relation: str, dst: Any, *, source: str | None = None) -> Path:
        """Memory.link; returns the link's path relative to the store."""
        return self._write("link", (_ref(src), relation, _ref(dst)), {"source": source})

    def unlink(self, src: Any, relation: str, dst: Any, *, source: str | None = None) -> None:
        self._write("unlink", (_ref(src), relation, _ref(dst)), {"source": source})

    def forget(self, ref: Any, *, reason: str, source: str | None = None) -> None:
        """Memory.forget: delete an entity and its links in one commit recording `reason`."""
        self._write("forget", (_ref(ref),), {"reason": reason, "source": source})

    def ingest_text(self, text: str, **kw: Any):
        """Memory.ingest_text of a text (a path names a file on the writer's node, so pass the text itself)."""
        return self._write("ingest_text", (text,), kw)

    def ingest_conversation(self, data: Any, **kw: Any):
        """Memory.ingest_conversation of a LoCoMo dict or JSON string."""
        return self._write("ingest_conversation", (data,), kw)

    # --- reads (a reader's, at least at this handle's last write) ------------------------

    def get(self, ref: Any):
        return self._read("get", (_ref(ref),))

    def head(self, ref: Any, max_bytes: int = 1 << 20):
        """Memory.head: the entity as the first `max_bytes` of its file read (what a search hit shows)."""
        return self._read("head", (_ref(ref), max_bytes))

    def exists(self, ref: Any) -> bool:
        return self._read("exists", (_ref(ref),))

    def ls(self, cls: str | None = None) -> list[str]:
        return self._read("ls", (cls,))

    def classes(self) -> list[str]:
        return self._read("classes")

    def neighbors(self, ref: Any):
        return self._read("neighbors", (_ref(ref),))

    def backlinks(self, ref: Any) -> dict[str, list[str]]:
        return self._read("backlinks", (_ref(ref),))

    def history(self, ref: Any):
        return self._read("history", (_ref(ref),))

    def search(self, query: str, *, k: int = 10, classes: Iterable[str] | str | None = None, **kw: Any):
        """Memory.search on a reader: the hits of one commit (at least this handle's last write)."""
        return self._read("search", (query,), {"k": k, "classes": classes, **kw})


def _ref(ref: Any) -> str:
    from hutch.memory._entity import Entity

    if isinstance(ref, Entity):
        return ref.id
    if isinstance(ref, str):
        return ref
    raise ConfigError(f"{ref!r} is not an entity: pass an Entity or an id such as 'actors/alice-chen'.")


__all__ = ["DEFAULT_ROOT", "FleetMemory", "init_remote", "memory", "memory_down"]
