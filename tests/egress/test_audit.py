"""The decision log cannot be flushed by the sandbox it audits.

First the log on its own (pure logic, a fake clock): refusals and policy changes apart from
allowed noise, every drop counted, the rate limit, the memory bound. Then through the gateway:
a sandbox that floods the resolver with junk after a refusal still leaves that refusal, and the
flood, in its log.
"""

from __future__ import annotations

import gc
import json
import random
import string
import sys
import textwrap
import time
import tracemalloc

from hutch import Network
from hutch.sandbox._host.egress import audit
from hutch.sandbox._host.egress.audit import DecisionLog

from egress_world import GW

WALL = 1_700_000_000.0


def refuse(log, now, name, reason=None, protocol="dns", address=None):
    log.record(WALL + now, now, name, address, 53, protocol, "deny", reason or f"{name} is not in the allowed domains")


def allow(log, now, name="www.example.test"):
    log.record(WALL + now, now, name, "192.0.2.10", 53, "dns", "allow", "matches www.example.test")


def accounted(view) -> bool:
    """Every decision is either in the list or counted as dropped, kind by kind."""
    kept = {k: 0 for k in audit.KINDS}
    for d in view:
        kept[d.kind] += 1
    return all(view.seen[k] == kept[k] + view.dropped[k] for k in audit.KINDS)


def test_allowed_noise_never_pushes_a_refusal_or_a_policy_change_out():
    log = DecisionLog(0.0)
    refuse(log, 0.0, "secret.evil.test")
    log.record(WALL, 0.0, None, None, None, "policy", "allow", "policy replaced: none -> allow(...)")
    now = 0.0
    for _ in range(50_000):          # far more allowed decisions than the log keeps, at any rate
        now += 0.01
        allow(log, now)
    view = log.view()
    assert [d.name for d in view if d.verdict == "deny"] == ["secret.evil.test"]
    assert [d.protocol for d in view if d.protocol == "policy"] == ["policy"]
    assert view.seen["allowed"] == 50_000 and view.dropped["allowed"] == 50_000 - audit.ALLOWED_KEPT
    assert accounted(view)
    assert [d.time for d in view] == sorted(d.time for d in view)


def test_a_refusal_flood_keeps_the_first_and_the_last_and_counts_every_refusal():
    log = DecisionLog(0.0)
    now = 0.0
    refuse(log, now, "secret.evil.test", protocol="tls", reason="secret.evil.test is not in the allowed domains")
    for i in range(30_000):
        now += 0.01
        refuse(log, now, f"j{i}.junk.test")
    now += 1000                       # the bucket refills: the latest refusals are stored again
    for i in range(audit.REFUSED_LAST):
        now += 0.1
        refuse(log, now, f"late{i}.evil.test")
    view = log.view()
    names = [d.name for d in view]
    assert names[0] == "secret.evil.test"                       # the first ones stay for good
    assert names[-1] == f"late{audit.REFUSED_LAST - 1}.evil.test"
    assert len(names) == audit.REFUSED_FIRST + audit.REFUSED_LAST
    assert view.seen["refused"] == 30_001 + audit.REFUSED_LAST
    assert view.dropped["refused"] == view.seen["refused"] - len(names)
    assert accounted(view)
    # by reason: one row for the junk, whatever the names; the earlier TLS refusal has its own row
    by_reason = {(r.protocol, r.key): r for r in view.refusals_by_reason}
    junk = by_reason[("dns", "<name> is not in the allowed domains")]
    assert junk.count == 30_000 + audit.REFUSED_LAST and junk.first == WALL + 0.01
    assert by_reason[("tls", "<name> is not in the allowed domains")].count == 1
    # by target: the first distinct targets one by one, the rest in one row; nothing uncounted
    by_target = {r.key: r for r in view.refusals_by_target}
    assert by_target["secret.evil.test"].count == 1 and by_target["secret.evil.test"].protocol == "tls"
    assert len(view.refusals_by_target) == audit.TARGETS_KEPT + 1
    assert sum(r.count for r in view.refusals_by_target) == view.seen["refused"]
    assert by_target[None].last == WALL + now


def test_a_refusal_hammered_again_and_again_is_one_row_with_its_count_and_times():
    log = DecisionLog(0.0)
    for i in range(5000):
        refuse(log, i * 0.001, "169.254.169.254", protocol="tcp", reason="169.254.169.254 is a metadata address",
               address="169.254.169.254")
    (row,) = log.view().refusals_by_target
    assert (row.key, row.count, row.first, row.last) == ("169.254.169.254", 5000, WALL, WALL + 4.999)


def test_what_the_sandbox_makes_happen_is_stored_at_a_bounded_rate():
    log = DecisionLog(0.0)
    for i in range(10_000):          # 10,000 refusals in one second
        refuse(log, i / 10_000, f"j{i}.junk.test")
    view = log.view()
    assert len(view) <= audit.LOG_BURST + audit.LOG_RATE + 1
    assert view.dropped["refused"] == 10_000 - len(view)
    # policy changes come from the host, not the sandbox: never rate-limited away
    for i in range(audit.POLICY_FIRST):
        log.record(WALL + 1, 1.0, None, None, None, "policy", "allow", f"policy replaced {i}")
    assert log.view().dropped["policy"] == 0


def test_the_log_stays_within_its_memory_bound_whatever_the_sandbox_sends():
    base = ".".join("".join(random.choices(string.ascii_lowercase, k=63)) for _ in range(4))

    def junk(n):   # a new string object each time, as the wire makes them
        return f"{random.randrange(1 << 30):010d}{base}"[:n]

    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        log = DecisionLog(0.0)
        now = 0.0
        for i in range(30_000):      # the longest names and reasons, all kinds, bursts and pauses
            now += 1.0 if i % 50 == 0 else 0.0001
            name = junk(253)
            kind = i % 4
            if kind == 0:
                refuse(log, now, name)
            elif kind == 1:
                log.record(WALL + now, now, name, ",".join(f"203.0.113.{j}" for j in range(40)), 53, "dns",
                           "allow", f"matches *.{name}")
            elif kind == 2:
                log.record(WALL + now, now, None, None, None, "policy", "allow", "policy replaced: " + name * 3)
            else:
                refuse(log, now, name, protocol="tls", address=f"10.{i % 250}.{i % 7}.1",
                       reason=f"reason {i} {junk(200)}")
        gc.collect()
        used = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    view = log.view()
    assert len(view) == (audit.ALLOWED_KEPT + audit.REFUSED_FIRST + audit.REFUSED_LAST + audit.POLICY_FIRST
                         + audit.POLICY_LAST)
    assert accounted(view)
    assert used < audit.LOG_MEMORY_BOUND, used


# --- through the gateway ---------------------------------------------------------------

# Junk queries as a resolver library would send them: up to 64 outstanding, each given up on after
# 0.1 s (so the queries the resolver's limits drop slow the sender down only a little).
JUNK_FLOOD = """
import json, os, socket, struct, sys, time
n, gw = int(sys.argv[1]), sys.argv[2]
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.connect((gw, 53))
s.setblocking(False)
def query(i, name):
    q = struct.pack("!HHHHHH", i & 0xFFFF, 0x0100, 1, 0, 0, 0)
    q += b"".join(bytes([len(p)]) + p.encode() for p in name.split(".")) + b"\\0" + struct.pack("!HH", 1, 1)
    return q
start = time.monotonic()
sent = answers = 0
out = {}
while sent < n or out:
    now = time.monotonic()
    for k in [k for k, t in out.items() if now - t > 0.1]:
        del out[k]
    while sent < n and len(out) < 64:
        s.send(query(sent, f"j{sent}x{os.urandom(4).hex()}.junk.test"))
        out[sent & 0xFFFF] = now
        sent += 1
    try:
        while True:
            data = s.recv(4096)
            if out.pop(int.from_bytes(data[:2], "big"), None) is not None:
                answers += 1
    except BlockingIOError:
        time.sleep(0.001)
print(json.dumps({"sent": sent, "answers": answers, "took": time.monotonic() - start}))
"""

# The same as fast as one process can send, not waiting for anything.
BLAST = """
import json, os, socket, struct, sys
n, gw = int(sys.argv[1]), sys.argv[2]
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.connect((gw, 53))
s.setblocking(False)
sent = 0
for i in range(n):
    name = f"b{i}x{os.urandom(4).hex()}.junk.test"
    q = struct.pack("!HHHHHH", i & 0xFFFF, 0x0100, 1, 0, 0, 0)
    q += b"".join(bytes([len(p)]) + p.encode() for p in name.split(".")) + b"\\0" + struct.pack("!HH", 1, 1)
    try:
        s.send(q)
        sent += 1
    except BlockingIOError:
        pass
print(json.dumps({"sent": sent}))
"""


def run_json(sb, code, *args, timeout=60):
    r = sb.run(sys.executable, "-c", textwrap.dedent(code), *args, timeout=timeout)
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_junk_queries_after_a_refusal_neither_erase_it_nor_go_uncounted(sandbox):
    """The finding: 2,100 queries for junk names in 0.4 s used to push every earlier refusal out."""
    sb = sandbox(Network.allow(domains=["www.example.test"]))
    assert sb.run("getent", "hosts", "secret-target.evil.test").returncode != 0
    assert sb.curl("http://203.0.113.10/").returncode != 0            # a raw address: refused at the proxy
    flood = run_json(sb, JUNK_FLOOD, "2500", GW)
    assert flood["sent"] == 2500
    print(f"junk flood: {flood}")
    log = sb.log()
    denied = [d for d in log if d.verdict == "deny"]
    assert any(d.name == "secret-target.evil.test" for d in denied), denied[:5]
    assert any(d.address == "203.0.113.10" and d.protocol in ("tcp", "http") for d in denied), denied[:5]
    assert accounted(log)
    # every junk query is accounted for: a refusal in the log's counters, or held back by a DNS limit
    junk = sum(r.count for r in log.refusals_by_reason if r.key == "<name> is not in the allowed domains")
    lim = log.limits
    held = lim["dns_over_rate"] + lim["dns_over_concurrency"] + lim["dns_dropped_by_kernel"]
    assert junk + held >= 2500 and held > 0, (junk, lim)
    # and the flood itself is in the list, with its time
    assert any("the log's limits count them" in d.reason for d in denied), (log.refusals_by_reason, lim)


def test_a_long_flood_leaves_a_bounded_log_and_every_decision_counted(sandbox):
    sb = sandbox(Network.allow(domains=["www.example.test"]))
    assert sb.run("getent", "hosts", "first-refusal.evil.test").returncode != 0
    sent = sum(run_json(sb, BLAST, "10000", GW)["sent"] for _ in range(4))
    sent += run_json(sb, JUNK_FLOOD, "1000", GW)["sent"]
    log = sb.log()
    assert len(log) <= (audit.ALLOWED_KEPT + audit.REFUSED_FIRST + audit.REFUSED_LAST + audit.POLICY_FIRST
                        + audit.POLICY_LAST)
    assert log[0].name == "first-refusal.evil.test" or any(d.name == "first-refusal.evil.test" for d in log)
    assert accounted(log)
    assert len(log.refusals_by_reason) <= audit.REASONS_KEPT + 1
    assert len(log.refusals_by_target) <= audit.TARGETS_KEPT + 1
    time.sleep(0.2)
    log = sb.log()
    asked = log.limits["dns_queries"] + log.limits["dns_dropped_by_kernel"]
    assert sent < asked <= sent + 4, (sent, log.limits)    # + getent's queries (A, perhaps AAAA, retries)
