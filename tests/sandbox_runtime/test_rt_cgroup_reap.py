"""Cgroup parents: a daemon killed outright is cleaned up by the next daemon of any instance, never a live one's;
a clean run leaves nothing under any controller (runsc makes its cgroups under all of them)."""

from __future__ import annotations

import os
import shutil
import secrets
import time
from pathlib import Path

import pytest

from hutch.sandbox._host.native import cgroups as cg
from rt_support import Api, Daemon

ROOT = Path("/sys/fs/cgroup")


def parents(parent: str) -> list[str]:
    """Every directory named `parent` under any hierarchy the host mounts."""
    return sorted(str(d / parent) for d in ROOT.iterdir() if (d / parent).is_dir())


def wait_for(cond, timeout: float, what: str):
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


@pytest.fixture
def daemons(tmp_path):
    made: list[Daemon] = []

    def make(name: str) -> Daemon:
        d = Daemon(tmp_path / name / "run")
        made.append(d)
        return d.start()

    try:
        yield make
    finally:
        for d in made:
            d.stop()
            d.cleanup_cgroups()


def test_a_killed_daemons_cgroups_go_when_another_daemon_starts_and_a_live_ones_stay(daemons, image):
    live = daemons("live")
    live_api = Api(live.sock, live.run_dir)
    killed = daemons("killed")
    api = Api(killed.sock, killed.run_dir)
    try:
        sb = live_api.create(image, timeout=300)
        api.create(image, timeout=300)
        live_dirs = parents(live.cgroup_parent)
        assert parents(killed.cgroup_parent) and len(live_dirs) >= 4
        killed.kill9()   # by its pid: no shutdown ran, its sandboxes die with its zygote
        wait_for(lambda: not any(cg._populated(Path(p)) for p in parents(killed.cgroup_parent)), 20,
                 "the killed daemon's sandboxes to die")
        left = parents(killed.cgroup_parent)
        assert left, "a daemon killed outright leaves its cgroup parents (what is reaped here)"
        time.sleep(cg.REAP_QUIET + 0.5)   # what a reaper waits for: no daemon is starting in them
        daemons("reaper")                 # a daemon of another instance starts
        assert parents(killed.cgroup_parent) == [], parents(killed.cgroup_parent)
        assert parents(live.cgroup_parent) == live_dirs   # the live instance keeps everything
        out, _, res = live_api.sh(sb["id"], "echo still here")
        assert out == "still here\n" and res["returncode"] == 0
    finally:
        api.close()
        live_api.close()
        if killed.proc.poll() is not None:   # its own restart reaps the rest it left (records, netns, tables)
            killed.start()


def test_a_free_lock_is_not_enough_nor_is_a_held_lock_on_empty_cgroups():
    """Unit level, real cgroups of this host: an instance whose lock is held is never reaped, however empty
    and old its cgroups; one whose lock is free but whose cgroups changed within REAP_QUIET is not either."""
    held = cg.Cgroups(f"hutch-{secrets.token_hex(4)}")
    fresh = cg.Cgroups(f"hutch-{secrets.token_hex(4)}")
    reaper = cg.Cgroups(f"hutch-{secrets.token_hex(4)}")
    try:
        held.hold_instance()
        held.setup()
        fresh.setup()   # no lock: its daemon is gone (or predates the lock), but it was just made
        old = time.time() - 3600
        for d in parents(held.parent):
            for p in [Path(d), *[c for c in Path(d).iterdir() if c.is_dir()]]:
                os.utime(p, (old, old))
        reaper.hold_instance()
        assert held.parent not in reaper.reap_dead_instances()
        assert fresh.parent not in reaper.reap_dead_instances()
        assert parents(held.parent) and parents(fresh.parent)
        held.release_instance()   # now it is a dead instance's: free lock, empty, unchanged for an hour
        assert held.parent in reaper.reap_dead_instances()
        assert parents(held.parent) == []
    finally:
        for c in (held, fresh, reaper):
            c.release_instance()
            for p in parents(c.parent):
                cg._remove_tree(Path(p), deadline=2.0)


def test_a_clean_run_leaves_no_cgroup_under_any_controller(daemons, image):
    d = daemons("clean")
    api = Api(d.sock, d.run_dir)
    try:
        sb = api.create(image)
        api.sh(sb["id"], "true")
        if shutil.which("runsc"):   # gVisor's runsc makes the sandbox's cgroups under every controller
            g = api.create(image, runtime="gvisor")
            out, _, _ = api.sh(g["id"], "echo gvisor")
            assert out == "gvisor\n"
        made = parents(d.cgroup_parent)
        assert len(made) >= 4, made
    finally:
        api.close()   # terminates them
    d.stop()
    assert parents(d.cgroup_parent) == []
