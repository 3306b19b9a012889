"""What one sandbox may ask of the shared resolver, and what a CNAME may lead it to.

A flood is held to the sandbox's own budget (queries a second, queries in flight, TCP
connections), counted, and does not slow another sandbox's lookups. An allowed name whose
answer runs through CNAMEs is answered only when every name on the chain is allowed too,
at the resolver and at the proxy alike.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import textwrap
import time

from hutch import Network
from hutch.sandbox._host.egress import dns

from egress_world import GW

QUERY = """
import struct
def query(qid, name, qtype=1):
    q = struct.pack("!HHHHHH", qid & 0xFFFF, 0x0100, 1, 0, 0, 0)
    return q + b"".join(bytes([len(p)]) + p.encode() for p in name.split(".")) + b"\\0" + struct.pack("!HH", qtype, 1)
"""

FLOOD = QUERY + """
import json, os, socket, sys, time
seconds, rate, gw = float(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.setblocking(False)
s.connect((gw, 53))
start = time.monotonic()
sent = answers = 0
while True:
    now = time.monotonic()
    if now - start >= seconds:
        break
    if rate and sent >= (now - start) * rate:
        time.sleep(0.0005)
    else:
        try:
            s.send(query(sent, f"f{sent}.{os.urandom(3).hex()}.junk.test"))
            sent += 1
        except BlockingIOError:
            pass
    try:
        while True:
            s.recv(4096)
            answers += 1
    except BlockingIOError:
        pass
took = time.monotonic() - start
s.settimeout(0.5)
try:
    while True:
        s.recv(4096)
        answers += 1
except OSError:
    pass
print(json.dumps({"sent": sent, "answers": answers, "took": took}))
"""

# sequential lookups, each on a fresh socket, one try with a 2 s timeout: the latency of each
PROBE = QUERY + """
import json, random, socket, sys, time
n, gw, names = int(sys.argv[1]), sys.argv[2], sys.argv[3].split(",")
out = []
for i in range(n):
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.settimeout(2)
    qid = random.randrange(65536)
    t = time.monotonic()
    s.sendto(query(qid, names[i % len(names)]), (gw, 53))
    try:
        while True:
            data = s.recv(4096)
            if int.from_bytes(data[:2], "big") == qid:
                out.append([time.monotonic() - t, data[3] & 0xF, int.from_bytes(data[6:8], "big")])
                break
    except socket.timeout:
        out.append([None, None, None])
    s.close()
    time.sleep(0.02)
print(json.dumps(out))
"""


def run_json(sb, code, *args, timeout=60):
    r = sb.run(sys.executable, "-c", textwrap.dedent(code), *args, timeout=timeout)
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def start_in(sb, code, *args) -> subprocess.Popen:
    return subprocess.Popen(["ip", "netns", "exec", sb.netns, "setpriv", "--bounding-set=-all", "--inh-caps=-all",
                             "--no-new-privs", "--", sys.executable, "-c", textwrap.dedent(code), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(p: subprocess.Popen, timeout=60) -> dict:
    out, err = p.communicate(timeout=timeout)
    assert p.returncode == 0, out + err
    return json.loads(out.strip().splitlines()[-1])


def test_a_sandbox_gets_its_query_budget_and_no_more_and_the_rest_is_counted(sandbox):
    sb = sandbox(Network.allow(domains=["www.example.test"]))
    got = run_json(sb, FLOOD, "1.5", "800", GW)        # paced well below what the resolver can read
    lim = sb.log().limits
    budget = dns.QUERY_BURST + dns.QUERY_RATE * got["took"]
    assert got["sent"] >= 1000, got
    assert got["answers"] <= budget + 20, (got, lim)
    assert got["answers"] >= min(got["sent"], budget) * 0.8, (got, lim)     # the budget itself is served
    assert lim["dns_queries"] + lim["dns_dropped_by_kernel"] == got["sent"], (got, lim)
    assert lim["dns_over_rate"] + lim["dns_over_concurrency"] + lim["dns_dropped_by_kernel"] \
        == got["sent"] - got["answers"], (got, lim)
    assert lim["dns_over_rate"] > 0
    # the budget refills: a sandbox that was limited can look names up again a moment later
    time.sleep(1.0)
    (latency, rcode, answers), = run_json(sb, PROBE, "1", GW, "www.example.test")
    assert latency is not None and rcode == 0 and answers == 1


def test_one_sandboxs_flood_does_not_delay_another_sandboxs_lookups(sandbox):
    flooder = sandbox(Network.allow(domains=["www.example.test"]))
    other = sandbox(Network.allow(domains=["www.example.test", "api.example.test"]))
    assert run_json(other, PROBE, "2", GW, "www.example.test,api.example.test")[0][1] == 0   # cached upstream
    floods = [start_in(flooder, FLOOD, "6", "0", GW) for _ in range(2)]     # as fast as two processes can send
    try:
        time.sleep(0.5)
        probes = run_json(other, PROBE, "60", GW, "www.example.test,api.example.test,nope.evil.test")
    finally:
        sent = sum(finish(p)["sent"] for p in floods)
    times = [t for t, _, _ in probes]
    assert None not in times, f"{times.count(None)} of {len(times)} lookups went unanswered"
    assert [(rc, n) for _, rc, n in probes[:3]] == [(0, 1), (0, 1), (3, 0)]
    p50, worst = statistics.median(times), max(times)
    print(f"other sandbox's lookups under a flood of {sent} queries: p50 {p50 * 1000:.2f} ms, max {worst * 1000:.1f} ms")
    lim = flooder.log().limits
    assert lim["dns_queries"] + lim["dns_dropped_by_kernel"] == sent, (sent, lim)
    assert lim["dns_over_rate"] + lim["dns_dropped_by_kernel"] > sent // 2, (sent, lim)
    # the flood was the flooder's to bear: none of the other sandbox's queries was limited or dropped, and each
    # was answered (within the probe's 2 s). Its latencies are printed
    # above, not asserted: bench/egress.py measures them ("dns flood", beside the same lookups with no flood).
    olim = other.log().limits
    assert olim["dns_queries"] == 2 + len(probes), (len(probes), olim)   # its warm-up's two and the probes
    assert olim["dns_over_rate"] == olim["dns_over_concurrency"] == olim["dns_dropped_by_kernel"] == 0, olim


TCP_HOLD = QUERY + """
import json, socket, struct, sys, time
n, gw = int(sys.argv[1]), sys.argv[2]
socks, out = [], []
for i in range(n):
    try:
        socks.append(socket.create_connection((gw, 53), timeout=3))
    except ConnectionResetError:
        # refused past the cap: the resolver resets a connection as soon as it accepts it, which can be before
        # this (non-blocking, polled) connect returns here on a loaded machine: the reset is its answer
        socks.append(None)
time.sleep(0.3)
for i, s in enumerate(socks):
    if s is None:
        out.append("reset")
        continue
    msg = query(i, "www.example.test")
    try:
        s.sendall(struct.pack("!H", len(msg)) + msg)
        data = s.recv(4096)
        out.append("answer" if len(data) > 14 else "closed")
    except ConnectionResetError:
        out.append("reset")
    except OSError as e:
        out.append(type(e).__name__)
print(json.dumps(out))
"""


def test_dns_over_tcp_connections_per_sandbox_are_capped_and_counted(sandbox):
    a = sandbox(Network.allow(domains=["www.example.test"]))
    b = sandbox(Network.allow(domains=["www.example.test"]))
    holder = start_in(a, TCP_HOLD.replace("time.sleep(0.3)", "time.sleep(2.5)"), str(dns.TCP_MAX + 3), GW)
    try:
        time.sleep(1.0)
        # while a holds all it may, b's TCP lookups work
        assert run_json(b, TCP_HOLD, "2", GW) == ["answer", "answer"]
    finally:
        got = finish(holder)
    assert got.count("answer") == dns.TCP_MAX, got
    assert all(x in ("reset", "closed", "BrokenPipeError") for x in got[dns.TCP_MAX:]), got
    log = a.log()
    assert log.limits["dns_tcp_refused"] == 3, log.limits
    assert any("DNS-over-TCP" in d.reason for d in log if d.verdict == "deny")


# --- CNAME chains (the fake DNS server answers them in full, like a recursive resolver) ---------

def lookup(sb, *names):
    return run_json(sb, PROBE, str(len(names)), GW, ",".join(names))


def test_a_cname_to_a_name_the_policy_does_not_allow_is_refused_and_logged(sandbox, world):
    sb = sandbox(Network.allow(domains=["*.example.test"]))
    mark = world.mark()
    got = lookup(sb, "ok-alias.example.test", "cdn-alias.example.test", "chain.example.test",
                 "internal-alias.example.test", "loop-a.example.test")
    assert [(rc, n) for _, rc, n in got] == [(0, 1), (3, 0), (3, 0), (3, 0), (3, 0)], got
    denied = {d.name: d.reason for d in sb.log() if d.verdict == "deny" and d.protocol == "dns"}
    assert "CNAME for forbidden.test" in denied["cdn-alias.example.test"], denied
    assert "CNAME for evil.test" in denied["chain.example.test"], denied        # the last hop counts too
    assert "CNAME for db.internal.test" in denied["internal-alias.example.test"], denied
    assert "loop" in denied["loop-a.example.test"], denied
    allowed = [d for d in sb.log() if d.name == "ok-alias.example.test" and d.verdict == "allow"]
    assert allowed and allowed[0].address == "192.0.2.10" and "www.example.test" in allowed[0].reason
    # each chain was read from the one answer: no target was asked for upstream on its own
    queried = {e["name"] for e in world.events_since(mark) if e["kind"] == "dns"}
    assert not queried & {"forbidden.test", "evil.test", "db.internal.test", "hop.example.test"}, queried


def test_the_proxy_refuses_a_name_whose_cname_leaves_the_policy(sandbox, world):
    """The proxy resolves a connection's name itself: a forged /etc/hosts entry for the alias must not
    get around the resolver's CNAME check."""
    sb = sandbox(Network.allow(domains=["*.example.test"]))
    mark = world.mark()
    r = sb.curl("--resolve", "cdn-alias.example.test:80:203.0.113.10", "http://cdn-alias.example.test/")
    assert r.returncode != 0
    r = sb.curl("--resolve", "cdn-alias.example.test:443:203.0.113.10", "https://cdn-alias.example.test/")
    assert r.returncode != 0
    assert not [e for e in world.events_since(mark) if e["kind"] in ("tcp", "http")], world.events_since(mark)
    denied = [d for d in sb.log() if d.verdict == "deny" and d.protocol in ("http", "tls")]
    assert len(denied) == 2 and all("CNAME for forbidden.test" in d.reason for d in denied), denied
    # and an alias whose chain stays inside the policy works through the proxy too
    r = sb.curl("http://ok-alias.example.test/")
    assert r.returncode == 0 and json.loads(r.stdout)["server"] == "192.0.2.10", r.stderr


def test_a_cname_target_the_policy_names_is_followed(sandbox):
    sb = sandbox(Network.allow(domains=["cdn-alias.example.test", "forbidden.test"]))
    ((_, rcode, n),) = lookup(sb, "cdn-alias.example.test")
    assert (rcode, n) == (0, 1)
    r = sb.curl("http://cdn-alias.example.test/")
    assert r.returncode == 0 and json.loads(r.stdout)["server"] == "203.0.113.10", r.stderr
