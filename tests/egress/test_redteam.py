"""Red-team tries at the egress policy beyond test_bypasses.py: every spelling of an address or a name a
server or a resolver might read otherwise, the gateway's own ports, another gateway's sandboxes, and
floods of connections that must stay bounded and charged to the sandbox that makes them.

Same world and rules as test_conformance.py: clients run in sandbox namespaces without capabilities,
against the fake internet of egress_world.py (whose honeypots at 10.0.0.1 and 169.254.169.254 exist only
there), and every check also looks at what the fake internet (or the fake host) did or did not receive.
"""

from __future__ import annotations

import subprocess
import sys

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
