"""Fixtures: a small real store and a real FUSE mount of it, always unmounted and its server reaped."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest

import hutch
from hutch import fuse


class Mounted:
    """A live mount: `.path` (mount point), `.proc` (the server), `.mem` (the store)."""

    def __init__(self, mem, path, proc):
        self.mem, self.path, self.proc = mem, str(path), proc

    def p(self, *parts: str) -> str:
        return os.path.join(self.path, *parts)

    def close(self) -> None:
        if os.path.ismount(self.path):
            subprocess.run(["fusermount3", "-u", "-z", self.path], capture_output=True)
        if self.proc.poll() is None:
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.send_signal(signal.SIGKILL)
                self.proc.wait(5)
        deadline = time.monotonic() + 5
        while os.path.ismount(self.path) and time.monotonic() < deadline:
            time.sleep(0.02)


def make_store(path) -> hutch.Memory:
    mem = hutch.Memory(path)
    alice = mem.put("actors", "Alice Chen", body="Head of data at Acme.", facts=["prefers weekly reports"],
                    source="chat:1")
    acme = mem.put("orgs", "Acme", body="Acme worries about customer churn: clients cancel after onboarding.")
    mem.link(alice, "works_at", acme)
    mem.put("topics", "Pricing", body="Tiered pricing was decided in November.")
    return mem


@pytest.fixture
def store(tmp_path):
    return make_store(tmp_path / "store")


@pytest.fixture
def mounted(store, tmp_path):
    mp = tmp_path / "mnt"
    mp.mkdir()
    proc = fuse.mount(store.root, mp)
    m = Mounted(store, mp, proc)
    try:
        yield m
    finally:
        m.close()


@pytest.fixture
def mounted_ro(store, tmp_path):
    mp = tmp_path / "mnt-ro"
    mp.mkdir()
    proc = fuse.mount(store.root, mp, writable=False)
    m = Mounted(store, mp, proc)
    try:
        yield m
    finally:
        m.close()


# --- memory inside sandboxes (test_sandbox_memory.py, test_mount_attacks.py) ---------------------------------

@pytest.fixture(scope="module")
def daemon():
    """A private daemon for the module's sandboxes (the SDK points at it), stopped at the module's end."""
    from sandbox_support import private_daemon

    with private_daemon() as env:
        yield env


@pytest.fixture(scope="module")
def image(tmp_path_factory):
    """A busybox image for the module's sandboxes."""
    from sandbox_support import busybox_root

    return hutch.Image.from_directory(busybox_root(tmp_path_factory.mktemp("bbroot") / "root"))
