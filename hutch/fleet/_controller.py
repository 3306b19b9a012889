"""The fleet's controller: a named, detached Ray actor on the head node that knows the fleet's nodes.

Once a second it compares Ray's live nodes with its agents and starts an agent (hutch/fleet/_agent.py) on each
node that has none, pinned there (NodeAffinitySchedulingStrategy, hard); a node that joins the cluster after
`hutch fleet up`, or comes back after a crash, gets one the same way. The agents report their node's row every
half second; `table()` hands the rows to callers (hutch/sandbox/_fleet.py) with health decided here: healthy
while its daemon answers, its Ray node is alive and its last report is under STALE seconds old. Callers
place sandboxes themselves from that table; nothing of a sandbox's traffic passes through this actor.

The table carries the fleet's token: whoever can call this actor can run code on every Ray node anyway
(a Ray cluster trusts everyone who reaches it), so it gives them nothing they did not have (docs/fleet.md).
"""

from __future__ import annotations

import threading
import time

from hutch.sandbox._fleet import NAMESPACE

STALE = 3.0        # seconds without a report before a node counts as unhealthy
RECONCILE = 1.0    # seconds between looks at Ray's nodes


def agent_name(node_id: str) -> str:
    return f"hutch-agent-{node_id[:16]}"


class Controller:
    """The Ray actor (hutch/fleet/_ops.py starts it: name CONTROLLER, lifetime detached, max_concurrency 64)."""

    def __init__(self, token: str, options: dict):
        self.token = token
        self.options = options
        self.rows: dict[str, dict] = {}
        self.agents: dict[str, object] = {}
        self.alive: set[str] = set()
        # cordons asked for that the node's agent has not reported yet (the agent keeps the cordon: a file in the
        # node's run directory, so it outlives this actor, the node's daemon and the node's Ray node)
        self.want: dict[str, bool] = {k: True for k in options.get("cordoned", ())}
        self.lock = threading.Lock()
        self.stopping = False
        self.started = time.time()
        threading.Thread(target=self._loop, name="hutch-fleet-reconcile", daemon=True).start()

    def _loop(self) -> None:
        while not self.stopping:
            try:
                self.reconcile()
            except Exception:   # Ray's GCS is briefly away: look again next time
                pass
            time.sleep(RECONCILE)

    def reconcile(self) -> None:
        import ray

        alive = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
        with self.lock:
            if self.stopping:
                return
            self.alive = alive
            for nid in list(self.agents):
                if nid not in alive:
                    del self.agents[nid]   # the node is dead, and its agent with it
            new = [nid for nid in alive if nid not in self.agents]
            for nid in new:
                self.agents[nid] = self._agent(nid)

    def _agent(self, node_id: str):
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from hutch.fleet._agent import NodeAgent

        name = agent_name(node_id)
        try:
            return ray.get_actor(name, namespace=NAMESPACE)   # this controller restarted: the agent runs on
        except ValueError:
            pass
        return ray.remote(NodeAgent).options(
            name=name, namespace=NAMESPACE, lifetime="detached", num_cpus=0, max_restarts=-1, max_concurrency=4,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
        ).remote(self.token, self.options)

    # --- what agents and callers call ----------------------------------------------------------

    def report(self, row: dict) -> None:
        row["seen"] = time.time()
        resend = None
        with self.lock:
            old = self.rows.get(row["key"])
            if old is None or old.get("seen", 0) <= row["seen"]:
                self.rows[row["key"]] = row
            want = self.want.get(row["key"])
            if want is not None and bool(row.get("cordoned")) == want:
                del self.want[row["key"]]   # the agent has it now
            elif want is not None:
                resend = self.agents.get(row.get("node_id", ""))
        if resend is not None:   # its agent was away when the cordon was asked (or restarted): tell it again
            try:
                resend.cordon.remote(want)
            except Exception:
                pass

    def table(self) -> list[dict]:
        now = time.time()
        out = []
        with self.lock:
            rows = [dict(r) for r in self.rows.values()]
            alive = set(self.alive)
            want = dict(self.want)
        for r in rows:
            age = now - r.get("seen", 0)
            if r.get("node_id") not in alive:
                r["healthy"], r["problem"] = False, "its Ray node is dead"
            elif age > STALE:
                r["healthy"], r["problem"] = False, f"no report from its agent for {age:.0f} s"
            r["cordoned"] = want.get(r["key"], bool(r.get("cordoned")))
            r["token"] = self.token
            r["age"] = age
            out.append(r)
        return sorted(out, key=lambda r: r["key"])

    def cordon(self, node: str, on: bool = True) -> str:
        """Stop (on) or let again (off) new sandboxes on `node`: its key, name (host/slot) or Ray node id. The
        node's agent records it (NodeAgent.cordon); until it reports it, or when it cannot be reached now, this
        actor holds it and tells the agent again with its next report."""
        import ray

        with self.lock:
            matches = [k for k, r in self.rows.items()
                       if node in (k, r.get("name")) or (len(node) >= 6 and r.get("node_id", "").startswith(node))]
            if len(matches) != 1:
                known = ", ".join(f"{r.get('name')} ({k})" for k, r in sorted(self.rows.items())) or "none"
                raise ValueError(f"{node!r} names {'no' if not matches else 'more than one'} fleet node; the nodes: "
                                 f"{known}.")
            key = matches[0]
            self.want[key] = on
            agent = self.agents.get(self.rows[key].get("node_id", ""))
        if agent is not None:
            try:
                ray.get(agent.cordon.remote(on), timeout=10)
            except Exception:   # its node is away: the next report from its agent gets it again
                pass
        return key

    def stop(self, timeout: float = 60.0) -> list[dict]:
        """End every node's daemon (and with it their sandboxes), then the agents; the caller kills this actor."""
        import ray

        with self.lock:
            self.stopping = True
            agents = dict(self.agents)
        refs = {nid: a.stop.remote() for nid, a in agents.items()}
        out = []
        for nid, ref in refs.items():
            try:
                out.append(ray.get(ref, timeout=timeout))
            except Exception as e:
                out.append({"node_id": nid, "error": str(e)})
        for a in agents.values():
            try:
                ray.kill(a, no_restart=True)
            except Exception:
                pass
        return out

    def ping(self) -> dict:
        import ray

        return {"started": self.started, "nodes": len(self.rows), "node_id": ray.get_runtime_context().get_node_id()}


__all__ = ["Controller", "STALE", "agent_name"]
