"""Two daemons with the same run-dir path in two mount namespaces (as a daemon in a container or a chroot
beside one on the host) share the host's cgroup tree, network stack and uid space, and keep apart: each
names what it makes from its own instance id, reaps only that, and hands out uid ranges the other does not.

Both run in the suite's fake host netns (nsenter), each in a mount namespace of its own with a private
tmpfs on /run, where its run directory is; their sockets are outside, where the test reaches them.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from egress_world import DNS_ADDR, SUBNET, sh
from hutch_testing import restore_env, stop_daemon, temp_busybox_root

import hutch
from hutch import Network
from hutch.sandbox._client import Endpoint, _ping

RUN_DIR = "/run/hutch-twin"     # the same path for both; not the default one, whatever the code under test does
CGROUP = Path("/sys/fs/cgroup")


class Twin:
    """A mount namespace (held by a sleeping process) with its own /run, and a daemon in it."""

    def __init__(self, world, tmp: Path, name: str):
        self.world, self.tmp, self.name = world, tmp, name
        self.sock = tmp / f"{name}.sock"
        self.log = tmp / f"{name}.log"
        self.holder = subprocess.Popen(
            ["nsenter", f"--net=/run/netns/{world.host}", "unshare", "-m", "--propagation", "private", "sh", "-c",
             "mount -t tmpfs -o mode=0755,size=16m twinrun /run && echo ready && exec sleep 3600"],
            stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
        if self.holder.stdout.readline().strip() != "ready":
            raise RuntimeError("the mount namespace could not be set up")
        self.proc: subprocess.Popen | None = None

    def start(self) -> "Twin":
        env = {k: v for k, v in os.environ.items() if not k.startswith("HUTCH_")}
        env.update(HUTCH_RUN_DIR=RUN_DIR, HUTCH_SOCKET=str(self.sock), HUTCH_EGRESS_RESOLVERS=DNS_ADDR,
                   HUTCH_STATE_DIR=str(self.tmp / f"{self.name}-state"))
        with open(self.log, "ab") as lf:
            self.proc = subprocess.Popen(["nsenter", "-t", str(self.holder.pid), "-m", "-n", sys.executable, "-m",
                                          "hutch", "serve"], env=env, cwd="/", stdin=subprocess.DEVNULL, stdout=lf,
                                         stderr=lf, start_new_session=True)
        deadline = time.monotonic() + 30
        while not _ping(Endpoint(socket_path=str(self.sock)), 1.0):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"daemon {self.name} did not start:\n{self.log.read_text()[-3000:]}")
            time.sleep(0.05)
        return self

    @property
    def instance(self) -> str:
        return Path(f"/proc/{self.holder.pid}/root{RUN_DIR}/instance-id").read_text().strip()

    def create(self, **kw):
        saved = {k: os.environ.get(k) for k in ("HUTCH_SOCKET", "HUTCH_RUN_DIR", "HUTCH_URL", "HUTCH_TOKEN")}
        os.environ.update(HUTCH_SOCKET=str(self.sock), HUTCH_RUN_DIR=str(self.tmp / f"{self.name}-client"))
        os.environ.pop("HUTCH_URL", None)
        os.environ.pop("HUTCH_TOKEN", None)
        try:
            return hutch.Sandbox.create(detach=True, timeout=300, **kw)
        finally:
            restore_env(saved)

    def close(self) -> None:
        if self.proc is not None:
            stop_daemon(self.proc)
        self.holder.kill()
        self.holder.wait()
        self.holder.stdout.close()


def cgroup_dirs(instance: str) -> list[Path]:
    roots = [CGROUP] if (CGROUP / "cgroup.controllers").exists() else [CGROUP / c for c in ("memory", "pids", "cpu")]
    return [r / f"hutch-{instance}" for r in roots if (r / f"hutch-{instance}").exists()]


def host_links(world) -> list[str]:
    out = sh("ip", "-n", world.host, "-o", "link").stdout
    return [ln.split(":")[1].strip().split("@")[0] for ln in out.splitlines()]


def host_tables(world) -> str:
    return sh("ip", "netns", "exec", world.host, "nft", "list", "tables").stdout


def fetch(sb) -> dict | None:
    r = sb.run("wget", "-q", "-O", "-", "http://www.example.test/", timeout=30)
    return json.loads(r.stdout) if r.returncode == 0 else None


def uid_base(sb) -> int:
    inside, base, count = sb.run("cat", "/proc/self/uid_map").stdout.split()
    assert (inside, count) == ("0", "65536")
    return int(base)


def gateway(sb) -> str:
    return re.search(r"nameserver (\S+)", sb.run("cat", "/etc/resolv.conf").stdout).group(1)


@pytest.fixture(scope="module")
def image():
    if shutil.which("busybox") is None:
        pytest.skip("busybox-static is not installed (scripts/debian-packages.txt lists it)")
    with temp_busybox_root("hutch-twin-root-") as root:
        yield hutch.Image.from_directory(root)


def test_two_daemons_with_one_run_dir_path_keep_apart(world, image, tmp_path):
    allow = Network.allow(domains=["www.example.test"])
    a = Twin(world, tmp_path, "a")
    b = Twin(world, tmp_path, "b")
    a_id = None
    try:
        a.start()
        sa = [a.create(image=image, network=allow), a.create(image=image)]
        b.start()   # starting up (and reaping what its predecessor left), b leaves a's sandboxes alone
        assert a.instance != b.instance
        for s in sa:
            assert s.run("echo", "alive").stdout == "alive\n"
        sb = [b.create(image=image, network=allow), b.create(image=image)]
        for s in (sa[0], sb[0]):
            assert fetch(s)["server"] == "192.0.2.10"
        # every host-wide name is the instance's own: subnets, links, tables, cgroups, uid ranges
        gw_a, gw_b = gateway(sa[0]), gateway(sb[0])
        assert gw_a != gw_b
        assert not {ipaddress.IPv4Address(gw_a), ipaddress.IPv4Address(gw_b)} & set(ipaddress.IPv4Network(SUBNET)), \
            "a daemon took the subnet of the suite's own gateway"
        links = host_links(world)
        assert any(n.startswith(f"hv{a.instance[:5]}") for n in links), links
        assert any(n.startswith(f"hv{b.instance[:5]}") for n in links), links
        assert f"hutch_egress_{a.instance}" in host_tables(world) and f"hutch_egress_{b.instance}" in host_tables(world)
        assert cgroup_dirs(a.instance) and cgroup_dirs(b.instance)
        bases = [uid_base(s) for s in sa + sb]
        assert len(set(bases)) == 4, f"two sandboxes share a host uid range: {bases}"

        # a crashes and comes back (the same instance: it reaps its own leftovers, nothing of b's)
        a_id = a.instance
        os.kill(a.proc.pid, signal.SIGKILL)
        a.proc.wait()
        a.start()
        assert a.instance == a_id
        for s in sb:
            assert s.run("echo", "alive").stdout == "alive\n"
        assert fetch(sb[0])["server"] == "192.0.2.10"
        assert sb[0].network_log()
        after = a.create(image=image, network=allow)
        assert fetch(after)["server"] == "192.0.2.10"
        assert gateway(after) == gw_a, "a restarted instance takes its subnet again"
        assert uid_base(after) not in [uid_base(s) for s in sb]

        # b stops for good: a's sandbox lives on, b leaves nothing behind
        b_id = b.instance
        b.close()
        assert after.run("echo", "alive").stdout == "alive\n"
        assert fetch(after)["server"] == "192.0.2.10"
        assert not cgroup_dirs(b_id)
        assert not [n for n in host_links(world) if n.startswith(f"hv{b_id[:5]}")]
        assert f"hutch_egress_{b_id}" not in host_tables(world)
    finally:   # a daemon's stop ends its sandboxes (a terminate() through the SDK could autostart a daemon)
        b.close()
        a.close()
    assert not cgroup_dirs(a_id)
    assert not [n for n in host_links(world) if n.startswith(f"hv{a_id[:5]}")]
    assert f"hutch_egress_{a_id}" not in host_tables(world)


def test_a_gateway_takes_only_a_subnet_nothing_on_the_host_uses(world):
    from egress_world import GatewayThread

    from hutch._core.errors import SandboxError

    # in use: the suite's own gateway (its table names 198.18.0.0/24), and a route
    candidates = ["198.18.0.0/20", "198.18.48.0/20", "198.18.64.0/20"]
    sh("ip", "-n", world.host, "route", "add", "blackhole", "198.18.50.0/24")
    gw = None
    try:
        gw = GatewayThread(world.host, upstream_resolvers=[DNS_ADDR], subnets=candidates, table="hutch_egress_probe",
                           link_prefix="hvprobe")
        assert gw.gw.gateway_address == "198.18.64.1"
        with pytest.raises(SandboxError, match="no egress subnet is free") as e:
            GatewayThread(world.host, upstream_resolvers=[DNS_ADDR], subnets=candidates, table="hutch_egress_probe2",
                          link_prefix="hvprob2")
        why = str(e.value)
        assert "198.18.0.0/20: the egress gateway of table inet hutch_egress_test" in why, why
        assert "198.18.48.0/20: a route to 198.18.50.0/24" in why, why
        assert "198.18.64.0/20: the egress gateway of table inet hutch_egress_probe" in why, why
        assert "hutch_egress_probe2" not in host_tables(world)
    finally:
        if gw is not None:
            gw.close()
        sh("ip", "-n", world.host, "route", "del", "blackhole", "198.18.50.0/24", check=False)
