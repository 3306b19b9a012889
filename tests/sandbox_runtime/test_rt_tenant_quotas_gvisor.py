"""Quotas charge memory-snapshot restores and forks as they charge creates (runtime="gvisor", where they exist):
every copy is a live sandbox with its CPU and memory limits, so a tenant at its sandboxes, cpu or memory quota
gets a 429 QuotaExceededError naming that quota from a restore and from a fork, with nothing half-made (no
sandbox, cgroup, process (which alone hold a sandbox's namespaces: its network is none, so it has no link or
named netns), mount, runsc file or memory snapshot left); a restore and a fork
racing for the last place cannot both have it (docs/tenants.md)."""

from __future__ import annotations

import concurrent.futures as cf
import os
import shutil
import time
from pathlib import Path

import httpx
import pytest

from hutch.sandbox._host.daemon import tenants as T

from rt_support import Daemon, shared_snapshot_daemon

pytestmark = pytest.mark.skipif(shutil.which("runsc") is None, reason="runsc is not installed (scripts/setup.sh)")

SHARED = "bb-gv-shared"
MB = 1 << 20


@pytest.fixture(scope="module")
def world(tmp_path_factory, busybox_root):
    base = tmp_path_factory.mktemp("gvquota")
    with shared_snapshot_daemon(base, busybox_root, "q", T.Quotas(sandboxes=2, memory=300 * MB), SHARED) as world:
        yield world


def _state(d: Daemon, op: httpx.Client) -> dict:
    """What a half-made sandbox would leave, as the host and the daemon see it."""
    cg = Path("/sys/fs/cgroup")
    cgroups = {str(p) for p in cg.glob(f"*/{d.cgroup_parent}/*") if p.is_dir() and p.name != "_zygote"}
    cgroups |= {str(p) for p in cg.glob(f"{d.cgroup_parent}/*") if p.is_dir() and p.name != "_zygote"}
    procs = set()   # the sandboxes (cgroup leaves) that hold processes: a sandbox's namespaces live only in them
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                text = Path(f"/proc/{pid}/cgroup").read_text()
            except OSError:
                continue
            for ln in text.splitlines():
                _, _, where = ln.partition(f"/{d.cgroup_parent}/")
                if where and not where.startswith("_zygote"):
                    procs.add(where.split("/")[0])
    run = str(d.run_dir)
    mounts = {ln.split()[4] for ln in Path("/proc/self/mountinfo").read_text().splitlines() if run in ln.split()[4]}
    gvdir = d.run_dir / "gvisor"
    store = d.state_dir / "memory-snapshots"
    return {"sandboxes": sorted(s["id"] for s in op.get("/v1/sandboxes").json()["sandboxes"]),
            "cgroups": cgroups, "processes": procs, "mounts": mounts,
            "runsc files": {str(p) for p in gvdir.rglob("*")} if gvdir.exists() else set(),
            "memory snapshots": {p.name for p in store.iterdir()} if store.exists() else set()}


def _same(before: dict, after: dict) -> None:
    for k in before:
        assert after[k] == before[k], (k, sorted(set(after[k]) ^ set(before[k]))[:10])


def _refused(r: httpx.Response, quota: str) -> dict:
    assert r.status_code == 429, r.text
    body = r.json()
    assert body["error"] == "QuotaExceededError" and body["quota"] == quota, body
    assert f"over its {quota} quota" in body["message"] and f"--quota {quota}=" in body["message"], body
    return body


def _create(ten, **limits) -> str:
    r = ten.post("/v1/sandboxes", json={"spec": {"image": SHARED, "runtime": "gvisor", "detach": True,
                                                 "timeout": 300, "limits": limits,
                                                 "command": ["sh", "-c", "exec sleep 1000"]}})
    assert r.status_code == 201, r.text
    return r.json()["id"]


def _use(ten) -> dict:
    return ten.get("/v1/tenant").json()["use"]


def _set(d: Daemon, ten, *pairs: str) -> None:
    """Change tenant q's quotas in the tenants file; the daemon rereads it at the next request."""
    time.sleep(0.01)   # a new mtime, whatever the filesystem's clock granularity
    T.set_(d.tenants_file, "q", pairs)
    want = T.read_file(d.tenants_file)["q"].quotas.to_dict()
    deadline = time.monotonic() + 10
    while ten.get("/v1/tenant").json()["quotas"] != want:
        assert time.monotonic() < deadline, "the daemon did not take the changed tenants file"
        time.sleep(0.05)


def test_restore_and_fork_are_charged_to_the_live_sandbox_cpu_and_memory_quotas(world):
    d, op, ten = world
    src = _create(ten, memory=128 * MB, cpu=0.5)
    made = [src]
    try:
        r = ten.post(f"/v1/sandboxes/{src}/snapshot-memory")
        assert r.status_code == 201, r.text
        snap = r.json()["id"]

        # sandboxes=2, one live: a fork of two is refused whole; a fork of one takes the last place
        before = _state(d, op)
        body = _refused(ten.post(f"/v1/sandboxes/{src}/fork", json={"n": 2, "detach": True}), "sandboxes")
        assert body["limit"] == 2 and body["used"] == 1
        _same(before, _state(d, op))
        r = ten.post(f"/v1/sandboxes/{src}/fork", json={"n": 1, "detach": True})
        assert r.status_code == 201, r.text
        kid = r.json()["sandboxes"][0]["id"]
        made.append(kid)
        assert _use(ten)["sandboxes"] == 2 and _use(ten)["memory"] == 256 * MB and _use(ten)["cpu"] == 1.0

        # at the quota: a restore and a fork are both refused, naming it, and leave nothing
        before = _state(d, op)
        body = _refused(ten.post(f"/v1/memory-snapshots/{snap}/restore", json={"detach": True}), "sandboxes")
        assert body["limit"] == 2 and body["used"] == 2
        _refused(ten.post(f"/v1/sandboxes/{kid}/fork", json={"n": 1, "detach": True}), "sandboxes")
        _refused(ten.post(f"/v1/sandboxes/{src}/fork", json={}), "sandboxes")
        _same(before, _state(d, op))
        assert _use(ten)["sandboxes"] == 2

        # memory: 300M, 256M live; another copy of 128M is over it
        _set(d, ten, "sandboxes=none")
        before = _state(d, op)
        body = _refused(ten.post(f"/v1/memory-snapshots/{snap}/restore", json={"detach": True}), "memory")
        assert body["limit"] == 300 * MB and body["used"] == 256 * MB
        _refused(ten.post(f"/v1/sandboxes/{src}/fork", json={"n": 1, "detach": True}), "memory")
        _same(before, _state(d, op))

        # cpu: 1.2, 1.0 live; another copy of 0.5 is over it
        _set(d, ten, "memory=none", "cpu=1.2")
        before = _state(d, op)
        body = _refused(ten.post(f"/v1/memory-snapshots/{snap}/restore", json={"detach": True}), "cpu")
        assert body["limit"] == 1.2 and body["used"] == 1.0
        _refused(ten.post(f"/v1/sandboxes/{kid}/fork", json={"n": 1, "detach": True}), "cpu")
        _same(before, _state(d, op))

        # below the quotas again (the copy ends): a restore is admitted, and counted
        assert ten.post(f"/v1/sandboxes/{kid}/terminate").status_code == 200
        r = ten.post(f"/v1/memory-snapshots/{snap}/restore", json={"detach": True})
        assert r.status_code == 201, r.text
        made.append(r.json()["id"])
        assert _use(ten)["sandboxes"] == 2 and _use(ten)["cpu"] == 1.0
        assert ten.delete(f"/v1/memory-snapshots/{snap}").status_code == 204
    finally:
        for s in made:
            ten.post(f"/v1/sandboxes/{s}/terminate")
        _set(d, ten, "sandboxes=2", "memory=300M", "cpu=none")


def test_a_restore_and_a_fork_racing_for_the_last_place_cannot_both_have_it(world):
    d, op, ten = world
    src = _create(ten, memory=64 * MB, cpu=0.25)
    made = [src]
    try:
        r = ten.post(f"/v1/sandboxes/{src}/snapshot-memory")
        assert r.status_code == 201, r.text
        snap = r.json()["id"]
        before = _state(d, op)
        with cf.ThreadPoolExecutor(4) as ex:
            calls = [lambda: ten.post(f"/v1/memory-snapshots/{snap}/restore", json={"detach": True}),
                     lambda: ten.post(f"/v1/sandboxes/{src}/fork", json={"n": 1, "detach": True})] * 2
            got = list(ex.map(lambda f: f(), calls))
        ok = [g for g in got if g.status_code == 201]
        for g in ok:
            body = g.json()
            made.extend([s["id"] for s in body["sandboxes"]] if "sandboxes" in body else [body["id"]])
        assert len(ok) == 1 and len(made) == 2, [(g.status_code, g.text[:200]) for g in got]
        for g in got:
            if g.status_code != 201:
                _refused(g, "sandboxes")
        after = _state(d, op)
        assert after["sandboxes"] == sorted(before["sandboxes"] + [made[1]])
        assert _use(ten)["sandboxes"] == 2
        assert ten.delete(f"/v1/memory-snapshots/{snap}").status_code == 204
    finally:
        for s in made:
            ten.post(f"/v1/sandboxes/{s}/terminate")


def test_a_tenants_fork_and_restore_show_its_spec_as_it_named_things(world):
    """A copy runs the source's spec as the daemon rewrote it for the tenant (its volume stored as
    `t.<tenant>.<name>`, its image by id); the tenant sees it as it named them, as for the source, so that the
    spec it reads back creates the same sandbox again."""
    d, op, ten = world
    r = ten.post("/v1/volumes", json={"name": "vq", "create": True})
    assert r.status_code in (200, 201), r.text
    r = ten.post("/v1/sandboxes", json={"spec": {
        "image": SHARED, "runtime": "gvisor", "detach": True, "timeout": 300, "limits": {"memory": 64 * MB},
        "command": ["sh", "-c", "exec sleep 1000"], "mounts": [{"kind": "volume", "source": "vq", "target": "/v"}]}})
    assert r.status_code == 201, r.text
    src = r.json()
    made = [src["id"]]
    try:
        assert src["spec"]["image"] == SHARED and src["spec"]["mounts"][0]["source"] == "vq"
        r = ten.post(f"/v1/sandboxes/{src['id']}/fork", json={"n": 1, "detach": True})
        assert r.status_code == 201, r.text
        kid = r.json()["sandboxes"][0]
        made.append(kid["id"])
        snap = ten.post(f"/v1/sandboxes/{src['id']}/snapshot-memory")
        assert snap.status_code == 201, snap.text
        ten.post(f"/v1/sandboxes/{kid['id']}/terminate")
        r = ten.post(f"/v1/memory-snapshots/{snap.json()['id']}/restore", json={"detach": True})
        assert r.status_code == 201, r.text
        back = r.json()
        made.append(back["id"])
        copies = (kid, back, *(ten.get(f"/v1/sandboxes/{c['id']}").json() for c in (kid, back)))
        for copy in copies:
            mounts = copy["spec"]["mounts"]
            assert [m["source"] for m in mounts] == ["vq"], copy["spec"]
            assert "t.q." not in str(copy["spec"]), copy["spec"]
            # the image as the source showed it (the name the tenant used), not the snapshot's image node's id
            assert copy["spec"]["image"] == SHARED, copy["spec"]
        assert ten.delete(f"/v1/memory-snapshots/{snap.json()['id']}").status_code == 204
    finally:
        for s in made:
            ten.post(f"/v1/sandboxes/{s}/terminate")
        ten.delete("/v1/volumes/vq")


def test_the_operators_copies_of_a_tenants_sandbox_are_the_tenants_and_charged_to_it(world):
    """A fork of a tenant's sandbox and a restore of its memory snapshot asked for by the operator are the
    tenant's sandboxes (it sees and ends them) and count against its quotas, as its own copies do: at its
    sandboxes quota the operator's copy is refused with the tenant's 429, leaving nothing."""
    d, op, ten = world
    src = _create(ten, memory=64 * MB)
    made = [src]
    try:
        r = ten.post(f"/v1/sandboxes/{src}/snapshot-memory")
        assert r.status_code == 201, r.text
        snap = r.json()["id"]
        r = op.post(f"/v1/sandboxes/{src}/fork", json={"n": 1, "detach": True})
        assert r.status_code == 201, r.text
        kid = r.json()["sandboxes"][0]["id"]
        made.append(kid)
        assert _use(ten)["sandboxes"] == 2 and _use(ten)["memory"] == 128 * MB
        assert ten.get(f"/v1/sandboxes/{kid}").json()["spec"]["image"] == SHARED   # its own, shown as it named it
        before = _state(d, op)   # sandboxes=2, both live: the operator's next copy is over the tenant's quota
        body = _refused(op.post(f"/v1/sandboxes/{src}/fork", json={"n": 1, "detach": True}), "sandboxes")
        assert body["limit"] == 2 and body["used"] == 2
        _refused(op.post(f"/v1/memory-snapshots/{snap}/restore", json={"detach": True}), "sandboxes")
        _same(before, _state(d, op))
        assert ten.post(f"/v1/sandboxes/{kid}/terminate").status_code == 200   # the tenant ends the copy
        r = op.post(f"/v1/memory-snapshots/{snap}/restore", json={"detach": True})
        assert r.status_code == 201, r.text
        back = r.json()["id"]
        made.append(back)
        assert back in [s["id"] for s in ten.get("/v1/sandboxes").json()["sandboxes"]]
        assert _use(ten)["sandboxes"] == 2
        assert ten.get(f"/v1/sandboxes/{back}").json()["spec"]["image"] == SHARED
        assert ten.delete(f"/v1/memory-snapshots/{snap}").status_code == 204
    finally:
        for s in made:
            op.post(f"/v1/sandboxes/{s}/terminate")
