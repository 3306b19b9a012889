"""Red-team tries at the egress policy beyond test_bypasses.py: every spelling of an address or a name a
server or a resolver might read otherwise, the gateway's own ports, another gateway's sandboxes, and
floods of connections that must stay bounded and charged to the sandbox that makes them.

Same world and rules as test_conformance.py: clients run in sandbox namespaces without capabilities,
against the fake internet of egress_world.py (whose honeypots at 10.0.0.1 and 169.254.169.254 exist only
there), and every check also looks at what the fake internet (or the fake host) did or did not receive.
"""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
import time

from hutch import Network

from test_bypasses import client_hello, raw_cases, records, req, run_json

# Hosts that are, or hide, an address or another name: each spelt in a Host header and in an SNI.
# A server (or a resolver) may read them as the address or name after the trick; none may be dialed.
ODD_HOSTS = [
    "3221225985",                 # 192.0.2.1 as one decimal number
    "0xc000020a", "0300.0.2.10",  # hex and octal
    "0x7f.1", "127.1", "0177.0.0.1", "2130706433",   # loopback, short and odd forms
    "10.0.0.1", "169.254.169.254", "0.0.0.0", "100.64.0.1", "224.0.0.251", "255.255.255.255",
    "[::1]", "[::ffff:10.0.0.1]", "[64:ff9b::a00:1]", "[fe80::1%25eth0]", "[fc00::1]", "::1",
    "www.example.test.evil.test", "evil.test#www.example.test", "evil.test?.www.example.test",
    "evil.test/.www.example.test", "evil.test\\.www.example.test", "www.example.test@evil.test",
    "evil.test%2ewww.example.test", "evil.test%00.www.example.test", "evil.test .www.example.test",
    "xn--www-example-test.evil.test", "www.example.test:80@evil.test", "evil.test:80#.www.example.test",
]


def test_addresses_and_names_in_disguise_reach_nothing_but_the_allowed_name(sandbox, world):
    """In a Host header (port 80) and an SNI (port 443), sent to a forbidden address: each odd host is
    refused, and nothing but www.example.test's own address is ever reached."""
    sb = sandbox(Network.allow(domains=["www.example.test", "*.www.example.test"], ports=[80, 443]))
    cases = []
    for i, h in enumerate(ODD_HOSTS):
        cases.append({"name": f"http {h}", "host": "203.0.113.10", "port": 80, "wait": 2,
                      "parts": [req(f"/odd-{i}", f"Host: {h}")]})
        cases.append({"name": f"tls {h}", "host": "203.0.113.10", "port": 443, "wait": 2, "until": "\x00",
                      "parts": records(client_hello(((h.encode("latin-1"), 0),)))})
    n_odd = len(cases)
    # the control: the allowed name itself, the same way, reaches its own address
    cases.append({"name": "http allowed", "host": "203.0.113.10", "port": 80, "wait": 2,
                  "parts": [req("/odd-control", "Host: www.example.test")]})
    mark = world.mark()
    got = raw_cases(sb, cases, timeout=120)
    evs = [e for e in world.events_since(mark) if e["kind"] in ("tcp", "http", "host-tcp")]
    assert [(e.get("local"), e.get("path")) for e in evs if e["kind"] != "tcp"] == [("192.0.2.10", "/odd-control")], \
        (evs, got)
    assert got.pop("http allowed").startswith("data HTTP/1.1 200"), got
    assert set(got.values()) <= {"reset", "eof"}, {k: v for k, v in got.items() if v not in ("reset", "eof")}
    denies = [d for d in sb.log() if d.verdict == "deny" and d.protocol in ("http", "tls", "tcp")]
    assert len(denies) == n_odd, [(d.name, d.reason) for d in denies]


# --- floods of connections -----------------------------------------------------------

FLOOD = """
import socket, sys, time
end = time.monotonic() + float(sys.argv[1])
n = 0
while time.monotonic() < end:
    s = socket.socket(); s.setblocking(False)
    try:
        s.connect(("203.0.113.10", 80))
    except BlockingIOError:
        pass
    s.close(); n += 1
print(n, flush=True)
"""

LOOKUPS = """
import json, socket, sys, time
end = time.monotonic() + float(sys.argv[1])
out = {"ok": 0, "failed": []}
while time.monotonic() < end:
    try:
        s = socket.create_connection(("www.example.test", 80), timeout=5)
        s.sendall(b"GET /during-flood HTTP/1.1\\r\\nHost: www.example.test\\r\\nConnection: close\\r\\n\\r\\n")
        s.settimeout(5)
        assert s.recv(100).startswith(b"HTTP/1.1 200")
        s.close(); out["ok"] += 1
    except Exception as e:
        out["failed"].append(type(e).__name__)
    time.sleep(0.2)
print(json.dumps(out))
"""


def test_a_connection_flood_is_held_to_its_rate_and_starves_no_other_sandbox(sandbox, world):
    """One sandbox opens connections as fast as it can; the host drops what goes over its connect rate before
    the proxy (or conntrack) sees it and counts it as the sandbox's, and another sandbox's lookups and requests
    all succeed meanwhile (the proxy's accept loop used to keep the event loop to itself under a flood: the
    other sandbox's lookups failed, and the flood hit the 2,048-connection limit it never held open)."""
    from hutch.sandbox._host.egress.netns import CONNECT_BURST, CONNECT_RATE

    flooder = sandbox(Network.allow(domains=["www.example.test"]))
    other = sandbox(Network.allow(domains=["www.example.test"]))
    seconds = "6"
    pre = ["setpriv", "--bounding-set=-all", "--inh-caps=-all", "--no-new-privs", "--", sys.executable, "-c"]
    flood = subprocess.Popen(["ip", "netns", "exec", flooder.netns, *pre, FLOOD, seconds], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        got = run_json(other, LOOKUPS, seconds, timeout=60)
        out, err = flood.communicate(timeout=60)
    finally:
        if flood.poll() is None:
            flood.kill()
        flood.wait()
    attempts = int(out.strip() or 0)
    limits = flooder.log().limits
    assert got["ok"] > 0 and not got["failed"], got
    assert attempts > CONNECT_BURST + CONNECT_RATE * 6, (attempts, err)
    assert limits["tcp_over_connect_rate"] > 0, limits
    # what reached the proxy came at the connect rate: never near its limit of open connections
    assert limits["tcp_over_connection_limit"] == 0, limits
    assert other.log().limits["tcp_over_connect_rate"] == 0, other.log().limits


# --- what a connection the sandbox stops reading holds on the host -----------------------------------

HOLD_UNREAD = """
import socket, sys
socks = []
for i in range(int(sys.argv[1])):
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)   # its own socket holds next to nothing
    s.settimeout(10)
    s.connect(("www.example.test", 80))
    s.sendall(b"GET /bytes/1000000000 HTTP/1.1\\r\\nHost: www.example.test\\r\\n\\r\\n")
    socks.append(s)
print("open", flush=True)
sys.stdin.readline()
"""


def socket_memory(netns: str) -> int:
    """Bytes the TCP sockets of a netns hold in their buffers (received, queued to send, reserved)."""
    out = subprocess.run(["ip", "netns", "exec", netns, "ss", "-tmnH"], capture_output=True, text=True,
                         check=True).stdout
    total = 0
    for m in re.finditer(r"skmem:\(r(\d+),rb\d+,t(\d+),tb\d+,f(\d+),w(\d+)", out):
        r, t, f, w = (int(x) for x in m.groups())
        total += r + max(t, w) + (f if f < 1 << 31 else f - (1 << 32))   # forward alloc is signed
    return total


def test_connections_the_sandbox_stops_reading_hold_a_bounded_share_of_host_memory(sandbox, world):
    """300 downloads the sandbox never reads: what the server sends waits in the gateway's sockets. Their
    buffers together stay within a few times the sandbox's share (they used to grow to the kernel's autotuning
    limits, some MiB a connection: 300 of them took ~1 GiB of the host's TCP memory, whose limit is global, so
    one sandbox could stall TCP for the whole host)."""
    from hutch.sandbox._host.egress.proxy import SANDBOX_BUFFERS

    sb = sandbox(Network.allow(domains=["www.example.test"]))
    base = socket_memory(world.host)
    p = subprocess.Popen(["ip", "netns", "exec", sb.netns, sys.executable, "-c", HOLD_UNREAD, "300"],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "open", p.stderr.read() if p.poll() is not None else ""
        seen = []
        # the buffers fill as fast as the fake server writes: sample until they stop growing
        for _ in range(40):
            seen.append(socket_memory(world.host) - base)
            if seen[-1] > 4 * SANDBOX_BUFFERS or (len(seen) > 6 and seen[-1] <= max(seen[:-4])):
                break
            time.sleep(0.25)
    finally:
        p.kill()
        p.wait()
        p.stdin.close()
        p.stdout.close()
        p.stderr.close()
    assert max(seen) <= 3 * SANDBOX_BUFFERS, [s >> 20 for s in seen]
    assert max(seen) > 0, seen


# --- another gateway's sandboxes -------------------------------------------------------------------

LISTEN = """
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(("0.0.0.0", 8000)); s.listen()
s.settimeout(float(sys.argv[1]))
print("ready", flush=True)
try:
    c, a = s.accept(); print("accepted", a[0], flush=True)
except OSError:
    print("none", flush=True)
"""


def test_another_gateways_sandboxes_are_never_dialed(sandbox, world):
    """A second gateway on this host (another daemon's) has a link subnet of its own. A sandbox here whose policy
    names all of 198.18.0.0/15, where both subnets lie, reaches none of the other's sandboxes, also one whose own
    rules are gone (a gVisor sandbox's netstack reads its link below them). It held: the proxy dials the address
    (the policy names it), but the other gateway's host rules take nothing from its links but DNS and proxy
    traffic, so the sandbox's answer never reaches the dialing socket."""
    from egress_world import GatewayThread, Sandbox as WorldSandbox, sh

    gw2 = GatewayThread(world.host, upstream_resolvers=["192.0.2.53"], subnet="198.18.8.0/24",
                        table="hutch_egress_rt2", link_prefix="hr")
    name = f"hutch-eg-rt2-{world.tag}"
    listener = None
    try:
        sh("ip", "netns", "add", name)
        other = WorldSandbox(world, name, "rt2-b")
        gw2.call(gw2.gw.attach(other.id, f"/run/netns/{name}", Network.open()))
        addr = gw2.sync(lambda: gw2.gw.attachment(other.id).address)
        other.run("nft", "flush", "ruleset", caps=True, check=True)
        listener = subprocess.Popen(["ip", "netns", "exec", name, sys.executable, "-c", LISTEN, "15"],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert listener.stdout.readline().strip() == "ready"
        sb = sandbox(Network.allow(cidrs=["198.18.0.0/15"], ports=None))
        r = sb.py(textwrap.dedent(f"""
            import socket
            try:
                s = socket.create_connection(({addr!r}, 8000), timeout=3)
                s.sendall(b"hello"); s.settimeout(3)
                print("data" if s.recv(10) else "eof")
            except OSError as e:
                print(type(e).__name__)
        """))
        listener.kill()
        out, _ = listener.communicate(timeout=10)
        assert "accepted" not in out, (out, r.stdout)
        assert r.stdout.strip() in ("ConnectionResetError", "eof", "TimeoutError", "ConnectionRefusedError"), r.stdout
    finally:
        if listener is not None:
            if listener.poll() is None:
                listener.kill()
            listener.wait()
            listener.stdout.close()
            listener.stderr.close()
        try:
            gw2.call(gw2.gw.detach("rt2-b"))
        finally:
            gw2.close()
            sh("ip", "netns", "del", name, check=False)


HOLD_HELLOS = """
import socket, sys, time
part = bytes.fromhex(sys.argv[1])
socks = []
end = time.monotonic() + 9
while len(socks) < int(sys.argv[2]) and time.monotonic() < end:
    try:
        s = socket.create_connection(("203.0.113.10", 443), timeout=3)
        s.sendall(part)
        socks.append(s)
    except OSError:
        pass
print(len(socks), flush=True)
sys.stdin.readline()
"""


def _rss() -> int:
    with open("/proc/self/status") as f:
        return int(re.search(r"VmRSS:\s+(\d+)", f.read()).group(1)) * 1024


def test_unfinished_client_hellos_hold_a_bounded_share_of_the_daemons_memory(sandbox, world):
    """1,900 connections each send all but the last 100 bytes of a 60 KB ClientHello, and wait: the proxy (here in
    this process, as in the daemon) holds at most HELD_MAX of them for the sandbox and refuses the connections
    beyond it (before, it held every one until its 10 s were up: 211 MiB more of this process)."""
    from hutch.sandbox._host.egress.proxy import HELD_MAX

    sb = sandbox(Network.allow(domains=["www.example.test"]))
    part = b"".join(records(client_hello(extra=[(0x15, b"\0" * 60000)])))[:-100]
    before = _rss()
    p = subprocess.Popen(["ip", "netns", "exec", sb.netns, sys.executable, "-c", HOLD_HELLOS, part.hex(), "1900"],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        opened = int(p.stdout.readline().strip() or 0)
        grown = _rss() - before
    finally:
        p.kill()
        p.wait()
        p.stdin.close()
        p.stdout.close()
        p.stderr.close()
    assert opened > 1000, opened
    refused = [d for d in sb.log() if "unfinished ClientHellos" in d.reason]
    assert refused and sb.log().refusals_by_reason, sb.log().refusals_by_reason
    assert grown < 2 * HELD_MAX + (48 << 20), grown >> 20
