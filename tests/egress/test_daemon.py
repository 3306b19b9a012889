"""The gateway inside the real daemon: sandboxes made through the SDK get the policy they ask for.

The daemon runs inside the suite's fake "host" netns (so its gateway's veths,
rules and upstream DNS all live among the test's own namespaces), on a
private socket, with a busybox root as the image.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time

import pytest
from egress_world import daemon_in_world
from hutch_testing import temp_busybox_root

import hutch
from hutch import Network

BUSYBOX = shutil.which("busybox")


@pytest.fixture(scope="module")
def busybox_root():
    if BUSYBOX is None:
        pytest.skip("busybox-static is not installed (scripts/debian-packages.txt lists it)")
    with temp_busybox_root("hutch-egress-root-", BUSYBOX) as root:
        # a hostile image: resolv.conf points at a host file; the daemon must not write through it
        os.symlink("/etc/hutch-egress-must-not-exist", root / "etc" / "resolv.conf")
        yield root


@pytest.fixture(scope="module", params=["default", "opt-out"])
def daemon(world, request):
    """The daemon, once as it runs by default (sandboxes in user namespaces) and once with HUTCH_USERNS=0."""
    with daemon_in_world(world, "198.18.1.0/24", request.param) as run_dir:
        yield run_dir


def host_links(world) -> list[str]:
    out = subprocess.run(["ip", "-n", world.host, "-o", "link"], capture_output=True, text=True).stdout
    return [ln.split(":")[1].strip().split("@")[0] for ln in out.splitlines()]


def fetch(sb, url):
    r = sb.run("wget", "-O", "-", url, timeout=20)
    return json.loads(r.stdout) if r.returncode == 0 else None


def test_sdk_sandbox_gets_its_policy_and_can_change_it(daemon, world, busybox_root, request):
    before = set(host_links(world))
    sb = hutch.Sandbox.create(image=hutch.Image.from_directory(busybox_root), timeout=120,
                              network=Network.allow(domains=["www.example.test"]))
    try:
        host_root = sb.run("cat", "/proc/self/uid_map").stdout.split()[1]
        assert (host_root == "0") == (request.node.callspec.params["daemon"] == "opt-out"), host_root
        assert fetch(sb, "http://www.example.test/")["server"] == "192.0.2.10"
        assert fetch(sb, "http://api.example.test/") is None
        assert fetch(sb, "http://203.0.113.10/") is None
        assert not os.path.exists("/etc/hutch-egress-must-not-exist")
        log = sb.network_log()
        assert any(d["name"] == "www.example.test" and d["verdict"] == "allow" for d in log)
        assert any(d["name"] == "api.example.test" and d["verdict"] == "deny" for d in log)
        assert set(log[0]) == {"time", "name", "address", "port", "protocol", "verdict", "reason"}
        from click.testing import CliRunner

        from hutch.cli import cli
        out = CliRunner().invoke(cli, ["sandbox", "netlog", sb.id])
        assert out.exit_code == 0 and "api.example.test" in out.output and "deny" in out.output, out.output

        sb.set_network(Network.allow(domains=["api.example.test"]))
        assert fetch(sb, "http://api.example.test/")["server"] == "198.51.100.10"
        assert fetch(sb, "http://www.example.test/") is None

        sb.set_network(Network.none())
        assert "eth0" not in sb.run("cat", "/proc/net/dev").stdout
        with pytest.raises(hutch.NetworkPolicyError):
            sb.set_network(Network.from_dict({"mode": "allow", "domains": ["bad name"]}))
        # the daemon validates what arrives over HTTP just as strictly, naming the entry
        from hutch.sandbox import _client
        for bad, needle in (({"mode": "allow", "domains": ["bad name"]}, "bad name"),
                            ({"mode": "allow", "cidrs": ["10.0.0.0/33"]}, "10.0.0.0/33"),
                            ({"mode": "wide"}, "wide")):
            with pytest.raises(hutch.NetworkPolicyError, match=needle):
                _client.default_client().json("PUT", f"/v1/sandboxes/{sb.id}/network", json={"network": bad})
    finally:
        sb.terminate()
    assert wait_gone(world, before)


def test_sdk_sandbox_without_network_can_be_given_one(daemon, world, busybox_root):
    before = set(host_links(world))
    sb = hutch.Sandbox.create(image=hutch.Image.from_directory(busybox_root), timeout=120)
    try:
        assert "eth0" not in sb.run("cat", "/proc/net/dev").stdout
        assert set(host_links(world)) == before
        sb.set_network(Network.allow(domains=["www.example.test"]))
        assert fetch(sb, "http://www.example.test/")["server"] == "192.0.2.10"
    finally:
        sb.terminate()
    assert wait_gone(world, before)


def test_sdk_network_log_counts_what_it_does_not_list(daemon, world, busybox_root):
    sb = hutch.Sandbox.create(image=hutch.Image.from_directory(busybox_root), timeout=120,
                              network=Network.allow(domains=["www.example.test"]))
    try:
        assert fetch(sb, "http://api.example.test/") is None                  # the refusal an auditor wants
        r = sb.run("sh", "-c", "for i in $(seq 150); do nslookup j$i.junk.test >/dev/null 2>&1; done; true",
                   timeout=60)
        assert r.returncode == 0, r.stderr
        log = sb.network_log()
        assert isinstance(log, hutch.NetworkLog)
        assert any(d["name"] == "api.example.test" and d["verdict"] == "deny" for d in log)
        kept = sum(1 for d in log if d["verdict"] == "deny" and d["protocol"] != "policy")
        assert log.dropped["refused"] > 0 and log.seen["refused"] == kept + log.dropped["refused"], log.seen
        junk = [x for x in log.refusals_by_reason if x["reason"] == "<name> is not in the allowed domains"]
        assert junk and junk[0]["count"] >= 150, log.refusals_by_reason
        assert "dns_over_rate" in log.limits
        from click.testing import CliRunner

        from hutch.cli import cli
        out = CliRunner().invoke(cli, ["sandbox", "netlog", sb.id])
        assert out.exit_code == 0, out.output
        assert "not listed above" in out.output and "refused, by reason" in out.output, out.output
        out = CliRunner().invoke(cli, ["sandbox", "netlog", sb.id, "--json"])
        as_json = json.loads(out.output)
        assert as_json["dropped"] == log.dropped and as_json["refusals_by_reason"] == list(log.refusals_by_reason)
    finally:
        sb.terminate()


def wait_gone(world, before, timeout=5.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if set(host_links(world)) <= before:
            return True
        time.sleep(0.05)
    return False
