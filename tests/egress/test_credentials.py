"""Credentials brokered at the gateway (egress/broker.py), in the suite's world of network namespaces.

The fake API (tests/egress/_fakenet.py) records every header it gets and, at /echo-headers, sends them back:
the secret must reach it, come back to the sandbox only as stars, never go to another host, and stop at its
budget. The sandbox side trusts only its own CA (curl --cacert of it); the gateway dials upstream verifying
the fake internet's certificates.
"""

from __future__ import annotations

import json
import ssl

import pytest

from hutch import Network, NetworkPolicyError, Secret

SECRET = "sk-live-7c1f0e5a9b2d4c3e8f60a1b2c3d4e5f6"
API = "api.example.test"


def creds(**kw):
    return {API: Secret.from_value(SECRET, **kw)}


def ca_file(world, sb, tmp_path):
    pem = world.gw.sync(world.gw.gw.ca_pem, sb.id)
    p = tmp_path / f"{sb.id}-ca.pem"
    p.write_bytes(pem)
    return p


def curl(sb, ca, *args):
    return sb.run("curl", "-sS", "--max-time", "8", "--cacert", str(ca), *args, timeout=30)


def got_headers(world, mark, path=None):
    return [e["headers"] for e in world.events_since(mark)
            if e["kind"] == "http" and (path is None or e["path"].startswith(path))]


def test_the_secret_reaches_the_api_and_comes_back_only_as_stars(sandbox, world, tmp_path):
    sb = sandbox(Network.allow(domains=[API, "www.example.test"], credentials=creds()))
    ca = ca_file(world, sb, tmp_path)
    mark = world.mark()
    # the sandbox sends its own Authorization: the gateway's replaces it
    r = curl(sb, ca, "-H", "Authorization: Bearer forged", "-H", "Accept-Encoding: gzip",
             f"https://{API}/echo-headers")
    assert r.returncode == 0, r.stderr
    upstream = got_headers(world, mark, "/echo-headers")
    assert upstream == [upstream[0]] and upstream[0]["authorization"] == f"Bearer {SECRET}"
    assert upstream[0]["accept-encoding"] == "identity"
    echoed = json.loads(r.stdout)["headers"]
    assert SECRET not in r.stdout and echoed["authorization"] == "*" * len(f"Bearer {SECRET}")
    log = sb.log()
    assert any(d.name == API and d.verdict == "allow" and "credential brokered" in d.reason for d in log)
    assert SECRET not in repr(list(log)) and SECRET not in json.dumps(world.gw.sync(
        lambda: world.gw.gw.log(sb.id).to_dict()))


def test_a_custom_header_and_format(sandbox, world, tmp_path):
    sb = sandbox(Network.allow(domains=[API], credentials={API: Secret.from_value(
        SECRET, header="X-Api-Key", format="key={}")}))
    mark = world.mark()
    r = curl(sb, ca_file(world, sb, tmp_path), f"https://{API}/echo-headers")
    assert r.returncode == 0, r.stderr
    h = got_headers(world, mark)[0]
    assert h["x-api-key"] == f"key={SECRET}" and "authorization" not in h
    assert SECRET not in r.stdout


def test_the_credential_goes_to_no_other_host(sandbox, world, tmp_path):
    sb = sandbox(Network.allow(domains=[API, "www.example.test", "other.example.test"], credentials=creds()))
    ca = ca_file(world, sb, tmp_path)
    mark = world.mark()
    # another allowed host over TLS: relayed unread, its own certificate (the sandbox's CA cannot vouch for it)
    r = curl(sb, ca, "https://www.example.test/echo-headers")
    assert r.returncode != 0
    r = sb.curl("https://www.example.test/echo-headers")    # with the real CA: works, and carries no credential
    assert r.returncode == 0 and "authorization" not in json.loads(r.stdout)["headers"]
    # plain HTTP to the credential host itself: no credential either
    r = sb.run("curl", "-sS", "--max-time", "8", f"http://{API}/echo-headers")
    assert r.returncode == 0 and "authorization" not in json.loads(r.stdout)["headers"]
    # the credential host's TLS, but a request for another host inside it: refused, never forwarded
    r = curl(sb, ca, "-H", "Host: other.example.test", f"https://{API}/echo-headers")
    assert r.returncode != 0
    # SNI of the credential host, dialed at another server's address: the gateway dials the real one
    r = curl(sb, ca, "--resolve", f"{API}:443:203.0.113.10", f"https://{API}/echo-headers")
    assert r.returncode == 0 and json.loads(r.stdout)["server"] == "198.51.100.10"
    for e in world.events_since(mark):
        if e["kind"] == "http" and "authorization" in e["headers"]:
            assert e["local"] == "198.51.100.10" and e["host"] == API, e
    assert any(d.verdict == "deny" and "other.example.test" in d.reason for d in sb.log())


def test_an_upstream_that_does_not_verify_gets_no_credential(sandbox, world, tmp_path):
    sb = sandbox(Network.allow(domains=[API], credentials=creds()))
    ca = ca_file(world, sb, tmp_path)
    trusted = world.gw.sync(lambda: world.gw.gw.upstream_tls)
    world.gw.sync(setattr, world.gw.gw, "upstream_tls", ssl.create_default_context())   # the host's CAs only
    try:
        mark = world.mark()
        r = curl(sb, ca, f"https://{API}/echo-headers")
        assert r.returncode != 0
        assert not got_headers(world, mark)
        assert any(d.verdict == "deny" and "did not verify" in d.reason for d in sb.log())
    finally:
        world.gw.sync(setattr, world.gw.gw, "upstream_tls", trusted)


def test_budgets_cap_requests_and_bytes(sandbox, world, tmp_path):
    sb = sandbox(Network.allow(domains=[API], credentials=creds(requests_per_minute=3)))
    ca = ca_file(world, sb, tmp_path)
    mark = world.mark()
    codes = [curl(sb, ca, "-o", "/dev/null", "-w", "%{http_code}", f"https://{API}/echo-headers").stdout
             for _ in range(5)]
    assert codes == ["200", "200", "200", "429", "429"], codes
    assert len(got_headers(world, mark)) == 3
    assert any(d.verdict == "deny" and "3 requests per minute" in d.reason for d in sb.log())

    sb2 = sandbox(Network.allow(domains=[API], credentials=creds(bytes_per_minute=20_000)))
    ca2 = ca_file(world, sb2, tmp_path)
    mark = world.mark()
    (tmp_path / "up").write_bytes(b"u" * 30_000)
    r = curl(sb2, ca2, "-o", "/dev/null", "-w", "%{http_code}", "--data-binary", f"@{tmp_path / 'up'}",
             f"https://{API}/upload")
    assert r.stdout == "429" and not got_headers(world, mark)      # refused before a byte went upstream
    # a response counts too: once the minute's bytes are past the budget, the next request is refused
    codes = [curl(sb2, ca2, "-o", "/dev/null", "-w", "%{http_code}", f"https://{API}/bytes/15000").stdout
             for _ in range(3)]
    assert codes == ["200", "200", "429"], codes


def test_a_policy_change_ends_a_brokered_connection_whose_credential_changed(sandbox, world, tmp_path):
    sb = sandbox(Network.allow(domains=[API], credentials=creds()))
    ca = ca_file(world, sb, tmp_path)
    code = f"""
import socket, ssl, sys, time
ctx = ssl.create_default_context(cafile={str(ca)!r})
s = ctx.wrap_socket(socket.create_connection(({API!r}, 443), timeout=10), server_hostname={API!r})
req = b"GET /echo-headers HTTP/1.1\\r\\nHost: {API}\\r\\n\\r\\n"
s.sendall(req); print(len(s.recv(65536)) > 0, flush=True)
sys.stdin.readline()
try:
    s.sendall(req); print(repr(s.recv(65536)[:12]), flush=True)
except OSError as e:
    print("reset", flush=True)
"""
    import subprocess
    p = subprocess.Popen(["ip", "netns", "exec", sb.netns, "python3", "-c", code], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "True"
        sb.set_policy(Network.allow(domains=[API], credentials={API: Secret.from_value("sk-other-0123456789")}))
        p.stdin.write("\n")
        p.stdin.flush()
        assert p.stdout.readline().strip() in ("reset", "b''")
    finally:
        p.kill()
        p.wait()
        p.stdin.close()
        p.stdout.close()
    assert any(d.verdict == "deny" and "credential" in d.reason and "changed" in d.reason for d in sb.log())


def test_a_credential_without_its_value_is_refused_by_the_gateway(sandbox, world, monkeypatch):
    """A client that sends only the variable's name must not make the daemon read its own environment."""
    monkeypatch.setenv("HUTCH_TEST_DAEMON_SECRET", "daemon-own-secret-value")
    policy = Network.allow(domains=[API], credentials={API: Secret.from_env("HUTCH_TEST_DAEMON_SECRET")})
    sb = sandbox(Network.none(), attach=False)
    with pytest.raises(NetworkPolicyError, match="without its value"):
        world.gw.call(world.gw.gw.attach(sb.id, f"/run/netns/{sb.netns}", policy))
    with pytest.raises(NetworkPolicyError, match="without its value"):   # nor by a policy change
        world.gw.call(world.gw.gw.attach(sb.id, f"/run/netns/{sb.netns}", Network.none()))
        world.gw.call(world.gw.gw.set_policy(sb.id, policy))


def test_secret_values_are_checked_and_never_shown():
    s = Secret.from_value(SECRET)
    assert SECRET not in repr(s) and SECRET not in repr(Network.allow(domains=[API], credentials={API: s}))
    assert "value" not in s.to_dict() and s.to_dict(reveal=True)["value"] == SECRET
    for bad, words in ((lambda: Secret.from_value("short"), "8 to"),
                       (lambda: Secret.from_value(SECRET + "\r\nX-Evil: 1"), "line break"),
                       (lambda: Secret.from_value(SECRET, header="Host"), "header"),
                       (lambda: Secret.from_value(SECRET, header="Content-Length"), "header"),
                       (lambda: Secret.from_value(SECRET, format="Bearer {0.__class__}"), "format"),
                       (lambda: Secret.from_value(SECRET, format="no placeholder"), "format"),
                       (lambda: Secret.from_value(SECRET, requests_per_minute=0), "positive"),
                       (lambda: Network.allow(domains=["*.example.test"], credentials={"*.example.test": s}),
                        "no wildcard"),
                       (lambda: Network.allow(domains=["www.example.test"], credentials={API: s}),
                        "not in the allowed domains"),
                       (lambda: Network.allow(domains=[API], credentials={API: "sk-raw"}), "not a hutch.Secret")):
        with pytest.raises(NetworkPolicyError, match=words):
            bad()
    import hutch

    with pytest.raises(hutch.InvalidSpecError, match="takes no credentials"):
        hutch.Image.debian_slim().run_commands("true", network=Network.allow(domains=[API], credentials={API: s}))


PIPELINE = """
import socket, ssl, sys
ctx = ssl.create_default_context(cafile=sys.argv[1])
s = ctx.wrap_socket(socket.create_connection(("{api}", 443), timeout=10), server_hostname="{api}")
s.sendall(sys.argv[2].encode().decode("unicode_escape").encode("latin-1"))
got = b""
while True:
    try:
        d = s.recv(65536)
    except (OSError, ssl.SSLError):
        break
    if not d:
        break
    got += d
sys.stdout.write(got.decode("latin-1"))
""".replace("{api}", API)


def test_pipelined_requests_past_the_budget_get_their_answers_in_order(sandbox, world, tmp_path):
    sb = sandbox(Network.allow(domains=[API], credentials=creds(requests_per_minute=2)))
    ca = ca_file(world, sb, tmp_path)
    one = f"GET /echo-headers HTTP/1.1\\r\\nHost: {API}\\r\\n\\r\\n"
    r = sb.run("python3", "-c", PIPELINE, str(ca), one * 3, timeout=40)
    import re

    assert re.findall(r"HTTP/1\.1 (\d{3}) ", r.stdout) == ["200", "200", "429"], r.stdout[-500:]
    assert SECRET not in r.stdout


def test_an_upgrade_on_a_credential_connection_is_refused(sandbox, world, tmp_path):
    sb = sandbox(Network.allow(domains=[API], credentials=creds()))
    ca = ca_file(world, sb, tmp_path)
    mark = world.mark()
    up = f"GET /echo-headers HTTP/1.1\\r\\nHost: {API}\\r\\nUpgrade: websocket\\r\\nConnection: Upgrade\\r\\n\\r\\n"
    r = sb.run("python3", "-c", PIPELINE, str(ca), up, timeout=40)
    assert "HTTP/1.1" not in r.stdout and not got_headers(world, mark)
    assert any(d.verdict == "deny" and "Upgrade" in d.reason for d in sb.log())


def test_the_upstream_context_verifies_certificate_and_name():
    from hutch.sandbox._host.egress.broker import upstream_context

    ctx = upstream_context()
    assert ctx.verify_mode == ssl.CERT_REQUIRED and ctx.check_hostname
    assert ctx.minimum_version >= ssl.TLSVersion.TLSv1_2


HANDSHAKES = """
import socket, ssl, sys, threading
ctx = ssl.create_default_context(cafile=sys.argv[1])
ok, refused, held = [], [], []
def one():
    try:
        s = ctx.wrap_socket(socket.create_connection(("api.example.test", 443), timeout=10),
                            server_hostname="api.example.test")
        held.append(s)
        ok.append(1)
    except OSError:
        refused.append(1)
ts = [threading.Thread(target=one) for _ in range(int(sys.argv[2]))]
[t.start() for t in ts]
[t.join() for t in ts]
print(len(ok), len(refused))
"""


def test_one_sandbox_s_tls_work_at_the_gateway_is_bounded(sandbox, world, tmp_path, monkeypatch):
    """The gateway's TLS for credential hosts runs on the daemon's CPU, so each sandbox gets a share: connections
    at once, handshakes a second, brokered bytes a second (paced, not cut); what is held back is counted."""
    import time

    from hutch.sandbox._host.egress import broker

    monkeypatch.setattr(broker, "BROKERED_BYTES_PER_SECOND", 256 << 10)   # the gateway runs in this process
    sb = sandbox(Network.allow(domains=[API], credentials=creds()))
    ca = ca_file(world, sb, tmp_path)
    r = sb.run("python3", "-c", HANDSHAKES, str(ca), "60", timeout=60)
    ok, refused = map(int, r.stdout.split())
    assert ok <= broker.MAX_BROKERED and ok + refused == 60, (r.stdout, r.stderr)
    lim = sb.log().limits
    assert lim["tls_over_connection_limit"] + lim["tls_over_handshake_rate"] >= refused > 0, lim
    time.sleep(60 / broker.HANDSHAKES_PER_SECOND)   # the burst is back: brokering goes on
    r = curl(sb, ca, "-o", "/dev/null", "-w", "%{http_code}", f"https://{API}/echo-headers")
    assert r.stdout == "200", (r.stdout, r.stderr)
    # bytes: paced to BROKERED_BYTES_PER_SECOND (256 KiB/s here: 1 s of burst, then 3 s), the download whole
    n = 1 << 20
    t0 = time.monotonic()
    r = curl(sb, ca, "-o", "/dev/null", "-w", "%{http_code} %{size_download}", f"https://{API}/bytes/{n}")
    took = time.monotonic() - t0
    assert r.stdout == f"200 {n}", (r.stdout, r.stderr)
    assert took >= 2.5 and sb.log().limits["tls_paced_ms"] > 0, (took, sb.log().limits)
