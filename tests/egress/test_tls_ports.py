"""Which protocol a port carries, and a TLS connection relayed unread only to a server that speaks TLS.

The proxy reads a plain-HTTP connection request by request, but relays a TLS connection unread
after its ClientHello. A ClientHello with an allowed server name is therefore no ticket for a raw
channel: not on port 80 (where servers speak plain HTTP), and on no port unless the server answers
the ClientHello with TLS. Plain HTTP on 443 is refused as well.
"""

from __future__ import annotations

import json

from hutch import Network

from test_bypasses import client_hello, raw_cases, records, req

HELLO_WWW = b"".join(records(client_hello((("www.example.test", 0),))))


def reached(world, mark, port=None):
    return [e for e in world.events_since(mark) if e["kind"] in ("tcp", "http") and (port is None or e["port"] == port)]


def test_a_client_hello_on_port_80_is_refused_even_with_an_allowed_name(sandbox, world):
    sb = sandbox(Network.allow(domains=["www.example.test"]))
    mark = world.mark()
    smuggled = req("/smuggled", "Host: evil.test")
    got = raw_cases(sb, [
        {"name": "own-address", "host": "192.0.2.10", "port": 80, "parts": [HELLO_WWW, smuggled]},
        {"name": "other-address", "host": "203.0.113.10", "port": 80, "parts": [HELLO_WWW + smuggled]},
    ])
    assert got == {"own-address": "reset", "other-address": "reset"}, got
    assert not reached(world, mark), reached(world, mark)             # not even dialed
    denied = [d for d in sb.log() if d.protocol == "tls"]
    assert [d.verdict for d in denied] == ["deny", "deny"], denied
    assert all("port 80" in d.reason and d.name == "www.example.test" for d in denied), denied
    # plain HTTP on port 80 is what the port is for
    r = sb.curl("http://www.example.test/")
    assert r.returncode == 0 and json.loads(r.stdout)["server"] == "192.0.2.10", r.stderr


def test_plain_http_on_port_443_is_refused(sandbox, world):
    sb = sandbox(Network.allow(domains=["www.example.test"]))
    mark = world.mark()
    got = raw_cases(sb, [{"name": "http-on-443", "host": "192.0.2.10", "port": 443,
                          "parts": [req("/", "Host: www.example.test")]}])
    assert got == {"http-on-443": "reset"}, got
    assert not reached(world, mark)
    (d,) = [d for d in sb.log() if d.protocol == "http"]
    assert d.verdict == "deny" and "port 443" in d.reason, d


def test_a_fake_client_hello_opens_no_raw_channel_to_a_server_that_does_not_speak_tls(sandbox, world):
    """An echo server under an allowed name, on a port the policy allows: after a ClientHello the proxy
    used to relay whatever followed, unread. Now only the ClientHello goes; the echo (not TLS) ends it."""
    sb = sandbox(Network.allow(domains=["echo.example.test"], ports=None))
    hello = b"".join(records(client_hello((("echo.example.test", 0),))))
    mark = world.mark()
    got = raw_cases(sb, [
        {"name": "then-data", "host": "203.0.113.20", "port": 7000, "parts": [hello, b"raw bytes, unread\n"]},
        {"name": "one-segment", "host": "203.0.113.20", "port": 7000, "parts": [hello + b"raw bytes, unread\n"]},
    ])
    assert got == {"then-data": "reset", "one-segment": "reset"}, got
    assert reached(world, mark, 7000)        # the proxy did dial: it is the server's answer that ends it
    refused = [d for d in sb.log() if d.verdict == "deny" and d.protocol == "tls"]
    assert len(refused) == 2 and all("did not answer the TLS ClientHello with TLS" in d.reason for d in refused), \
        refused


def test_tls_to_a_server_that_speaks_it_works_on_any_allowed_port(sandbox, world):
    sb = sandbox(Network.allow(domains=["www.example.test"], ports=[443, 8443]))
    for url in ("https://www.example.test:8443/x", "https://www.example.test/y"):
        r = sb.curl(url)
        assert r.returncode == 0, (url, r.stderr)
        body = json.loads(r.stdout)
        assert body["server"] == "192.0.2.10" and body["tls"], body
    allowed = [d for d in sb.log() if d.protocol == "tls" and d.verdict == "allow"]
    assert sorted(d.port for d in allowed) == [443, 8443], allowed
