"""Read the name a TCP connection is for: TLS ClientHello SNI, or the HTTP Host of every request.

Pure parsing, no I/O. The parsers are strict on purpose: anything a server
might read differently from us (two Host headers, bare LF line ends, both
Content-Length and Transfer-Encoding, obs-fold, an encrypted ClientHello) is
refused rather than guessed, because a disagreement is a bypass.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

MAX_HELLO = 64 * 1024
MAX_HEAD = 64 * 1024
_TLS_HANDSHAKE = 0x16
_TLS_ALERT = 0x15
_EXT_SNI = 0x0000
_EXT_ECH = (0xFE0D, 0xFFCE)   # encrypted ClientHello (and its ESNI predecessor)


class Refused(Exception):
    """The bytes are not something the proxy will relay; the message is the log reason."""


def looks_like_tls(buf: bytes) -> bool:
    return len(buf) >= 1 and buf[0] == _TLS_HANDSHAKE


def parse_client_hello(buf: bytes) -> tuple[str, str | int | None]:
    """('need', n) when more bytes are needed; ('sni', name-or-None) when done. Raises Refused."""
    state, val, _end = _walk_hello(buf)
    return state, val


def client_hello_end(buf: bytes) -> int:
    """Where the records that carry a complete ClientHello end: what follows them is the client's next
    message, which the proxy holds back until the server has answered with TLS."""
    state, _val, end = _walk_hello(buf)
    if state != "sni":
        raise ValueError("the ClientHello is not complete")
    return end


def _walk_hello(buf: bytes) -> tuple[str, str | int | None, int]:
    hs = bytearray()
    pos = 0
    need_len = None
    while True:
        if len(buf) < pos + 5:
            return ("need", pos + 5 - len(buf), pos)
        if buf[pos] != _TLS_HANDSHAKE:
            raise Refused("a TLS record other than a handshake came before the ClientHello ended")
        if buf[pos + 1] != 3:
            raise Refused("not a TLS record (bad version)")
        rlen = int.from_bytes(buf[pos + 3:pos + 5], "big")
        if rlen == 0 or rlen > 16384 + 2048:
            raise Refused("a TLS record of impossible length")
        if len(buf) < pos + 5 + rlen:
            return ("need", pos + 5 + rlen - len(buf), pos)
        hs += buf[pos + 5:pos + 5 + rlen]
        pos += 5 + rlen
        if need_len is None and len(hs) >= 4:
            if hs[0] != 1:
                raise Refused("the first TLS handshake message is not a ClientHello")
            need_len = 4 + int.from_bytes(hs[1:4], "big")
            if need_len > MAX_HELLO:
                raise Refused("the TLS ClientHello is too large")
        if need_len is not None and len(hs) >= need_len:
            if len(hs) > need_len:
                # a client's first flight is the ClientHello alone; more in its records is for someone else
                raise Refused("the TLS records of the ClientHello carry more than the ClientHello")
            return ("sni", _sni_from_hello(bytes(hs[4:need_len])), pos)
        if pos > MAX_HELLO:
            raise Refused("the TLS ClientHello is too large")


def server_answers_tls(buf: bytes) -> str | None:
    """Does a server's first bytes start a TLS answer to a ClientHello? None: need more bytes;
    "" yes (a ServerHello or HelloRetryRequest, or a TLS alert); otherwise why not."""
    if len(buf) < 6:
        if buf and buf[0] not in (_TLS_HANDSHAKE, _TLS_ALERT):
            return f"it answered {bytes(buf[:16])!r}, not TLS"
        return None
    if buf[1] != 3:
        return f"it answered {bytes(buf[:16])!r}, not TLS"
    rlen = int.from_bytes(buf[3:5], "big")
    if buf[0] == _TLS_HANDSHAKE and buf[5] == 2 and 0 < rlen <= 16384 + 2048:
        return ""
    if buf[0] == _TLS_ALERT and rlen == 2 and buf[5] in (1, 2):
        return ""
    return f"it answered {bytes(buf[:16])!r}, not a TLS ServerHello"


def _sni_from_hello(body: bytes) -> str | None:
    try:
        p = 2 + 32                                   # client_version, random
        p += 1 + body[p]                             # session_id
        p += 2 + int.from_bytes(body[p:p + 2], "big")  # cipher_suites
        p += 1 + body[p]                             # compression_methods
        if p == len(body):
            return None
        end = p + 2 + int.from_bytes(body[p:p + 2], "big")
        if end != len(body):
            raise Refused("malformed TLS ClientHello extensions")
        p += 2
        names = []
        seen = set()
        while p < end:
            etype = int.from_bytes(body[p:p + 2], "big")
            elen = int.from_bytes(body[p + 2:p + 4], "big")
            data = body[p + 4:p + 4 + elen]
            if len(data) != elen:
                raise Refused("malformed TLS ClientHello extension")
            if etype in seen:
                raise Refused(f"TLS extension {etype} appears twice")
            seen.add(etype)
            if etype in _EXT_ECH:
                raise Refused("an encrypted ClientHello (ECH) hides the server name; it is not relayed")
            if etype == _EXT_SNI:
                q = 2
                lend = 2 + int.from_bytes(data[0:2], "big")
                if lend != len(data):
                    raise Refused("malformed TLS server_name extension")
                while q < lend:
                    ntype = data[q]
                    nlen = int.from_bytes(data[q + 1:q + 3], "big")
                    name = data[q + 3:q + 3 + nlen]
                    if len(name) != nlen:
                        raise Refused("malformed TLS server_name entry")
                    if ntype == 0:
                        names.append(name)
                    q += 3 + nlen
            p += 4 + elen
        if len(names) > 1:
            raise Refused("the TLS ClientHello names more than one server")
        if not names:
            return None
        try:
            return names[0].decode("ascii")
        except UnicodeDecodeError:
            raise Refused("the TLS server name is not ASCII") from None
    except IndexError:
        raise Refused("malformed TLS ClientHello") from None


# --- HTTP/1.x -------------------------------------------------------------

_TOKEN = re.compile(rb"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$")
_METHOD_OK = re.compile(rb"^[A-Z]{1,20}$")
_FRAMING = (b"content-length", b"transfer-encoding")


@dataclass(frozen=True)
class RequestHead:
    method: str
    target: str
    version: str
    host: str | None        # the Host header value (name[:port]) or None
    body: tuple[str, int]   # ("none", 0) | ("length", n) | ("chunked", 0)
    upgrade: bool
    size: int               # bytes of the head including the final CRLFCRLF


def looks_like_http(buf: bytes) -> bool:
    m = re.match(rb"^([A-Z]{1,20}) ", buf[:21])
    return m is not None


def parse_request_head(buf: bytes | bytearray) -> RequestHead | None:
    """None while the head is incomplete; a RequestHead when complete. Raises Refused."""
    end = buf.find(b"\r\n\r\n")
    if end < 0:
        if len(buf) > MAX_HEAD:
            raise Refused("an HTTP request head is larger than 64 KiB")
        return None
    raw = bytes(buf[:end])
    lines = raw.split(b"\r\n")
    if any(b"\n" in ln or b"\r" in ln for ln in lines):
        raise Refused("an HTTP request uses bare CR or LF line ends")
    parts = lines[0].split(b" ")
    if len(parts) != 3 or not _METHOD_OK.match(parts[0]) or parts[2] not in (b"HTTP/1.1", b"HTTP/1.0"):
        raise Refused("not an HTTP/1.x request line")
    method, target, version = (x.decode("latin-1") for x in parts)
    if method == "PRI":
        raise Refused("HTTP/2 without TLS (h2c) is not relayed")
    if method == "CONNECT":
        raise Refused("CONNECT is not relayed: it would open a tunnel the proxy cannot check")
    hosts, lengths, te, upgrade = [], [], [], False
    for ln in lines[1:]:
        if not ln or ln[0] in b" \t":
            raise Refused("an HTTP header uses obsolete line folding")
        name, sep, value = ln.partition(b":")
        if not sep or not _TOKEN.match(name):
            raise Refused("a malformed HTTP header line")
        key = name.lower()
        val = value.strip(b" \t")
        if b"_" in key and key.replace(b"_", b"-") in _FRAMING:
            # CGI/WSGI-style servers read "_" as "-": they would frame the body by a header we ignored
            raise Refused(f"an HTTP header {name.decode('latin-1')!r} that some servers read as "
                          f"{key.replace(b'_', b'-').decode('latin-1')!r}")
        if key == b"host":
            hosts.append(val.decode("latin-1"))
        elif key == b"content-length":
            lengths.append(val)
        elif key == b"transfer-encoding":
            te.append(val.lower())
        elif key == b"upgrade":
            upgrade = True
    if len(hosts) > 1:
        raise Refused("an HTTP request carries more than one Host header")
    host = hosts[0] if hosts else None
    if target.startswith(("http://", "https://")) or "://" in target.split("/", 1)[0]:
        # absolute-form: its authority must say the same as Host, or a server acting as a
        # proxy would fetch another name than the one we checked
        m = re.match(r"^[A-Za-z][A-Za-z0-9+.-]*://([^/?#]*)", target)
        auth = m.group(1) if m else ""
        if "@" in auth or host is None or _host_name(auth) != _host_name(host):
            raise Refused(f"an absolute request target {target[:80]!r} names another host than Host")
    elif not target.startswith("/") and not (target == "*" and method == "OPTIONS"):
        raise Refused("an HTTP request target that is neither a path nor an absolute URL")
    if te and lengths:
        raise Refused("an HTTP request with both Content-Length and Transfer-Encoding")
    if te and version == "HTTP/1.0":
        # HTTP/1.0 has no chunked coding: a server may ignore the header and read the chunks as requests
        raise Refused("an HTTP/1.0 request with Transfer-Encoding")
    if te:
        codings = [c.strip() for c in b",".join(te).split(b",")]
        if codings != [b"chunked"]:
            raise Refused("an HTTP request Transfer-Encoding other than plain chunked")
        body = ("chunked", 0)
    elif lengths:
        if len(set(lengths)) != 1 or not lengths[0].isdigit() or len(lengths[0]) > 15:
            raise Refused("an HTTP request with a bad or repeated Content-Length")
        n = int(lengths[0])
        body = ("length", n) if n else ("none", 0)
    else:
        body = ("none", 0)
    return RequestHead(method, target, version, host, body, upgrade, end + 4)


def _host_name(hostport: str) -> str:
    h = hostport.strip().lower()
    if h.startswith("["):
        return h
    name, _, port = h.rpartition(":") if ":" in h else (h, "", "")
    if ":" in h and not port.isdigit():
        return "\0bad"
    return name.rstrip(".")


def host_name(hostport: str) -> str:
    """'Example.COM.:8080' -> 'example.com'. IPv6 literals come back bracketed."""
    return _host_name(hostport)


class RequestStream:
    """Checks every request on a plain-HTTP connection (client to server direction).

    `feed(data)` returns the bytes that may be forwarded now; it raises Refused
    when a request names another host than `name` or cannot be framed safely.
    """

    def __init__(self, name: str, rewrite=None):
        self.name = name
        self.rewrite = rewrite     # (head, raw head bytes) -> the head to forward; may raise Refused
        self.buf = bytearray()
        self.state = "head"
        self.remaining = 0
        self.requests = 0

    def feed(self, data: bytes) -> bytes:
        self.buf += data
        out = bytearray()
        while self.buf:
            if self.state == "head":
                head = parse_request_head(self.buf)
                if head is None:
                    break
                if head.host is None:
                    raise Refused("an HTTP request without a Host header")
                if host_name(head.host) != self.name:
                    raise Refused(f"request {self.requests + 1} on this connection is for {head.host!r}, "
                                  f"not {self.name}")
                if head.upgrade and self.rewrite is None:
                    raise Refused("HTTP Upgrade over plain HTTP is not relayed (use TLS, e.g. wss://)")
                self.requests += 1
                raw = bytes(self.buf[:head.size])
                try:
                    out += self.rewrite(head, raw) if self.rewrite else raw
                except Refused as e:
                    e.passed = bytes(out)   # what the requests before it in this read may still send
                    raise
                del self.buf[:head.size]
                kind, n = head.body
                if kind == "length":
                    self.state, self.remaining = "body", n
                elif kind == "chunked":
                    self.state = "chunk-size"
            elif self.state == "body":
                k = min(self.remaining, len(self.buf))
                out += self.buf[:k]
                del self.buf[:k]
                self.remaining -= k
                if self.remaining == 0:
                    self.state = "head"
            elif self.state == "chunk-size":
                i = self.buf.find(b"\r\n")
                if i < 0:
                    if len(self.buf) > 4096:
                        raise Refused("an HTTP chunk-size line is too long")
                    break
                line = bytes(self.buf[:i])
                size_text = line.split(b";", 1)[0].strip(b" \t")
                if not size_text or not re.fullmatch(rb"[0-9A-Fa-f]{1,15}", size_text) or b"\n" in line:
                    raise Refused("a malformed HTTP chunk-size line")
                size = int(size_text, 16)
                out += self.buf[:i + 2]
                del self.buf[:i + 2]
                if size == 0:
                    self.state = "trailers"
                else:
                    self.state, self.remaining = "chunk-data", size
            elif self.state == "chunk-data":
                k = min(self.remaining, len(self.buf))
                out += self.buf[:k]
                del self.buf[:k]
                self.remaining -= k
                if self.remaining == 0:
                    self.state = "chunk-crlf"
            elif self.state == "chunk-crlf":
                if len(self.buf) < 2:
                    break
                if self.buf[:2] != b"\r\n":
                    raise Refused("an HTTP chunk is not followed by CRLF")
                out += self.buf[:2]
                del self.buf[:2]
                self.state = "chunk-size"
            elif self.state == "trailers":
                i = self.buf.find(b"\r\n")
                if i < 0:
                    if len(self.buf) > MAX_HEAD:
                        raise Refused("HTTP trailers are too large")
                    break
                line = bytes(self.buf[:i])
                if b"\n" in line or b"\r" in line:
                    raise Refused("HTTP trailers use bare CR or LF")
                out += self.buf[:i + 2]
                del self.buf[:i + 2]
                if not line:
                    self.state = "head"
        return bytes(out)
