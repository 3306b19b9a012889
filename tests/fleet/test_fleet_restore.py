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
    deadline = time.monotonic() + 30
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
