"""The caller's side of a hutch fleet on Ray (docs/fleet.md): `HUTCH_URL=ray://auto`, `hutch.connect("ray://head:10001")`.

A fleet is one hutch daemon per Ray node, each started and watched by that node's agent (hutch/fleet). The caller
asks the fleet's controller (a named Ray actor) for its table of nodes once a second at most; everything else goes
straight to a node's daemon, over its Unix socket when the node runs on this host (the same boot) and the
caller may use it, else over TLS with the fleet's token, the daemon's certificate pinned by the fingerprint the
table carries. So a call through the fleet costs what a call to one daemon costs, plus a dictionary look-up.

- create: the better of SAMPLE nodes drawn at random from those that are healthy, not cordoned and under their
  cap, by free capacity (the least of their free share of sandboxes, memory and CPU); a node that cannot be
  reached is skipped and the create tried on another.
- a sandbox's id starts with its node's key (`hutch serve --id-prefix`), so any process finds its node.
- a node that is gone: calls about its sandboxes raise SandboxLostError (status "lost"), never hang.

Here, and only here, the sandbox wing meets Ray; `import ray` happens when a fleet URL is used.
"""

from __future__ import annotations

import os
import random
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from hutch._core.errors import (
    ConfigError, DaemonError, ImageError, NotFoundError, QuotaExceededError, SandboxError, SandboxLostError,
    SnapshotLostError,
)

SCHEME = "ray://"
#: the Ray namespace of the fleet's actors, and the controller's name in it
NAMESPACE = "hutch"
CONTROLLER = "hutch-fleet"
#: seconds a caller trusts its copy of the node table
REFRESH = 1.0
#: nodes drawn for each create; the one with the most free capacity takes it
SAMPLE = 2
#: seconds to connect to a node's daemon before it counts as gone
NODE_CONNECT_TIMEOUT = 3.0
#: nodes a create tries before it gives up
CREATE_ATTEMPTS = 3
#: bytes per chunk of an image moved between nodes
TRANSFER_CHUNK = 1 << 20
#: the references every node resolves on its own host (a base, not an image of the store): never moved
_LOCAL_REFS = ("dir:", "debian-slim")


def is_fleet_url(url: str | None) -> bool:
    return bool(url) and url.startswith(SCHEME)


def ray_address(url: str) -> str:
    """ray://auto -> "auto" (a driver of the cluster this host runs); ray://HOST:PORT -> Ray Client's address."""
    rest = url[len(SCHEME):].rstrip("/")
    if not rest:
        raise ConfigError(f"{url!r} names no Ray cluster: use ray://auto (the cluster this host is part of) or "
                          "ray://HEAD:10001 (Ray Client).")
    return "auto" if rest == "auto" else url


def import_ray():
    try:
        import ray
    except ImportError as e:
        raise ConfigError("a fleet URL (ray://...) needs Ray: pip install 'hutch[ray]'.") from e
    return ray


def connect_ray(url: str):
    """Join the Ray cluster `url` names (unless this process already is a Ray driver or worker)."""
    global _joined
    ray = import_ray()
    if not ray.is_initialized():
        import logging

        _joined = True
        try:
            ray.init(address=ray_address(url), namespace=NAMESPACE, log_to_driver=False,
                     logging_level=logging.WARNING, configure_logging=False)
        except (ConnectionError, RuntimeError, ValueError) as e:
            raise DaemonError(f"cannot join the Ray cluster at {url} ({e}); start one with `ray start --head`, or "
                              "give its address: ray://HEAD:10001.") from e
    return ray


def controller(url: str):
    """The fleet controller's actor handle (DaemonError naming `hutch fleet up` when none runs)."""
    ray = connect_ray(url)
    try:
        return ray.get_actor(CONTROLLER, namespace=NAMESPACE)
    except ValueError:
        raise DaemonError(f"no hutch fleet runs on the Ray cluster at {url}: start one with `hutch fleet up --ray "
                          f"{ray_address(url)}`.") from None


def local_boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


@dataclass
class Node:
    """One row of the controller's table (hutch/fleet/_controller.py makes it)."""

    key: str                     # the node's key: its sandboxes' ids start with it and a dash
    name: str                    # hostname/slot, for people
    node_id: str = ""            # the Ray node's id
    boot_id: str = ""            # the host's boot id: equal to ours when the node runs on this host
    socket: str = ""             # its daemon's Unix socket
    url: str = ""                # its daemon's TLS listener, https://IP:PORT
    fingerprint: str = ""        # the SHA-256 of that listener's certificate
    token: str = field(default="", repr=False)
    started: float = 0.0         # when its daemon started (a new daemon knows none of the old one's sandboxes)
    live: int = 0
    max_sandboxes: int = 0
    cpus: float = 1.0
    load: float = 0.0
    mem_total: int = 0
    mem_available: int = 0
    healthy: bool = False
    cordoned: bool = False
    problem: str = ""

    @classmethod
    def from_row(cls, row: dict) -> "Node":
        names = cls.__dataclass_fields__
        return cls(**{k: v for k, v in row.items() if k in names})

    def free(self, pending: int = 0) -> float:
        """Its free capacity, 0..1: its free share of sandboxes times its free share of memory times 1 / (1 + its
        load per CPU). A product, so nodes that share a host (the same memory and load) are ranked by sandboxes."""
        slots = max(0.0, 1.0 - (self.live + pending) / self.max_sandboxes) if self.max_sandboxes else 0.0
        mem = self.mem_available / self.mem_total if self.mem_total else 1.0
        return slots * mem / (1.0 + max(0.0, self.load) / max(self.cpus, 1.0))

    def takes(self, pending: int = 0) -> bool:
        return self.healthy and not self.cordoned and self.live + pending < self.max_sandboxes


#: a fleet sandbox's id: its node's key (`hutch serve --id-prefix`: 1-12 lowercase letters and digits), a dash and
#: the 12 hex digits the daemon draws
_FLEET_ID = re.compile(r"([a-z0-9]{1,12})-[0-9a-f]{12}")


def key_of(sandbox_id: str) -> str | None:
    """The node key a fleet sandbox id starts with (`<key>-<12 hex>`), or None (a name, such as "no-such-box")."""
    m = _FLEET_ID.fullmatch(sandbox_id)
    return m.group(1) if m else None


class Fleet:
    """A process's view of one fleet: the node table (refreshed at most every REFRESH s) and a client per node."""

    def __init__(self, url: str, make_client, token: str | None = None):
        self.url = url
        self._make_client = make_client   # (Node, token) -> a _client.Client of that node's daemon
        self.token = token   # a tenant's (connect(url, token=)): the caller's calls are its; None: the fleet's
        self._controller = controller(url)
        self._lock = threading.Lock()
        self._nodes: dict[str, Node] = {}
        self._at = -1e9
        self._pending: dict[str, int] = {}   # creates placed since the last table, per node
        self._clients: dict[tuple, object] = {}
        self._op_clients: dict[tuple, object] = {}   # with the fleet's token: moving images and snapshots
        self._transfers: dict[tuple[str, str], threading.Lock] = {}   # (node key, image) -> one transfer at once
        self._snapshots: dict[str, str] = {}   # memory snapshot id -> the key of the node that holds it
        self._refresh()

    # --- the table ----------------------------------------------------------------------

    def _refresh(self) -> None:
        ray = import_ray()
        try:
            rows = ray.get(self._controller.table.remote(), timeout=10)
        except Exception as e:   # the controller is gone (fleet down), restarting elsewhere, or Ray is away
            if self._nodes:      # the daemons do not need it: go on with the table we have, ask again soon
                with self._lock:
                    self._at = time.monotonic() - REFRESH + 0.25
                return
            raise DaemonError(f"the hutch fleet at {self.url} did not answer ({e}); is it up (`hutch fleet ls`)?") from e
        nodes = {r["key"]: Node.from_row(r) for r in rows}
        with self._lock:
            self._nodes, self._at, self._pending = nodes, time.monotonic(), {}

    def nodes(self, max_age: float = REFRESH) -> dict[str, Node]:
        if time.monotonic() - self._at > max_age:
            self._refresh()
        return self._nodes

    def node(self, key: str) -> Node | None:
        n = self.nodes().get(key)
        if n is None and time.monotonic() - self._at > 0.1:
            n = self.nodes(0).get(key)   # a node newer than our table
        return n

    # --- placement ----------------------------------------------------------------------

    def place(self, skip: set[str] = frozenset()) -> Node:
        """The node for a create (SAMPLE drawn, the freest taken); when our table has none with room, a new table
        is asked for first (ours counts our creates since it as placed, also those that went elsewhere)."""
        for max_age in (REFRESH, 0):
            nodes = self.nodes(max_age)
            with self._lock:
                ok = [n for n in nodes.values() if n.key not in skip and n.takes(self._pending.get(n.key, 0))]
                if ok:
                    drawn = random.sample(ok, min(SAMPLE, len(ok)))
                    best = max(drawn, key=lambda n: n.free(self._pending.get(n.key, 0)))
                    self._pending[best.key] = self._pending.get(best.key, 0) + 1
                    return best
        raise SandboxError(_no_node(nodes, skip))

    def create(self, attempt):
        """`attempt(client)` on placed nodes until one answers: (client, its answer). A node that cannot be
        reached (SandboxLostError, DaemonError) is left out for this create and another tried, at most
        CREATE_ATTEMPTS nodes; a node whose daemon is at its cap (`full`) is left out and another tried, as many
        as there are."""
        skip: set[str] = set()
        last = None
        tries = 0
        while tries < CREATE_ATTEMPTS:
            try:
                node = self.place(skip)
            except SandboxError:
                if last is not None:
                    raise last
                raise
            c = self.client(node)
            try:
                return c, attempt(c)
            except QuotaExceededError as e:
                if not self.full(node.key, e):
                    raise
                skip.add(node.key)
                last = e
            except (SandboxLostError, DaemonError) as e:
                skip.add(node.key)
                last = e
                tries += 1
        raise last

    def full(self, key: str, e: QuotaExceededError) -> bool:
        """Whether `e` is node `key`'s daemon refusing a create at its cap (quota host_sandboxes): if so this
        process places nothing more there until its next table."""
        if e.quota != "host_sandboxes":
            return False   # a tenant's quota: the same on every node's daemon
        with self._lock:
            n = self._nodes.get(key)
            if n is not None:
                self._pending[key] = max(self._pending.get(key, 0), n.max_sandboxes - n.live)
        return True

    # --- clients ------------------------------------------------------------------------

    def close(self) -> None:
        """Close the node clients (their pooled connections; nothing is sent)."""
        with self._lock:
            clients = list(self._clients.values()) + list(self._op_clients.values())
            self._clients.clear()
            self._op_clients.clear()
        for c in clients:
            try:
                c.http.close()
            except Exception:  # noqa: BLE001 - closing a client: nothing to tell, nothing to retry
                pass

    def client(self, node: Node):
        """The caller's client of `node`'s daemon (a tenant's token if the caller gave one, else the fleet's)."""
        return self._client(node, self._clients, self.token)

    def op_client(self, node: Node):
        """The fleet's (the operator's) client of `node`'s daemon: what moves images and memory snapshots between
        nodes (export and import are the operator's; the caller is a Ray driver, which the fleet trusts: its
        table carries the fleet's token). The same as client() for a caller without a tenant's token."""
        if self.token is None:
            return self.client(node)
        return self._client(node, self._op_clients, None)

    def _client(self, node: Node, cache: dict, token: str | None):
        k = (node.key, node.socket, node.url, node.fingerprint, node.started)
        c = cache.get(k)
        if c is None:
            with self._lock:
                c = cache.get(k)
                if c is None:
                    c = self._make_client(node, token) if token is not None else self._make_client(node)
                    c.ep.restarted = lambda key=node.key, started=node.started: self.restarted(key, started)
                    c.ep.fetch_image = lambda ref, key=node.key: self.fetch_image(key, ref)
                    cache[k] = c
        return c

    # --- images -------------------------------------------------------------------------

    def fetch_image(self, key: str, ref: str) -> bool:
        """Bring image `ref` (an `image:` id or a built image's name) to node `key` from a node of the fleet that
        has it: the source's export streamed into the node's import, which is told the digest the source reports
        (GET /v1/images/{id} -> "digest") and the tenants that hold it there ("owners": it records them) and refuses, storing nothing, an archive of any other image (besides
        checking every layer against its content digest, as any import does). False for a reference a node
        resolves on its own host (a dir: or the default base); NotFoundError when no node has the image."""
        if ref.startswith(_LOCAL_REFS):
            return False
        name = ref[len("image:"):] if ref.startswith("image:") else ref
        target = self.node(key)
        if target is None:
            return False
        with self._lock:
            lock = self._transfers.setdefault((key, name), threading.Lock())
        with lock:   # this process's other creates on that node wait for the one transfer
            dst = self.client(target)
            try:
                dst.json("GET", f"/v1/images/{name}")
                return True   # another thread brought it meanwhile
            except NotFoundError:
                pass
            peers = {id(self.client(n)): n for n in self.nodes().values() if n.healthy and n.key != key}
            found = [(c, a) for c, a in self.fan_out(lambda c: c.json("GET", f"/v1/images/{name}"), strict=False)
                     if id(c) in peers and isinstance(a, dict)]
            if not found:
                raise NotFoundError(f"image {ref!r} is on no node of the fleet {self.url}: build it (`hutch image "
                                    "build`) or import it (`hutch image import`) on one, and the others fetch it.")
            src, info = min(found, key=lambda ca: peers[id(ca[0])].key)
            src_node = peers[id(src)]
            # the tenants that hold it there hold it here too (the operator's answer names them; a tenant's not)
            owners = self.op_client(src_node).json("GET", f"/v1/images/{info['id']}").get("owners") or []
            params = {"digest": info["digest"], **({"owner": list(owners)} if owners else {})}
            resp = self.op_client(src_node).request("GET", f"/v1/images/{info['id']}/export", stream=True)
            try:
                got = self.op_client(target).json("POST", "/v1/images/import", params=params,
                                                  content=resp.iter_bytes(TRANSFER_CHUNK))
            finally:
                resp.close()
            if got.get("id") != info["id"] or got.get("digest") != info["digest"]:
                raise ImageError(f"node {key} imported {got.get('id')!r} (digest {got.get('digest')!r}) for image "
                                 f"{info['id']} of digest {info['digest']} from node {src_node.key}; "
                                 "remove it (`hutch image rm`) and try again.")
            if got.get("base") == "debian-slim":   # the base every host builds itself
                from hutch.sandbox._ensure import ensure_image

                ensure_image(self.op_client(target), "debian-slim")
        return True

    def restarted(self, key: str, started: float) -> bool:
        """Whether node `key`'s daemon is not the one that started at `started` (it died and another runs, or
        none): a sandbox of the old one is lost, not merely unknown."""
        n = self.node(key)
        if n is not None and n.started == started:
            n = self.nodes(0).get(key)
        return n is None or n.started != started

    def owner(self, sandbox_id: str):
        """The client of the node that runs `sandbox_id` (an id; a name is looked for on every node)."""
        return self.client(self.owner_node(sandbox_id))

    def owner_node(self, sandbox_id: str) -> Node:
        key = key_of(sandbox_id)
        if key is not None:
            node = self.node(key)
            if node is not None:
                return node
        # a name, or an id whose node the table does not hold (never in this fleet, or one a name looks like):
        # asked of every node, as a single daemon answers an unknown one (NotFoundError)
        nodes = {id(self.client(n)): n for n in self.nodes().values() if n.healthy}
        for c, answer in self.fan_out(lambda c: c.json("GET", f"/v1/sandboxes/{sandbox_id}"), strict=False):
            if isinstance(answer, dict):
                return nodes[id(c)]
        where = f" (its id names fleet node {key}, which is not in the fleet now: `hutch fleet ls`)" if key else ""
        raise NotFoundError(f"no sandbox {sandbox_id!r} on any node of the fleet {self.url}{where}; list them with "
                            "hutch.Sandbox.list().")

    def snapshot_node(self, snapshot_id: str) -> Node:
        """The node whose daemon holds memory snapshot `snapshot_id` (asked of every healthy node once, then
        remembered): a restore, export or delete of it goes there."""
        key = self._snapshots.get(snapshot_id)
        node = self.nodes().get(key) if key else None
        if node is not None and node.healthy:
            return node
        nodes = {id(self.client(n)): n for n in self.nodes().values() if n.healthy}
        answers = self.fan_out(lambda c: c.json("GET", f"/v1/memory-snapshots/{snapshot_id}"), strict=False)
        for c, answer in answers:
            if isinstance(answer, dict) and id(c) in nodes:
                self._snapshots[snapshot_id] = nodes[id(c)].key
                return nodes[id(c)]
        unreachable = {nodes[id(c)].key for c, a in answers
                       if id(c) in nodes and isinstance(a, (SandboxLostError, SnapshotLostError, DaemonError))}
        raise self._snapshot_missing(snapshot_id, key, unreachable)

    def _snapshot_missing(self, snapshot_id: str, cached: str | None, unreachable: set[str]) -> NotFoundError:
        """The error of a memory snapshot that no node which answers holds: SnapshotLostError when the node
        that took it (its id starts with the node's key; or the one this process last found it on) is dead,
        unhealthy, unreachable or no longer in the fleet; else NotFoundError (deleted, or never this fleet's)."""
        nodes = self.nodes()
        took = next((k for k in nodes if snapshot_id.startswith(k)), None)
        for origin in dict.fromkeys(k for k in (cached, took) if k):
            n = nodes.get(origin)
            if n is not None and n.healthy and origin not in unreachable:
                continue
            what = ("which is not in the fleet now" if n is None else
                    f"which is lost ({n.problem or 'unhealthy'})" if not n.healthy else
                    "which does not answer")
            name = f"{n.name} ({origin})" if n is not None else origin
            return SnapshotLostError(
                f"memory snapshot {snapshot_id} lived on fleet node {name}, {what}, and no other node holds a copy: "
                "it cannot be restored until that node returns with its state directory. A snapshot is kept on the "
                "node that took it (and on nodes a restore moved it to); export the snapshots you need to keep "
                "(`snap.export(path)`, `hutch snapshot export`) and import them anywhere, or take a new one.")
        return NotFoundError(f"no memory snapshot {snapshot_id!r} on any node of the fleet {self.url} (a snapshot "
                             "stays on the node that took it; hutch.Snapshot.list() lists them).")

    def restore_node(self, snapshot_id: str) -> Node:
        """The node a restore of memory snapshot `snapshot_id` goes to: a node that holds it and takes new
        sandboxes (healthy, not cordoned, under its cap); else a placed node, the snapshot moved there first
        (fetch_memory_snapshot), as a create's image is."""
        holder = self.snapshot_node(snapshot_id)
        with self._lock:
            if holder.takes(self._pending.get(holder.key, 0)):
                return holder
        holders = {id(self.client(n)): n for n in self.nodes().values() if n.healthy}
        found = [holders[id(c)] for c, a in self.fan_out(
            lambda c: c.json("GET", f"/v1/memory-snapshots/{snapshot_id}"), strict=False)
            if isinstance(a, dict) and id(c) in holders]
        with self._lock:
            ok = [n for n in found if n.takes(self._pending.get(n.key, 0))]
        if ok:
            self._snapshots[snapshot_id] = ok[0].key
            return ok[0]
        target = self.place({n.key for n in found})
        self.fetch_memory_snapshot(target.key, holder, snapshot_id)
        return target

    def fetch_memory_snapshot(self, key: str, source: Node, snapshot_id: str) -> None:
        """Bring memory snapshot `snapshot_id` to node `key` from node `source`: its image first (fetch_image,
        which also builds the default base there), then the source's export streamed into the node's import,
        told the digest the source reports (GET /v1/memory-snapshots/{id}/digest): it refuses, storing nothing,
        an archive of any other snapshot, and keeps the snapshot under the same id."""
        target = self.node(key)
        if target is None:
            raise SandboxLostError(f"fleet node {key} left the fleet while a memory snapshot was moved to it; try "
                                   "again.")
        with self._lock:
            lock = self._transfers.setdefault((key, "memory-snapshot:" + snapshot_id), threading.Lock())
        with lock:
            dst, src = self.op_client(target), self.op_client(source)
            have = src.json("GET", f"/v1/memory-snapshots/{snapshot_id}/digest")
            want, owner, shown = have["digest"], have.get("owner"), have.get("owner_image")
            try:
                there = dst.json("GET", f"/v1/memory-snapshots/{snapshot_id}/digest")
                if (there.get("owner"), there.get("owner_image")) == (owner, shown):
                    return   # another thread brought it meanwhile (the same owner recorded: else import it again)
            except NotFoundError:
                pass
            info = src.json("GET", f"/v1/memory-snapshots/{snapshot_id}")
            if info.get("image"):
                self.fetch_image(key, info["image"])
            params = {"digest": want, **({"owner": owner} if owner else {}),   # its owner travels with it
                      **({"owner_image": shown} if owner and shown else {})}
            resp = src.request("GET", f"/v1/memory-snapshots/{snapshot_id}/export", stream=True)
            try:
                got = dst.json("POST", "/v1/memory-snapshots/import", params=params,
                               content=resp.iter_bytes(TRANSFER_CHUNK))
            finally:
                resp.close()
            if got.get("id") != snapshot_id:
                raise SandboxError(f"node {key} imported memory snapshot {got.get('id')!r} for {snapshot_id} from "
                                   f"node {source.key}; delete it there (hutch.Snapshot.delete) and try again.")

    def fan_out(self, call, *, strict: bool = True) -> list[tuple[object, object]]:
        """`call(client)` on every healthy node at once: [(client, answer)]; with strict=False an error is
        the answer, else the first error is raised."""
        nodes = [n for n in self.nodes().values() if n.healthy]
        clients = [self.client(n) for n in nodes]

        def one(c):
            try:
                return c, call(c)
            except NotFoundError as e:
                return c, e
            except Exception as e:
                if strict:
                    raise
                return c, e
        if len(clients) <= 1:
            return [one(c) for c in clients]
        with ThreadPoolExecutor(min(16, len(clients)), thread_name_prefix="hutch-fleet") as pool:
            return list(pool.map(one, clients))

    def home(self):
        """The client for calls about no sandbox (images, volumes, doctor): the healthy node first by key."""
        return self.client(self.home_node())

    def home_node(self) -> Node:
        ok = sorted((n for n in self.nodes().values() if n.healthy), key=lambda n: n.key)
        if not ok:
            raise DaemonError(_no_node(self.nodes(), set()))
        return ok[0]

    def placed(self, skip: set[str]) -> "tuple[Node, Exception | None]":
        """place(skip), or the error to raise (for the async create, which runs its attempts itself)."""
        try:
            return self.place(skip), None
        except SandboxError as e:
            return None, e


def _no_node(nodes: dict[str, Node], skip: set[str]) -> str:
    if not nodes:
        return "the fleet has no nodes yet: `hutch fleet up` starts one per Ray node (`hutch fleet ls` lists them)."
    why = "; ".join(f"{n.name} ({n.key}): " + ("unreachable just now" if n.key in skip else "cordoned" if n.cordoned
                    else n.problem or "unhealthy" if not n.healthy else f"full ({n.live}/{n.max_sandboxes})")
                    for n in sorted(nodes.values(), key=lambda n: n.key))
    return (f"no fleet node can take a sandbox now: {why}. Add nodes (`ray start --address ...`), uncordon one "
            "(`hutch fleet cordon --off NODE`), or end sandboxes.")


_fleets: dict[tuple, Fleet] = {}
_fleets_lock = threading.Lock()
_joined = False   # whether this module, not its caller, made this process a Ray driver


def disconnect() -> None:
    """Forget every fleet, and leave Ray if it was this module that joined it (tests, before a cluster ends)."""
    global _joined
    with _fleets_lock:
        _fleets.clear()   # not closed: sandboxes of them may still be spoken to on their nodes' clients
    if _joined:
        _joined = False
        import_ray().shutdown()


def close_all() -> None:
    """Forget this process's fleets, their node clients closed (at interpreter exit)."""
    with _fleets_lock:
        mine = [f for k, f in _fleets.items() if k[0] == os.getpid()]
        _fleets.clear()
    for f in mine:
        f.close()


def fleet(url: str, make_client, token: str | None = None) -> Fleet:
    """The process's Fleet of `url` and caller's token (one per process, URL and token)."""
    k = (os.getpid(), url, token)
    with _fleets_lock:
        f = _fleets.get(k)
        if f is None:
            f = _fleets[k] = Fleet(url, make_client, token)
        return f


__all__ = ["CONTROLLER", "NAMESPACE", "NODE_CONNECT_TIMEOUT", "REFRESH", "SAMPLE", "SCHEME", "Fleet", "Node",
           "close_all", "connect_ray", "controller", "disconnect", "fleet", "import_ray", "is_fleet_url", "key_of", "local_boot_id",
           "ray_address"]
