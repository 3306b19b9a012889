"""Credentials brokered at the gateway: the sandbox calls an API whose key it never holds.

For a host that carries a credential (`Network.allow(credentials={host: Secret})`) the proxy hands the
connection here instead of relaying it unread:

1. the sandbox's TLS is terminated with a leaf certificate for that host, issued by the sandbox's own CA
   (`SandboxCA`: made in memory when the sandbox first has a credential, its certificate installed into the
   sandbox's trust store, its key never written anywhere; name constraints limit it to the credential hosts,
   so even its key could sign for no other name);
2. the gateway opens its own TLS connection to the real server, verifying its certificate and name against
   the host's trust store (HUTCH_EGRESS_UPSTREAM_CA replaces it), HTTP/1.1 only;
3. each request is read as HTTP/1.1 (framing checked as for plain HTTP, Host must be the host, no Upgrade);
   the credential's header is set (one the sandbox sent of that name is dropped), Accept-Encoding becomes
   identity, and the request budget is taken;
4. what comes back has every occurrence of the secret (and of the header's value) replaced by as many '*'
   before it reaches the sandbox: a response that echoes it shows stars, and its framing is unchanged.

Budgets (`requests_per_minute`, `bytes_per_minute` of the Secret) count per sandbox and host over a sliding
minute, both directions' bytes; a request over them is answered 429 by the gateway and never sent on.
"""

from __future__ import annotations

import asyncio
import collections
import datetime
import os
import ssl
import time

from hutch._core import paths, settings
from hutch.sandbox._host.egress import sniff

HANDSHAKE_TIMEOUT = 10.0
#: How long bytes that could begin the secret are held back, waiting for the rest, before they go on.
HOLD = 1.0
WINDOW = 60.0
ENV_UPSTREAM_CA = settings.EGRESS_UPSTREAM_CA.name


class SandboxCA:
    """One sandbox's CA: a P-256 key in memory and a certificate constrained to `hosts`."""

    def __init__(self, sandbox_id: str, hosts):
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID

        self.hosts = frozenset(hosts)
        self._key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.timezone.utc)
        self._name = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "hutch"),
                                x509.NameAttribute(NameOID.COMMON_NAME, f"hutch egress CA of sandbox {sandbox_id}")])
        self.cert = (
            x509.CertificateBuilder().subject_name(self._name).issuer_name(self._name)
            .public_key(self._key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1)).not_valid_after(now + datetime.timedelta(days=398))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                         crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.NameConstraints(permitted_subtrees=[x509.DNSName(h) for h in sorted(self.hosts)],
                                                excluded_subtrees=None), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(self._key.public_key()), critical=False)
            .sign(self._key, hashes.SHA256()))
        self.pem = self.cert.public_bytes(serialization.Encoding.PEM)
        self._contexts: dict[str, ssl.SSLContext] = {}

    def context_for(self, host: str) -> ssl.SSLContext:
        """A server context presenting a leaf for `host` (made once per host; key and cert never on disk)."""
        ctx = self._contexts.get(host)
        if ctx is not None:
            return ctx
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.timezone.utc)
        leaf = (
            x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, host)]))
            .issuer_name(self._name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1)).not_valid_after(now + datetime.timedelta(days=397))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(host)]), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(self._key.public_key()), critical=False)
            .sign(self._key, hashes.SHA256()))
        pem = (leaf.public_bytes(serialization.Encoding.PEM) + self.pem
               + key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                   serialization.NoEncryption()))
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.set_alpn_protocols(["http/1.1"])
        fd = os.memfd_create("hutch-egress-leaf", os.MFD_CLOEXEC)   # ssl loads only from a path: a memory file
        try:
            os.write(fd, pem)
            ctx.load_cert_chain(f"/proc/self/fd/{fd}")
        finally:
            os.close(fd)
        self._contexts[host] = ctx
        return ctx


def upstream_context(cafile: str | None = None) -> ssl.SSLContext:
    """The context the gateway dials credential hosts with: certificate and name verified, HTTP/1.1."""
    env_ca = settings.EGRESS_UPSTREAM_CA.get()
    cafile = cafile or (str(env_ca) if env_ca else None)
    if cafile is not None:   # whoever may change it could add a CA and read the credentials the gateway sends
        paths.root_only_file(cafile, "the egress gateway trusts the CAs in it when it sends a credential to its "
                             "host: that user could add one of theirs and read every brokered credential",
                             f"point {ENV_UPSTREAM_CA} at a bundle of root's own")
    ctx = ssl.create_default_context(cafile=cafile)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.set_alpn_protocols(["http/1.1"])
    return ctx


class Budget:
    """Requests and bytes over the last minute (sliding); None: no cap. `what` names it in a refusal."""

    BUCKET = 0.1   # seconds of byte counts kept as one entry: a minute is at most 600 of them

    def __init__(self, requests: int | None, nbytes: int | None, what: str = "its budget"):
        self.requests, self.nbytes, self.what = requests, nbytes, what
        self._reqs: collections.deque = collections.deque()
        self._bytes: collections.deque = collections.deque()   # [time, bytes] per BUCKET
        self._bytes_sum = 0

    def _trim(self, now: float) -> None:
        while self._reqs and self._reqs[0] <= now - WINDOW:
            self._reqs.popleft()
        while self._bytes and self._bytes[0][0] <= now - WINDOW:
            self._bytes_sum -= self._bytes.popleft()[1]

    def over(self, body: int = 0) -> str | None:
        """Why one more request with `body` bytes known ahead would be over this budget, or None."""
        self._trim(time.monotonic())
        if self.requests is not None and len(self._reqs) >= self.requests:
            return f"over {self.what} of {self.requests} requests per minute"
        if self.nbytes is not None and self._bytes_sum + body > self.nbytes:
            return f"over {self.what} of {self.nbytes} bytes per minute"
        return None

    def count_request(self) -> None:
        if self.requests is not None:
            self._reqs.append(time.monotonic())

    def take_request(self, body: int) -> str | None:
        """Count one request with `body` bytes known ahead; the reason if it is over a budget."""
        why = self.over(body)
        if why is None:
            self.count_request()
        return why

    def add(self, n: int) -> bool:
        """Count bytes moved; False once the minute's bytes are over the budget."""
        now = time.monotonic()
        self._trim(now)
        if n and self.nbytes is not None:
            if self._bytes and now - self._bytes[-1][0] < self.BUCKET:
                self._bytes[-1][1] += n
            else:
                self._bytes.append([now, n])
            self._bytes_sum += n
        return self.nbytes is None or self._bytes_sum <= self.nbytes

    def left(self) -> int | None:
        """Bytes the minute has left (0 or less: none), None without a byte cap."""
        if self.nbytes is None:
            return None
        self._trim(time.monotonic())
        return self.nbytes - self._bytes_sum


class Meter:
    """What one connection is charged to: its policy entry's budget (looked up at each charge, so a policy
    change applies to open connections too) and its credential's, if any."""

    def __init__(self, sandbox, entry: str, extra: "Budget | None" = None):
        self.sandbox, self.entry, self.extra = sandbox, entry, extra

    def budgets(self) -> list:
        return [b for b in (self.sandbox.entry_budget(self.entry), self.extra) if b is not None]

    def take_request(self, body: int = 0) -> str | None:
        bs = self.budgets()
        for b in bs:
            why = b.over(body)
            if why:
                return why
        for b in bs:
            b.count_request()
        return None

    def add(self, n: int) -> str | None:
        """Count bytes moved; the reason once a budget's minute is past it."""
        why = None
        for b in self.budgets():
            if not b.add(n) and why is None:
                why = f"over {b.what} of {b.nbytes} bytes per minute"
        return why

    def left(self) -> int | None:
        lefts = [x for x in (b.left() for b in self.budgets()) if x is not None]
        return min(lefts) if lefts else None


class OverBudget(sniff.Refused):
    pass


#: What one sandbox may make the gateway's TLS do. The gateway's CPU is the daemon's (bench/broker.py: ~1 ms per
#: brokered connection for its two handshakes, ~2 ms per MiB decrypted, redacted and encrypted again), not the
#: sandbox's cgroup's, so it is bounded per sandbox instead: at most ~28 + 38 ms of a core a second each.
HANDSHAKES_PER_SECOND = 20.0
HANDSHAKE_BURST = 40
MAX_BROKERED = 32                  # brokered connections open at once
BROKERED_BYTES_PER_SECOND = 16 << 20


class Share:
    """One sandbox's share of the gateway's TLS work: a handshake rate, open brokered connections, and a byte
    rate its brokered traffic is paced to (held back, not cut). Counters go to the log's `limits`."""

    def __init__(self):
        now = time.monotonic()
        self._hs, self._hs_at = float(HANDSHAKE_BURST), now
        self._bytes, self._bytes_at = float(BROKERED_BYTES_PER_SECOND), now
        self.open = 0
        self.over_rate = self.over_connections = 0
        self.paced = 0.0                   # seconds brokered traffic was held back

    def admit(self) -> str | None:
        """Take a new brokered connection's handshakes; why not, if it is over a limit."""
        if self.open >= MAX_BROKERED:
            self.over_connections += 1
            return f"more than {MAX_BROKERED} connections to credential hosts at once"
        now = time.monotonic()
        self._hs = min(HANDSHAKE_BURST, self._hs + (now - self._hs_at) * HANDSHAKES_PER_SECOND)
        self._hs_at = now
        if self._hs < 1:
            self.over_rate += 1
            return f"more than {HANDSHAKES_PER_SECOND:g} TLS handshakes a second with credential hosts"
        self._hs -= 1
        self.open += 1
        return None

    def release(self) -> None:
        self.open -= 1

    async def pace(self, n: int) -> None:
        """Wait until `n` more brokered bytes fit the sandbox's byte rate."""
        now = time.monotonic()
        self._bytes = min(BROKERED_BYTES_PER_SECOND, self._bytes + (now - self._bytes_at) * BROKERED_BYTES_PER_SECOND)
        self._bytes_at = now
        self._bytes -= n
        if self._bytes < 0:
            wait = -self._bytes / BROKERED_BYTES_PER_SECOND
            self.paced += wait
            await asyncio.sleep(wait)

    def counters(self) -> dict:
        return {"tls_over_handshake_rate": self.over_rate, "tls_over_connection_limit": self.over_connections,
                "tls_paced_ms": int(self.paced * 1000)}


class Redactor:
    """Replaces each needle in a byte stream by as many '*' (so lengths, and HTTP framing, stay as they were);
    bytes that could begin a needle are held back until the rest shows whether it is one."""

    def __init__(self, needles):
        self.needles = sorted({n for n in needles if n}, key=len, reverse=True)
        self.held = b""

    def feed(self, data: bytes) -> bytes:
        buf = self.held + data
        for n in self.needles:
            buf = buf.replace(n, b"*" * len(n))
        keep = 0
        for n in self.needles:   # the longest tail of buf that begins n: only where n's first byte is
            tail = buf[-(len(n) - 1):] if len(n) > 1 else b""
            i = tail.find(n[:1])
            while 0 <= i < len(tail) - keep:
                if n.startswith(tail[i:]):
                    keep = len(tail) - i
                    break
                i = tail.find(n[:1], i + 1)
        self.held = buf[len(buf) - keep:] if keep else b""
        return buf[:len(buf) - keep] if keep else buf

    def flush(self) -> bytes:
        out, self.held = self.held, b""
        return out


class Responses:
    """Counts the responses that have come back in full on a brokered connection (read as HTTP/1.1 framing:
    Content-Length, chunked, no body for HEAD, 1xx, 204, 304), so that a 429 is sent only after the answers
    to the requests before it. `broken` once the stream cannot be framed (then nothing more is counted)."""

    def __init__(self):
        self.methods: collections.deque = collections.deque()   # of requests forwarded, not yet answered
        self.done = 0
        self.broken = False
        self._buf = b""
        self._state, self._left = "head", 0
        self.changed = asyncio.Event()

    def feed(self, data: bytes) -> None:
        if self.broken or self._state == "close":   # a body that ends with the connection: nothing to keep
            return
        self._buf += data
        try:
            while self._step():
                pass
        except (ValueError, IndexError):
            self.broken = True
        self.changed.set()

    def _finish(self) -> None:
        self.methods.popleft()
        self.done += 1
        self._state = "head"

    def _step(self) -> bool:
        b = self._buf
        if self._state == "head":
            end = b.find(b"\r\n\r\n")
            if end < 0:
                if len(b) > sniff.MAX_HEAD:
                    raise ValueError("head too large")
                return False
            lines = b[:end].split(b"\r\n")
            self._buf = b[end + 4:]
            code = int(lines[0].split(b" ")[1])
            hdrs = {}
            for ln in lines[1:]:
                k, _, v = ln.partition(b":")
                hdrs[k.strip().lower()] = v.strip().lower()
            if 100 <= code < 200:
                if code == 101:
                    raise ValueError("switched protocols")
                return True
            if self.methods[0] == "HEAD" or code in (204, 304):
                self._finish()
            elif b"chunked" in hdrs.get(b"transfer-encoding", b""):
                self._state = "size"
            elif b"content-length" in hdrs:
                self._state, self._left = "body", int(hdrs[b"content-length"])
                if not self._left:
                    self._finish()
            else:
                self._state = "close"   # its end is the connection's
            return True
        if self._state == "body":
            k = min(self._left, len(b))
            self._buf, self._left = b[k:], self._left - k
            if not self._left:
                self._finish()
                return True
            return False
        if self._state == "size":
            i = b.find(b"\r\n")
            if i < 0:
                return False
            n = int(b[:i].split(b";")[0], 16)
            self._buf = b[i + 2:]
            self._state, self._left = ("trailers", 0) if n == 0 else ("chunk", n + 2)
            return True
        if self._state == "chunk":
            k = min(self._left, len(b))
            self._buf, self._left = b[k:], self._left - k
            if not self._left:
                self._state = "size"
                return True
            return False
        if self._state == "trailers":
            i = b.find(b"\r\n")
            if i < 0:
                return False
            self._buf = b[i + 2:]
            if i == 0:
                self._finish()
            return True
        return False

    async def settled(self, timeout: float) -> None:
        """Wait until every forwarded request has its answer (or the stream cannot tell, or `timeout`)."""
        deadline = time.monotonic() + timeout
        while self.methods and not self.broken:
            self.changed.clear()
            left = deadline - time.monotonic()
            if left <= 0:
                return
            try:
                await asyncio.wait_for(self.changed.wait(), left)
            except asyncio.TimeoutError:
                return


class TLSEnd:
    """One TLS end over a non-blocking socket of the proxy (an ssl.SSLObject fed through memory BIOs)."""

    def __init__(self, conn, sock, ctx: ssl.SSLContext, *, server_side: bool, hostname: str | None = None,
                 first: bytes = b""):
        self.conn, self.sock = conn, sock
        self.inc, self.out = ssl.MemoryBIO(), ssl.MemoryBIO()
        if first:
            self.inc.write(first)
        self.obj = ctx.wrap_bio(self.inc, self.out, server_side=server_side, server_hostname=hostname)

    async def _flush(self) -> None:
        data = self.out.read()
        if data:
            if self.sock is self.conn.upstream:   # counted once: on the server's side
                self.conn.sandbox.relayed += len(data)
            await self.conn.loop.sock_sendall(self.sock, data)

    async def _fill(self) -> None:
        data = await self.conn.loop.sock_recv(self.sock, 65536)
        if data:
            if self.sock is self.conn.upstream:
                self.conn.sandbox.relayed += len(data)
            self.inc.write(data)
        else:
            self.inc.write_eof()

    async def handshake(self) -> None:
        async def go():
            while True:
                try:
                    self.obj.do_handshake()
                    await self._flush()
                    return
                except ssl.SSLWantReadError:
                    await self._flush()
                    await self._fill()
        await asyncio.wait_for(go(), HANDSHAKE_TIMEOUT)

    async def recv(self) -> bytes:
        while True:
            try:
                return self.obj.read(65536)
            except ssl.SSLWantReadError:
                await self._flush()
                await self._fill()
            except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
                return b""

    async def send(self, data: bytes) -> None:
        if data:
            self.obj.write(data)
        await self._flush()

    async def close(self) -> None:
        try:
            self.obj.unwrap()
        except (ssl.SSLError, OSError, ValueError):
            pass
        try:
            await self._flush()
        except OSError:
            pass


def _rewrite(secret, host: str, budget: "Meter", responses: "Responses"):
    """The request-head rewrite of a brokered connection: the credential set, compression off, budget taken."""
    header = secret.header.lower().encode()
    value = header_value(secret).encode()

    def rewrite(head: sniff.RequestHead, raw: bytes) -> bytes:
        if head.upgrade:
            raise sniff.Refused("HTTP Upgrade on a connection that carries a credential is not relayed")
        body = head.body[1] if head.body[0] == "length" else 0
        over = budget.take_request(len(raw) + body)
        if over:
            raise OverBudget(f"a request to {host} {over}")
        lines = raw[:-4].split(b"\r\n")
        kept = [lines[0]] + [ln for ln in lines[1:]
                             if ln.partition(b":")[0].strip().lower() not in (header, b"accept-encoding")]
        kept += [secret.header.encode() + b": " + value, b"Accept-Encoding: identity"]
        responses.methods.append(head.method)
        return b"\r\n".join(kept) + b"\r\n\r\n"

    return rewrite


def header_value(secret) -> str:
    """The header's value: the daemon's copy of the secret only (never a lookup in the daemon's environment)."""
    return secret.format.replace("{}", secret.value)


def too_many(reason: str) -> bytes:
    body = (f"hutch egress gateway: {reason}; the request was not sent. Wait, or raise the budget (the Network's or the Secret's).\n"
            ).encode()
    return (b"HTTP/1.1 429 Too Many Requests\r\nContent-Type: text/plain; charset=utf-8\r\nConnection: close\r\n"
            b"Retry-After: 60\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))


async def serve(proxy, conn, host: str, target: str, port: int, hello: bytes, secret, why: str) -> None:
    """Run one brokered connection to the end (the proxy's `_handle` hands it over after its checks)."""
    sb = conn.sandbox
    why_not = sb.tls.admit()
    if why_not:
        return proxy._deny(conn, f"{why_not}; {host} refused", name=host, address=target, port=port, protocol="tls")
    try:
        return await _serve(proxy, conn, host, target, port, hello, secret, why)
    finally:
        sb.tls.release()


async def _serve(proxy, conn, host: str, target: str, port: int, hello: bytes, secret, why: str) -> None:
    gw, sb = proxy.gw, conn.sandbox
    down_tls = TLSEnd(conn, conn.client, sb.ca.context_for(host), server_side=True, first=hello)
    try:
        await down_tls.handshake()
    except (ssl.SSLError, asyncio.TimeoutError, OSError) as e:
        return proxy._deny(conn, f"the sandbox's TLS to {host} failed ({_ssl_reason(e)}); does it trust its "
                           "CA (/etc/ssl/certs/ca-certificates.crt)?", name=host, address=target, port=port,
                           protocol="tls")
    await proxy._dial(conn, target, port)
    up_tls = TLSEnd(conn, conn.upstream, gw.upstream_tls, server_side=False, hostname=host)
    try:
        await up_tls.handshake()
    except (ssl.SSLError, asyncio.TimeoutError, OSError) as e:
        return proxy._deny(conn, f"the server's certificate for {host} did not verify ({_ssl_reason(e)}); the "
                           "credential was not sent", name=host, address=target, port=port, protocol="tls")
    conn.kind, conn.secret = "brokered", secret
    gw._record(sb, host, target, port, "tls", "allow", f"{why}; credential brokered ({secret.header})")
    budget = sb.budgets.setdefault(host, Budget(secret.requests_per_minute, secret.bytes_per_minute,
                                                "the credential's budget"))
    budget = conn.meter = Meter(sb, conn.meter.entry if conn.meter else host, budget)
    responses = Responses()
    stream = sniff.RequestStream(host, rewrite=_rewrite(secret, host, budget, responses))
    red = Redactor([secret.value.encode(), header_value(secret).encode()])

    refused: list[str] = []    # set when a request is over budget: the 429 goes last, after what was asked before

    async def down():
        while True:
            try:
                data = await (asyncio.wait_for(up_tls.recv(), HOLD) if red.held else up_tls.recv())
            except asyncio.TimeoutError:
                await down_tls.send(red.flush())
                continue
            budget.add(len(data))
            if not data:
                await down_tls.send(red.flush())
                if not refused:
                    await down_tls.close()
                return
            await sb.tls.pace(len(data))
            await down_tls.send(red.feed(data))
            responses.feed(data)

    task = conn.loop.create_task(down())
    conn.tasks.append(task)
    try:
        while True:
            data = await down_tls.recv()
            if not data:
                await up_tls.close()
                break
            try:
                out = stream.feed(data)
            except OverBudget as e:
                gw._record(sb, host, target, port, "tls", "deny", str(e))
                refused.append(str(e))
                # answers come in the order of the requests: those forwarded before this one go first
                if e.passed:   # the requests before it in the same read
                    await up_tls.send(e.passed)
                await responses.settled(HANDSHAKE_TIMEOUT)
                if red.held:
                    await down_tls.send(red.flush())
                task.cancel()
                await down_tls.send(too_many(str(e)))
                await down_tls.close()
                return conn.close()
            except sniff.Refused as e:
                gw._record(sb, host, target, port, "tls", "deny", str(e))
                return conn.close(reset=True)
            over = budget.add(len(out))
            if over:
                gw._record(sb, host, target, port, "tls", "deny", f"a request to {host} went {over}; reset")
                return conn.close(reset=True)
            await sb.tls.pace(len(out))
            await up_tls.send(out)
        await task
    except (OSError, ConnectionError, ssl.SSLError):
        return conn.close(reset=True)
    conn.close()


def _ssl_reason(e: BaseException) -> str:
    if isinstance(e, asyncio.TimeoutError):
        return f"no handshake in {HANDSHAKE_TIMEOUT:.0f} s"
    return getattr(e, "verify_message", None) or getattr(e, "reason", None) or e.__class__.__name__
