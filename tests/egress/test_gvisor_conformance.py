"""The egress conformance suite (test_conformance.py) against runtime="gvisor" sandboxes: the same tests, the
`sandbox` fixture giving each a real gVisor sandbox of the real daemon (in the fake host's netns) instead of a
bare network namespace. Clients are the host's curl and python3 (its /usr bound read-only into a busybox root),
run inside the sentry: gVisor's netstack on the link the daemon's gateway plumbed.

Left out, with the reason: the tests of the gateway itself (detach, a second gateway, reaping links, machines
of the internet side), which do not depend on the runtime, and those that give the attacker CAP_NET_ADMIN in
its netns (a gVisor sandbox's netns is the sentry's netstack, which has no nftables to flush).
"""

from __future__ import annotations

import ipaddress
import shutil
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from egress_world import daemon_in_world, wait_for
from hutch_testing import make_busybox_root

import hutch
import test_conformance as conf

pytestmark = pytest.mark.skipif(shutil.which("runsc") is None or shutil.which("busybox") is None
                                or not Path("/usr/bin/python3").exists() or shutil.which("curl") is None,
                                reason="runsc, busybox-static, curl and python3 are needed (scripts/setup.sh)")

SUBNET = "198.18.11.0/24"
GW = str(ipaddress.ip_network(SUBNET).network_address + 1)

SKIPPED = {
    "test_detach_leaves_nothing", "test_a_second_gateway_that_cannot_start_leaves_the_first_ones_rules",
    "test_start_reaps_links_a_crashed_gateway_left", "test_other_machines_cannot_use_the_gateway",
    "test_host_side_rules_hold_even_if_the_sandbox_rules_are_gone",
    # gVisor's versions below: the listener or client runs in the netns from the host there; the sentry has no
    # /proc/sys/net/ipv6 and shows lo's routes; Network.none() keeps the link (netstack took it over at start)
    "test_another_sandbox_is_unreachable", "test_policy_change_resets_a_now_forbidden_open_connection",
    "test_ipv6_out_is_impossible", "test_none_sandbox_has_no_route_at_all",
    "test_set_policy_none_removes_the_link_and_allow_brings_it_back",
}
for _name in dir(conf):
    if _name.startswith("test_") and _name not in SKIPPED:
        globals()[_name] = getattr(conf, _name)


@pytest.fixture(scope="module")
def gv_root():
    tmp = Path(tempfile.mkdtemp(prefix="hutch-egress-gvconf-"))
    try:
        root = make_busybox_root(tmp / "root", shutil.which("busybox"))
        (root / "lib").symlink_to("usr/lib")
        (root / "lib64").symlink_to("usr/lib64")
        yield root
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture(scope="module")
def gv_daemon(world):
    with daemon_in_world(world, SUBNET, "default") as run_dir:
        yield run_dir


@pytest.fixture(autouse=True)
def _daemons_gateway(monkeypatch):
    """The suite's tests name the gateway's address (GW): here it is the daemon's gateway's."""
    monkeypatch.setattr(conf, "GW", GW)


class GvSandbox:
    """What the suite calls on a sandbox, for a hutch gVisor sandbox."""

    def __init__(self, sb: "hutch.Sandbox", world):
        self.sb, self.world, self.id = sb, world, sb.id

    def run(self, *argv, timeout=20, caps=False, check=False, input=None):
        assert not caps, "a gVisor sandbox's commands have no capabilities to give"
        if argv and argv[0] == sys.executable:   # the suite's clients are this interpreter: inside, the host's
            argv = ("/usr/bin/python3", *argv[1:])
        r = self.sb.run(*argv, timeout=timeout, stdin=input if input is not None else False)
        if check and r.returncode:
            raise AssertionError(f"{argv} failed ({r.returncode}): {r.stderr}")
        return r

    def py(self, code, timeout=20, **kw):
        return self.run("/usr/bin/python3", "-c", code, timeout=timeout, **kw)

    def curl(self, *args, timeout=20):
        return self.run("curl", "-sS", "--max-time", "8", "--cacert", str(self.world.ca), *args, timeout=timeout)

    @property
    def address(self):
        out = self.run("ip", "-o", "-4", "addr", "show", "dev", "eth0").stdout
        return out.split(" inet ")[1].split("/")[0]

    def set_policy(self, policy):
        self.sb.set_network(policy)

    def log(self):
        return [SimpleNamespace(**d) for d in self.sb.network_log()]

    @property
    def etc(self):
        return _Etc(self.sb)


class _Etc:
    """`sb.etc / "hosts"`: the sandbox's own /etc (the suite writes a forged hosts file there)."""

    def __init__(self, sb):
        self.sb = sb

    def __truediv__(self, name):
        sb = self.sb
        return SimpleNamespace(write_text=lambda text: sb.files.write(f"/etc/{name}", text))


@pytest.fixture
def sandbox(world, gv_daemon, gv_root):
    made = []

    def make(policy, attach=True):
        assert attach, "a hutch sandbox is always attached"
        sb = hutch.Sandbox.create(image=hutch.Image.from_directory(gv_root), runtime="gvisor", timeout=300,
                                  network=policy, mounts=[hutch.Mount.bind("/usr", "/usr"),
                                                          hutch.Mount.bind(str(world.tmp), str(world.tmp))])
        made.append(sb)
        return GvSandbox(sb, world)

    try:
        yield make
    finally:
        for sb in made:
            sb.terminate()


def test_another_gvisor_sandbox_is_unreachable(sandbox):
    """conf.test_another_sandbox_is_unreachable with b's listener inside b (in its sentry's netstack)."""
    import threading

    a = sandbox(hutch.Network.open())
    b = sandbox(hutch.Network.open())
    baddr = b.address
    got: dict = {}
    listen = threading.Thread(target=lambda: got.update(r=b.py(conf.pyclient("""
        import socket
        s = socket.socket(); s.bind(("0.0.0.0", 8000)); s.listen()
        u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); u.bind(("0.0.0.0", 8000))
        open("/tmp/ready", "w").close()
        s.settimeout(6); u.settimeout(0.1)
        try:
            c, peer = s.accept(); print("accepted", peer)
        except OSError:
            print("none")
        try:
            print("udp", u.recvfrom(10))
        except OSError:
            print("noudp")
    """), timeout=30)))
    listen.start()
    try:
        assert wait_for(lambda: "ready" in {f.name for f in b.sb.files.list("/tmp")}, timeout=15), "no listener"
        r = a.py(conf.reach_by_udp_and_tcp(baddr))
        assert r.stdout.strip() == "error", r.stdout + r.stderr
    finally:
        listen.join(40)
    out = got["r"].stdout
    assert "accepted" not in out and "noudp" in out, out + got["r"].stderr


def test_ipv6_out_is_impossible_on_gvisor(sandbox):
    sb = sandbox(conf.ALLOW_WWW)
    r = sb.py(conf.pyclient("""
        import socket
        try:
            print(open("/proc/net/if_inet6").read().strip().replace("\\n", " ") or "none")
        except OSError:
            print("none")
        try:
            socket.create_connection(("2001:db8::10", 80), timeout=2)
            print("connected")
        except OSError as e:
            print("error", type(e).__name__)
    """))
    out = r.stdout.split("\n")
    assert all(" lo" in a or a == "none" for a in [out[0]]) and "eth0" not in out[0], r.stdout
    assert out[1].startswith("error"), r.stdout + r.stderr
    assert sb.curl("-6", "http://www.example.test/").returncode != 0


def test_none_sandbox_has_no_route_out_on_gvisor(sandbox):
    sb = sandbox(hutch.Network.none())
    routes = [ln for ln in sb.run("ip", "-o", "route").stdout.splitlines() if ln.strip()]
    assert all("dev lo" in ln for ln in routes), routes   # the sentry lists lo's own routes
    links = [ln.split(":")[1].strip() for ln in sb.run("ip", "-o", "link").stdout.splitlines()]
    assert links == ["lo"], links
    r = sb.py(conf.pyclient(f"""
        import socket
        for dst in [("192.0.2.10", 80), ("{GW}", 53)]:
            try:
                socket.create_connection(dst, timeout=2); print("connected")
            except OSError as e:
                print(type(e).__name__, e.errno)
    """))
    errnos = r.stdout.split()[1::2]
    assert r.stdout.split()[::2] == ["OSError", "OSError"] and set(errnos) <= {"101", "113"}, r.stdout + r.stderr
    # ENETUNREACH natively; the sentry answers EHOSTUNREACH: no route either way


def test_set_policy_none_refuses_everything_and_allow_brings_it_back_on_gvisor(sandbox, world):
    """Network.none() on a gVisor sandbox keeps its link (its netstack cannot take a new one; with the link
    removed, as natively, a later allow left it without a network) and refuses everything through it."""
    sb = sandbox(conf.ALLOW_WWW)
    assert conf.served(sb.curl("http://www.example.test/"))["server"] == "192.0.2.10"
    sb.set_policy(hutch.Network.none())
    mark = world.mark()
    assert sb.curl("http://www.example.test/").returncode != 0
    assert sb.curl("http://192.0.2.10/").returncode != 0
    time.sleep(0.3)
    assert [e for e in world.events_since(mark) if e["kind"] in ("tcp", "http", "dns")] == []
    sb.set_policy(hutch.Network.allow(domains=["api.example.test"]))
    assert conf.served(sb.curl("http://api.example.test/"))["server"] == "198.51.100.10"
    assert sb.curl("http://www.example.test/").returncode != 0


def test_policy_change_resets_a_now_forbidden_open_connection_on_gvisor(sandbox):
    sb = sandbox(hutch.Network.allow(domains=["www.example.test", "api.example.test"]))
    code = conf.HOLD_WWW_AND_API
    p = sb.sb.exec("/usr/bin/python3", "-c", code, stdin=True, timeout=60)
    try:
        assert p.stdout.readline().strip() == "open"
        sb.set_policy(hutch.Network.allow(domains=["api.example.test"]))
        p.stdin.write("go\n")
        out = p.stdout.read()
    finally:
        p.kill() if p.returncode is None else None
    assert "www.example.test reset" in out, out
    assert "api.example.test alive" in out, out
    assert any(d.name == "www.example.test" and "policy change" in d.reason for d in sb.log())
    assert sb.curl("http://www.example.test/").returncode != 0
    assert conf.served(sb.curl("http://api.example.test/"))["server"] == "198.51.100.10"
