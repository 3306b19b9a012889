"""The fleet on a real 3-node Ray cluster: up/ls/cordon/down, placement, routing, a node's death and return."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
from fleet_support import (
    CAP, GUARD, LOOPBACK, NODES, RUN_TAG, cgroup_children, cgroup_parent_of, node_args, read_line,
)

import hutch


def make(root, **kw):
    kw.setdefault("timeout", 120)
    kw["tags"] = {**RUN_TAG, **(kw.get("tags") or {})}
    return hutch.Sandbox.create(image=hutch.Image.from_directory(root), **kw)


def test_up_starts_one_daemon_per_ray_node_on_loopback(ray_fleet):
    rows = json.loads(ray_fleet.up_output)
    assert len(rows) == NODES and all(r["healthy"] for r in rows), rows
    assert len({r["node_id"] for r in rows}) == NODES          # one per Ray node
    assert len({r["key"] for r in rows}) == NODES
    assert len({r["pid"] for r in rows}) == NODES              # each its own daemon process ...
    assert len({r["socket"] for r in rows}) == NODES           # ... socket and run directory
    for r in rows:
        assert r["url"].startswith(f"https://{LOOPBACK}:"), r["url"]
        assert Path(r["socket"]).is_socket()
        assert "token" not in r                                # the operator's table does not print the token
        cmdline = Path(f"/proc/{r['pid']}/cmdline").read_bytes().split(b"\0")
        assert b"serve" in cmdline and r["key"].encode() in cmdline
        token_file = Path(r["run_dir"]) / "fleet-token"
        assert token_file.stat().st_mode & 0o077 == 0
        assert token_file.read_bytes().strip() not in b" ".join(cmdline)   # a token file, never the token
    # `fleet up` again is a no-op: the same daemons
    again = json.loads(ray_fleet.cli("fleet", "up", "--ray", ray_fleet.address, "--json"))
    assert {r["pid"] for r in again} == {r["pid"] for r in rows}


def test_ls_prints_nodes_capacity_and_health(ray_fleet):
    out = ray_fleet.cli("fleet", "ls", "--ray", ray_fleet.address)
    lines = out.strip().splitlines()
    assert lines[0].split()[:3] == ["KEY", "NODE", "HEALTH"]
    assert len(lines) == 1 + NODES
    assert all(" ok " in line and f"/{CAP}" in line for line in lines[1:]), out


def test_creates_spread_over_the_nodes_and_calls_go_to_the_owner(fleet_sdk, fleet_busybox):
    keys = {r["key"] for r in fleet_sdk.table()}
    sbs = [make(fleet_busybox, tags={"t": "spread"}) for _ in range(12)]
    per_node = Counter(sb.id.split("-")[0] for sb in sbs)
    assert set(per_node) <= keys and len(per_node) == NODES, per_node   # every node took some
    assert max(per_node.values()) <= 8, per_node
    for sb in sbs[:4]:
        assert sb.run("hostname").stdout.strip() == f"hutch-{sb.id}"
        sb.files.write("/tmp/x", b"fleet")
        assert sb.files.read("/tmp/x") == b"fleet"
        assert sb._client.ep.node == sb.id.split("-")[0]    # spoken to on its own node's daemon
    listed = hutch.Sandbox.list(tags={**RUN_TAG, "t": "spread"})
    assert sorted(s.id for s in listed) == sorted(s.id for s in sbs)   # the list spans the fleet
    # another process finds a sandbox by id (its node is in the id) and by name (asked of every node)
    named = make(fleet_busybox, name="fleet-named", detach=True)
    code = ("import hutch,sys; hutch.connect('ray://auto'); "
            f"a = hutch.Sandbox.from_id({sbs[5].id!r}); b = hutch.Sandbox.from_id('fleet-named'); "
            "print(a.run('hostname').stdout.strip(), b.id)")
    out = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, RAY_ADDRESS=fleet_sdk.address),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == [f"hutch-{sbs[5].id}", named.id]
    for sb in sbs:
        sb.terminate()
        assert sb.status == "terminated"
    named.terminate()


def test_a_cordoned_node_takes_no_new_sandboxes(fleet_sdk, fleet_busybox):
    import ray

    from hutch.sandbox import _fleet

    ctl = _fleet.controller("ray://auto")
    assert ray.get(ctl.ping.remote())["node_id"] == fleet_sdk.cluster.head_node.node_id   # killing a worker spares it
    rows = fleet_sdk.table()
    victim = rows[0]
    fleet_sdk.cli("fleet", "cordon", "--ray", fleet_sdk.address, victim["name"])
    try:
        fleet_sdk.wait(lambda rs: any(r["key"] == victim["key"] and r["cordoned"] for r in rs), what="the cordon")
        time.sleep(1.2)   # our table is at most 1 s old
        sbs = [make(fleet_busybox) for _ in range(8)]
        assert not [sb.id for sb in sbs if sb.id.startswith(victim["key"] + "-")]
        assert "cordoned" in fleet_sdk.cli("fleet", "ls", "--ray", fleet_sdk.address)
    finally:
        fleet_sdk.cli("fleet", "cordon", "--ray", fleet_sdk.address, "--off", victim["key"])
    bad = subprocess.run([sys.executable, "-m", "hutch", "fleet", "cordon", "--ray", fleet_sdk.address, "nosuch"],
                         env=fleet_sdk.env, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 1 and "names no fleet node" in bad.stderr and victim["key"] in bad.stderr


def test_a_node_whose_daemon_fails_health_checks_takes_no_new_sandboxes(fleet_sdk, fleet_busybox):
    """A node whose Ray node and agent live but whose daemon does not answer its agent's health check (SIGSTOPped)
    is reported unhealthy, with why, and takes no creates; answering again, it takes them again."""
    rows = fleet_sdk.table()
    victim = rows[1]
    os.kill(victim["pid"], signal.SIGSTOP)
    try:
        sick = fleet_sdk.wait(lambda rs: any(r["key"] == victim["key"] and not r["healthy"] for r in rs),
                              what="the failed health check")
        row = next(r for r in sick if r["key"] == victim["key"])
        assert "does not answer" in row["problem"] and not row["cordoned"], row
        assert "does not answer" in fleet_sdk.cli("fleet", "ls", "--ray", fleet_sdk.address)
        time.sleep(1.2)   # our table is at most 1 s old
        sbs = [make(fleet_busybox) for _ in range(8)]
        assert not [sb.id for sb in sbs if sb.id.startswith(victim["key"] + "-")]
        assert {sb.id.split("-")[0] for sb in sbs} == {r["key"] for r in rows} - {victim["key"]}
        for sb in sbs:
            sb.terminate()
    finally:
        os.kill(victim["pid"], signal.SIGCONT)
    fleet_sdk.wait(lambda rs: any(r["key"] == victim["key"] and r["healthy"] for r in rs), what="the recovery")
    time.sleep(1.2)
    more = [make(fleet_busybox) for _ in range(9)]   # it has the fewest: the sample of two that holds it picks it
    assert [sb for sb in more if sb.id.startswith(victim["key"] + "-")], [sb.id for sb in more]


def test_egress_is_enforced_by_each_nodes_own_gateway(fleet_sdk, fleet_busybox):
    """A sandbox with an allow policy on every node: its lookup of a name the policy does not allow is refused,
    and the refusal is in the log of its own node's daemon (that node's gateway decided), not another's."""
    from hutch.sandbox import _client

    rows = {r["key"]: r for r in fleet_sdk.table()}
    on: dict[str, hutch.Sandbox] = {}
    for _ in range(12):   # placement spreads them: the freest of two sampled nodes
        sb = make(fleet_busybox, network=hutch.Network.allow(domains=["api.example.test"]))
        if sb.id.split("-")[0] in on:
            sb.terminate()
        else:
            on[sb.id.split("-")[0]] = sb
        if len(on) == len(rows):
            break
    assert set(on) == set(rows), list(on)
    for key, sb in on.items():
        name = f"refused-{key}.example.test"
        assert sb.run("nslookup", name, timeout=20).returncode != 0
        node = _client.Client(_client.Endpoint(url="", socket_path=rows[key]["socket"]))
        log = node.json("GET", f"/v1/sandboxes/{sb.id}/network/log")
        assert any(d["name"] == name and d["verdict"] == "deny" for d in log["decisions"]), log
        for other in set(rows) - {key}:   # the other nodes' daemons do not know it
            with pytest.raises(hutch.NotFoundError):
                _client.Client(_client.Endpoint(url="", socket_path=rows[other]["socket"])).json(
                    "GET", f"/v1/sandboxes/{sb.id}/network/log")


def test_a_client_that_dies_leaves_no_sandbox_on_any_node(fleet_sdk, fleet_busybox):
    code = ("import hutch,sys; hutch.connect('ray://auto'); "
            f"sbs = [hutch.Sandbox.create(image=hutch.Image.from_directory({str(fleet_busybox)!r}), "
            f"tags={{**{RUN_TAG!r}, 't': 'orphan'}}) for _ in range(6)]; "
            "print('ids', *(s.id for s in sbs), flush=True); sys.stdin.read()")
    p = subprocess.Popen([sys.executable, "-c", code], env=dict(os.environ, RAY_ADDRESS=fleet_sdk.address),
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        ids = read_line(p.stdout, "ids ").split()[1:]
        assert len(ids) == 6, p.stderr.read()
        assert len({i.split("-")[0] for i in ids}) > 1
        p.kill()
        p.wait()
        deadline = time.monotonic() + GUARD
        while time.monotonic() < deadline and hutch.Sandbox.list(tags={**RUN_TAG, "t": "orphan"}):
            time.sleep(0.2)
        assert hutch.Sandbox.list(tags={**RUN_TAG, "t": "orphan"}) == []   # the leases closed with the process
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        for f in (p.stdin, p.stdout, p.stderr):   # our ends of its pipes (left to the gc: ResourceWarning)
            f.close()


def test_a_dead_node_loses_its_sandboxes_fast_and_its_return_reaps_them(fleet_sdk, fleet_busybox):
    """Its daemon SIGKILLed with its Ray node (nothing torn down): calls about its sandboxes raise
    SandboxLostError (not a hang), creates go on elsewhere; the node that comes back takes the slot, its daemon
    reaps the old one's cgroups."""
    rows = fleet_sdk.table()
    by_node = {r["node_id"]: r for r in rows}
    worker = fleet_sdk.workers[-1]
    victim = by_node[worker.node_id]
    sbs = [make(fleet_busybox) for _ in range(9)]
    doomed = [sb for sb in sbs if sb.id.startswith(victim["key"] + "-")]
    assert doomed, [sb.id for sb in sbs]
    p = doomed[0].exec("sleep", "60")
    parent = cgroup_parent_of(Path(victim["run_dir"]))
    before = set(cgroup_children(parent))
    assert {f"pids/{sb.id}" for sb in doomed} <= before
    os.kill(victim["pid"], signal.SIGKILL)     # the daemon dies without ending anything ...
    fleet_sdk.cluster.remove_node(worker, allow_graceful=False)   # ... and its Ray node with it
    fleet_sdk.workers.remove(worker)
    t0 = time.monotonic()
    with pytest.raises(hutch.SandboxLostError):
        doomed[0].run("true")
    with pytest.raises(hutch.SandboxLostError):
        p.wait()
    assert doomed[-1].status == "lost" and doomed[-1].reason == "lost"
    with pytest.raises(hutch.SandboxLostError):
        hutch.Sandbox.from_id(doomed[0].id).run("true")
    doomed[-1].terminate()                      # harmless
    assert time.monotonic() - t0 < 120   # a hang guard (each call's connect times out in 3 s), not a speed target
    others = [make(fleet_busybox) for _ in range(6)]   # creates go on, on the nodes left
    assert not [sb.id for sb in others if sb.id.startswith(victim["key"] + "-")]
    fleet_sdk.wait(lambda rs: any(r["key"] == victim["key"] and not r["healthy"] for r in rs), what="node down")
    # the node comes back: a new Ray node, an agent on it, the dead one's slot, key and run directory
    fleet_sdk.workers.append(fleet_sdk.cluster.add_node(**node_args()))
    back = fleet_sdk.wait(lambda rs: any(r["key"] == victim["key"] and r["healthy"] and r["pid"] != victim["pid"]
                                         for r in rs), what="the node's return")
    row = next(r for r in back if r["key"] == victim["key"])
    assert row["run_dir"] == victim["run_dir"]
    assert before & set(cgroup_children(parent)) == set()   # the instance's new daemon reaped the old one's
    with pytest.raises(hutch.SandboxLostError):
        doomed[0].run("true")                  # still lost, not someone else's
    time.sleep(1.1)
    more = [make(fleet_busybox) for _ in range(9)]
    assert [sb for sb in more if sb.id.startswith(victim["key"] + "-")]   # and it takes sandboxes again


def test_the_async_sandbox_goes_through_the_fleet_too(fleet_sdk, fleet_busybox):
    import asyncio

    async def main():
        img = hutch.Image.from_directory(fleet_busybox)
        sbs = [await hutch.AsyncSandbox.create(image=img, timeout=120, tags={**RUN_TAG, "t": "async"})
               for _ in range(6)]
        try:
            assert len({sb.id.split("-")[0] for sb in sbs}) > 1
            for sb in sbs[:3]:
                r = await sb.run("hostname")
                assert r.stdout.strip() == f"hutch-{sb.id}"
            listed = await hutch.AsyncSandbox.list(tags={**RUN_TAG, "t": "async"})
            assert sorted(s.id for s in listed) == sorted(s.id for s in sbs)
            again = await hutch.AsyncSandbox.from_id(sbs[-1].id)
            assert (await again.run("hostname")).stdout.strip() == f"hutch-{sbs[-1].id}"
        finally:
            for sb in sbs:
                await sb.terminate()
        assert sbs[0].status == "terminated"

    asyncio.run(main())
