"""The gateway's DNS: an upstream client with a cache, and the resolver sandboxes talk to.

The resolver answers a name only when the asking sandbox's policy allows it;
for any other name it answers NXDOMAIN without sending anything upstream, so
a query cannot carry data out. It answers A records only (AAAA and the rest
are empty), and only with addresses the proxy would also dial.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import socket
import struct
import time
from dataclasses import dataclass

from dnslib import QTYPE, RCODE, RR, A, DNSRecord, DNSHeader, DNSQuestion

MIN_TTL = 1
MAX_TTL = 300
ANSWER_TTL = 30          # what sandboxes are told; short, so the proxy's view and theirs stay close
NEGATIVE_TTL = 5
UPSTREAM_TIMEOUT = 2.0
CACHE_MAX = 10_000       # names the upstream cache holds at most (oldest dropped first)


class ResolveError(Exception):
    """The name does not resolve (NXDOMAIN, no A record, or no upstream answered)."""


@dataclass
class _Entry:
    addrs: tuple[str, ...]
    expires: float
    error: str | None = None


class Upstream:
    """Resolves A records through the host's upstream resolvers; caches by TTL; coalesces lookups."""

    def __init__(self, servers: list[tuple[str, int]]):
        if not servers:
            raise ValueError("at least one upstream resolver is needed")
        self.servers = servers
        self._cache: dict[str, _Entry] = {}
        self._inflight: dict[str, asyncio.Future] = {}
        self.queries_sent = 0

    async def resolve(self, name: str) -> tuple[tuple[str, ...], int]:
        """(addresses, remaining ttl) for a normalized name. Raises ResolveError."""
        now = time.monotonic()
        e = self._cache.get(name)
        if e and e.expires > now:
            if e.error:
                raise ResolveError(e.error)
            return e.addrs, max(MIN_TTL, int(e.expires - now))
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
        return entry.addrs, max(MIN_TTL, int(entry.expires - time.monotonic()))

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
            # follow the CNAME chain inside the answer; keep only A records on it
            chain = {name}
            addrs, ttls = [], []
            for _ in range(10):
                grew = False
                for rr in reply.rr:
                    owner = str(rr.rname).lower().rstrip(".")
                    if owner in chain and rr.rtype == QTYPE.CNAME:
                        target = str(rr.rdata.label).lower().rstrip(".")
                        if target not in chain:
                            chain.add(target)
                            grew = True
                if not grew:
                    break
            for rr in reply.rr:
                owner = str(rr.rname).lower().rstrip(".")
                if owner in chain and rr.rtype == QTYPE.A:
                    a = str(rr.rdata)
                    if a not in addrs:
                        addrs.append(a)
                        ttls.append(rr.ttl)
            if not addrs:
                return _Entry((), time.monotonic() + NEGATIVE_TTL, f"{name} has no A record")
            ttl = min(MAX_TTL, max(MIN_TTL, min(ttls)))
            return _Entry(tuple(addrs), time.monotonic() + ttl)
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


class Resolver:
    """Serves sandboxes' DNS on the gateway address, UDP and TCP.

    `answer(source_ip, query_bytes)` does the work; `lookup` (given by the
    gateway) maps a source address to its policy and decides.
    """

    def __init__(self, decide):
        # decide(source_ip, name, qtype) -> awaitable (rcode, addrs, ttl)
        self._decide = decide
        self._udp = None
        self._tcp = None

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
        """Serve on a bound UDP socket and a bound TCP socket."""
        loop = asyncio.get_running_loop()
        resolver = self

        class _U(asyncio.DatagramProtocol):
            def connection_made(self, transport):
                self.t = transport

            def datagram_received(self, data, addr):
                loop.create_task(self._reply(data, addr))

            async def _reply(self, data, addr):
                out = await resolver.answer(addr[0], data)
                if out is not None:
                    if len(out) > 512:
                        out = DNSRecord.parse(out).truncate().pack()
                    self.t.sendto(out, addr)

        udp_sock, tcp_sock = socks
        self._udp, _ = await loop.create_datagram_endpoint(_U, sock=udp_sock)

        async def _tcp(reader, writer):
            src = writer.get_extra_info("peername")[0]
            try:
                while True:
                    n = struct.unpack("!H", await asyncio.wait_for(reader.readexactly(2), 10))[0]
                    out = await resolver.answer(src, await asyncio.wait_for(reader.readexactly(n), 10))
                    if out is None:
                        break
                    writer.write(struct.pack("!H", len(out)) + out)
                    await writer.drain()
            except (asyncio.IncompleteReadError, asyncio.TimeoutError, ConnectionError, OSError):
                pass
            finally:
                writer.close()

        self._tcp = await asyncio.start_server(_tcp, sock=tcp_sock)

    async def stop(self) -> None:
        if self._udp:
            self._udp.close()
        if self._tcp:
            self._tcp.close()
            await self._tcp.wait_closed()
