"""The gateway's I/O-free logic: policy validation, name and address rules, SNI and HTTP parsing."""

from __future__ import annotations

import ipaddress
import ssl

import pytest

from hutch import Network, NetworkPolicyError
from hutch.sandbox._host.egress.policy import (AddressRules, chain_allowed, name_allowed, normalize_name, port_allowed,
                                           protocol_allowed)
from hutch.sandbox._host.egress.sniff import (Refused, RequestStream, client_hello_end, parse_client_hello,
                                          parse_request_head, server_answers_tls)

RULES = AddressRules(ipaddress.IPv4Network("198.18.0.0/16"), ["192.0.2.254", "127.0.0.1"])


# --- Network validation -------------------------------------------------------

@pytest.mark.parametrize("kw,needle", [
    ({"domains": ["exa mple.com"]}, "'exa mple.com'"),
    ({"domains": ["*.com"]}, "'*.com'"),
    ({"domains": ["a.*.example.com"]}, "'a.*.example.com'"),
    ({"domains": ["1.2.3.4"]}, "'1.2.3.4'"),
    ({"domains": [42]}, "42"),
    ({"cidrs": ["10.0.0.0/33"]}, "'10.0.0.0/33'"),
    ({"cidrs": ["2001:db8::/32"]}, "IPv6"),
    ({"domains": ["a.example.com"], "ports": [0]}, "port 0"),
    ({"domains": ["a.example.com"], "ports": [70000]}, "port 70000"),
    ({"domains": ["a.example.com"], "ports": []}, "ports=[]"),
    ({"domains": "a.example.com"}, "lists"),
    ({}, "at least one"),
])
def test_allow_validation_names_the_bad_entry(kw, needle):
    with pytest.raises(NetworkPolicyError) as e:
        Network.allow(**kw)
    assert needle in str(e.value)


def test_network_round_trips_and_from_dict_validates():
    n = Network.allow(domains=["API.Example.com.", "*.example.org"], cidrs=["203.0.113.7/24"], ports=[443])
    assert n.domains == ("*.example.org", "api.example.com") and n.cidrs == ("203.0.113.0/24",)
    assert Network.from_dict(n.to_dict()) == n
    assert Network.from_dict({"mode": "open"}) == Network.open()
    assert Network.allow(domains=["a.example.com"], ports=None).ports == ()
    for bad in ({"mode": "wide"}, {"mode": "allow", "domains": ["bad name"]}, {"mode": "none", "extra": 1}, "open"):
        with pytest.raises(NetworkPolicyError):
            Network.from_dict(bad)


# --- names ---------------------------------------------------------------------

def test_wildcards_match_below_never_the_apex():
    p = Network.allow(domains=["*.example.com", "exact.example.net"])
    assert name_allowed(p, "a.example.com") and name_allowed(p, "a.b.example.com")
    assert not name_allowed(p, "example.com")
    assert not name_allowed(p, "badexample.com")
    assert not name_allowed(p, "a.example.com.evil.net")
    assert name_allowed(p, "exact.example.net") and not name_allowed(p, "x.exact.example.net")
    assert not name_allowed(Network.none(), "a.example.com")
    assert name_allowed(Network.open(), "anything.example")


def test_normalize_name_rejects_addresses_and_junk():
    assert normalize_name("WWW.Example.COM.") == "www.example.com"
    for bad in ("127.0.0.1", "", "a..b", "exa mple.com", "ex\u00e4mple.com", "[::1]", "a" * 64 + ".com"):
        assert normalize_name(bad) is None, bad


def test_ports():
    p = Network.allow(domains=["a.example.com"], ports=[443])
    assert port_allowed(p, 443) and not port_allowed(p, 80)
    assert port_allowed(Network.allow(domains=["a.example.com"], ports=None), 22)
    assert port_allowed(Network.open(), 22)


# --- addresses -------------------------------------------------------------------

@pytest.mark.parametrize("addr", ["127.0.0.1", "10.1.2.3", "172.16.0.1", "192.168.1.1", "169.254.169.254",
                                  "100.64.0.1", "100.100.100.200", "0.0.0.0", "224.0.0.1", "255.255.255.255",
                                  "240.0.0.1", "198.18.0.1", "198.18.3.4", "192.0.2.254"])
def test_private_and_special_addresses_are_refused_by_default(addr):
    for p in (Network.open(), Network.allow(domains=["a.example.com"]), Network.allow(cidrs=["0.0.0.0/0"])):
        assert not RULES.address_allowed(p, addr), (p, addr)


def test_a_cidr_inside_a_special_block_opens_it_but_never_loopback_host_or_links():
    assert RULES.address_allowed(Network.allow(cidrs=["10.1.0.0/16"]), "10.1.2.3")
    assert not RULES.address_allowed(Network.allow(cidrs=["10.1.0.0/16"]), "10.2.0.1")
    assert RULES.address_allowed(Network.allow(cidrs=["169.254.169.254/32"]), "169.254.169.254")
    assert not RULES.address_allowed(Network.allow(cidrs=["127.0.0.0/8"]), "127.0.0.1")
    assert not RULES.address_allowed(Network.allow(cidrs=["198.18.0.0/16"]), "198.18.0.5")
    assert not RULES.address_allowed(Network.allow(cidrs=["192.0.2.0/24"]), "192.0.2.254")


def test_public_addresses():
    assert RULES.address_allowed(Network.open(), "203.0.113.9", by_cidr_only=True)
    assert not RULES.address_allowed(Network.allow(domains=["a.example.com"]), "203.0.113.9", by_cidr_only=True)
    assert RULES.address_allowed(Network.allow(domains=["a.example.com"]), "203.0.113.9")
    assert RULES.address_allowed(Network.allow(cidrs=["203.0.113.0/24"]), "203.0.113.9", by_cidr_only=True)
    assert not RULES.address_allowed(Network.open(), "2001:db8::1")


# --- TLS ClientHello ------------------------------------------------------------

def client_hello(server_hostname):
    ctx = ssl.create_default_context()
    obj = ctx.wrap_bio(ssl.MemoryBIO(), out := ssl.MemoryBIO(), server_hostname=server_hostname)
    try:
        obj.do_handshake()
    except ssl.SSLWantReadError:
        pass
    return out.read()


def test_sni_from_a_real_client_hello_also_in_pieces():
    hello = client_hello("api.example.com")
    assert parse_client_hello(hello) == ("sni", "api.example.com")
    state, need = parse_client_hello(hello[:3])
    assert state == "need" and need > 0
    state, need = parse_client_hello(hello[:40])
    assert state == "need" and need == len(hello) - 40
    # the same handshake split over two TLS records
    body = hello[5:]
    split = b"\x16\x03\x01" + (20).to_bytes(2, "big") + body[:20] + \
        b"\x16\x03\x01" + (len(body) - 20).to_bytes(2, "big") + body[20:]
    assert parse_client_hello(split) == ("sni", "api.example.com")


def test_client_hello_without_sni_and_garbage():
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    obj = ctx.wrap_bio(ssl.MemoryBIO(), out := ssl.MemoryBIO())
    try:
        obj.do_handshake()
    except ssl.SSLWantReadError:
        pass
    assert parse_client_hello(out.read()) == ("sni", None)
    with pytest.raises(Refused):
        parse_client_hello(b"\x16\x03\x01\x00\x05\x02\x00\x00\x01\x00")   # a ServerHello, not a ClientHello
    with pytest.raises(Refused):
        parse_client_hello(b"\x17\x03\x03\x00\x05hello")


def test_where_a_client_hello_ends_and_nothing_rides_in_its_records():
    hello = client_hello("api.example.com")
    assert client_hello_end(hello + b"GET / HTTP/1.1\r\n") == len(hello)
    with pytest.raises(ValueError):
        client_hello_end(hello[:-1])
    # more handshake bytes after the ClientHello inside its own record: refused, not passed on
    stuffed = hello[:3] + (len(hello) - 5 + 9).to_bytes(2, "big") + hello[5:] + b"\x14\x00\x00\x05hello"
    with pytest.raises(Refused, match="more than the ClientHello"):
        parse_client_hello(stuffed)


def test_what_counts_as_a_server_answering_tls():
    server_hello = b"\x16\x03\x03\x00\x7a\x02\x00\x00\x76\x03\x03"
    assert server_answers_tls(server_hello) == ""
    assert server_answers_tls(b"\x15\x03\x03\x00\x02\x02\x28") == ""                 # a fatal alert
    assert server_answers_tls(b"\x16\x03") is None                                    # not yet known
    assert server_answers_tls(b"") is None
    for not_tls in (b"HTTP/1.1 400 Bad Request\r\n", b"-ERR unknown command\r\n", b"SSH-2.0-OpenSSH\r\n",
                    b"\x16\x03\x01\x00\x7a\x01\x00",          # a ClientHello echoed back
                    b"\x15\x03\x03\x00\x10\x02\x28", b"\x16\x02\x00\x00\x05\x02", b"H"):
        assert server_answers_tls(not_tls), not_tls


def test_a_cname_chain_is_allowed_only_name_by_name():
    p = Network.allow(domains=["www.example.com", "*.cdn.example.net"])
    assert chain_allowed(p, ["www.example.com"])
    assert chain_allowed(p, ["www.example.com", "edge1.cdn.example.net"])
    v = chain_allowed(p, ["www.example.com", "edge1.cdn.example.net", "origin.internal"])
    assert not v and "origin.internal" in v.reason and "allow origin.internal" in v.reason
    assert not chain_allowed(p, ["www.example.com", "bad name"])
    assert chain_allowed(Network.open(), ["a.example.com", "b.example.org"])


def test_each_well_known_port_carries_its_own_protocol():
    assert protocol_allowed(80, "http") and protocol_allowed(443, "tls")
    assert not protocol_allowed(80, "tls") and "port 80" in protocol_allowed(80, "tls").reason
    assert not protocol_allowed(443, "http")
    assert protocol_allowed(8443, "tls") and protocol_allowed(8080, "http")


# --- HTTP -------------------------------------------------------------------------

def test_request_stream_follows_bodies_and_checks_every_host():
    s = RequestStream("a.example.com")
    out = s.feed(b"POST /x HTTP/1.1\r\nHost: a.example.com\r\nContent-Length: 38\r\n\r\n"
                 b"GET / HTTP/1.1\r\nHost: evil.example\r\n\r\n")
    assert out.endswith(b"evil.example\r\n\r\n")     # that was a body, not a request
    out = s.feed(b"PUT / HTTP/1.1\r\nHost: A.Example.com:80\r\nTransfer-Encoding: chunked\r\n\r\n"
                 b"5;ext=1\r\nhello\r\n0\r\nTrailer: x\r\n\r\n")
    assert out.endswith(b"Trailer: x\r\n\r\n") and s.requests == 2
    # a head split across reads is held back until complete
    assert s.feed(b"GET / HTTP/1.1\r\nHo") == b""
    with pytest.raises(Refused):
        s.feed(b"st: evil.example\r\n\r\n")


@pytest.mark.parametrize("raw", [
    b"GET / HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n",
    b"GET / HTTP/1.1\r\nHost : a\r\n\r\n",
    b"GET / HTTP/1.1\r\n Host: a\r\n\r\n",
    b"GET / HTTP/1.1\r\nHost: a\nX: y\r\n\r\n",
    b"GET / HTTP/1.1\r\nHost: a\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n",
    b"GET / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: gzip, chunked\r\n\r\n",
    b"CONNECT b:443 HTTP/1.1\r\nHost: a\r\n\r\n",
    b"GET http://b/ HTTP/1.1\r\nHost: a\r\n\r\n",
    b"GET http://a@b/ HTTP/1.1\r\nHost: a\r\n\r\n",
    b"GET / HTTP/2.0\r\nHost: a\r\n\r\n",
    b"PRI * HTTP/2.0\r\n\r\n",
])
def test_ambiguous_requests_are_refused(raw):
    with pytest.raises(Refused):
        parse_request_head(raw)
