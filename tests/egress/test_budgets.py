"""Budgets of every allowed host (Network.allow/open(requests_per_minute=, bytes_per_minute=)), in the suite's
world of network namespaces: plain HTTP (each request counted), TLS relayed unread and raw TCP to a CIDR (each
connection one request, bytes counted as they are spliced), a wildcard entry shared by every name below it,
open() counted as one, and a policy change applying to open connections. The fake internet records what
arrived, so "never sent" is checked there, not assumed."""

from __future__ import annotations

import json

from hutch import Network, NetworkPolicyError, Secret

import pytest

ECHO_PY = """
import socket, sys
s = socket.create_connection(("203.0.113.20", 7000), timeout=8)
sent = 0
try:
    for _ in range(int(sys.argv[1])):
        s.sendall(b"e" * 1000)
        sent += 1000
        got = b""
        while len(got) < 1000:
            d = s.recv(65536)
            if not d:
                raise ConnectionResetError
            got += d
except OSError as e:
    print(sent, type(e).__name__)
else:
    print(sent, "ok")
"""


def http_events(world, mark, path):
    return [e for e in world.events_since(mark) if e["kind"] == "http" and e["path"].startswith(path)]


def codes(sb, url, n):
    return [sb.curl("-o", "/dev/null", "-w", "%{http_code}", url).stdout for _ in range(n)]


def test_the_budgets_are_checked_and_travel_as_json():
    n = Network.allow(domains=["a.example.com"], requests_per_minute=5, bytes_per_minute=10_000)
    assert Network.from_dict(n.to_dict()) == n and n.to_dict()["requests_per_minute"] == 5
    assert Network.from_dict(Network.open(bytes_per_minute=7).to_dict()).bytes_per_minute == 7
    assert "requests_per_minute" not in Network.allow(domains=["a.example.com"]).to_dict()
    for bad in (0, -1, 1.5, True, "5"):
        with pytest.raises(NetworkPolicyError, match="requests_per_minute"):
            Network.allow(domains=["a.example.com"], requests_per_minute=bad)
    with pytest.raises(NetworkPolicyError, match="none"):
        Network.from_dict({"mode": "none", "bytes_per_minute": 5})


def test_plain_http_requests_are_counted_and_the_one_over_is_never_sent(sandbox, world):
    sb = sandbox(Network.allow(domains=["www.example.test"], requests_per_minute=3))
    mark = world.mark()
    got = codes(sb, "http://www.example.test/budget-http", 5)
    assert got[:3] == ["200"] * 3 and "200" not in got[3:], got
    assert len(http_events(world, mark, "/budget-http")) == 3
    assert any(d.verdict == "deny" and "the budget of www.example.test of 3 requests per minute" in d.reason
               for d in sb.log())


def test_tls_relayed_unread_counts_connections_and_bytes(sandbox, world):
    sb = sandbox(Network.allow(domains=["www.example.test"], requests_per_minute=2))
    mark = world.mark()
    got = codes(sb, "https://www.example.test/budget-tls", 3)
    assert got[:2] == ["200", "200"] and got[2] != "200", got
    assert len(http_events(world, mark, "/budget-tls")) == 2
    assert any(d.verdict == "deny" and "a connection to www.example.test over" in d.reason for d in sb.log())

    sb2 = sandbox(Network.allow(domains=["www.example.test"], bytes_per_minute=200_000))
    r = sb2.curl("-o", "/dev/null", "-w", "%{http_code} %{size_download}", "https://www.example.test/bytes/250000")
    assert r.stdout.startswith("200 250000"), (r.stdout, r.stderr)   # a response may take the minute past it
    # then the minute's bytes are spent: the next connection is refused
    r = sb2.curl("-o", "/dev/null", "-w", "%{http_code}", "https://www.example.test/bytes/1000")
    assert r.returncode != 0 or r.stdout != "200", r.stdout
    assert any(d.verdict == "deny" and "200000 bytes per minute" in d.reason for d in sb2.log())


def test_raw_tcp_to_a_cidr_is_cut_at_the_byte_budget(sandbox, world):
    sb = sandbox(Network.allow(cidrs=["203.0.113.20/32"], ports=[7000], bytes_per_minute=10_000))
    mark = world.mark()
    r = sb.run("python3", "-c", ECHO_PY, "20", timeout=30)
    sent, how = r.stdout.split()
    # each round trip is 2,000 bytes of the budget (1,000 each way): the sandbox sends no byte past it
    assert how != "ok" and int(sent) <= 10_000, r.stdout + r.stderr
    assert any(d.verdict == "deny" and "the budget of 203.0.113.20/32 of 10000 bytes per minute" in d.reason
               for d in sb.log()), [d.reason for d in sb.log()]
    assert len([e for e in world.events_since(mark) if e["kind"] == "tcp" and e["port"] == 7000]) == 1


def test_a_wildcard_entry_is_one_budget_for_every_name_below_it(sandbox, world):
    sb = sandbox(Network.allow(domains=["*.example.test"], requests_per_minute=2))
    mark = world.mark()
    got = [sb.curl("-o", "/dev/null", "-w", "%{http_code}", f"http://{h}/budget-wild").stdout
           for h in ("www.example.test", "other.example.test", "second.example.test")]
    assert got[:2] == ["200", "200"] and got[2] != "200", got   # a third name gets no minute of its own
    assert len(http_events(world, mark, "/budget-wild")) == 2


def test_open_counts_everything_together(sandbox, world):
    sb = sandbox(Network.open(requests_per_minute=2))
    mark = world.mark()
    got = [sb.curl("-o", "/dev/null", "-w", "%{http_code}", url).stdout
           for url in ("http://www.example.test/budget-open", "https://other.example.test/budget-open",
                       "http://second.example.test/budget-open")]
    assert got[:2] == ["200", "200"] and got[2] != "200", got
    assert len(http_events(world, mark, "/budget-open")) == 2


def test_a_policy_change_applies_to_open_connections_and_keeps_the_minute(sandbox, world):
    sb = sandbox(Network.allow(cidrs=["203.0.113.20/32"], ports=[7000]))
    # a connection opened without a budget, then capped by a new policy while it is open
    code = ("import socket, sys, time\n"
            "s = socket.create_connection(('203.0.113.20', 7000), timeout=8)\n"
            "s.sendall(b'x' * 1000); s.recv(65536)\n"
            "print('open', flush=True); sys.stdin.readline()\n"
            "try:\n"
            "    for _ in range(50):\n"
            "        s.sendall(b'y' * 1000); assert s.recv(65536)\n"
            "    print('uncapped')\n"
            "except (OSError, AssertionError) as e:\n"
            "    print('cut', type(e).__name__)\n")
    import subprocess

    p = subprocess.Popen(["ip", "netns", "exec", sb.netns, "setpriv", "--bounding-set=-all", "--inh-caps=-all",
                          "--no-new-privs", "--", "python3", "-c", code], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "open"
        sb.set_policy(Network.allow(cidrs=["203.0.113.20/32"], ports=[7000], bytes_per_minute=20_000))
        p.stdin.write("\n")
        p.stdin.flush()
        out = p.stdout.readline().strip()
        assert out.startswith("cut"), out
    finally:
        p.kill()
        p.wait()
        p.stdin.close()
        p.stdout.close()
    # and a new connection finds the minute still spent
    r = sb.run("python3", "-c", ECHO_PY, "5", timeout=30)
    assert not r.stdout.endswith("ok\n"), r.stdout


def test_a_credential_host_is_charged_to_its_entry_too(sandbox, world, tmp_path):
    api = "api.example.test"
    sb = sandbox(Network.allow(domains=[api], credentials={api: Secret.from_value("sk-live-0123456789abcdef")},
                               requests_per_minute=2))
    pem = world.gw.sync(world.gw.gw.ca_pem, sb.id)
    (tmp_path / "ca.pem").write_bytes(pem)
    got = [sb.run("curl", "-sS", "--max-time", "8", "--cacert", str(tmp_path / "ca.pem"), "-o", "/dev/null",
                  "-w", "%{http_code}", f"https://{api}/echo-headers", timeout=30).stdout for _ in range(3)]
    assert got == ["200", "200", "429"], got
    assert json.dumps(world.gw.sync(lambda: world.gw.gw.log(sb.id).to_dict())).count("requests per minute") >= 1
