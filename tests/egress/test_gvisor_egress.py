"""The egress gateway holds for runtime="gvisor" sandboxes, and in each copy restored from one: gVisor's
netstack on the link the gateway plumbed (a plain /32), the host rules deciding as for a native sandbox."""

from __future__ import annotations

import json
import shutil

import pytest
from egress_world import daemon_in_world
from hutch_testing import temp_busybox_root

import hutch
from hutch import Network

pytestmark = pytest.mark.skipif(shutil.which("runsc") is None or shutil.which("busybox") is None,
                                reason="runsc and busybox-static are needed (scripts/setup.sh)")


@pytest.fixture(scope="module")
def busybox_root():
    with temp_busybox_root("hutch-egress-gv-root-", shutil.which("busybox")) as root:
        yield root


@pytest.fixture(scope="module")
def daemon(world):
    with daemon_in_world(world, "198.18.1.0/24", "default") as run_dir:
        yield run_dir


def fetch(sb, url):
    """GET through busybox nc (busybox's wget segfaults under gVisor's systrap here): the JSON body, or None."""
    host = url.split("/")[2]
    r = sb.run("sh", "-c", f"printf 'GET / HTTP/1.0\\r\\nHost: {host}\\r\\n\\r\\n' | nc -w 5 {host} 80", timeout=20)
    head, sep, body = r.stdout.partition("\r\n\r\n")
    return json.loads(body) if sep and " 200 " in head.split("\r\n")[0] else None


def _snapshot_soon(sb):
    """A snapshot right after the sandbox's connections: refused with StateError while netstack keeps one."""
    snap = sb.snapshot_memory()
    snap.delete()


def test_policy_holds_in_a_gvisor_sandbox_and_its_restored_copy(daemon, world, busybox_root):
    sb = hutch.Sandbox.create(image=hutch.Image.from_directory(busybox_root), timeout=120, runtime="gvisor",
                              network=Network.allow(domains=["www.example.test"]))
    made = [sb]
    try:
        # snapshotted before any connection: gVisor saves no TCP endpoint that is not closed (StateError)
        snap = sb.snapshot_memory()
        copy = hutch.Sandbox.restore(snap)
        made.append(copy)
        snap.delete()
        for s in (sb, copy):
            assert fetch(s, "http://www.example.test/")["server"] == "192.0.2.10"
            assert fetch(s, "http://api.example.test/") is None
            assert fetch(s, "http://203.0.113.10/") is None
        assert any(d["name"] == "api.example.test" and d["verdict"] == "deny" for d in sb.network_log())
        assert any(d["name"] == "www.example.test" and d["verdict"] == "allow" for d in copy.network_log())
        with pytest.raises(hutch.StateError, match="open network connection"):
            _snapshot_soon(sb)
        sb.set_network(Network.allow(domains=["api.example.test"]))   # host-side: changes the source only
        assert fetch(sb, "http://api.example.test/")["server"] == "198.51.100.10"
        assert fetch(copy, "http://api.example.test/") is None
    finally:
        for s in made:
            s.terminate()


def test_a_gvisor_sandbox_without_network_cannot_be_given_one(daemon, world, busybox_root):
    sb = hutch.Sandbox.create(image=hutch.Image.from_directory(busybox_root), timeout=120, runtime="gvisor")
    try:
        with pytest.raises(hutch.UnsupportedError, match="network="):
            sb.set_network(Network.allow(domains=["www.example.test"]))
    finally:
        sb.terminate()
