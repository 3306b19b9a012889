"""Helpers of the egress suite: a fake internet and a gateway, all inside network namespaces this suite creates.

Layout (every name carries a random tag; everything is removed at the end, also on failure):

    hutch-eg-sb-<tag>-N  --veth hv<hex>-->  hutch-eg-host-<tag>  --veth hutchi<tag>-->  hutch-eg-inet-<tag>
    (sandboxes; clients                      (plays the host: the Gateway             (fake internet: DNS,
     run here without                         runs in a thread that entered            HTTP(S), echo, UDP
     capabilities)                            this netns; a host-only service)         sinks, honeypots)

The "host" netns routes only into the inet netns, so nothing a test does can
reach a real address: even the honeypot addresses (10.0.0.1, 169.254.169.254)
exist only inside the inet netns, where they record whoever reaches them.
"""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

if os.geteuid() != 0 or not shutil.which("ip"):
    pytest.skip("the egress suite needs root and iproute2", allow_module_level=True)

from hutch.sandbox._host.egress import Gateway  # noqa: E402
from hutch.sandbox._host.egress import netns as _netns  # noqa: E402
from hutch.sandbox._host.egress.nft import available as nft_available  # noqa: E402

if not nft_available():
    pytest.skip("libnftables1 is not installed (scripts/setup.sh installs it)", allow_module_level=True)

HERE = Path(__file__).parent
HOST_ADDR = "192.0.2.254"
DNS_ADDR = "192.0.2.53"
WEB = ["192.0.2.10", "198.51.100.10", "203.0.113.10", "10.0.0.1", "169.254.169.254", "192.0.2.11"]
PROXY_ADDR = "203.0.113.30"
ECHO = [("203.0.113.20", 7000), ("203.0.113.20", 7001), ("203.0.113.21", 7000), ("10.0.0.1", 7000)]
UDP = [("203.0.113.10", 443), ("203.0.113.10", 9999), ("192.0.2.10", 53)]
SUBNET = "198.18.0.0/24"
GW = "198.18.0.1"
HOST_SERVICE_PORT = 2222

ZONE = {
    "www.example.test": ["192.0.2.10"],
    "api.example.test": ["198.51.100.10"],
    "other.example.test": ["203.0.113.10"],
    "second.example.test": ["192.0.2.11"],
    "example.test": ["192.0.2.10"],
    "deep.a.example.test": ["192.0.2.10"],
    "mixed.example.test": ["10.0.0.1", "203.0.113.10"],
    "local.example.test": ["127.0.0.1"],
    "private.example.test": ["10.0.0.1"],
    "meta.example.test": ["169.254.169.254"],
    "cgnat.example.test": ["100.64.0.1"],
    "gateway.example.test": [GW],
    "hostaddr.example.test": [HOST_ADDR],
    "proxy.example.test": [PROXY_ADDR],
    "forbidden.test": ["203.0.113.10"],
    "evil.test": ["203.0.113.10"],
    # never-reachable and special answers the bypass suite tries (no server exists at any of them)
    "zero.example.test": ["0.0.0.0"],
    "bcast.example.test": ["255.255.255.255"],
    "mcast.example.test": ["224.0.0.251"],
    "sibling.example.test": ["198.18.0.2"],
    "bench.example.test": ["198.19.0.1"],
    "alimeta.example.test": ["100.100.100.200"],
    # made local on the host only while a test runs (a `local` route, a new address)
    "anyip.example.test": ["198.51.100.77"],
    "newaddr.example.test": ["198.51.100.78"],
    # answered a second late (a policy change while its lookup is in flight)
    "slow.example.test": ["192.0.2.10"],
    # a TCP echo server under a name (a service that speaks neither TLS nor HTTP)
    "echo.example.test": ["203.0.113.20"],
    "db.internal.test": ["10.0.0.1"],
}
# CNAME chains, answered in full by the fake DNS server (the chain, then the last name's A records)
CNAMES = {
    "ok-alias.example.test": "www.example.test",
    "cdn-alias.example.test": "forbidden.test",
    "chain.example.test": "hop.example.test",
    "hop.example.test": "evil.test",
    "internal-alias.example.test": "db.internal.test",
    "loop-a.example.test": "loop-b.example.test",
    "loop-b.example.test": "loop-a.example.test",
}
# HTTPS on a port other than 443 (the proxy must let TLS through wherever the server answers with TLS)
HTTPS_EXTRA = [("192.0.2.10", 8443)]
SLOW_DNS = ["slow.example.test"]
# answers that change from one query to the next, TTL 0 (DNS rebinding)
REBIND = {"rebind.example.test": [["203.0.113.10"], ["10.0.0.1"]]}
ZONE6 = {"www.example.test": ["2001:db8::10"], "mapped.example.test": ["::ffff:127.0.0.1"]}


def sh(*argv, check=True, timeout=30, **kw):
    return subprocess.run(list(argv), check=check, capture_output=True, text=True, timeout=timeout, **kw)


def make_ca(tmp: Path) -> tuple[Path, Path, Path]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "hutch egress test CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(days=1))
          .not_valid_after(now + datetime.timedelta(days=2))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    names = [x509.DNSName(n) for n in ZONE] + [x509.DNSName("*.example.test")]
    names += [x509.IPAddress(ipaddress.ip_address(a)) for a in WEB]
    cert = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "example.test")]))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(days=1)).not_valid_after(now + datetime.timedelta(days=2))
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            .sign(ca_key, hashes.SHA256()))
    ca_path, cert_path, key_path = tmp / "ca.pem", tmp / "cert.pem", tmp / "key.pem"
    ca_path.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return ca_path, cert_path, key_path


class GatewayThread:
    """Runs a Gateway on its own event loop, in a thread that entered the fake host's netns."""

    def __init__(self, host_netns: str, **kw):
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.error = None
        self.gw = None
        self._kw = kw
        self._host_netns = host_netns
        self.thread = threading.Thread(target=self._run, daemon=True, name="egress-test-gw")
        self.thread.start()
        self.ready.wait(30)
        if self.error:   # the loop too (its self-pipe, a socket pair, was left to the gc: ResourceWarning)
            self.thread.join(10)
            if not self.thread.is_alive():
                self.loop.close()
            raise self.error

    def _run(self):
        fd = os.open(f"/run/netns/{self._host_netns}", os.O_RDONLY)
        try:
            _netns.setns(fd)
        finally:
            os.close(fd)
        asyncio.set_event_loop(self.loop)
        try:
            self.gw = Gateway(**self._kw)
            self.loop.run_until_complete(self.gw.start())
        except BaseException as e:  # noqa: BLE001 - handed to the test thread
            self.error = e
            self.ready.set()
            return
        self.ready.set()
        self.loop.run_forever()

    def call(self, coro, timeout=30):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def sync(self, fn, *a):
        async def _c():
            return fn(*a)
        return self.call(_c())

    def close(self):
        try:
            if self.gw is not None and not self.error:
                try:
                    self.call(self.gw.stop(), timeout=60)
                finally:
                    self.loop.call_soon_threadsafe(self.loop.stop)
                    self.thread.join(10)
        finally:   # the loop too, once its thread is done (left open: ResourceWarning, unclosed event loop)
            if not self.thread.is_alive():
                self.loop.close()


class Sandbox:
    """A network namespace standing in for a sandbox; commands run in it without capabilities."""

    def __init__(self, world, name, sid):
        self.world, self.netns, self.id = world, name, sid
        self.etc = Path("/etc/netns") / name

    def run(self, *argv, timeout=20, caps=False, check=False, input=None):
        pre = ["ip", "netns", "exec", self.netns]
        if not caps:
            pre += ["setpriv", "--bounding-set=-all", "--inh-caps=-all", "--no-new-privs", "--"]
        return subprocess.run(pre + list(argv), capture_output=True, text=True, timeout=timeout,
                              check=check, input=input)

    def py(self, code, timeout=20, **kw):
        return self.run(sys.executable, "-c", code, timeout=timeout, **kw)

    def curl(self, *args, timeout=20):
        return self.run("curl", "-sS", "--max-time", "8", "--cacert", str(self.world.ca), *args, timeout=timeout)

    @property
    def address(self):
        return self.world.gw.sync(lambda: self.world.gw.gw.attachment(self.id).address)

    def set_policy(self, policy):
        self.world.gw.call(self.world.gw.gw.set_policy(self.id, policy))

    def log(self):
        return self.world.gw.sync(self.world.gw.gw.log, self.id)


class World:
    def __init__(self, tmp: Path):
        self.tag = secrets.token_hex(3)
        self.tmp = tmp
        self.host = f"hutch-eg-host-{self.tag}"
        self.inet = f"hutch-eg-inet-{self.tag}"
        self.events = tmp / "events.jsonl"
        self.events.touch()
        self.procs: list[subprocess.Popen] = []
        self.sandboxes: list[Sandbox] = []
        self.gw: GatewayThread | None = None
        self._n = 0

    def up(self):
        t, h, i = self.tag, self.host, self.inet
        sh("ip", "netns", "add", h)
        sh("ip", "netns", "add", i)
        sh("ip", "link", "add", f"hutchi{t}", "netns", h, "type", "veth", "peer", "name", "inet0", "netns", i)
        for ns in (h, i):
            sh("ip", "-n", ns, "link", "set", "lo", "up")
        sh("ip", "-n", h, "addr", "add", f"{HOST_ADDR}/32", "dev", f"hutchi{t}")
        sh("ip", "-n", h, "link", "set", f"hutchi{t}", "up")
        for net in ("192.0.2.0/24", "198.51.100.0/24", "203.0.113.0/24", "10.0.0.0/8", "169.254.169.254/32"):
            sh("ip", "-n", h, "route", "add", net, "dev", f"hutchi{t}")
        for a in sorted({DNS_ADDR, PROXY_ADDR, *WEB, *(e[0] for e in ECHO), *(u[0] for u in UDP)}):
            sh("ip", "-n", i, "addr", "add", f"{a}/32", "dev", "inet0")
        sh("ip", "-n", i, "link", "set", "inet0", "up")
        sh("ip", "-n", i, "route", "add", f"{HOST_ADDR}/32", "dev", "inet0")
        sh("ip", "-n", i, "route", "add", "default", "via", HOST_ADDR, "dev", "inet0", "onlink")
        self.ca, cert, key = make_ca(self.tmp)
        cfg = {"events": str(self.events), "zone": ZONE, "zone6": ZONE6, "dns": DNS_ADDR, "web": WEB,
               "cert": str(cert), "key": str(key), "echo": ECHO, "udp": UDP, "proxy": PROXY_ADDR,
               "rebind": REBIND, "slow_dns": SLOW_DNS, "cname": CNAMES, "https_extra": HTTPS_EXTRA}
        (self.tmp / "fakenet.json").write_text(json.dumps(cfg))
        self.spawn(i, sys.executable, str(HERE / "_fakenet.py"), str(self.tmp / "fakenet.json"))
        # a service only the host has: on every host address and on loopback
        self.spawn(h, sys.executable, "-c", _HOST_SERVICE, str(self.events), str(HOST_SERVICE_PORT))
        # credential hosts are dialed verifying their certificates: the fake internet's CA is their trust store
        self.gw = GatewayThread(h, upstream_resolvers=[DNS_ADDR], subnet=SUBNET, table="hutch_egress_test",
                                upstream_ca=str(self.ca))

    def spawn(self, netns, *argv):
        p = subprocess.Popen(["ip", "netns", "exec", netns, *argv], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.procs.append(p)
        line = p.stdout.readline()
        if line.strip() != "ready":
            raise RuntimeError(f"{argv[1]} did not start: {line} {p.stderr.read() if p.poll() is not None else ''}")
        return p

    def sandbox(self, policy, attach=True) -> Sandbox:
        self._n += 1
        name = f"hutch-eg-sb-{self.tag}-{self._n}"
        sh("ip", "netns", "add", name)
        sb = Sandbox(self, name, f"sb{self._n}")
        self.sandboxes.append(sb)
        sb.etc.mkdir(parents=True, exist_ok=True)
        (sb.etc / "resolv.conf").write_text(f"nameserver {GW}\noptions attempts:1 timeout:2\n")
        if attach:
            self.gw.call(self.gw.gw.attach(sb.id, f"/run/netns/{name}", policy))
        return sb

    def drop_sandbox(self, sb: Sandbox):
        try:
            if self.gw is not None:
                self.gw.call(self.gw.gw.detach(sb.id))
        finally:
            sh("ip", "netns", "del", sb.netns, check=False)
            shutil.rmtree(sb.etc, ignore_errors=True)
            if sb in self.sandboxes:
                self.sandboxes.remove(sb)

    def events_since(self, mark: int) -> list[dict]:
        with open(self.events) as f:
            lines = f.readlines()[mark:]
        return [json.loads(x) for x in lines if x.strip()]

    def mark(self) -> int:
        with open(self.events) as f:
            return sum(1 for _ in f)

    def down(self):
        errors = []
        for sb in list(self.sandboxes):
            try:
                self.drop_sandbox(sb)
            except Exception as e:  # noqa: BLE001 - keep cleaning
                errors.append(e)
        if self.gw is not None:
            try:
                self.gw.close()
            except Exception as e:  # noqa: BLE001
                errors.append(e)
        for p in self.procs:
            try:
                p.stdin.close()
                p.wait(5)
            except Exception:  # noqa: BLE001
                p.kill()
                p.wait(5)
            finally:   # its output pipes too (they were left for the garbage collector: ResourceWarning)
                p.stdout.close()
                p.stderr.close()
        for ns in (self.host, self.inet):
            sh("ip", "netns", "del", ns, check=False)
        if errors:
            raise errors[0]


_HOST_SERVICE = r"""
import json, socket, sys, threading, time
ev, port = sys.argv[1], int(sys.argv[2])
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(("0.0.0.0", port)); s.listen()
u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); u.bind(("0.0.0.0", port))
def log(kind, addr):
    with open(ev, "a") as f: f.write(json.dumps({"kind": kind, "local": "host", "port": port, "src": addr[0], "t": time.time()}) + "\n")
def udp():
    while True:
        d, a = u.recvfrom(2048); log("host-udp", a)
threading.Thread(target=udp, daemon=True).start()
def tcp():
    while True:
        c, a = s.accept(); log("host-tcp", a); c.close()
threading.Thread(target=tcp, daemon=True).start()
print("ready", flush=True)
sys.stdin.read()
"""




def wait_for(pred, timeout=5.0, step=0.05):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(step)
    return pred()


@contextmanager
def daemon_in_world(world: "World", subnet: str, mode: str, extra_env: dict | None = None,
                    default_image: bool = False, args: tuple = (), run_dir: Path | None = None):
    """The real daemon in the fake host's netns, the SDK pointed at it; yields its run dir. `mode`: "default"
    (sandboxes in user namespaces) or "opt-out" (HUTCH_USERNS=0). Daemons of one test session need subnets of
    their own. `default_image`: build the default image first, here in the real host's network: the daemon in
    the fake host's netns can reach no Debian mirror, so on a fresh machine (CI) its own build would fail."""
    from hutch_testing import sdk_pointed_at, start_daemon, stop_daemon

    if default_image:
        from hutch.sandbox._host.images import DEBIAN_SLIM, ensure_image

        ensure_image(DEBIAN_SLIM)

    own = run_dir is None   # given one (the same daemon started again), the caller removes it
    if own:
        run_dir = Path(tempfile.mkdtemp(prefix="hutch-egress-run-"))
    env = {"HUTCH_EGRESS_RESOLVERS": "192.0.2.53", "HUTCH_EGRESS_SUBNET": subnet, **(extra_env or {})}
    if mode == "opt-out":
        env["HUTCH_USERNS"] = "0"
    try:
        # nsenter, not `ip netns exec`: the latter remounts /sys and would hide the cgroup controllers
        proc = start_daemon(run_dir, env, prefix=("nsenter", f"--net=/run/netns/{world.host}"), args=args)
        try:
            with sdk_pointed_at(run_dir):
                yield run_dir
        finally:
            stop_daemon(proc)
    finally:
        if own:
            shutil.rmtree(run_dir, ignore_errors=True)
