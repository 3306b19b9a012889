"""A cordon is kept by its node (a file in the node's run directory): it outlives the node's daemon, the fleet's
controller and `hutch fleet up` again, and `--off` lasts as well."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

from fleet_support import GUARD, NODES, RUN_TAG

import hutch


def _cordoned(rows, key) -> bool:
    return next(r for r in rows if r["key"] == key)["cordoned"]


def test_a_cordon_outlives_the_daemon_the_controller_and_fleet_up(fleet_sdk, fleet_busybox):
    import ray

    from hutch.sandbox import _fleet

    victim = fleet_sdk.table()[0]
    key = victim["key"]
    fleet_sdk.cli("fleet", "cordon", "--ray", fleet_sdk.address, key)
    try:
        rows = fleet_sdk.wait(lambda rs: _cordoned(rs, key), what="the cordon")
        assert (Path(victim["run_dir"]) / "cordoned").exists()
        # the node's daemon dies and its agent starts another: still cordoned
        os.kill(victim["pid"], signal.SIGKILL)
        rows = fleet_sdk.wait(lambda rs: any(r["key"] == key and r["healthy"] and r["pid"] != victim["pid"]
                                             for r in rs), what="the daemon's restart")
        assert _cordoned(rows, key)
        # the controller dies (Ray starts it again, with an empty table): its agents tell it
        ctl = _fleet.controller("ray://auto")
        started = ray.get(ctl.ping.remote())["started"]
        ray.kill(ctl, no_restart=False)
        deadline = time.monotonic() + GUARD
        while time.monotonic() < deadline:
            try:
                if ray.get(ctl.ping.remote(), timeout=10)["started"] != started:
                    break
            except Exception:   # restarting
                pass
            time.sleep(0.3)
        else:
            raise AssertionError(f"the controller was not restarted in {GUARD:.0f} s")
        rows = fleet_sdk.wait(lambda rs: len(rs) == NODES and all(r["healthy"] for r in rs),
                              what="the restarted controller's table")
        assert _cordoned(rows, key) and sum(r["cordoned"] for r in rows) == 1
        # `hutch fleet up` again: the same fleet, the same cordon
        again = json.loads(fleet_sdk.cli("fleet", "up", "--ray", fleet_sdk.address, "--json"))
        assert _cordoned(again, key)
        time.sleep(1.2)   # our table is at most 1 s old
        sbs = [hutch.Sandbox.create(image=hutch.Image.from_directory(fleet_busybox), timeout=120,
                                    tags={**RUN_TAG, "t": "cordon"}) for _ in range(6)]
        assert not [sb.id for sb in sbs if sb.id.startswith(key + "-")]
        for sb in sbs:
            sb.terminate()
    finally:
        fleet_sdk.cli("fleet", "cordon", "--ray", fleet_sdk.address, "--off", key)
    rows = fleet_sdk.wait(lambda rs: not _cordoned(rs, key), what="the cordon's end")
    assert not (Path(victim["run_dir"]) / "cordoned").exists()
    pid = next(r for r in rows if r["key"] == key)["pid"]
    os.kill(pid, signal.SIGKILL)   # --off outlives a restart too
    fleet_sdk.wait(lambda rs: any(r["key"] == key and r["healthy"] and r["pid"] != pid for r in rs)
                   and not _cordoned(rs, key), what="the daemon's restart, uncordoned")
