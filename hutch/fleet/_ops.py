"""`hutch fleet up | ls | down | cordon`: the operator's calls, made as a short-lived Ray driver."""

from __future__ import annotations

import time
from pathlib import Path

from hutch._core.errors import ConfigError, DaemonError
from hutch.sandbox._fleet import CONTROLLER, NAMESPACE, import_ray

DEFAULT_RUN_ROOT = Path("/run/hutch-fleet")
DEFAULT_MAX_PER_NODE = 1000
UP_TIMEOUT = 120.0


def join(address: str = "auto"):
    """Join the Ray cluster at `address` (auto, HOST:PORT of its GCS, or ray://HOST:10001) as a driver."""
    import logging

    ray = import_ray()
    if not ray.is_initialized():
        try:
            ray.init(address=address, namespace=NAMESPACE, log_to_driver=False, logging_level=logging.WARNING,
                     configure_logging=False)
        except (ConnectionError, RuntimeError, ValueError) as e:
            raise DaemonError(f"cannot join the Ray cluster at {address!r} ({e}); start it with `ray start --head` "
                              "(and `ray start --address HEAD:6379` on the other hosts), or name it with --ray.") from e
    return ray


def _controller(ray, address: str):
    try:
        return ray.get_actor(CONTROLLER, namespace=NAMESPACE)
    except ValueError:
        raise DaemonError(f"no hutch fleet runs on the Ray cluster at {address!r}; start it with `hutch fleet up "
                          f"--ray {address}`.") from None


def up(address: str = "auto", *, max_per_node: int = DEFAULT_MAX_PER_NODE, listen_host: str | None = None,
       run_root: str | Path = DEFAULT_RUN_ROOT, state_dir: str | Path | None = None, state_per_node: bool = False,
       tenants: str | Path | None = None, timeout: float = UP_TIMEOUT) -> list[dict]:
    """Start the fleet on the Ray cluster at `address` (a no-op for a fleet that runs) and return its table once
    every live Ray node's daemon answers.

    One agent per Ray node starts that node's hutch daemon (docs/fleet.md). `max_per_node`: sandboxes a node
    takes at most; `listen_host`: the address the daemons' TLS listeners bind (default: each Ray node's own);
    `run_root`: where each node's run directory goes (`<run_root>/<key>`); `state_dir`: the daemons' state
    directory (default /var/lib/hutch, shared by the nodes of one host; `state_per_node=True`: one per node);
    `tenants`: a tenants file every node's daemon serves (`hutch serve --tenants`: the same path on every host).
    """
    from hutch.fleet._agent import new_token
    from hutch.fleet._controller import Controller

    if not isinstance(max_per_node, int) or max_per_node < 1:
        raise ConfigError(f"max_per_node={max_per_node!r} must be a positive number of sandboxes.")
    ray = join(address)
    try:
        ctl = ray.get_actor(CONTROLLER, namespace=NAMESPACE)
    except ValueError:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        head = [n["NodeID"] for n in ray.nodes() if n["Alive"] and "node:__internal_head__" in n.get("Resources", {})]
        strategy = NodeAffinitySchedulingStrategy(head[0], soft=False) if head else "DEFAULT"
        options = {"max_per_node": max_per_node, "listen_host": listen_host, "run_root": str(run_root),
                   "state_dir": str(state_dir) if state_dir else None, "state_per_node": state_per_node,
                   "tenants": str(Path(tenants).absolute()) if tenants else None}
        ctl = ray.remote(Controller).options(
            name=CONTROLLER, namespace=NAMESPACE, lifetime="detached", num_cpus=0, max_restarts=-1,
            max_concurrency=64, scheduling_strategy=strategy, get_if_exists=True,
        ).remote(new_token(), options)
    return wait_ready(ray, ctl, timeout)


def wait_ready(ray, ctl, timeout: float = UP_TIMEOUT) -> list[dict]:
    """The table once every live Ray node has a healthy row (DaemonError naming those that have none)."""
    deadline = time.monotonic() + timeout
    while True:
        alive = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
        rows = _table(ray, ctl)
        ready = {r["node_id"] for r in rows if r["healthy"]}
        if alive <= ready:
            return [_public(r) for r in rows if r["node_id"] in alive]
        if time.monotonic() > deadline:
            bad = [f"{r['name']}: {r['problem']}" for r in rows if r["node_id"] in alive and not r["healthy"]]
            missing = len(alive - {r["node_id"] for r in rows})
            raise DaemonError("the fleet is not up after %.0f s: %s%s (each node's daemon log is its run "
                              "directory's daemon.log)" % (timeout, "; ".join(bad) or "",
                                                           f"; {missing} node(s) have no agent yet" if missing else ""))
        time.sleep(0.2)


def _table(ray, ctl, timeout: float = 30.0) -> list[dict]:
    """The controller's table; while it restarts (its node died: Ray starts it again) asked again."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return ray.get(ctl.table.remote(), timeout=timeout)
        except (ray.exceptions.ActorUnavailableError, ray.exceptions.GetTimeoutError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def _public(row: dict) -> dict:
    return {k: v for k, v in row.items() if k != "token"}


def ls(address: str = "auto") -> list[dict]:
    """The fleet's nodes: key, name, health (and why not), live sandboxes, cap, load, memory, addresses."""
    ray = join(address)
    return [_public(r) for r in _table(ray, _controller(ray, address))]


def cordon(node: str, on: bool = True, address: str = "auto") -> str:
    """Take `node` (key, host/slot name, or Ray node id) out of placement (on) or put it back (off); its running
    sandboxes are not touched. Returns the node's key."""
    ray = join(address)
    try:
        return ray.get(_controller(ray, address).cordon.remote(node, on), timeout=30)
    except ray.exceptions.RayTaskError as e:
        raise ConfigError(str(e.cause) if getattr(e, "cause", None) else str(e)) from None


def down(address: str = "auto") -> list[dict]:
    """End the fleet: every node's daemon (and its sandboxes), the agents, the controller."""
    ray = join(address)
    ctl = _controller(ray, address)
    out = ray.get(ctl.stop.remote(), timeout=120)
    ray.kill(ctl, no_restart=True)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:   # the name is free once the actor is gone: a new `up` may follow
        try:
            ray.get_actor(CONTROLLER, namespace=NAMESPACE)
        except ValueError:
            break
        time.sleep(0.1)
    return out


__all__ = ["DEFAULT_MAX_PER_NODE", "DEFAULT_RUN_ROOT", "cordon", "down", "join", "ls", "up", "wait_ready"]
