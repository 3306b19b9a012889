"""The gateway's TCP proxy: decide on a connection, dial it, relay it.

Every TCP connection a sandbox opens arrives here through the host's REDIRECT
rule. The proxy learns the original destination (SO_ORIGINAL_DST), and:

1. if the policy admits that address by itself (a CIDR rule; `open` and a
   public address), dials it and relays raw bytes;
2. otherwise reads the first bytes: a TLS ClientHello's SNI or an HTTP
   request's Host. The protocol must be the port's (no TLS on 80, no plain
   HTTP on 443: `PORT_PROTOCOLS`), the name must be allowed, and so must every
   name of its CNAME chain; the proxy resolves it itself and dials one of its
   acceptable addresses (the sandbox's choice of address, a forged /etc/hosts
   entry or a raw IP, counts for nothing);
3. a TLS connection is relayed unread, so the proxy first passes on only the
   ClientHello and relays the rest once the server has answered it with TLS:
   a fake ClientHello cannot open a raw channel to a server that speaks
   something else.

A refused connection is reset (SO_LINGER 0). After the decision, bytes move
with splice(2) through a pipe, so they never enter Python; a plain-HTTP
connection's requests are still parsed one by one, so that each Host is checked.
"""

from __future__ import annotations

import asyncio
import errno
import fcntl
import ipaddress
import os
import socket
import struct
import sys
import traceback

from hutch.sandbox._host.egress import broker, sniff
from hutch.sandbox._host.egress.dns import ResolveError
from hutch.sandbox._host.egress.policy import Verdict, chain_allowed, normalize_name, protocol_allowed
from hutch.sandbox._spec import matching_domain

SO_ORIGINAL_DST = 80
PEEK_TIMEOUT = 10.0
DIAL_TIMEOUT = 10.0
CHUNK = 1 << 20
MAX_CONNS_PER_SANDBOX = 2048
ACCEPT_BATCH = 16          # connections accepted per turn of the event loop
#: Kernel buffer space that one sandbox's proxied connections share: each connection's two sockets (both ways)
#: and its two splice pipes, ten parts in all, are sized when it opens to an equal part of it for the number of
#: connections the sandbox then has (at most 2 MiB, at least 4 KiB each), and every open connection's sockets
#: shrink to the new part whenever that number doubles. What a socket has queued already stays (TCP never takes
#: back a window it offered), so connections the sandbox stops reading hold up to about this times
#: (1 + ln connections) opened one after another: 300 held 22 MiB. Left to the kernel's autotuning each grew to
#: some MiB, and the host's TCP memory limit is one for every socket of the host: a few hundred such connections
#: of one sandbox reached it.
SANDBOX_BUFFERS = 16 << 20
#: Bytes one sandbox's connections may hold together in the proxy's own memory while they are read: ClientHellos
#: and HTTP request heads not yet complete. A connection that would take it past this is refused (each may hold
#: up to 64 KiB: 1,900 connections holding 60 KB of a ClientHello each grew the daemon by 211 MiB).
HELD_MAX = 4 << 20
CONN_BUF_MAX = 2 << 20
CONN_BUF_MIN = 4 << 10
_F_SETPIPE_SZ = 1031
_SPLICE_FLAGS = getattr(os, "SPLICE_F_MOVE", 1) | getattr(os, "SPLICE_F_NONBLOCK", 2)


def original_dst(sock: socket.socket) -> tuple[str, int]:
    raw = sock.getsockopt(socket.SOL_IP, SO_ORIGINAL_DST, 16)
    port = struct.unpack("!H", raw[2:4])[0]
    return socket.inet_ntoa(raw[4:8]), port


def delivered_locally(addr: str) -> bool:
    """Would this host deliver a packet for `addr` to itself?

    Asks the kernel now, so it also knows addresses added since the gateway last listed
    them and `local` routes (AnyIP) that are no interface's address. Sends nothing.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((addr, 9))      # a route lookup: a local route makes the source the address itself
        except OSError:
            return False              # no route at all: a dial fails by itself
        if s.getsockname()[0] == addr:
            return True
    if _nonlocal_bind():
        return False
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.bind((addr, 0))         # succeeds only for local (or broadcast) addresses
            return True
        except OSError:
            return False


def _nonlocal_bind() -> bool:
    try:
        with open("/proc/sys/net/ipv4/ip_nonlocal_bind", "rb") as f:
            return f.read(1) != b"0"
    except OSError:
        return True


def buffer_share(conns: int) -> int:
    """The size of each socket buffer and pipe of a sandbox's connection while it has `conns` of them."""
    return max(CONN_BUF_MIN, min(CONN_BUF_MAX, SANDBOX_BUFFERS // (10 * max(1, conns))))


def _set_buffers(sock: socket.socket, size: int) -> None:
    # the kernel doubles the value (for its bookkeeping) and no longer autotunes the socket
    for opt in (socket.SO_RCVBUF, socket.SO_SNDBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, opt, size)
        except OSError:
            pass


def _hard_close(sock: socket.socket | None, reset: bool) -> None:
    if sock is None or sock.fileno() < 0:
        return
    if reset:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass
    sock.close()


class Conn:
    """One proxied connection; knows what it was allowed as, so a new policy can re-check it."""

    def __init__(self, loop, sandbox, client: socket.socket):
        self.loop = loop
        self.sandbox = sandbox
        self.client = client
        self.upstream: socket.socket | None = None
        self.name: str | None = None
        self.address: str | None = None
        self.port = 0
        self.kind = "tcp"          # tcp (by address) | tls | http | brokered (TLS with a credential, broker.py)
        self.secret = None         # the credential a brokered connection carries
        self.meter = None          # the budgets it is charged to (broker.Meter), once decided
        self.closed = False
        self.tasks: list[asyncio.Task] = []
        self.buffers = CONN_BUF_MAX    # the size of its socket buffers and pipes (buffer_share)
        self.held = 0                  # bytes of it the proxy holds while reading it (HELD_MAX)

    def hold(self, n: int) -> bool:
        """The proxy now holds `n` bytes of this connection; False if its sandbox's connections then hold more
        than HELD_MAX together (the caller refuses it)."""
        self.sandbox.held += n - self.held
        self.held = n
        return self.sandbox.held <= HELD_MAX

    def shrink(self, size: int) -> None:
        """Give its sockets smaller buffers (the sandbox has more connections now)."""
        if size >= self.buffers or self.closed:
            return
        self.buffers = size
        for s in (self.client, self.upstream):
            if s is not None and s.fileno() >= 0:
                _set_buffers(s, size)

    def close(self, reset: bool = False) -> None:
        """Close both sides at once; `reset` sends RST instead of FIN."""
        if self.closed:
            return
        self.closed = True
        for s in (self.client, self.upstream):
            if s is not None and s.fileno() >= 0:
                self.loop.remove_reader(s.fileno())
                self.loop.remove_writer(s.fileno())
        _hard_close(self.client, reset)
        _hard_close(self.upstream, reset)
        self.hold(0)
        me = asyncio.current_task()
        for t in self.tasks:
            if t is not me:
                t.cancel()
        self.sandbox.conns.discard(self)

    async def _wait(self, sock: socket.socket, writable: bool) -> None:
        if self.closed:
            raise ConnectionAbortedError("connection closed")
        fd = sock.fileno()
        fut = self.loop.create_future()

        def ready():
            if not fut.done():
                fut.set_result(None)

        (self.loop.add_writer if writable else self.loop.add_reader)(fd, ready)
        try:
            await fut
        finally:
            # after close() the fd number may already belong to another socket
            if not self.closed:
                (self.loop.remove_writer if writable else self.loop.remove_reader)(fd)
        if self.closed:
            raise ConnectionAbortedError("connection closed")

    async def splice(self, src: socket.socket, dst: socket.socket, *, sending: bool = False) -> None:
        """Move bytes src -> dst through a pipe until EOF; then half-close dst. Every byte is charged to the
        connection's budgets; `sending` (the sandbox's side to the server's) never moves past what their minute
        has left: a connection that would is refused (OverBudget)."""
        r, w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        meter = self.meter
        try:
            try:
                fcntl.fcntl(w, _F_SETPIPE_SZ, min(CHUNK, self.buffers))
            except OSError:
                pass
            sfd, dfd = src.fileno(), dst.fileno()
            while True:
                want = CHUNK
                left = meter.left() if sending and meter is not None else None
                if left is not None and left <= 0:
                    await self._wait(src, False)   # nothing may go: see whether the sandbox sends more
                    try:
                        more = src.recv(1, socket.MSG_PEEK)
                    except BlockingIOError:
                        continue
                    left = meter.left()
                    if more and left is not None and left <= 0:   # it does, and the minute still has no room
                        raise broker.OverBudget(f"{self.name or self.address} went over {_byte_budget(meter)}")
                    want = 1 if not more else CHUNK          # the end of its stream: the splice reads the EOF
                    if left is not None and more:
                        want = min(CHUNK, left)
                elif left is not None:
                    want = min(CHUNK, left)
                try:
                    n = os.splice(sfd, w, want, flags=_SPLICE_FLAGS)
                except BlockingIOError:
                    await self._wait(src, False)
                    continue
                if n == 0:
                    break
                self.sandbox.relayed += n
                if meter is not None:
                    meter.add(n)
                while n:
                    try:
                        n -= os.splice(r, dfd, n, flags=_SPLICE_FLAGS)
                    except BlockingIOError:
                        await self._wait(dst, True)
            if not self.closed:
                dst.shutdown(socket.SHUT_WR)
        finally:
            os.close(r)
            os.close(w)

    async def copy_checked(self, src: socket.socket, dst: socket.socket, stream: sniff.RequestStream) -> None:
        """Client -> server for plain HTTP: every request head is checked before it is forwarded."""
        while True:
            # no more at once than its share of buffers: what the server does not take waits here
            data = await self.loop.sock_recv(src, min(65536, self.buffers))
            if not data:
                if not self.closed:
                    dst.shutdown(socket.SHUT_WR)
                return
            out = stream.feed(data)
            if not self.hold(len(stream.buf)):   # a request head not yet complete
                raise sniff.Refused(f"the sandbox's connections hold more than {HELD_MAX >> 20} MiB of "
                                    "unfinished ClientHellos and request heads")
            if out:
                self.sandbox.relayed += len(out)
                if self.meter is not None:
                    left = self.meter.left()
                    if left is not None and len(out) > left:
                        raise broker.OverBudget(f"a request to {self.name} went over {_byte_budget(self.meter)}")
                    self.meter.add(len(out))
                await self.loop.sock_sendall(dst, out)


def _byte_budget(meter) -> str:
    b = min((b for b in meter.budgets() if b.nbytes is not None), key=lambda b: b.left())
    return f"{b.what} of {b.nbytes} bytes per minute"


def _entry(policy, conn: Conn) -> str:
    """The entry of the policy whose budget a connection is charged to: the domain entry that admits its name,
    the cidr that admits its address, or "open" (everything together)."""
    if policy.mode == "allow":
        if conn.name is not None and (d := matching_domain(policy.domains, conn.name)) is not None:
            return d
        ip = ipaddress.ip_address(conn.address)
        for c in policy.cidrs:
            if ip in ipaddress.ip_network(c):
                return c
    return "open"


def _counting(meter, name: str):
    """A plain-HTTP connection's request hook: each request is taken from its budgets (head and a known body
    ahead), Upgrade refused as without it."""

    def take(head: sniff.RequestHead, raw: bytes) -> bytes:
        if head.upgrade:
            raise sniff.Refused("HTTP Upgrade over plain HTTP is not relayed (use TLS, e.g. wss://)")
        over = meter.take_request(len(raw) + (head.body[1] if head.body[0] == "length" else 0))
        if over:
            raise broker.OverBudget(f"a request to {name} {over}")
        return raw

    return take


class Proxy:
    """Accepts redirected connections on the gateway address and runs each one."""

    def __init__(self, gateway):
        self.gw = gateway
        self._sock: socket.socket | None = None
        self._task: asyncio.Task | None = None

    async def start(self, sock: socket.socket) -> None:
        self._sock = sock
        sock.listen(4096)
        sock.setblocking(False)
        self._task = asyncio.get_running_loop().create_task(self._accept_loop())

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        if self._sock:
            self._sock.close()

    async def _accept_loop(self) -> None:
        loop = asyncio.get_running_loop()
        accepted = 0
        while True:
            accepted += 1
            if accepted % ACCEPT_BATCH == 0:
                # sock_accept does not yield while connections are waiting: under a flood it would keep the
                # event loop (every sandbox's DNS and connections) to itself
                await asyncio.sleep(0)
            try:
                client, peer = await loop.sock_accept(self._sock)
            except OSError as e:
                if e.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    await asyncio.sleep(0.05)
                    continue
                raise
            client.setblocking(False)
            sb = self.gw._by_addr.get(peer[0])
            if sb is None:
                _hard_close(client, True)
                continue
            if len(sb.conns) >= MAX_CONNS_PER_SANDBOX:
                # one sandbox must not use up the gateway's descriptors for all others
                sb.conns_refused += 1
                self.gw._record(sb, None, None, None, "tcp", "deny",
                                f"more than {MAX_CONNS_PER_SANDBOX} open connections")
                _hard_close(client, True)
                continue
            conn = Conn(loop, sb, client)
            sb.conns.add(conn)
            n = len(sb.conns)
            conn.buffers = buffer_share(n)
            _set_buffers(client, conn.buffers)
            if n & (n - 1) == 0 and n > 1:    # twice as many connections as at the last share: all shrink
                for c in sb.conns:
                    c.shrink(conn.buffers)
            conn.tasks.append(loop.create_task(self._run(conn)))

    async def _run(self, conn: Conn) -> None:
        try:
            await self._handle(conn)
        except asyncio.CancelledError:
            conn.close(reset=True)
        except (sniff.Refused, OSError, ConnectionError, asyncio.TimeoutError):
            conn.close(reset=True)
        except Exception as e:  # noqa: BLE001 - a bug must not take the gateway down; reset the connection
            self.gw._record(conn.sandbox, conn.name, conn.address, conn.port, conn.kind, "deny",
                            f"internal error in the proxy: {e.__class__.__name__}: {e}")
            conn.close(reset=True)
            traceback.print_exc(file=sys.stderr)

    def _deny(self, conn: Conn, reason: str, name=None, address=None, port=None, protocol="tcp") -> None:
        self.gw._record(conn.sandbox, name, address, port, protocol, "deny", reason)
        conn.close(reset=True)

    async def _handle(self, conn: Conn) -> None:
        sb, loop = conn.sandbox, conn.loop
        policy = sb.policy
        try:
            odst, oport = original_dst(conn.client)
        except OSError:
            return self._deny(conn, "no original destination (the connection was not redirected)")
        conn.port = oport
        pv = self.gw._port_allowed(policy, oport)
        if not pv:
            return self._deny(conn, pv.reason, address=odst, port=oport)
        av = self.gw._rules.address_allowed(policy, odst, by_cidr_only=True)
        if av:
            conn.kind, conn.address = "tcp", odst
            if not self._take_connection(conn, policy):
                return
            await self._dial(conn, odst, oport)
            self.gw._record(sb, None, odst, oport, "tcp", "allow", av.reason)
            await self._relay(conn, bytearray(), None)
            return
        # no address rule admits it: the connection must name an allowed server
        buf = bytearray()
        name = None
        deadline = loop.time() + PEEK_TIMEOUT
        stream = None
        while True:
            if buf:
                if sniff.looks_like_tls(buf):
                    try:
                        state, val = sniff.parse_client_hello(bytes(buf))
                    except sniff.Refused as e:
                        return self._deny(conn, str(e), address=odst, port=oport, protocol="tls")
                    if state == "sni":
                        if val is None:
                            return self._deny(conn, "a TLS ClientHello without a server name (SNI), "
                                              f"and {av.reason}", address=odst, port=oport, protocol="tls")
                        conn.kind, name = "tls", val
                        break
                elif sniff.looks_like_http(buf):
                    try:
                        head = sniff.parse_request_head(buf)
                    except sniff.Refused as e:
                        return self._deny(conn, str(e), address=odst, port=oport, protocol="http")
                    if head is not None:
                        if head.host is None:
                            return self._deny(conn, "an HTTP request without a Host header", address=odst,
                                              port=oport, protocol="http")
                        conn.kind, name = "http", sniff.host_name(head.host)
                        break
                elif len(buf) >= 21 or not bytes(buf).isupper():
                    return self._deny(conn, f"neither TLS nor HTTP, and {av.reason}", address=odst, port=oport)
            left = deadline - loop.time()
            if left <= 0:
                return self._deny(conn, f"the client sent no server name in {PEEK_TIMEOUT:.0f} s, "
                                  f"and {av.reason}", address=odst, port=oport)
            try:
                data = await asyncio.wait_for(loop.sock_recv(conn.client, 65536), left)
            except asyncio.TimeoutError:
                continue
            except sniff.Refused as e:
                return self._deny(conn, str(e), address=odst, port=oport)
            if not data:
                conn.close()
                return
            buf += data
            if len(buf) > sniff.MAX_HELLO + 16:
                return self._deny(conn, "no server name in the first 64 KiB", address=odst, port=oport)
            if not conn.hold(len(buf)):
                return self._deny(conn, f"the sandbox's connections hold more than {HELD_MAX >> 20} MiB of "
                                  "unfinished ClientHellos and request heads", address=odst, port=oport)

        n = normalize_name(name)
        if n is None:
            return self._deny(conn, f"{name!r} is not a DNS name, and {av.reason}", address=odst, port=oport,
                              protocol=conn.kind)
        conn.name = n
        kv = protocol_allowed(oport, conn.kind)
        if not kv:
            return self._deny(conn, kv.reason, name=n, address=odst, port=oport, protocol=conn.kind)
        nv = self.gw._name_allowed(policy, n)
        if not nv:
            return self._deny(conn, nv.reason, name=n, address=odst, port=oport, protocol=conn.kind)
        try:
            answer = await self.gw._upstream.resolve(n)
        except ResolveError as e:
            return self._deny(conn, str(e), name=n, port=oport, protocol=conn.kind)
        cv = chain_allowed(sb.policy, answer.names)
        if not cv:
            return self._deny(conn, cv.reason, name=n, port=oport, protocol=conn.kind)
        addrs = answer.addrs
        ok, why = [], []
        for a in addrs:
            v = self.gw._rules.address_allowed(sb.policy, a)
            (ok if v else why).append(a if v else v.reason)
        if not ok:
            return self._deny(conn, f"{n} resolves only to refused addresses: {'; '.join(why)}", name=n,
                              address=addrs[0] if addrs else None, port=oport, protocol=conn.kind)
        target = odst if odst in ok else ok[0]
        if sb.policy is not policy:   # the policy changed while we looked: decide again from the start
            return self._deny(conn, "the policy changed while the connection was being decided", name=n,
                              address=target, port=oport, protocol=conn.kind)
        conn.address = target
        why = nv.reason + ("" if target == odst else f"; dialed {target}, not {odst}")
        conn.meter = broker.Meter(sb, _entry(policy, conn))
        if conn.kind == "http":
            stream = sniff.RequestStream(n, rewrite=_counting(conn.meter, n))
            try:
                first = bytearray(stream.feed(bytes(buf)))
            except sniff.Refused as e:
                return self._deny(conn, str(e), name=n, address=target, port=oport, protocol="http")
            del buf                      # not held for the connection's life
            conn.hold(len(stream.buf))
            await self._dial(conn, target, oport)
            self.gw._record(sb, n, target, oport, "http", "allow", why)
            return await self._relay(conn, first, stream)
        secret = dict(sb.policy.credentials).get(n)
        if secret is not None and sb.ca is not None and n in sb.ca.hosts:
            # the gateway is the server here: its own TLS reads the ClientHello and whatever followed it
            return await broker.serve(self, conn, n, target, oport, bytes(buf), secret, why)
        end = sniff.client_hello_end(bytes(buf))
        if not self._take_connection(conn, policy):
            return
        await self._dial(conn, target, oport)
        self.gw._record(sb, n, target, oport, "tls", "allow", why)
        answer = await self._server_answers_tls(conn, bytes(buf[:end]))
        if answer is None:
            return
        if conn.meter is not None:
            conn.meter.add(len(answer) + end)   # the ClientHello and the server's first answer count too
        await loop.sock_sendall(conn.client, answer)
        rest = bytearray(buf[end:])
        del buf, answer                  # not held for the connection's life
        conn.hold(0)
        await self._relay(conn, rest, None)

    def _take_connection(self, conn: Conn, policy) -> bool:
        """A connection relayed unread counts as one request of its entry's budget; False (and refused) if over."""
        if conn.meter is None:
            conn.meter = broker.Meter(conn.sandbox, _entry(policy, conn))
        over = conn.meter.take_request()
        if over:
            self._deny(conn, f"a connection to {conn.name or conn.address} {over}", name=conn.name,
                       address=conn.address, port=conn.port, protocol=conn.kind)
            return False
        return True

    async def _server_answers_tls(self, conn: Conn, hello: bytes) -> bytes | None:
        """Send the ClientHello alone; return the server's first bytes if they are TLS. Otherwise the
        connection is closed (the server closed without a word) or refused and reset, and None."""
        loop = conn.loop
        await loop.sock_sendall(conn.upstream, hello)
        got = bytearray()
        deadline = loop.time() + PEEK_TIMEOUT
        while True:
            verdict = sniff.server_answers_tls(got)
            if verdict == "":
                return bytes(got)
            if verdict is not None:
                break
            left = deadline - loop.time()
            if left <= 0:
                verdict = f"no answer in {PEEK_TIMEOUT:.0f} s"
                break
            try:
                data = await asyncio.wait_for(loop.sock_recv(conn.upstream, 65536), left)
            except asyncio.TimeoutError:
                continue
            if not data:
                if not got:
                    conn.close()      # nothing came back, so nothing can be relayed
                    return None
                verdict = "it closed the connection"
                break
            got += data
        self._deny(conn, f"the server did not answer the TLS ClientHello with TLS ({verdict}); a connection "
                   "that is not TLS end to end is not relayed unread", name=conn.name, address=conn.address,
                   port=conn.port, protocol="tls")
        return None

    async def _dial(self, conn: Conn, addr: str, port: int) -> None:
        if delivered_locally(addr):
            # the policy checks know the host's addresses as last listed; the kernel knows them now
            self.gw._record(conn.sandbox, conn.name, addr, port, conn.kind, "deny",
                            f"{addr} is delivered to the host itself (a local address or route)")
            raise ConnectionRefusedError(f"{addr} is local to the host")
        conn.shrink(buffer_share(len(conn.sandbox.conns)))
        up = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        up.setblocking(False)
        up.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        _set_buffers(up, conn.buffers)     # before connect: the window it offers is sized by it
        conn.upstream = up
        try:
            await asyncio.wait_for(conn.loop.sock_connect(up, (addr, port)), DIAL_TIMEOUT)
        except (OSError, asyncio.TimeoutError) as e:
            self.gw._record(conn.sandbox, conn.name, addr, port, conn.kind, "deny",
                            f"dialing {addr}:{port} failed: {e.__class__.__name__}")
            raise

    async def _relay(self, conn: Conn, first: bytearray, stream) -> None:
        loop = conn.loop
        conn.client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if first:
            conn.sandbox.relayed += len(first)
            if conn.meter is not None and stream is None:
                left = conn.meter.left()
                if left is not None and len(first) > left:
                    self.gw._record(conn.sandbox, conn.name, conn.address, conn.port, conn.kind, "deny",
                                    f"{conn.name or conn.address} went over {_byte_budget(conn.meter)}")
                    conn.close(reset=True)
                    return
                conn.meter.add(len(first))
            elif conn.meter is not None:
                conn.meter.add(len(first))
            await loop.sock_sendall(conn.upstream, first)
        first.clear()                    # the caller's too: not held for the connection's life
        down = loop.create_task(conn.splice(conn.upstream, conn.client))
        conn.tasks.append(down)

        def down_done(t: asyncio.Task) -> None:
            # the server side broke (reset, error): pass it on now, not at the client's next write
            if not t.cancelled() and t.exception() is not None:
                conn.close(reset=True)

        down.add_done_callback(down_done)
        try:
            try:
                if stream is not None:
                    await conn.copy_checked(conn.client, conn.upstream, stream)
                else:
                    await conn.splice(conn.client, conn.upstream, sending=True)
            except sniff.Refused as e:   # a request that cannot be framed, or over a budget (OverBudget)
                self.gw._record(conn.sandbox, conn.name, conn.address, conn.port, conn.kind, "deny",
                                f"{e}; reset" if isinstance(e, broker.OverBudget) else str(e))
                conn.close(reset=True)
                return
            await down
        except (OSError, ConnectionError):
            conn.close(reset=True)
            return
        conn.close()

    def recheck(self, conn: Conn, policy) -> Verdict:
        """Would `policy` still allow this open connection?"""
        gw = self.gw
        pv = gw._port_allowed(policy, conn.port)
        if not pv:
            return pv
        if conn.address is None:
            return Verdict(True, "undecided")   # still peeking: it will read the new policy
        if conn.kind == "tcp":
            return gw._rules.address_allowed(policy, conn.address, by_cidr_only=True)
        if conn.kind == "brokered" and dict(policy.credentials).get(conn.name) != conn.secret:
            return Verdict(False, f"the credential of {conn.name} changed")
        if gw._rules.address_allowed(policy, conn.address, by_cidr_only=True):
            return Verdict(True, "address allowed")
        nv = gw._name_allowed(policy, conn.name)
        if not nv:
            return nv
        return gw._rules.address_allowed(policy, conn.address)
