"""Copies of a gVisor sandbox that mounts a volume (a tenant's, in its volume store, or the operator's): a fork of
a restore, a fork of that fork and a restore of a fork's copy each run with the volume mounted, see what was
written into it before and write into it themselves. Their images' chains hold a layer more than once (a copy
that wrote what a snapshot below it had: layers are named by their content), which the root's overlay takes once:
overlayfs refuses a lowerdir twice (ELOOP, "conflicting lowerdir path"), and the fork answered 500."""

from __future__ import annotations

import os
import shutil

import httpx
import pytest

from hutch.sandbox._host.daemon import tenants as T

from rt_support import shared_snapshot_daemon, split_frames

pytestmark = pytest.mark.skipif(shutil.which("runsc") is None, reason="runsc is not installed (scripts/setup.sh)")

SHARED = "bb-gv-forkvol"
MB = 1 << 20


@pytest.fixture(scope="module")
def world(tmp_path_factory, busybox_root):
    base = tmp_path_factory.mktemp("gvforkvol")
    quotas = T.Quotas(sandboxes=8, memory=2048 * MB)
    with shared_snapshot_daemon(base, busybox_root, "fv", quotas, SHARED) as (d, op, ten):
        yield d, {"operator": op, "tenant": ten}


def _ok(r: httpx.Response, status: int = 200) -> dict:
    assert r.status_code == status, r.text
    return r.json()


def _sh(c: httpx.Client, sid: str, script: str) -> str:
    r = c.post(f"/v1/sandboxes/{sid}/exec", json={"argv": ["sh", "-c", script]})
    assert r.status_code == 200, r.text
    out, err, res = split_frames(r.content)
    assert res["returncode"] == 0, (out, err, res)
    return out.decode()


def _layers(op: httpx.Client, ref: str) -> list[str]:
    """The layer digests under image `ref`, top first."""
    out = []
    while not ref.startswith("dir:"):
        node = _ok(op.get(f"/v1/images/{ref}"))
        if node.get("layer"):
            out.append(node["layer"])
        ref = node["parent"]
    return out


@pytest.mark.parametrize("who", ["tenant", "operator"])
def test_forks_of_a_restore_and_of_a_fork_mount_the_volume(world, who):
    d, clients = world
    c = clients[who]
    vol = f"fv-{who}"
    _ok(c.post("/v1/volumes", json={"name": vol, "create": True}))
    made: list[str] = []
    snaps: list[str] = []
    try:
        spec = {"image": SHARED, "runtime": "gvisor", "detach": True, "timeout": 300, "limits": {"memory": 128 * MB},
                "command": ["sleep", "1000"],
                "mounts": [{"kind": "volume", "target": "/data", "source": vol, "readonly": False}]}
        src = _ok(c.post("/v1/sandboxes", json={"spec": spec}), 201)["id"]
        made.append(src)
        _sh(c, src, "echo src > /data/src")
        snap = _ok(c.post(f"/v1/sandboxes/{src}/snapshot-memory", json={}), 201)["id"]
        snaps.append(snap)
        restored = _ok(c.post(f"/v1/memory-snapshots/{snap}/restore", json={"detach": True}), 201)["id"]
        made.append(restored)
        kid = _ok(c.post(f"/v1/sandboxes/{restored}/fork", json={"n": 1, "detach": True}), 201)["sandboxes"][0]["id"]
        made.append(kid)
        grandkid = _ok(c.post(f"/v1/sandboxes/{kid}/fork", json={"n": 2, "detach": True}), 201)
        grandkids = [s["id"] for s in grandkid["sandboxes"]]
        made += grandkids
        for i, sid in enumerate([restored, kid, *grandkids]):
            assert _sh(c, sid, "cat /data/src") == "src\n"
            _sh(c, sid, f"echo {i} > /data/w{sid}")
        # and a restore of a fork's copy: the chain under it has every layer once
        body = _ok(c.post(f"/v1/sandboxes/{grandkids[0]}/snapshot-memory", json={}), 201)
        snap2 = body["id"]
        chain = _layers(clients["operator"], body["image"])
        # the case this test is for: a copy's writes came out as a layer already below it (each layer is its
        # content's digest), which the root's overlay of a copy of it must take once
        assert len(set(chain)) < len(chain), chain
        snaps.append(snap2)
        again = _ok(c.post(f"/v1/memory-snapshots/{snap2}/restore", json={"detach": True}), 201)["id"]
        made.append(again)
        seen = set(_sh(c, again, "ls /data").split())
        assert {"src", f"w{restored}", f"w{kid}", *(f"w{g}" for g in grandkids)} <= seen
    finally:
        for sid in made:
            c.post(f"/v1/sandboxes/{sid}/terminate")
        for s in snaps:
            c.delete(f"/v1/memory-snapshots/{s}")
        c.delete(f"/v1/volumes/{vol}", params={"force": "1"})


def test_a_chain_longer_than_one_overlay_mount_takes_is_a_409_naming_it_and_leaves_nothing(tmp_path):
    """mount(2) reads one page of options: a longer lowerdir list was cut short by the kernel, and overlayfs
    answered ELOOP for a lowerdir the cut made a prefix of another, or ENOENT (a fork of a fork ~70 deep: a 500).
    mount_root refuses such a chain before it makes anything; one that fits is mounted, every layer seen."""
    from hutch._core.errors import StateError
    from hutch.sandbox._host.gvisor import runtime as R

    layers = []
    for i in range(120):
        d = tmp_path / "layers" / f"l{i}"
        d.mkdir(parents=True)
        (d / f"f{i}").write_text("x")
        layers.append(d)
    gv = R.GvSandbox("forkvol-deep", tmp_path / "sb", network=False)
    try:
        with pytest.raises(StateError, match=r"chain of 120 layers.*more than one overlay mount takes here "
                                             r"\(about \d+\)"):
            R.mount_root(gv, layers, 1 << 20, 0, -1)
        assert not gv.dir.exists() and gv.mounts == []
    finally:
        R.unmount_root(gv)
    fits = 20
    try:
        R.mount_root(gv, layers[:fits], 1 << 20, 0, -1)
        assert sorted(os.listdir(gv.merged)) == sorted(f"f{i}" for i in range(fits))
    finally:
        R.unmount_root(gv)
    with open("/proc/self/mountinfo") as f:
        assert not any(str(tmp_path) in ln.split()[4] for ln in f)
