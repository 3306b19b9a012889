"""The gateway's DNS: an upstream client with a cache, and the resolver sandboxes talk to.

The resolver answers a name only when the asking sandbox's policy allows it;
for any other name it answers NXDOMAIN without sending anything upstream, so
a query cannot carry data out. It answers A records only (AAAA and the rest
are empty), and only with addresses the proxy would also dial.

Each sandbox has a `Lane`: its own UDP socket (bound to its link, so a flood fills only its
own receive buffer and takes only its own turns of the event loop), a query budget (token
bucket), a cap on queries being answered at once and on DNS-over-TCP connections. What a
limit holds back is dropped and counted, never queued.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import socket
import struct
import sys
import time
from dataclasses import dataclass
from typing import Callable, NamedTuple

from dnslib import QTYPE, RCODE, RR, A, DNSRecord, DNSHeader, DNSQuestion

from hutch.sandbox._host.egress.audit import TokenBucket

MIN_TTL = 1
MAX_TTL = 300
ANSWER_TTL = 30          # what sandboxes are told; short, so the proxy's view and theirs stay close
NEGATIVE_TTL = 5
UPSTREAM_TIMEOUT = 2.0
CACHE_MAX = 10_000       # names the upstream cache holds at most (oldest dropped first)
MAX_CHAIN = 8            # CNAMEs followed inside one answer

# per sandbox
QUERY_RATE = 200.0       # DNS queries a second (token bucket); beyond it they are dropped and counted
QUERY_BURST = 400
INFLIGHT_MAX = 64        # queries being answered at once (each may wait for upstream)
TCP_MAX = 4              # DNS-over-TCP connections open at once
TCP_IDLE = 10.0          # seconds a DNS-over-TCP connection may wait for its next query
UDP_BATCH = 8            # datagrams read from one socket per turn of the event loop
NOTE_EVERY = 1.0         # a limit that holds queries back is noted in the log at most once a second

_SO_BINDTODEVICE = getattr(socket, "SO_BINDTODEVICE", 25)
_SO_MEMINFO = 55         # struct of 9 u32; the last is the socket's drop count
_IP_FREEBIND = 15


class ResolveError(Exception):
    """The name does not resolve (NXDOMAIN, no A record, or no upstream answered)."""


class Answer(NamedTuple):
    """An upstream answer: the A records, their remaining TTL, and the names on the way there
    (the name asked first, then each CNAME target in order)."""

    addrs: tuple[str, ...]
    ttl: int
    names: tuple[str, ...]


@dataclass
class _Entry:
    addrs: tuple[str, ...]
    expires: float
    error: str | None = None
    names: tuple[str, ...] = ()


class Upstream:
    """Resolves A records through the host's upstream resolvers; caches by TTL; coalesces lookups."""

    def __init__(self, servers: list[tuple[str, int]]):
        if not servers:
            raise ValueError("at least one upstream resolver is needed")
        self.servers = servers
        self._cache: dict[str, _Entry] = {}
        self._inflight: dict[str, asyncio.Future] = {}
        self.queries_sent = 0

    async def resolve(self, name: str) -> Answer:
        """The A records of a normalized name and the CNAME chain to them. Raises ResolveError.

        The chain is not judged here (the cache is shared by every policy): the caller checks each
        name on it against the asking sandbox's policy before it uses any address.
        """
        now = time.monotonic()
        e = self._cache.get(name)
        if e and e.expires > now:
            if e.error:
                raise ResolveError(e.error)
            return Answer(e.addrs, max(MIN_TTL, int(e.expires - now)), e.names)
        task = self._inflight.get(name)
        if task is None:
            # The lookup is a task of its own, not the first asker's: when that asker is cancelled (its
            # sandbox went away), the others waiting for the same name still get the answer.
            task = asyncio.ensure_future(self._fill(name))
            self._inflight[name] = task
            task.add_done_callback(lambda _t, n=name: self._inflight.pop(n, None))
        entry = await asyncio.shield(task)
        if entry.error:
            raise ResolveError(entry.error)
        return Answer(entry.addrs, max(MIN_TTL, int(entry.expires - time.monotonic())), entry.names)

    async def _fill(self, name: str) -> _Entry:
        try:
            entry = await self._lookup(name)
        except Exception as ex:  # noqa: BLE001 - every failure becomes a short negative entry
            entry = _Entry((), time.monotonic() + NEGATIVE_TTL, f"{name} did not resolve: {ex}")
        self._cache.pop(name, None)  # re-inserted last: the dict's order is the order of filling
        self._cache[name] = entry
        if len(self._cache) > CACHE_MAX:
            self._expire()
        return entry

    def _expire(self) -> None:
        """Drop expired entries; if that is not enough (a sandbox under `open` asking for ever new names),
        the oldest ones too, so the cache stays bounded."""
        now = time.monotonic()
        for k in [k for k, v in self._cache.items() if v.expires <= now]:
            del self._cache[k]
        excess = len(self._cache) - CACHE_MAX * 9 // 10
        if excess > 0:
            for k in list(itertools.islice(self._cache, excess)):
                del self._cache[k]

    async def _lookup(self, name: str) -> _Entry:
        last = "no upstream resolver answered"
        for server in self.servers:
            try:
                reply = await self._query(server, name)
            except (OSError, asyncio.TimeoutError, ValueError) as e:
                last = f"upstream {server[0]} failed ({e.__class__.__name__})"
                continue
            rcode = reply.header.rcode
            if rcode == RCODE.NXDOMAIN:
                return _Entry((), time.monotonic() + NEGATIVE_TTL, f"{name} does not exist (NXDOMAIN)")
            if rcode != RCODE.NOERROR:
                last = f"upstream {server[0]} answered {RCODE.get(rcode)}"
                continue
            # The CNAME chain inside the answer, in order. A records count only for names on it (no
            # other record of the answer is believed), and the chain is never followed with a second
            # query: a target the answer does not resolve stays unresolved, so nothing the policy
            # has not yet judged is sent upstream.
            names = [name]
            for _ in range(MAX_CHAIN):
                targets = [str(rr.rdata.label).lower().rstrip(".") for rr in reply.rr
                           if rr.rtype == QTYPE.CNAME and str(rr.rname).lower().rstrip(".") == names[-1]]
                if not targets:
                    break
                if len(set(targets)) > 1:
                    return _Entry((), time.monotonic() + NEGATIVE_TTL,
                                  f"{names[-1]} has more than one CNAME in the answer", tuple(names))
                if targets[0] in names:
                    return _Entry((), time.monotonic() + NEGATIVE_TTL, f"{name} has a CNAME loop", tuple(names))
                names.append(targets[0])
            addrs, ttls = [], []
            for rr in reply.rr:
                owner = str(rr.rname).lower().rstrip(".")
                if owner == names[-1] and rr.rtype == QTYPE.A:
                    a = str(rr.rdata)
                    if a not in addrs:
                        addrs.append(a)
                        ttls.append(rr.ttl)
            ttls += [rr.ttl for rr in reply.rr if rr.rtype == QTYPE.CNAME
                     and str(rr.rname).lower().rstrip(".") in names[:-1]]
            if not addrs:
                what = name if len(names) == 1 else f"{name} (a CNAME for {names[-1]})"
                return _Entry((), time.monotonic() + NEGATIVE_TTL, f"{what} has no A record", tuple(names))
            ttl = min(MAX_TTL, max(MIN_TTL, min(ttls)))
            return _Entry(tuple(addrs), time.monotonic() + ttl, None, tuple(names))
        raise ResolveError(last)

    async def _query(self, server: tuple[str, int], name: str) -> DNSRecord:
        self.queries_sent += 1
        q = DNSRecord(DNSHeader(id=random.randrange(65536), rd=1), q=DNSQuestion(name, QTYPE.A))
        wire = q.pack()
        loop = asyncio.get_running_loop()
        fut = loop.create_future()

        class _P(asyncio.DatagramProtocol):
            def datagram_received(self, data, addr):
                if addr[0] == server[0] and addr[1] == server[1] and not fut.done():
                    try:
                        r = DNSRecord.parse(data)
                    except Exception:  # noqa: BLE001 - garbage from the wire is ignored
                        return
                    if r.header.id == q.header.id and r.q.qname == q.q.qname:
                        fut.set_result(r)

            def error_received(self, exc):
                if not fut.done():
                    fut.set_exception(exc)

        transport, _ = await loop.create_datagram_endpoint(_P, remote_addr=server, family=socket.AF_INET)
        try:
            transport.sendto(wire)
            reply = await asyncio.wait_for(fut, UPSTREAM_TIMEOUT)
        finally:
            transport.close()
        if reply.header.tc:
            reply = await self._query_tcp(server, wire, q.header.id)
        return reply

    async def _query_tcp(self, server, wire: bytes, qid: int) -> DNSRecord:
        r, w = await asyncio.wait_for(asyncio.open_connection(*server), UPSTREAM_TIMEOUT)
        try:
            w.write(struct.pack("!H", len(wire)) + wire)
            n = struct.unpack("!H", await asyncio.wait_for(r.readexactly(2), UPSTREAM_TIMEOUT))[0]
            reply = DNSRecord.parse(await asyncio.wait_for(r.readexactly(n), UPSTREAM_TIMEOUT))
        finally:
            w.close()
        if reply.header.id != qid:
            raise ValueError("mismatched DNS reply id")
        return reply


class Lane:
    """One sandbox's share of the resolver: its query budget, its TCP connections, its own UDP socket.

    `note(reason)` (set by the gateway) puts a refusal in the sandbox's log; a limit calls it at
    most once every NOTE_EVERY seconds, the counters count every query it held back.
    """

    def __init__(self, now: float, note: Callable[[str], None] | None = None):
        self.bucket = TokenBucket(QUERY_RATE, QUERY_BURST, now)
        self.note = note
        self.inflight = 0
        self.tcp = 0
        self.sock: socket.socket | None = None
        self.queries = 0
        self.over_rate = 0
        self.over_inflight = 0
        self.tcp_refused = 0
        self.kernel_dropped = 0     # datagrams the kernel dropped on sockets this lane had (their buffer was full)
        self._noted: dict[str, float] = {}
        self._drops_seen = 0

    def admit(self, now: float) -> bool:
        """May one more query be answered now? Counts and notes it when not."""
        self.queries += 1
        if not self.bucket.take(now):
            self.over_rate += 1
            self._note("rate", now, f"DNS queries beyond {QUERY_RATE:.0f} a second (bursts of {QUERY_BURST}) "
                                    "are dropped; the log's limits count them")
            return False
        if self.inflight >= INFLIGHT_MAX:
            self.over_inflight += 1
            self._note("inflight", now, f"DNS queries beyond {INFLIGHT_MAX} being answered at once are dropped; "
                                        "the log's limits count them")
            return False
        return True

    def admit_tcp(self, now: float) -> bool:
        if self.tcp >= TCP_MAX:
            self.tcp_refused += 1
            self._note("tcp", now, f"DNS-over-TCP connections beyond {TCP_MAX} open at once are reset; "
                                   "the log's limits count them")
            return False
        return True

    def check_drops(self, sock: socket.socket) -> None:
        drops = _drops(sock)
        if drops > self._drops_seen:
            self._drops_seen = drops
            self._note("kernel", time.monotonic(), "DNS queries sent faster than the resolver reads them are "
                                                   "dropped by the kernel; the log's limits count them")

    def _note(self, limit: str, now: float, reason: str) -> None:
        last = self._noted.get(limit)
        if last is not None and now - last < NOTE_EVERY:
            return
        self._noted[limit] = now
        if self.note is not None:
            self.note(reason)

    def counters(self) -> dict[str, int]:
        return {"dns_queries": self.queries, "dns_over_rate": self.over_rate,
                "dns_over_concurrency": self.over_inflight,
                "dns_dropped_by_kernel": self.kernel_dropped + _drops(self.sock), "dns_tcp_refused": self.tcp_refused}


class Resolver:
    """Serves sandboxes' DNS on the gateway address, UDP and TCP.

    `answer(source_ip, query_bytes)` does the work; `decide` (given by the gateway) maps a
    source address to its policy and decides, `lane_of` maps it to the sandbox's Lane.
    """

    def __init__(self, decide, lane_of: Callable[[str], Lane | None]):
        # decide(source_ip, name, qtype) -> awaitable (rcode, addrs, ttl)
        self._decide = decide
        self._lane_of = lane_of
        self._udp: socket.socket | None = None
        self._tcp = None
        self._tasks: set[asyncio.Task] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self.address: str | None = None
        self.port = 0

    async def answer(self, src: str, data: bytes) -> bytes | None:
        try:
            q = DNSRecord.parse(data)
        except Exception:  # noqa: BLE001 - not DNS: no answer at all
            return None
        if q.header.opcode != 0:   # only QUERY: no UPDATE, NOTIFY ... through the gateway
            return DNSRecord(DNSHeader(id=q.header.id, qr=1, ra=1, rcode=RCODE.NOTIMP)).pack()
        if q.header.qr or len(q.questions) != 1:
            r = DNSRecord(DNSHeader(id=q.header.id, qr=1, ra=1, rcode=RCODE.FORMERR))
            return r.pack()
        qn = q.q
        reply = DNSRecord(DNSHeader(id=q.header.id, qr=1, rd=q.header.rd, ra=1), q=qn)
        rcode, addrs, ttl = await self._decide(src, str(qn.qname), qn.qtype)
        reply.header.rcode = rcode
        for a in addrs:
            reply.add_answer(RR(qn.qname, QTYPE.A, ttl=ttl, rdata=A(a)))
        return reply.pack()

    async def start(self, socks: tuple[socket.socket, socket.socket]) -> None:
        """Serve on a bound UDP socket and a bound TCP socket (the lanes' sockets come and go)."""
        self._loop = loop = asyncio.get_running_loop()
        udp_sock, tcp_sock = socks
        self.address, self.port = udp_sock.getsockname()
        self._udp = udp_sock
        loop.add_reader(udp_sock.fileno(), self._readable, udp_sock, None)
        self._tcp = await asyncio.start_server(self._serve_tcp, sock=tcp_sock, backlog=1024)

    def open_lane(self, lane: Lane, link: str) -> None:
        """Give a lane a UDP socket of its own, bound to the sandbox's link.

        The kernel delivers a datagram to the socket bound to the link it came in on before the
        shared one, so a flood fills only this socket's buffer. Without one (the link is gone
        already) the lane's queries go to the shared socket, still under its limits.
        """
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.setsockopt(socket.SOL_SOCKET, _SO_BINDTODEVICE, link.encode())
            s.setsockopt(socket.SOL_IP, _IP_FREEBIND, 1)
            s.bind((self.address, self.port))
            s.setblocking(False)
            self._loop.add_reader(s.fileno(), self._readable, s, lane)
        except OSError:
            s.close()
            return
        lane.sock = s

    def close_lane(self, lane: Lane) -> None:
        s, lane.sock = lane.sock, None
        if s is not None:
            lane.kernel_dropped += _drops(s)
            lane._drops_seen = 0
            if self._loop is not None and not self._loop.is_closed():
                self._loop.remove_reader(s.fileno())
            s.close()

    def _readable(self, sock: socket.socket, lane: Lane | None) -> None:
        if lane is not None:
            lane.check_drops(sock)
        # a few datagrams per turn: every other socket with something to read gets its turn in between
        for _ in range(UDP_BATCH):
            try:
                data, addr = sock.recvfrom(4096)
            except OSError:       # nothing more to read (or an ICMP error): wait for the next turn
                return
            who = lane if lane is not None else self._lane_of(addr[0])
            if who is None:
                continue          # no sandbox has this address: nothing to answer
            if not who.admit(time.monotonic()):
                continue
            who.inflight += 1
            t = self._loop.create_task(self._reply(sock, who, data, addr))
            self._tasks.add(t)
            t.add_done_callback(self._tasks.discard)

    async def _reply(self, sock: socket.socket, lane: Lane, data: bytes, addr) -> None:
        try:
            out = await self.answer(addr[0], data)
            if out is not None and sock.fileno() >= 0:
                if len(out) > 512:
                    out = DNSRecord.parse(out).truncate().pack()
                try:
                    sock.sendto(out, addr)
                except OSError:
                    pass          # a full buffer or a closed lane: the client asks again
        except Exception:  # noqa: BLE001 - a bug in one answer must not stop the resolver
            import traceback
            traceback.print_exc(file=sys.stderr)
        finally:
            lane.inflight -= 1

    async def _serve_tcp(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        src = writer.get_extra_info("peername")[0]
        lane = self._lane_of(src)
        if lane is None or not lane.admit_tcp(time.monotonic()):
            _reset(writer)
            return
        lane.tcp += 1
        try:
            while True:
                n = struct.unpack("!H", await asyncio.wait_for(reader.readexactly(2), TCP_IDLE))[0]
                data = await asyncio.wait_for(reader.readexactly(n), TCP_IDLE)
                if not lane.admit(time.monotonic()):
                    _reset(writer)
                    return
                lane.inflight += 1
                try:
                    out = await self.answer(src, data)
                finally:
                    lane.inflight -= 1
                if out is None:
                    break
                writer.write(struct.pack("!H", len(out)) + out)
                await writer.drain()
        except (asyncio.IncompleteReadError, asyncio.TimeoutError, ConnectionError, OSError):
            pass
        finally:
            lane.tcp -= 1
            writer.close()

    async def stop(self) -> None:
        if self._udp is not None:
            if not self._loop.is_closed():
                self._loop.remove_reader(self._udp.fileno())
            self._udp.close()
            self._udp = None
        for t in list(self._tasks):
            t.cancel()
        if self._tcp:
            self._tcp.close()
            await self._tcp.wait_closed()


def _drops(sock: socket.socket | None) -> int:
    """How many datagrams the kernel dropped for this socket (its receive buffer was full)."""
    if sock is None or sock.fileno() < 0:
        return 0
    try:
        return struct.unpack("9I", sock.getsockopt(socket.SOL_SOCKET, _SO_MEMINFO, 36))[8]
    except (OSError, struct.error):
        return 0


def _reset(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except (OSError, AttributeError):
        pass
    writer.transport.abort()
