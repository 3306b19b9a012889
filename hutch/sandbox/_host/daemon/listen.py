"""The daemon's listeners: its own accept loops in front of aiohttp, so nobody unchecked reaches HTTP.

    gate = Gate(limits, log, PeerCheck(policy), token, ssl_context); gate.server = runner.server
    gate.start_unix(sock); gate.start_tcp(sock)     # accept loops (tasks)
    gate.lookup(request.transport)                  # the middleware: which connection, authenticated yet?

- Unix socket: SO_PEERCRED is checked at accept, before anything is read; a refused
  peer gets one 403 JSON answer and never meets the HTTP parser. Its accept loop is
  separate from TCP's, and TCP can never hold more than `max_tcp` descriptors, so a
  TCP flood cannot starve local clients of descriptors or of accepts.
- TCP: TLS, then every request needs the token (checked by the middleware, per
  request). Until a connection's first authenticated request it is *pending*: at most
  `max_tcp_per_peer` pending per address (per /64 for IPv6), `max_tcp // 2` pending in
  all; accepts are paced at `tcp_accept_rate` per second.
- Every connection: the next request's head must arrive within `header_timeout` of its
  first byte (of the accept, for a TCP connection's first request, TLS included), and an
  idle keep-alive connection is closed after `idle_timeout`. A request in progress (an
  exec, a lease) has no limit.
- What floods can cause (refusals, cap hits, timeouts, accept errors) goes to the
  rate-limited log (ratelog.py).
"""

from __future__ import annotations

import asyncio
import errno
import ipaddress
import json
import resource
import socket
import time
from collections import Counter
from dataclasses import dataclass

from hutch._core.errors import ConfigError
from hutch._core.tokens import token_matches
from hutch.sandbox._host.daemon.access import Peer, PeerCheck
from hutch.sandbox._host.daemon.ratelog import RateLog

#: Seconds a request head may take from its first byte (a TCP connection's first: from the accept).
HEADER_TIMEOUT = 10.0
#: Seconds a keep-alive connection may sit idle between requests.
IDLE_TIMEOUT = 60.0
#: TCP connections at once (authenticated or not); at most half of them unauthenticated.
MAX_TCP = 1024
#: Unauthenticated TCP connections from one address (one /64 for IPv6).
MAX_TCP_PER_PEER = 16
#: New TCP connections accepted per second (bursts of a second's worth).
TCP_ACCEPT_RATE = 500.0
#: Who a request of the operator is (Gate.authorize): a Unix peer, or the daemon's own TCP token.
OPERATOR = "operator"
#: Refused Unix peers answered at once; more are closed without an answer.
_MAX_REFUSING = 64
#: Descriptors kept out of TCP's reach: the Unix socket's clients, sandboxes, the zygote, files.
_FD_RESERVE = 256


@dataclass(frozen=True)
class ListenLimits:
    """Timeouts and caps of the daemon's listeners (see the module docstring); defaults above."""

    header_timeout: float = HEADER_TIMEOUT
    idle_timeout: float = IDLE_TIMEOUT
    max_tcp: int = MAX_TCP
    max_tcp_per_peer: int = MAX_TCP_PER_PEER
    tcp_accept_rate: float = TCP_ACCEPT_RATE

    def __post_init__(self):
        for name in ("header_timeout", "idle_timeout", "tcp_accept_rate"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise ConfigError(f"{name}={v!r} must be a positive number of seconds (or per second).")
        for name in ("max_tcp", "max_tcp_per_peer"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 2:
                raise ConfigError(f"{name}={v!r} must be a whole number of at least 2.")

    def fitted(self) -> "ListenLimits":
        """These limits with max_tcp lowered to what the descriptor limit allows (raised to its hard cap first)."""
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != hard:
            try:
                resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
                soft = hard
            except (ValueError, OSError):
                pass
        room = max(2, (soft - _FD_RESERVE) // 2) if soft != resource.RLIM_INFINITY else self.max_tcp
        if room >= self.max_tcp:
            return self
        return ListenLimits(self.header_timeout, self.idle_timeout, room, min(self.max_tcp_per_peer, room),
                            self.tcp_accept_rate)


def peer_key(addr) -> str:
    """The address a per-peer cap counts: the IPv4 address, or the /64 of an IPv6 one."""
    try:
        ip = ipaddress.ip_address(addr[0].split("%")[0])
    except (ValueError, IndexError, TypeError):
        return "?"
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped:
            return str(ip.ipv4_mapped)
        return str(ipaddress.ip_network(f"{ip}/64", strict=False))
    return str(ip)


class Conn(asyncio.Protocol):
    """One accepted connection: aiohttp's protocol inside, its timers and its place in the caps around it.

    One timer per connection, never re-armed per request (this is on every request's path): it fires
    at most `header_timeout` apart, and each time closes the connection if the awaited request head is
    overdue (header_timeout after its first byte) or it has idled `idle_timeout`, else sets itself
    for the nearer of those deadlines; while a request is in progress it lapses, and the request's
    end sets it again.
    """

    def __init__(self, gate: "Gate", inner: asyncio.Protocol, tcp: bool, peer: str, accepted: float):
        self.gate, self.inner, self.tcp, self.peer = gate, inner, tcp, peer
        self.authenticated = not tcp
        self.transport = None
        self.busy = 0
        self.started: float | None = accepted   # when the request head now awaited began (None: idle)
        self.idle_since = accepted
        self.timer: asyncio.TimerHandle | None = None
        self.released = False

    # --- asyncio.Protocol, passed through ---------------------------------------------------

    def connection_made(self, transport):
        self.transport = transport
        self.gate.conns[transport] = self
        self.inner.connection_made(transport)
        self._tick()

    def data_received(self, data):
        if self.started is None and not self.busy:
            self.started = self.gate.loop.time()   # the next request began: its head has header_timeout
        self.inner.data_received(data)

    def eof_received(self):
        return self.inner.eof_received()

    def pause_writing(self):
        self.inner.pause_writing()

    def resume_writing(self):
        self.inner.resume_writing()

    def connection_lost(self, exc):
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        self.gate.conns.pop(self.transport, None)
        self.gate.release(self)
        self.inner.connection_lost(exc)

    # --- requests (called by the middleware) ------------------------------------------------

    def begin(self) -> None:
        self.busy += 1
        self.started = None

    def end(self) -> None:
        self.busy -= 1
        if not self.busy:
            self.idle_since = self.gate.loop.time()
            if self.timer is None:
                self.timer = self.gate.loop.call_at(self.idle_since + self.gate.limits.header_timeout, self._tick)

    # --- the timer -------------------------------------------------------------------------

    def _tick(self) -> None:
        self.timer = None
        if self.busy or self.transport is None or self.transport.is_closing():
            return
        lim, now = self.gate.limits, self.gate.loop.time()
        if self.started is not None:
            due, why = self.started + lim.header_timeout, "header"
        else:
            due, why = self.idle_since + lim.idle_timeout, "idle"
        if now < due:
            self.timer = self.gate.loop.call_at(min(due, now + lim.header_timeout), self._tick)
            return
        if why == "header":
            self.gate.log.note("header-timeout", f"hutch daemon: closed a {'TCP' if self.tcp else 'Unix'} connection "
                               f"from {self.peer}: no complete request head within {lim.header_timeout:g} s")
        self.transport.abort()


def _json_errors(handler):
    """aiohttp's request handler (one per connection), answering the errors it makes itself as the API's JSON.

    A request aiohttp cannot parse (a request line or header over its limits, a bad method, broken framing)
    never reaches the app or its middleware: aiohttp answers it from `handle_error`, in plain text. The class
    swap keeps aiohttp's construction (whatever the runner's handler arguments) and changes only that answer;
    the subclass adds no slots, so the object's layout is aiohttp's."""
    handler.__class__ = _handler_class(type(handler))
    return handler


_classes: dict = {}


def _handler_class(base):
    cls = _classes.get(base)
    if cls is None:
        from aiohttp import web

        class JsonErrorHandler(base):
            __slots__ = ()

            def handle_error(self, request, status=500, exc=None, message=None):
                if status >= 500:
                    self.log_exception("Error handling request from %s", request.remote, exc_info=exc)
                if request.writer.output_size > 0:
                    raise ConnectionError("the response had begun; no error answer can follow it")
                if status == 504:
                    body = {"error": "SandboxTimeout", "message": "the request took too long and was given up; retry it."}
                elif status >= 500:
                    body = {"error": "DaemonError", "message": f"the daemon failed ({status}); see its log."}
                else:
                    why = (message or (str(exc) if exc else "") or "malformed").splitlines()[0][:300]
                    body = {"error": "ConfigError", "message": f"the request could not be read as HTTP/1.1 ({why}); "
                            "keep the request line and each header under 8 KiB and frame the body as HTTP/1.1."}
                resp = web.json_response(body, status=status)
                resp.force_close()
                return resp

        cls = _classes[base] = JsonErrorHandler
    return cls


class Gate:
    """The accept loops, the connections they made and the caps and timers over them."""

    def __init__(self, limits: ListenLimits, log: RateLog, check: PeerCheck, token: str | None = None,
                 ssl_context=None, tenants=None):
        self.server = None   # aiohttp's web.Server (a protocol factory), set once the app runner is set up
        self.limits, self.log, self.check = limits, log, check
        self.token, self.ssl = token, ssl_context
        self.tenants = tenants   # tenants.Registry (`hutch serve --tenants`), or None
        self.loop = asyncio.get_running_loop()
        self.conns: dict[object, Conn] = {}
        self.tcp_count = 0
        self.pending = 0
        self.pending_by_peer: Counter[str] = Counter()
        self.room = asyncio.Event()
        self.room.set()
        self.refusing = 0
        self.tasks: set[asyncio.Task] = set()

    def start_unix(self, sock: socket.socket) -> None:
        self._spawn(self._unix_loop(sock))

    def start_tcp(self, sock: socket.socket) -> None:
        if (self.token is None and self.tenants is None) or self.ssl is None:
            raise ConfigError("a TCP listener needs a token (or tenants) and TLS.")
        self._spawn(self._tcp_loop(sock))

    def _spawn(self, coro) -> None:
        t = self.loop.create_task(coro)
        self.tasks.add(t)   # the loop keeps only a weak reference to a task
        t.add_done_callback(self.tasks.discard)

    async def close(self) -> None:
        """Stop accepting (and end handshakes and refusals in progress); served connections stay to aiohttp."""
        tasks = list(self.tasks)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def lookup(self, transport) -> Conn | None:
        return self.conns.get(transport)

    def authorize(self, conn: Conn, header: str | None):
        """Who sends this request of `conn`: OPERATOR (a Unix peer checked at accept, or the TCP token), a
        tenants.Tenant (its token, on either listener), or None: refused (a TCP request without a valid token)."""
        tenant = self.tenants.lookup(header) if self.tenants is not None and header else None
        if tenant is not None:
            who = tenant
        elif not conn.tcp:
            return OPERATOR
        elif self.token is not None and token_matches(header, self.token):
            who = OPERATOR
        else:
            self.log.note("bad-token", f"hutch daemon: refused a TCP request from {conn.peer}: missing or wrong token")
            return None
        if conn.tcp and not conn.authenticated:
            conn.authenticated = True
            self._unpend(conn.peer)
        return who

    # --- Unix socket ---------------------------------------------------------------------

    async def _unix_loop(self, lsock: socket.socket) -> None:
        while True:
            try:
                csock, _ = await self.loop.sock_accept(lsock)
            except OSError as e:
                await self._accept_failed("Unix", e)
                continue
            try:
                peer = Peer.of(csock)
                allowed = self.check.allows(peer)
            except OSError:
                csock.close()
                continue
            if not allowed:
                self._refuse(csock, peer)
                continue
            try:
                await self.loop.connect_accepted_socket(
                    lambda: Conn(self, _json_errors(self.server()), False, f"uid {peer.uid}", self.loop.time()), csock)
            except OSError:
                csock.close()

    def _refuse(self, csock: socket.socket, peer: Peer) -> None:
        self.log.note("refused-peer", f"hutch daemon: refused a connection from uid {peer.uid} (pid {peer.pid}): "
                                      f"this daemon serves {self.check.policy.describe()}")
        if self.refusing >= _MAX_REFUSING:
            csock.close()
            return
        self.refusing += 1
        self._spawn(self._answer_refused(csock))

    async def _answer_refused(self, csock: socket.socket) -> None:
        hint = " (`hutch serve --group NAME`)" if self.check.policy.gid is None else ""
        body = json.dumps({"error": "DaemonError", "message":
                           f"this hutch daemon serves {self.check.policy.describe()}{hint}; your user may not "
                           "drive it. Ask its operator to add you to its group, or use the SDK as root."}).encode()
        head = (f"HTTP/1.1 403 Forbidden\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
                "Connection: close\r\n\r\n").encode()
        try:
            csock.setblocking(False)
            await asyncio.wait_for(self.loop.sock_sendall(csock, head + body), 1.0)
            csock.shutdown(socket.SHUT_WR)
            deadline = self.loop.time() + 1.0
            read = 0
            # read what the client sent, so that closing does not reset the connection before it reads the answer
            while read < (1 << 16) and (left := deadline - self.loop.time()) > 0:
                chunk = await asyncio.wait_for(self.loop.sock_recv(csock, 4096), left)
                if not chunk:
                    break
                read += len(chunk)
        except (OSError, asyncio.TimeoutError):
            pass
        finally:
            self.refusing -= 1
            csock.close()

    # --- TCP -----------------------------------------------------------------------------

    async def _tcp_loop(self, lsock: socket.socket) -> None:
        lim = self.limits
        tokens, last = lim.tcp_accept_rate, time.monotonic()
        while True:
            await self.room.wait()
            now = time.monotonic()
            tokens = min(lim.tcp_accept_rate, tokens + (now - last) * lim.tcp_accept_rate)
            last = now
            if tokens < 1:
                await asyncio.sleep((1 - tokens) / lim.tcp_accept_rate)
                continue
            try:
                csock, addr = await self.loop.sock_accept(lsock)
            except OSError as e:
                await self._accept_failed("TCP", e)
                continue
            tokens -= 1
            peer = peer_key(addr)
            if self.pending_by_peer[peer] >= lim.max_tcp_per_peer:
                self.log.note("peer-cap", f"hutch daemon: closed a TCP connection from {peer}: it already has "
                                          f"{lim.max_tcp_per_peer} unauthenticated connections")
                csock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\1\0\0\0\0\0\0\0")   # reset, no TIME_WAIT
                csock.close()
                continue
            self.tcp_count += 1
            self.pending += 1
            self.pending_by_peer[peer] += 1
            self._update_room()
            conn = Conn(self, _json_errors(self.server()), True, peer, self.loop.time())
            self._spawn(self._handshake(csock, conn))

    async def _handshake(self, csock: socket.socket, conn: Conn) -> None:
        try:
            await self.loop.connect_accepted_socket(lambda: conn, csock, ssl=self.ssl,
                                                    ssl_handshake_timeout=self.limits.header_timeout)
        except (OSError, asyncio.TimeoutError, ConnectionError) as e:
            self.log.note("tls-failed", f"hutch daemon: TLS with {conn.peer} failed: {type(e).__name__}: {e}")
            csock.close()
            self.release(conn)
        except asyncio.CancelledError:
            csock.close()
            self.release(conn)
            raise

    def release(self, conn: Conn) -> None:
        if conn.released or not conn.tcp:
            return
        conn.released = True
        self.tcp_count -= 1
        if not conn.authenticated:
            self._unpend(conn.peer)
        self._update_room()

    def _unpend(self, peer: str) -> None:
        self.pending -= 1
        self.pending_by_peer[peer] -= 1
        if self.pending_by_peer[peer] <= 0:
            del self.pending_by_peer[peer]
        self._update_room()

    def _update_room(self) -> None:
        full = self.tcp_count >= self.limits.max_tcp or self.pending >= self.limits.max_tcp // 2
        if full and self.room.is_set():
            self.room.clear()
            self.log.note("tcp-full", f"hutch daemon: {self.tcp_count} TCP connections ({self.pending} "
                                      "unauthenticated) reached the cap; new ones wait in the listen queue")
        elif not full:
            self.room.set()

    async def _accept_failed(self, what: str, e: OSError) -> None:
        self.log.note(f"accept-{what}", f"hutch daemon: accepting a {what} connection failed: {e}")
        if e.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
            await asyncio.sleep(0.05)   # out of descriptors: let connections end rather than spin


__all__ = ["Conn", "Gate", "HEADER_TIMEOUT", "IDLE_TIMEOUT", "ListenLimits", "MAX_TCP", "MAX_TCP_PER_PEER", "OPERATOR",
           "peer_key"]
