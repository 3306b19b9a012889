"""Egress bypasses beyond the conformance suite: odd TLS hellos, HTTP framing a lenient server reads
differently, DNS tricks and rebinding, never-reachable answers, host-local routes, ICMP, policy
changes cutting live connections, and what a real sandbox may do to its own network.

Same rules as test_conformance.py: clients run in sandbox namespaces without capabilities,
against the fake internet of egress_world.py; every check also looks at what the fake internet
(or the fake host) did or did not receive.
"""

from __future__ import annotations

import asyncio
import json
import os
import struct
import subprocess
import sys
import textwrap
import time

import pytest

from hutch import Network

from egress_world import GW, HOST_SERVICE_PORT, sh, wait_for

ALLOW_WWW = Network.allow(domains=["www.example.test"])


def run_json(sb, code: str, *args, timeout=40, caps=False):
    r = sb.run(sys.executable, "-c", textwrap.dedent(code), *args, timeout=timeout, caps=caps)
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


# A client that sends raw bytes on a fresh connection per case and says what came back:
# "reset", "eof", "timeout", or the first bytes of the answer.
RAW_CLIENT = """
import json, socket, sys, time
cases = json.loads(sys.argv[1])
out = {}
for c in cases:
    try:
        s = socket.create_connection((c["host"], c["port"]), timeout=5)
    except OSError as e:
        out[c["name"]] = "connect-error " + type(e).__name__
        continue
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    s.settimeout(c.get("wait", 3))
    got = "timeout"
    try:
        for part in c["parts"]:
            s.sendall(bytes.fromhex(part))
            time.sleep(c.get("gap", 0))
        data = b""
        while True:
            d = s.recv(65536)
            if not d:
                got = "data " + data.decode("latin-1") if data else "eof"
                break
            data += d
            if c.get("until", "}").encode("latin-1") in data:
                got = "data " + data.decode("latin-1")
                break
    except ConnectionResetError:
        got = "reset"
    except socket.timeout:
        pass
    except OSError as e:
        got = "error " + type(e).__name__
    s.close()
    out[c["name"]] = got
print(json.dumps(out))
"""


def raw_cases(sb, cases, timeout=60):
    for c in cases:
        c["parts"] = [p.hex() for p in c["parts"]]
    return run_json(sb, RAW_CLIENT, json.dumps(cases), timeout=timeout)


def body_of(result: str) -> dict:
    assert result.startswith("data "), result
    return json.loads(result.split("\r\n\r\n", 1)[1])


# --- TLS ClientHellos, built by hand ----------------------------------------------


def client_hello(names=(("www.example.test", 0),), *, sni_twice=False, extra=(), hs_type=1,
                 declared=None) -> bytes:
    """A TLS handshake message (no record header): ClientHello with the given server_name entries."""
    exts = b""
    if names is not None:
        entries = b"".join(struct.pack("!BH", t, len(n)) + n for n, t in
                           ((n.encode("utf-8") if isinstance(n, str) else n, t) for n, t in names))
        data = struct.pack("!H", len(entries)) + entries
        exts += (struct.pack("!HH", 0, len(data)) + data) * (2 if sni_twice else 1)
    for etype, data in extra:
        exts += struct.pack("!HH", etype, len(data)) + data
    body = (b"\x03\x03" + os.urandom(32) + b"\x00" + b"\x00\x04\x13\x01\xc0\x2f" + b"\x01\x00"
            + struct.pack("!H", len(exts)) + exts)
    n = len(body) if declared is None else declared
    return bytes([hs_type]) + n.to_bytes(3, "big") + body


def records(hs: bytes, size: int = 16384, content_type: int = 0x16) -> list[bytes]:
    return [bytes([content_type, 3, 1]) + struct.pack("!H", len(hs[i:i + size])) + hs[i:i + size]
            for i in range(0, len(hs), size)]


def test_odd_client_hellos_dial_only_the_allowed_names_address(sandbox):
    """Each hello goes to a forbidden address (203.0.113.10); only an allowed SNI may move it, and
    only to the name's own address. Every refusal is logged with its reason."""
    sb = sandbox(Network.allow(domains=["www.example.test"], ports=[443]))
    ech = [(0xFE0D, b"\x00" + os.urandom(40))]
    cases = [   # name, parts (each sent as its own segment), expected verdict, what the reason says
        ("upper", records(client_hello((("WWW.EXAMPLE.TEST", 0),))), "allow", "matches"),
        ("trailing-dot", records(client_hello((("www.example.test.", 0),))), "allow", "matches"),
        ("tiny-records", records(client_hello(), size=7), "allow", "matches"),
        ("segments", [bytes([b]) for b in b"".join(records(client_hello()))[:40]]
         + [b"".join(records(client_hello()))[40:]], "allow", "matches"),
        ("forbidden-byte-by-byte", [bytes([b]) for b in b"".join(records(client_hello((("evil.test", 0),))))],
         "deny", "not in the allowed"),
        ("non-hostname-entry-ignored", records(client_hello((("evil.test", 1), ("www.example.test", 0)))),
         "allow", "matches"),
        ("two-names", records(client_hello((("www.example.test", 0), ("evil.test", 0)))), "deny", "more than one"),
        ("sni-twice", records(client_hello(sni_twice=True)), "deny", "twice"),
        ("nul", records(client_hello((("www.example.test\0.evil.test", 0),))), "deny", "not a DNS name"),
        ("ip-literal", records(client_hello((("192.0.2.10", 0),))), "deny", "not a DNS name"),
        ("non-ascii", records(client_hello((("www.ex\u00e4mple.test", 0),))), "deny", "ASCII"),
        ("other-name", records(client_hello((("evil.test", 0),))), "deny", "not in the allowed"),
        ("suffix", records(client_hello((("www.example.test.evil.test", 0),))), "deny", "not in the allowed"),
        ("no-sni", records(client_hello(None)), "deny", "without a server name"),
        ("ech", records(client_hello(extra=ech)), "deny", "ECH"),
        ("esni", records(client_hello(extra=[(0xFFCE, os.urandom(40))])), "deny", "ECH"),
        ("ccs-between-fragments", [records(client_hello(), size=30)[0], records(b"\x01", content_type=0x14)[0],
                                   *records(client_hello(), size=30)[1:]], "deny", "other than a handshake"),
        ("server-hello-first", records(client_hello(hs_type=2)), "deny", "not a ClientHello"),
        ("huge-declared-length", records(client_hello(declared=1 << 20))[:1], "deny", "too large"),
    ]
    got = raw_cases(sb, [{"name": n, "host": "203.0.113.10", "port": 443, "parts": p, "gap": 0.002, "until": "\x00"}
                         for n, p, _, _ in cases])
    log = [d for d in sb.log() if d.protocol in ("tls", "tcp")]
    assert len(log) == len(cases), (got, [(d.verdict, d.reason) for d in log])
    for (name, _, verdict, needle), d in zip(cases, log):
        assert d.verdict == verdict and needle in d.reason, (name, got[name], d)
        if verdict == "allow":
            assert d.address == "192.0.2.10" and d.name == "www.example.test", (name, d)
        else:
            assert got[name] in ("reset", "eof"), (name, got[name])


def test_tls_fronting_reaches_only_the_sni_names_address(sandbox, world):
    """Inside TLS the proxy sees only the SNI (documented), so it dials the SNI name's own address."""
    sb = sandbox(ALLOW_WWW)
    mark = world.mark()
    r = sb.curl("--resolve", "www.example.test:443:203.0.113.10", "-H", "Host: evil.test", "https://www.example.test/f")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["server"] == "192.0.2.10"
    # the other way round: a forbidden SNI with an allowed inner Host is refused before any dial
    r = sb.curl("--resolve", "evil.test:443:192.0.2.10", "-H", "Host: www.example.test", "https://evil.test/g")
    assert r.returncode != 0
    reached = [(e.get("local"), e.get("path")) for e in world.events_since(mark) if e["kind"] in ("tcp", "http")]
    assert reached and all(local == "192.0.2.10" for local, _ in reached), reached
    assert ("192.0.2.10", "/g") not in reached


# --- HTTP requests -----------------------------------------------------------------


def req(target, *headers, method="GET", version="HTTP/1.1", body=b"") -> bytes:
    head = f"{method} {target} {version}\r\n" + "".join(h + "\r\n" for h in headers) + "\r\n"
    return head.encode("latin-1") + body


def test_http_request_shapes_reach_only_the_allowed_host(sandbox, world):
    sb = sandbox(ALLOW_WWW)
    www = "Host: www.example.test"
    smuggled = req("/c-smuggled", "Host: evil.test")
    cases = [   # name, bytes, allowed
        ("host-port", req("/c-host-port", "Host: www.example.test:8080"), True),
        ("host-upper-dot", req("/c-host-upper-dot", "Host: WWW.Example.TEST."), True),
        ("absolute-same", req("http://www.example.test/c-absolute-same", www), True),
        ("userinfo-host-1", req("/c-u1", "Host: evil.test@www.example.test"), False),
        ("userinfo-host-2", req("/c-u2", "Host: www.example.test@evil.test"), False),
        ("host-list", req("/c-host-list", "Host: www.example.test, evil.test"), False),
        ("host-empty", req("/c-host-empty", "Host: "), False),
        ("host-ipv6", req("/c-host-ipv6", "Host: [::ffff:127.0.0.1]"), False),
        ("host-ip", req("/c-host-ip", "Host: 192.0.2.10"), False),
        ("host-twice-case", req("/c-twice", www, "host: evil.test"), False),
        ("host-space-before-colon", req("/c-space", "Host : evil.test", www), False),
        ("absolute-upper-scheme", req("HTTP://evil.test/c-abs-upper", www), False),
        ("absolute-userinfo", req("http://www.example.test@evil.test/c-abs-ui", www), False),
        ("absolute-fragment", req("http://evil.test#@www.example.test/c-abs-frag", www), False),
        ("absolute-other-scheme", req("ftp://evil.test/c-abs-ftp", www), False),
        ("http10-no-host", req("/c-10", version="HTTP/1.0"), False),
        ("http10-absolute-no-host", req("http://www.example.test/c-10abs", version="HTTP/1.0"), False),
        ("connect-forbidden", req("evil.test:443", "Host: evil.test:443", method="CONNECT"), False),
        ("connect-allowed", req("www.example.test:443", "Host: www.example.test:443", method="CONNECT"), False),
        ("websocket", req("/c-ws", www, "Upgrade: websocket", "Connection: Upgrade"), False),
        ("lowercase-method", b"get /c-lower HTTP/1.1\r\nHost: evil.test\r\n\r\n", False),
        ("tab-separated", b"GET\t/c-tab HTTP/1.1\r\nHost: evil.test\r\n\r\n", False),
        ("http09", b"GET /c-09\r\n\r\n", False),
        ("leading-crlf", b"\r\n" + req("/c-crlf", "Host: evil.test"), False),
        ("pipelined-one-segment", req("/c-pipe1", www) + smuggled, False),
        ("after-a-body", req("/c-body", www, "Content-Length: 4", method="POST", body=b"abcd") + smuggled, False),
        ("te-on-http10", req("/c-te10", www, "Transfer-Encoding: chunked", method="POST", version="HTTP/1.0",
                             body=b"0\r\n\r\n"), False),
        ("te-underscore", req("/c-te_", www, "Content-Length: 5", "Transfer_Encoding: chunked", method="POST",
                              body=b"0\r\n\r\n"), False),
        ("cl-underscore", req("/c-cl_", www, "Content_Length: 5", method="POST", body=b"hello"), False),
    ]
    mark = world.mark()
    specs = [{"name": n, "host": "203.0.113.10", "port": 80, "parts": [b]} for n, b, _ in cases]
    # the same requests one byte per segment: the decision waits for the whole head
    for name, raw in (("dribbled-allowed", req("/c-dribbled-allowed", www)),
                      ("dribbled-forbidden", req("/c-dribbled-forbidden", "Host: evil.test"))):
        cases.append((name, raw, name.endswith("-allowed")))
        specs.append({"name": name, "host": "203.0.113.10", "port": 80, "parts": [bytes([b]) for b in raw],
                      "gap": 0.001})
    got = raw_cases(sb, specs)
    evs = [e for e in world.events_since(mark) if e["kind"] in ("tcp", "http")]
    assert not [e for e in evs if e.get("local") != "192.0.2.10"], evs
    hosts = {e["path"]: e["host"] for e in evs if e["kind"] == "http"}
    for name, raw, allowed in cases:
        path = raw.split(b" ")[1].decode("latin-1")
        if allowed:
            assert body_of(got[name])["server"] == "192.0.2.10", (name, got[name])
            assert path in hosts, (name, hosts)
        else:
            assert got[name] in ("reset", "eof"), (name, got[name])
    assert all(h.lower().rstrip(".").startswith("www.example.test") for h in hosts.values()), hosts
    assert "/c-smuggled" not in hosts
    denies = [d for d in sb.log() if d.verdict == "deny"]
    assert len(denies) == sum(1 for c in cases if not c[2]), [(d.name, d.reason) for d in denies]


# A server that reads framing the way some real ones do: HTTP/1.0 bodies by Content-Length only
# (Transfer-Encoding ignored), header names with "_" taken as "-" (CGI/WSGI style). It logs the
# Host of every request it parses.
LENIENT = r"""
import json, socket, sys, threading, time
ev, addr, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind((addr, port)); s.listen()
def log(**kw):
    kw.update(kind="lenient", t=time.time())
    with open(ev, "a") as f: f.write(json.dumps(kw) + "\n")
def serve(c):
    buf = b""
    try:
        while True:
            while b"\r\n\r\n" not in buf:
                d = c.recv(65536)
                if not d: return
                buf += d
            head, buf = buf.split(b"\r\n\r\n", 1)
            lines = head.decode("latin-1").split("\r\n")
            version = lines[0].rsplit(" ", 1)[-1]
            h = {}
            for ln in lines[1:]:
                k, _, v = ln.partition(":")
                h[k.strip().lower().replace("_", "-")] = v.strip()
            log(line=lines[0], host=h.get("host"))
            if version == "HTTP/1.1" and h.get("transfer-encoding", "").lower() == "chunked":
                while True:
                    while b"\r\n" not in buf: buf += c.recv(65536)
                    line, buf = buf.split(b"\r\n", 1)
                    n = int(line.split(b";")[0], 16)
                    while len(buf) < n + 2: buf += c.recv(65536)
                    buf = buf[n + 2:]
                    if n == 0: break
            elif "content-length" in h:
                n = int(h["content-length"])
                while len(buf) < n: buf += c.recv(65536)
                buf = buf[n:]
            c.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
    except Exception:
        pass
    finally:
        c.close()
print("ready", flush=True)
def accept():
    while True:
        c, _ = s.accept(); threading.Thread(target=serve, args=(c,), daemon=True).start()
threading.Thread(target=accept, daemon=True).start()
sys.stdin.read()
"""


@pytest.fixture
def lenient_server(world):
    """The lenient server on 192.0.2.10:8081 in the fake internet; stopped (by its own pid) afterwards."""
    p = subprocess.Popen(["ip", "netns", "exec", world.inet, sys.executable, "-c", LENIENT, str(world.events),
                          "192.0.2.10", "8081"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "ready"
        yield ("192.0.2.10", 8081)
    finally:
        p.kill()
        p.wait(5)
        p.stdin.close()
        p.stdout.close()


def test_framing_a_lenient_server_reads_differently_cannot_smuggle_a_request(sandbox, world, lenient_server):
    sb = sandbox(Network.allow(domains=["www.example.test"], ports=[8081]))
    www = "Host: www.example.test"
    smuggled = req("/smuggled", "Host: evil.test")
    # HTTP/1.0 with Transfer-Encoding: the proxy would read a chunk of size 0xFACE whose "data" is,
    # for a server ignoring TE on 1.0, two more requests (the second for evil.test)
    face = b"FACE ;x HTTP/1.1\r\n" + www.encode() + b"\r\n\r\n" + smuggled
    te10 = req("/te10", www, "Transfer-Encoding: chunked", method="POST", version="HTTP/1.0") + face
    te10 += b"x" * (0xFACE - (len(face) - len(b"FACE ;x HTTP/1.1\r\n"))) + b"\r\n0\r\n\r\n"
    # "Transfer_Encoding" beside Content-Length: the proxy would frame by length, the server by chunks
    inner = b"0\r\n\r\n" + smuggled
    under = req("/under", www, f"Content-Length: {len(inner)}", "Transfer_Encoding: chunked", method="POST",
                body=inner)
    mark = world.mark()
    got = raw_cases(sb, [{"name": n, "host": "www.example.test", "port": 8081, "parts": [b], "until": "\x00",
                          "wait": 2} for n, b in (("te10", te10), ("under", under))])
    seen = [e for e in world.events_since(mark) if e["kind"] == "lenient"]
    assert not [e for e in seen if e["host"] != "www.example.test"], (seen, got)
    assert got == {"te10": "reset", "under": "reset"}, got


# --- DNS -------------------------------------------------------------------------------

DNS_CLIENT = """
import json, random, socket, struct, sys
GW = sys.argv[1]
def wire(name):
    if isinstance(name, list):   # raw labels
        return b"".join(bytes([len(x)]) + x.encode("latin-1") for x in name) + b"\\0"
    return b"".join(bytes([len(p)]) + p.encode("latin-1") for p in name.split(".")) + b"\\0"
def ask(name, qtype=1, flags=0x0100, qd=1, extra=b"", ar=0, tcp=False):
    qid = random.randrange(65536)
    msg = struct.pack("!HHHHHH", qid, flags, qd, 0, 0, ar)
    for _ in range(qd):
        msg += wire(name) + struct.pack("!HH", qtype, 1)
    msg += extra
    if tcp:
        s = socket.create_connection((GW, 53), timeout=3)
        s.sendall(struct.pack("!H", len(msg)) + msg)
        data = s.recv(4096)[2:]
    else:
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.settimeout(3)
        s.sendto(msg, (GW, 53)); data = s.recv(4096)
    s.close()
    return [data[3] & 0xF, struct.unpack("!H", data[6:8])[0]]
# EDNS0 OPT with a client-subnet option and a cookie that would carry data upstream
opt = b"\\0" + struct.pack("!HHIH", 41, 4096, 0, 4 + 8 + 4 + 8) + struct.pack("!HH", 8, 8) + b"\\x00\\x01\\x18\\x00\\xc0\\x00\\x02\\x00" + struct.pack("!HH", 10, 8) + b"secretsx"
cases = json.loads(sys.argv[2])
out = {}
for c in cases:
    case = c.pop("case")
    out[case] = ask(**c)
print(json.dumps(out))
"""


def test_dns_tricks_never_send_a_forbidden_name_upstream(sandbox, world):
    sb = sandbox(Network.allow(domains=["*.example.test"]))
    long = ".".join(["s" * 63] * 3) + ".evil.test"
    cases = {   # case: (query arguments, expected [rcode, answers])
        "suffix-appended": ({"name": "www.example.test.evil.test"}, [3, 0]),
        "suffix-glued": ({"name": "evilexample.test"}, [3, 0]),
        "apex-glued": ({"name": "xexample.test"}, [3, 0]),
        "long": ({"name": long}, [3, 0]),
        "long-tcp": ({"name": long, "tcp": True}, [3, 0]),
        "nul-label": ({"name": ["data\0x", "example", "test"]}, [3, 0]),
        "dot-in-label": ({"name": ["data.evil", "test"]}, [3, 0]),
        "case-0x20": ({"name": "WwW.ExAmPlE.TeSt"}, [0, 1]),
        "edns-forbidden": ({"name": "data.evil.test", "ar": 1, "extra": "OPT"}, [3, 0]),
        "edns-allowed": ({"name": "www.example.test", "ar": 1, "extra": "OPT"}, [0, 1]),
        "https-type": ({"name": "www.example.test", "qtype": 65}, [0, 0]),
        "aaaa-mapped-loopback": ({"name": "mapped.example.test", "qtype": 28}, [0, 0]),
        "svcb-type": ({"name": "www.example.test", "qtype": 64}, [0, 0]),
        "any-type": ({"name": "www.example.test", "qtype": 255, "tcp": True}, [0, 0]),
        "null-type": ({"name": "data2.evil.test", "qtype": 10}, [3, 0]),
        "update-opcode": ({"name": "example.test", "flags": 0x2800, "qtype": 6}, [4, 0]),
        "notify-opcode": ({"name": "www.example.test", "flags": 0x2000}, [4, 0]),
        "two-questions": ({"name": "data3.evil.test", "qd": 2}, [1, 0]),
        "a-response": ({"name": "data4.evil.test", "flags": 0x8100}, [1, 0]),
    }
    payload = []
    for case, (kw, _) in cases.items():
        payload.append(dict(kw, case=case))
    code = DNS_CLIENT.replace("out[case] = ask(**c)",
                              'c["extra"] = opt if c.get("extra") == "OPT" else b""; out[case] = ask(**c)')
    mark = world.mark()
    got = run_json(sb, code, GW, json.dumps(payload))
    assert got == {case: want for case, (_, want) in cases.items()}, got
    asked = [(e["name"], e["qtype"]) for e in world.events_since(mark) if e["kind"] == "dns"]
    assert set(asked) <= {("www.example.test", "A")}, asked
    # an answer is logged with the rule that allowed its name
    allowed = [d for d in sb.log() if d.protocol == "dns" and d.verdict == "allow"]
    assert allowed and all(d.reason == "matches *.example.test" for d in allowed), allowed


def test_dns_rebinding_is_checked_when_the_proxy_dials(sandbox, world):
    """rebind.example.test answers a public and a private address in turn, TTL 0."""
    sb = sandbox(Network.allow(domains=["rebind.example.test"]))
    mark = world.mark()
    outcomes = []
    for _ in range(3):
        time.sleep(1.1)     # the gateway keeps even a TTL-0 answer for a second
        r = sb.py(textwrap.dedent("""
            import socket
            s = socket.create_connection(("203.0.113.10", 80), timeout=5)
            s.sendall(b"GET /rebind HTTP/1.1\\r\\nHost: rebind.example.test\\r\\n\\r\\n")
            try:
                print("data" if s.recv(100) else "eof")
            except ConnectionResetError:
                print("reset")
        """))
        outcomes.append(r.stdout.strip())
    answers = [e["answer"] for e in world.events_since(mark) if e["kind"] == "rebind"]
    assert len(answers) >= 3, answers
    # each connection was decided on the proxy's own, fresh lookup
    assert outcomes == ["data" if a == ["203.0.113.10"] else "reset" for a in answers[:3]], (outcomes, answers)
    evs = world.events_since(mark)
    assert not [e for e in evs if e.get("local") == "10.0.0.1"], evs
    assert any(d.verdict == "deny" and "10.0.0.1" in d.reason for d in sb.log())


# --- addresses that must never be dialed ---------------------------------------------------

NEVER_NAMES = ["zero.example.test", "bcast.example.test", "mcast.example.test", "sibling.example.test",
               "bench.example.test", "alimeta.example.test", "mapped.example.test"]


def test_names_resolving_to_never_or_special_addresses_are_refused(sandbox, world):
    other = sandbox(Network.open())    # so that 198.18.0.2 may well be a live sibling sandbox
    sb = sandbox(Network.allow(domains=["*.example.test"], ports=None))
    assert other.address
    mark = world.mark()
    cases = []
    for name in NEVER_NAMES:
        for port in (80, HOST_SERVICE_PORT):
            cases.append({"name": f"{name}:{port}", "host": "192.0.2.10", "port": port, "wait": 2,
                          "parts": [req("/never", f"Host: {name}")]})
    got = raw_cases(sb, cases)
    assert set(got.values()) <= {"reset", "eof"}, got
    r = sb.run("getent", "ahostsv4", *NEVER_NAMES)
    assert r.stdout.strip() == "", r.stdout
    time.sleep(0.2)
    evs = world.events_since(mark)
    assert not [e for e in evs if e["kind"] in ("tcp", "http", "host-tcp")], evs
    denied = {d.name for d in sb.log() if d.verdict == "deny"}
    assert set(NEVER_NAMES) <= denied, denied


@pytest.fixture
def host_local(world):
    """198.51.100.77 made local on the fake host by a `local` route, 198.51.100.78 by a new address."""
    made = []
    try:
        sh("ip", "-n", world.host, "route", "add", "local", "198.51.100.77/32", "dev", "lo", "table", "local")
        made.append(("route", "del", "local", "198.51.100.77/32", "dev", "lo", "table", "local"))
        sh("ip", "-n", world.host, "addr", "add", "198.51.100.78/32", "dev", "lo")
        made.append(("addr", "del", "198.51.100.78/32", "dev", "lo"))
        yield
    finally:
        for args in made:
            sh("ip", "-n", world.host, *args, check=False)


def test_host_local_routes_and_fresh_host_addresses_are_never_dialed(sandbox, world, host_local):
    """The host's own addresses are never reachable, also those of a `local` route and one added a moment ago."""
    sb = sandbox(Network.allow(domains=["*.example.test"], ports=None))
    mark = world.mark()
    got = raw_cases(sb, [{"name": name, "host": "192.0.2.10", "port": HOST_SERVICE_PORT, "wait": 2,
                          "parts": [req("/local", f"Host: {name}")]}
                         for name in ("anyip.example.test", "newaddr.example.test")])
    r = sb.run("getent", "ahostsv4", "anyip.example.test", "newaddr.example.test")
    time.sleep(0.2)
    evs = [e for e in world.events_since(mark) if e["kind"].startswith("host-")]
    assert not evs, (evs, got)
    assert set(got.values()) <= {"reset", "eof"}, got
    assert r.stdout.strip() == "", r.stdout


# --- ICMP and raw sockets ------------------------------------------------------------


def icmp_in_echos(world) -> int:
    out = subprocess.run(["ip", "netns", "exec", world.inet, "cat", "/proc/net/snmp"], capture_output=True,
                         text=True, check=True).stdout.splitlines()
    names, values = [ln.split() for ln in out if ln.startswith("Icmp:")][:2]
    return int(values[names.index("InEchos")])


PING = """
import json, socket, struct
out = {}
try:
    socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP); out["raw"] = "opened"
except OSError as e:
    out["raw"] = type(e).__name__
try:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM, socket.IPPROTO_ICMP); s.settimeout(1)
    sent = 0
    for dst in ("203.0.113.10", "192.0.2.53", "%s"):
        try:
            s.sendto(struct.pack("!BBHHH", 8, 0, 0, 1, 1) + b"hutch", (dst, 0)); sent += 1
        except OSError:
            pass
    try:
        s.recv(100); out["ping"] = "reply"
    except OSError:
        out["ping"] = "no reply, sent %%d" %% sent
except OSError as e:
    out["ping"] = type(e).__name__
print(json.dumps(out))
""" % GW


def test_icmp_and_raw_sockets_never_leave(sandbox, world):
    sb = sandbox(Network.open())
    # the worst case: ping sockets allowed to every group (some distributions do this)
    sb.run("sh", "-c", "echo 0 2147483647 > /proc/sys/net/ipv4/ping_group_range", caps=True, check=True)
    before = icmp_in_echos(world)
    got = run_json(sb, PING)
    assert got["raw"] == "PermissionError" and got["ping"].startswith("no reply"), got
    # and with the sandbox's own rules gone (CAP_NET_ADMIN gained somehow): the host drops ICMP
    sb.run("nft", "flush", "ruleset", caps=True, check=True)
    got = run_json(sb, PING, caps=True)
    assert got["raw"] == "opened" and got["ping"].startswith("no reply"), got
    assert icmp_in_echos(world) == before


# --- policy changes cut live connections ------------------------------------------------

HOLD = """
import json, socket, sys, time
conns = {}
www = socket.create_connection(("www.example.test", 80), timeout=20)
www.sendall(b"GET /slow HTTP/1.1\\r\\nHost: www.example.test\\r\\n\\r\\n")
www.recv(100)
conns["http"] = www
echo = socket.create_connection(("203.0.113.20", 7000), timeout=20)
echo.sendall(b"ping"); assert echo.recv(10) == b"ping"
conns["raw"] = echo
print("open", flush=True)
sys.stdin.readline()
t0 = time.monotonic()
out = {}
for name, s in conns.items():
    s.settimeout(3)
    try:
        if name == "raw":
            s.sendall(b"after")
        while True:
            d = s.recv(4096)
            if not d:
                out[name] = "eof"; break
            if time.monotonic() - t0 > 1.5:
                out[name] = "alive"; break
    except ConnectionResetError:
        out[name] = "reset"
    except OSError as e:
        out[name] = type(e).__name__
out["seconds"] = round(time.monotonic() - t0, 2)
print(json.dumps(out), flush=True)
"""


def _change_policy_midway(sb, world, new_policy, script: str, ready: str, *, settle: float = 0.0,
                          unprivileged: bool = False) -> tuple[str, str, object]:
    """Run `script` in the sandbox's netns until it prints `ready`, replace the policy, then tell it to go on:
    (its stdout, its stderr, the world's mark taken just before the change)."""
    drop = ["setpriv", "--bounding-set=-all", "--inh-caps=-all", "--no-new-privs", "--"] if unprivileged else []
    p = subprocess.Popen(["ip", "netns", "exec", sb.netns, *drop, sys.executable, "-c", script],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == ready, p.stderr.read() if p.poll() is not None else ""
        time.sleep(settle)
        mark = world.mark()
        sb.set_policy(new_policy)
        out, err = p.communicate("go\n", timeout=20)
    finally:
        if p.poll() is None:
            p.kill()
        p.wait()
    return out, err, mark


@pytest.mark.parametrize("new_policy", [
    Network.none(),
    Network.allow(domains=["api.example.test"]),
    Network.allow(domains=["www.example.test"], cidrs=["203.0.113.20/32"], ports=[443]),
], ids=["none", "other-name", "other-port"])
def test_policy_change_cuts_established_connections(sandbox, world, new_policy):
    sb = sandbox(Network.allow(domains=["www.example.test"], cidrs=["203.0.113.20/32"], ports=[80, 7000]))
    out, err, mark = _change_policy_midway(sb, world, new_policy, HOLD, "open", unprivileged=True)
    got = json.loads(out.strip().splitlines()[-1])
    # /slow keeps sending: a connection the change did not cut would read as "alive"
    assert got["http"] in ("reset", "eof") and got["raw"] in ("reset", "eof", "BrokenPipeError"), (got, err)
    # nothing the sandbox sent after the change arrived
    assert not [e for e in world.events_since(mark) if e["kind"] in ("tcp", "http")]
    assert len([d for d in sb.log() if "policy change" in d.reason]) == 2, sb.log()


UNDECIDED = """
import socket, sys
s = socket.create_connection(("192.0.2.10", 80), timeout=5)
print("connected", flush=True)
sys.stdin.readline()
try:
    s.sendall(b"GET /undecided HTTP/1.1\\r\\nHost: www.example.test\\r\\n\\r\\n")
    print("data" if s.recv(100) else "eof")
except ConnectionResetError:
    print("reset")
except OSError as e:
    print(type(e).__name__)
"""


@pytest.mark.parametrize("new_policy", [Network.none(), Network.allow(domains=["api.example.test"])],
                         ids=["none", "other-name"])
def test_a_connection_still_being_decided_is_refused_after_a_change(sandbox, world, new_policy):
    sb = sandbox(ALLOW_WWW)
    # settle: accepted by the proxy, waiting for the request
    out, err, mark = _change_policy_midway(sb, world, new_policy, UNDECIDED, "connected", settle=0.1)
    assert out.strip() in ("reset", "eof", "BrokenPipeError"), out + err
    assert not [e for e in world.events_since(mark) if e["kind"] in ("tcp", "http")]


def test_dns_to_any_other_resolver_never_leaves(sandbox, world):
    """UDP DNS only to the gateway, whatever the policy; DNS over TCP elsewhere only where raw TCP is allowed."""
    sb = sandbox(Network.open())
    strict = sandbox(Network.allow(domains=["*.example.test"], ports=None))
    query = bytes.fromhex("123401000001000000000000") + b"\x06leaked\x04evil\x04test\x00\x00\x01\x00\x01"
    code = textwrap.dedent(f"""
        import json, socket, struct
        out = {{}}
        u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        for dst in [("192.0.2.53", 53), ("192.0.2.10", 53), ("203.0.113.10", 443)]:
            try:
                u.sendto({query!r}, dst); out[dst[0]] = "sent"
            except OSError as e:
                out[dst[0]] = type(e).__name__
        try:
            s = socket.create_connection(("192.0.2.53", 53), timeout=3)
            s.sendall(struct.pack("!H", {len(query)}) + {query!r})
            out["tcp"] = "answer" if s.recv(512) else "eof"
        except ConnectionResetError:
            out["tcp"] = "reset"
        except OSError as e:
            out["tcp"] = type(e).__name__
        print(json.dumps(out))
    """)
    mark = world.mark()
    got_open, got_strict = run_json(sb, code), run_json(strict, code)
    time.sleep(0.3)
    evs = world.events_since(mark)
    assert all(v == "PermissionError" for k, v in got_open.items() if k != "tcp"), got_open
    assert got_strict["tcp"] in ("reset", "eof"), got_strict
    # Network.open() admits raw TCP to any public address: DNS over TCP to a public resolver is open by design
    assert got_open["tcp"] == "answer", got_open
    assert [e["name"] for e in evs if e["kind"] == "dns"] == ["leaked.evil.test"], evs
    assert not [e for e in evs if e["kind"] == "udp"], evs


def test_a_policy_change_racing_detach_never_plumbs_another_namespace(sandbox, world):
    """The sandbox ends (detach closes its netns fd) while set_policy still builds its link: the fd number
    is taken at once by another namespace, which must not get the ended sandbox's link and policy."""
    sb = sandbox(Network.none())
    victim = sandbox(Network.none(), attach=False)
    gw = world.gw.gw

    async def race():
        change = asyncio.get_running_loop().create_task(gw.set_policy(sb.id, Network.open()))
        await asyncio.sleep(0)           # set_policy is now waiting for its link
        await gw.detach(sb.id)
        fd = os.open(f"/run/netns/{victim.netns}", os.O_RDONLY)   # most likely the number detach freed
        try:
            return repr(await asyncio.gather(change, return_exceptions=True))
        finally:
            os.close(fd)

    outcome = world.gw.call(race())
    links = sh("ip", "-n", victim.netns, "-o", "link").stdout
    assert "eth0" not in links, (links, outcome)
    assert not world.gw.sync(lambda: [a for a, s in gw._by_addr.items() if s.id == sb.id]), outcome
    # set_policy either finished before the detach or says the sandbox is gone; never a failed setns
    assert outcome == "[None]" or "NotFoundError" in outcome, outcome


def test_a_dns_answer_in_flight_follows_a_policy_change(sandbox, world):
    """slow.example.test is answered upstream a second late; the policy stops allowing it meanwhile."""
    sb = sandbox(Network.allow(domains=["*.example.test"]))
    p = subprocess.Popen(["ip", "netns", "exec", sb.netns, sys.executable, "-c", textwrap.dedent(f"""
        import socket, struct
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.settimeout(5)
        msg = struct.pack("!HHHHHH", 9, 0x0100, 1, 0, 0, 0) + b"\\x04slow\\x07example\\x04test\\x00\\x00\\x01\\x00\\x01"
        s.sendto(msg, ({GW!r}, 53))
        print("asked", flush=True)
        data = s.recv(512)
        print("%d/%d" % (data[3] & 0xF, struct.unpack("!H", data[6:8])[0]), flush=True)
    """)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "asked", p.stderr.read() if p.poll() is not None else ""
        time.sleep(0.3)    # the gateway's upstream lookup is under way
        sb.set_policy(Network.allow(domains=["www.example.test"]))
        out, err = p.communicate(timeout=20)
    finally:
        if p.poll() is None:
            p.kill()
        p.wait()
    assert out.strip() == "3/0", out + err
    assert any(d.name == "slow.example.test" and d.verdict == "deny" for d in sb.log()), sb.log()


def test_a_held_dns_connection_follows_the_new_policy(sandbox, world):
    sb = sandbox(ALLOW_WWW)
    p = subprocess.Popen(["ip", "netns", "exec", sb.netns, sys.executable, "-c", textwrap.dedent(f"""
        import socket, struct, sys
        s = socket.create_connection(({GW!r}, 53), timeout=5)
        def ask(name):
            msg = struct.pack("!HHHHHH", 7, 0x0100, 1, 0, 0, 0)
            msg += b"".join(bytes([len(x)]) + x.encode() for x in name.split(".")) + b"\\0\\0\\1\\0\\1"
            s.sendall(struct.pack("!H", len(msg)) + msg)
            data = s.recv(4096)[2:]
            return "%d/%d" % (data[3] & 0xF, struct.unpack("!H", data[6:8])[0])
        print(ask("www.example.test"), flush=True)
        sys.stdin.readline()
        print(ask("www.example.test"), ask("held.evil.test"), flush=True)
    """)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "0/1", p.stderr.read() if p.poll() is not None else ""
        mark = world.mark()
        sb.set_policy(Network.allow(domains=["api.example.test"]))
        out, err = p.communicate("go\n", timeout=20)
    finally:
        if p.poll() is None:
            p.kill()
        p.wait()
    assert out.split() == ["3/0", "3/0"], out + err
    assert not [e for e in world.events_since(mark) if e["kind"] == "dns"]


# --- a real sandbox (the daemon's runtime) and its own network ------------------------------------


@pytest.fixture(scope="module", params=["default", "opt-out"])
def real_daemon(world, request):
    """The real daemon in the fake host's netns: once as by default (sandboxes in user namespaces), once with
    HUTCH_USERNS=0."""
    import shutil
    import tempfile
    from pathlib import Path

    from egress_world import daemon_in_world
    from hutch_testing import make_busybox_root

    busybox = shutil.which("busybox")
    if busybox is None:
        pytest.skip("busybox-static is not installed (scripts/debian-packages.txt lists it)")
    tmp = Path(tempfile.mkdtemp(prefix="hutch-egress-bypass-"))
    try:
        root = make_busybox_root(tmp / "root", busybox)
        with daemon_in_world(world, "198.18.2.0/24", request.param):
            yield root
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def test_a_real_sandbox_cannot_change_its_own_network(real_daemon, world):
    import hutch

    sb = hutch.Sandbox.create(image=hutch.Image.from_directory(real_daemon), timeout=60,
                              network=Network.allow(domains=["www.example.test"]))
    try:
        status = sb.run("cat", "/proc/self/status").stdout
        caps = {ln.split(":")[0]: int(ln.split()[1], 16) for ln in status.splitlines() if ln.startswith("Cap")}
        assert caps["CapEff"] == 0 and caps["CapPrm"] == 0 and caps["CapBnd"] == 0, caps
        mark = world.mark()
        for argv in (["ip", "addr", "add", "198.18.2.77/32", "dev", "eth0"],
                     ["ip", "route", "add", "10.0.0.0/8", "dev", "eth0"],
                     ["ip", "link", "set", "eth0", "mtu", "1280"],
                     ["ip", "link", "add", "x0", "type", "dummy"],
                     ["sh", "-c", "echo 0 > /proc/sys/net/ipv6/conf/all/disable_ipv6"],
                     ["sh", "-c", "echo '0 2147483647' > /proc/sys/net/ipv4/ping_group_range"]):
            r = sb.run(*argv)
            assert r.returncode != 0, (argv, r.stdout, r.stderr)
        r = sb.run("ping", "-c", "1", "-W", "1", "203.0.113.10")
        assert r.returncode != 0, r.stdout
        assert "198.18.2.77" not in sb.run("ip", "addr").stdout
        assert not [e for e in world.events_since(mark) if e["kind"] in ("tcp", "http", "udp")]
    finally:
        sb.terminate()


def test_set_network_none_through_the_sdk_cuts_a_running_download(real_daemon, world):
    import hutch

    sb = hutch.Sandbox.create(image=hutch.Image.from_directory(real_daemon), timeout=60,
                              network=Network.allow(domains=["www.example.test"]))
    try:
        mark = world.mark()
        # /slow streams for a minute; the command's own timeout is 30 s
        p = sb.exec("wget", "-q", "-O", "/dev/null", "http://www.example.test/slow-sdk", timeout=30)
        assert wait_for(lambda: any(e.get("path") == "/slow-sdk" for e in world.events_since(mark)), 10)
        time.sleep(0.3)
        t0 = time.monotonic()
        sb.set_network(Network.none())
        code = p.wait()
        # well before the command's own 30 s timeout: the policy change ended it (a margin for load)
        assert code != 0 and time.monotonic() - t0 < 25, (code, time.monotonic() - t0)
        assert any("policy change" in d["reason"] for d in sb.network_log()), sb.network_log()
    finally:
        sb.terminate()


def test_two_gateways_on_one_host_keep_apart(real_daemon, world, sandbox):
    """A sandbox of the test's gateway, even without its own rules, reaches nothing of the daemon's gateway."""
    import hutch

    real = hutch.Sandbox.create(image=hutch.Image.from_directory(real_daemon), timeout=60,
                                network=Network.allow(domains=["*.example.test"]))
    try:
        other_gw = real.run("ip", "route").stdout.split("default via ")[1].split()[0]
        assert other_gw.startswith("198.18.2."), other_gw
        sb = sandbox(Network.allow(domains=["*.example.test"]))
        sb.run("nft", "flush", "ruleset", caps=True, check=True)
        got = run_json(sb, f"""
            import json, socket
            out = {{}}
            u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); u.settimeout(0.7)
            u.sendto(bytes.fromhex("abcd01000001000000000000") + b"\\x03www\\x07example\\x04test\\x00\\x00\\x01\\x00\\x01",
                     ({other_gw!r}, 53))
            try:
                u.recv(512); out["udp53"] = "answered"
            except OSError:
                out["udp53"] = "silent"
            for port in (53, 15001):
                try:
                    socket.create_connection(({other_gw!r}, port), timeout=0.7); out[port] = "connected"
                except OSError as e:
                    out[port] = type(e).__name__
            print(json.dumps(out))
        """, caps=True)
        assert got["udp53"] == "silent" and "connected" not in got.values(), got
        assert not [d for d in real.network_log() if d["name"] == "www.example.test"], real.network_log()
    finally:
        real.terminate()
