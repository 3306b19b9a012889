"""A real multi-node Ray cluster on this host and a hutch fleet on it (a unique module name: see tests/conftest.py).

Loopback only: every Ray node and every daemon listener is on 127.0.0.2 (Ray rewrites 127.0.0.1 in an address to
the host's routable one, so the whole cluster would bind and be dialled there; 127.0.0.2 is loopback too).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

LOOPBACK = "127.0.0.2"
#: every sandbox the suite makes carries it
RUN_TAG = {"suite": f"fleet-{uuid.uuid4().hex[:8]}"}
NODES = 3
#: sandboxes each node takes at most (`hutch fleet up --max-per-node`; its daemon holds it: --max-sandboxes)
CAP = 40
#: the tenants of the fleet's tenants file (`hutch fleet up --tenants`): every node's daemon serves them
TENANTS = ("ta", "tb")
#: seconds a condition the fleet reaches on its own is waited for (a daemon or the controller restarted, a node
#: marked dead by Ray or back, a lease closed, a writer moved): a hang guard, generous for a loaded 2-core machine
#: (load 40-230 seen while other work shares it; Ray alone takes 15-60 s to declare a killed node dead), never a
#: speed target. The waits poll the real condition, so a quiet machine passes as fast as before.
GUARD = 300.0


def node_args() -> dict:
    """A Ray node's arguments: one CPU, on LOOPBACK, and the ports of its agents chosen here. Left to Ray (0),
    the raylet waits for its agents to write the ports they took, and on a loaded machine (the dashboard agent's
    imports alone took 25 s) gives up after about 15 s and dies: the node "timed out during startup"."""
    import socket

    names = ("metrics_agent_port", "metrics_export_port", "dashboard_agent_listen_port", "runtime_env_agent_port")
    socks = [socket.socket() for _ in names]
    try:
        for s in socks:
            s.bind((LOOPBACK, 0))
        ports = {n: s.getsockname()[1] for n, s in zip(names, socks)}
    finally:
        for s in socks:
            s.close()
    return {"num_cpus": 1, "node_ip_address": LOOPBACK, **ports}


def hutch_cli(*args: str, env: dict | None = None, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hutch", *args], env=env, capture_output=True, text=True,
                          timeout=timeout, cwd="/")


class RayFleet:
    """A Ray cluster of NODES nodes (ray.cluster_utils.Cluster: real raylets, one GCS) with `hutch fleet up` on it.

    The pytest process joins Ray only through the SDK (hutch.connect("ray://auto")) and leaves it in close(),
    before the cluster ends, so no driver of a dead cluster lingers in the process."""

    def __init__(self, nodes: int = NODES):
        self.tmp = Path(tempfile.mkdtemp(prefix="hutch-fleet-test-"))
        self.run_root = self.tmp / "run"
        self.state_root = self.tmp / "state"   # each node its own image store (STATE/KEY), as on separate hosts
        self.tenants_file = self.tmp / "etc" / "tenants.json"
        self.tokens = {name: self._add_tenant(name) for name in TENANTS}
        self.cluster = None
        for attempt in range(3):   # a raylet that does not register in Ray's 30 s (a loaded machine): start again
            try:
                self._start(nodes)
                return
            except Exception:
                if attempt == 2:
                    shutil.rmtree(self.tmp, ignore_errors=True)
                    raise

    def _start(self, nodes: int) -> None:
        from ray.cluster_utils import Cluster

        self.cluster = None
        self.__dict__.pop("address", None)
        try:
            # every agent port chosen (node_args): Ray's default dashboard agent port, 52365, is another cluster's
            # on a shared machine, and a head whose agent cannot bind never registers
            self.cluster = Cluster(initialize_head=True, head_node_args={
                "include_dashboard": False, **node_args()})
            self.workers = [self.cluster.add_node(**node_args()) for _ in range(nodes - 1)]
            self.address = self.cluster.address
            self.env = dict(os.environ, RAY_ADDRESS=self.address)
            self.env.pop("HUTCH_URL", None)
            self.up_output = self.cli("fleet", "up", "--ray", self.address, "--run-root", str(self.run_root),
                                      "--state-dir", str(self.state_root), "--state-per-node", "--max-per-node",
                                      str(CAP), "--tenants", str(self.tenants_file), "--timeout", str(GUARD),
                                      "--json", timeout=GUARD + 120)
        except BaseException:   # a cluster that did not come up (an overloaded machine) leaves nothing either
            if self.cluster is not None:
                if hasattr(self, "address"):
                    hutch_cli("fleet", "down", "--ray", self.address, env=self.env, timeout=120)
                self.cluster.shutdown()
            shutil.rmtree(self.run_root, ignore_errors=True)
            shutil.rmtree(self.state_root, ignore_errors=True)
            raise

    def _add_tenant(self, name: str) -> str:
        tf = self.tmp / f"{name}.token"
        r = hutch_cli("tenant", "add", name, "--file", str(self.tenants_file), "--token-file", str(tf), timeout=60)
        if r.returncode != 0:
            shutil.rmtree(self.tmp, ignore_errors=True)
            raise AssertionError(f"hutch tenant add {name} exited {r.returncode}: {r.stderr[-2000:]}")
        return tf.read_text().strip()

    def cli(self, *args: str, check: bool = True, timeout: float = 180) -> str:
        r = hutch_cli(*args, env=self.env, timeout=timeout)
        if check and r.returncode != 0:
            raise AssertionError(f"hutch {' '.join(args)} exited {r.returncode}: {r.stdout}\n{r.stderr[-4000:]}"
                                 + self.logs())
        return r.stdout

    def table(self) -> list[dict]:
        r = hutch_cli("fleet", "ls", "--ray", self.address, "--json", env=self.env)
        try:
            return json.loads(r.stdout)
        except ValueError:
            raise AssertionError(f"hutch fleet ls exited {r.returncode}: {r.stdout!r}\n{r.stderr[-3000:]}") from None

    def wait(self, cond, timeout: float = GUARD, what: str = "the fleet"):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            rows = self.table()
            if cond(rows):
                return rows
            time.sleep(0.3)
        raise AssertionError(f"{what} did not happen in {timeout:.0f} s: {rows}" + self.logs())

    def logs(self) -> str:
        out = []
        for log in sorted(self.run_root.glob("*/daemon.log")):
            out.append(f"\n--- {log}:\n" + log.read_text(errors="replace")[-1500:])
        return "".join(out)

    def sdk(self, tenant: str | None = None) -> None:
        """Point this process's SDK at the fleet, as the operator or as `tenant` (its token)."""
        import hutch

        os.environ["RAY_ADDRESS"] = self.address
        hutch.connect("ray://auto", token=self.tokens[tenant] if tenant else None)

    def close(self) -> None:
        from hutch.sandbox import _client

        try:
            _client.disconnect()   # leave Ray before the cluster goes
            try:
                self.cli("fleet", "down", "--ray", self.address, check=False, timeout=120)
            finally:
                self.cluster.shutdown()
        finally:
            os.environ.pop("RAY_ADDRESS", None)
            shutil.rmtree(self.tmp, ignore_errors=True)


def cgroup_children(parent_name: str) -> list[str]:
    """The sandbox cgroups under every controller's `parent_name` (hutch-<instance>)."""
    found = []
    for ctl in Path("/sys/fs/cgroup").iterdir():
        p = ctl / parent_name
        if p.is_dir():
            found += [f"{ctl.name}/{c.name}" for c in p.iterdir() if c.is_dir() and c.name != "_zygote"]
    return found


def cgroup_parent_of(run_dir: Path) -> str:
    return "hutch-" + (run_dir / "instance-id").read_text().strip()


def read_line(stdout, start: str) -> str:
    """The first line a client process wrote that starts with `start` ("" at its end). A Ray driver's stdout also
    carries what Ray forwards to every driver (a node of an earlier test marked dead, say: "(raylet) The node
    with node id ..."), so a client's answer is not always its first line."""
    for line in stdout:
        if line.startswith(start):
            return line
    return ""
