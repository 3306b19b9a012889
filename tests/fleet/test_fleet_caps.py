"""A node's cap is its daemon's (`hutch serve --max-sandboxes`, set by the fleet): creates from many processes at
once, each placing from its own table, never put more on a node than its cap; a refused create goes elsewhere."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

from fleet_support import CAP, GUARD, NODES, RUN_TAG, read_line

import hutch

PROCS, EACH = 4, 40   # 160 creates at once against NODES * CAP = 120 places

_CLIENT = r"""
import json, sys
from concurrent.futures import ThreadPoolExecutor
import hutch
hutch.connect("ray://auto")
img = hutch.Image.from_directory(sys.argv[1])
tags = json.loads(sys.argv[2])
def one(_):
    try:
        return {"id": hutch.Sandbox.create(image=img, tags=tags, timeout=300).id}
    except hutch.QuotaExceededError as e:
        return {"error": "QuotaExceededError", "quota": e.quota, "message": str(e)}
    except hutch.SandboxError as e:
        return {"error": type(e).__name__, "message": str(e)}
with ThreadPoolExecutor(8) as pool:
    out = list(pool.map(one, range(int(sys.argv[3]))))
print(json.dumps(out), flush=True)
sys.stdin.read()   # holds the leases until the test is done
"""


def test_each_daemon_is_started_with_the_fleet_cap(ray_fleet):
    for r in ray_fleet.table():
        cmdline = Path(f"/proc/{r['pid']}/cmdline").read_bytes().split(b"\0")
        assert cmdline[cmdline.index(b"--max-sandboxes") + 1] == str(CAP).encode()
        assert r["max_sandboxes"] == CAP


def test_many_processes_creating_at_once_never_overshoot_a_node_cap(fleet_sdk, fleet_busybox):
    tags = {**RUN_TAG, "t": "cap"}
    env = dict(os.environ, RAY_ADDRESS=fleet_sdk.address)
    procs = [subprocess.Popen([sys.executable, "-c", _CLIENT, str(fleet_busybox), json.dumps(tags), str(EACH)],
                              env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(PROCS)]
    try:
        results = []
        for p in procs:
            line = read_line(p.stdout, "[")
            assert line, p.stderr.read()[-3000:]
            results += json.loads(line)
        ids = [r["id"] for r in results if "id" in r]
        errors = [r for r in results if "error" in r]
        per_node = Counter(i.split("-")[0] for i in ids)
        assert len(results) == PROCS * EACH
        assert max(per_node.values()) <= CAP, per_node                       # never over a node's cap
        assert max(per_node.values()) == CAP, per_node                       # and the cap was reached
        assert len(ids) == NODES * CAP, (per_node, errors[:3])   # refused ones found room elsewhere, till none had
        for e in errors:   # what did not fit: the daemon's retryable refusal, or no node with room
            assert (e["error"] == "QuotaExceededError" and e["quota"] == "host_sandboxes"
                    and "--max-sandboxes" in e["message"]) or "no fleet node can take" in e["message"], e
        live = hutch.Sandbox.list(tags=tags)
        assert sorted(s.id for s in live) == sorted(ids)                     # nothing made beyond what was answered
        rows = fleet_sdk.wait(lambda rs: sum(r["live"] for r in rs) >= len(ids), what="the table's counts")
        assert all(r["live"] <= CAP for r in rows), rows
        # at its cap a node's daemon refuses, naming the fix; once one of its sandboxes ends it takes one again
        full = next(k for k, n in per_node.items() if n == CAP)
        from hutch.sandbox import _client

        fl = _client.default_client().fleet
        c = fl.client(fl.nodes(0)[full])
        spec = {"image": f"dir:{fleet_busybox}", "tags": sorted(tags.items()), "detach": True, "timeout": 60}
        try:
            c.json("POST", "/v1/sandboxes", json={"spec": spec})
            raise AssertionError(f"node {full} at its cap took another sandbox")
        except hutch.QuotaExceededError as e:
            assert e.quota == "host_sandboxes" and e.limit == CAP and e.used >= CAP, vars(e)
        hutch.Sandbox.from_id(next(i for i in ids if i.startswith(full + "-"))).terminate()
        extra = hutch.Sandbox(c, c.json("POST", "/v1/sandboxes", json={"spec": spec}))
        assert extra.id.startswith(full + "-")
        extra.terminate()
    finally:
        for p in procs:
            p.kill()
            p.wait()
            for f in (p.stdin, p.stdout, p.stderr):   # our ends of its pipes (left to the gc: ResourceWarning)
                f.close()
    deadline = time.monotonic() + GUARD   # the clients' leases closed with them: every node's sandboxes end
    while time.monotonic() < deadline and hutch.Sandbox.list(tags=tags):
        time.sleep(0.3)
    assert hutch.Sandbox.list(tags=tags) == []
