"""gVisor memory snapshots through the fleet: a snapshot stays on the node that took it, and `Sandbox.restore`
goes to that node (not to the fleet's first), from this process and another."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import pytest
from fleet_support import RUN_TAG

import hutch

pytestmark = pytest.mark.skipif(shutil.which("runsc") is None, reason="runsc is not installed (scripts/setup.sh)")

COUNTER = "i=0; while :; do i=$((i+1)); echo $i > /tmp/n.tmp; mv /tmp/n.tmp /tmp/n; sleep 0.02; done"


def _n(sb) -> int:
    deadline = time.monotonic() + 120
    while True:
        try:
            return int(sb.files.read("/tmp/n"))
        except (hutch.NotFoundError, ValueError):
            assert time.monotonic() < deadline, "the counter never wrote"
            time.sleep(0.05)


def test_restore_goes_to_the_node_that_holds_the_snapshot(fleet_sdk, fleet_busybox):
    from hutch.sandbox import _client

    fl = _client.default_client().fleet
    home = fl.home_node().key   # where calls about no sandbox go: the snapshot must not be there
    fleet_sdk.cli("fleet", "cordon", "--ray", fleet_sdk.address, home)
    try:
        fleet_sdk.wait(lambda rs: any(r["key"] == home and r["cordoned"] for r in rs), what="the cordon")
        time.sleep(1.2)
        src = hutch.Sandbox.create("sh", "-c", COUNTER, image=hutch.Image.from_directory(fleet_busybox),
                                   runtime="gvisor", timeout=120, tags={**RUN_TAG, "t": "restore"})
    finally:
        fleet_sdk.cli("fleet", "cordon", "--ray", fleet_sdk.address, "--off", home)
    holder = src.id.split("-")[0]
    assert holder != home
    try:
        _n(src)
        snap = src.snapshot_memory()
        at = _n(src)
        copy = hutch.Sandbox.restore(snap, tags={**RUN_TAG, "t": "restore"})
        try:
            assert copy.id.startswith(holder + "-")           # on the snapshot's node
            n1 = _n(copy)
            time.sleep(0.3)
            assert _n(copy) > n1 and n1 <= at + 50             # it carries on from the snapshot's count
            assert hutch.Snapshot.from_id(snap.id).id == snap.id   # looked up on its node too
        finally:
            copy.terminate()
        # another process, with nothing but the snapshot's id
        code = ("import hutch; hutch.connect('ray://auto'); "
                f"c = hutch.Sandbox.restore({snap.id!r}, tags={{**{RUN_TAG!r}, 't': 'restore'}}); "
                "print(c.id, flush=True); c.terminate()")
        out = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, RAY_ADDRESS=fleet_sdk.address),
                             capture_output=True, text=True, timeout=180)
        assert out.returncode == 0, out.stderr[-3000:]
        assert out.stdout.strip().startswith(holder + "-")
        with pytest.raises(hutch.NotFoundError, match="no memory snapshot"):
            hutch.Sandbox.restore("0" * 32)
    finally:
        src.terminate()


def _node_client(row):
    from hutch.sandbox import _client

    return _client.Client(_client.Endpoint(url="", socket_path=row["socket"]))


def _forged(archive: bytes) -> bytes:
    """The archive with one byte of its memory image changed and the manifest's sha256 of that file made to
    match: every member checks out against the manifest, only the snapshot's digest tells."""
    import hashlib
    import io
    import json
    import tarfile

    with tarfile.open(fileobj=io.BytesIO(archive), mode="r:") as src:
        members = [(m, src.extractfile(m).read()) for m in src.getmembers()]
    manifest = json.loads(members[0][1])
    name = next(n for n in sorted(manifest["mem"]) if manifest["mem"][n]["size"])
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as dst:
        for i, (m, data) in enumerate(members):
            if m.name == f"mem/{name}":
                data = bytes([data[0] ^ 1]) + data[1:]
                manifest["mem"][name]["sha256"] = hashlib.sha256(data).hexdigest()
                members[0] = (members[0][0], json.dumps(manifest).encode())
        for m, data in members:
            m.size = len(data)
            dst.addfile(m, io.BytesIO(data))
    return out.getvalue()


def test_a_restore_on_a_node_that_lacks_the_snapshot_fetches_it_by_digest(fleet_sdk, fleet_busybox):
    """The node holding a snapshot is cordoned: a restore goes to another node, which imports the snapshot from
    the holder, told its digest, under the same id; the fleet lists it once and deletes every copy. An import
    told a digest refuses an archive of another snapshot (a forged memory file whose manifest sha256 matches),
    and keeps nothing of it."""
    rows = {r["key"]: r for r in fleet_sdk.table()}
    src = hutch.Sandbox.create("sh", "-c", COUNTER, image=hutch.Image.from_directory(fleet_busybox),
                               runtime="gvisor", timeout=120, tags={**RUN_TAG, "t": "move"})
    holder = src.id.split("-")[0]
    snap = None
    try:
        while (counted := _n(src)) < 100:   # a count a fresh start would take seconds to reach
            time.sleep(0.1)
        snap = src.snapshot_memory()
        src.terminate()
        h = _node_client(rows[holder])
        want = h.json("GET", f"/v1/memory-snapshots/{snap.id}/digest")
        assert want["id"] == snap.id and len(want["digest"]) == 64
        assert h.json("GET", f"/v1/memory-snapshots/{snap.id}/digest") == want   # the same every time
        others = [k for k in rows if k != holder]
        for k in others:   # no other node has it yet
            with pytest.raises(hutch.NotFoundError):
                _node_client(rows[k]).json("GET", f"/v1/memory-snapshots/{snap.id}")

        # a forged archive (consistent with its own manifest) is refused by the digest, nothing kept
        archive = b"".join(h.request("GET", f"/v1/memory-snapshots/{snap.id}/export", stream=True).iter_bytes())
        forged = _forged(archive)
        victim = _node_client(rows[others[0]])
        store = fleet_sdk.state_root / others[0] / "memory-snapshots"
        before = sorted(p.name for p in store.iterdir()) if store.is_dir() else []
        with pytest.raises(hutch.InvalidArchiveError, match="not the memory snapshot of digest"):
            victim.json("POST", "/v1/memory-snapshots/import", params={"digest": want["digest"]}, content=forged)
        with pytest.raises(hutch.InvalidArchiveError, match="not the memory snapshot of digest"):
            victim.json("POST", "/v1/memory-snapshots/import", params={"digest": "0" * 64}, content=archive)
        with pytest.raises(hutch.ConfigError, match="64-hex-digit digest"):
            victim.json("POST", "/v1/memory-snapshots/import", params={"digest": "x"}, content=archive)
        with pytest.raises(hutch.NotFoundError):
            victim.json("GET", f"/v1/memory-snapshots/{snap.id}")
        assert (sorted(p.name for p in store.iterdir()) if store.is_dir() else []) == before

        # the holder cordoned: the restore is placed elsewhere and the snapshot moved there
        fleet_sdk.cli("fleet", "cordon", "--ray", fleet_sdk.address, holder)
        try:
            fleet_sdk.wait(lambda rs: any(r["key"] == holder and r["cordoned"] for r in rs), what="the cordon")
            time.sleep(1.2)   # the SDK's table is at most REFRESH old
            copy = hutch.Sandbox.restore(snap, tags={**RUN_TAG, "t": "move"})
        finally:
            fleet_sdk.cli("fleet", "cordon", "--ray", fleet_sdk.address, "--off", holder)
        try:
            there = copy.id.split("-")[0]
            assert there != holder
            n1 = _n(copy)
            time.sleep(0.3)
            assert _n(copy) > n1 >= counted   # it carries on from the snapshot's count (at least `counted`)
        finally:
            copy.terminate()
        moved = _node_client(rows[there])
        assert moved.json("GET", f"/v1/memory-snapshots/{snap.id}/digest") == want   # the same snapshot, same id
        assert [s.id for s in hutch.Snapshot.list()].count(snap.id) == 1
        hutch.Snapshot.of(snap.id).delete()
        snap = None
        for k in (holder, there):
            with pytest.raises(hutch.NotFoundError):
                _node_client(rows[k]).json("GET", f"/v1/memory-snapshots/{want['id']}")
    finally:
        src.terminate()
        if snap is not None:
            try:
                hutch.Snapshot.of(snap.id).delete()
            except hutch.NotFoundError:
                pass
