"""The gateway's upstream DNS client on its own, against a resolver of the test's on loopback.

What a sandbox cannot do to other sandboxes through the shared cache: make their lookups fail by going
away mid-lookup, or grow the daemon's memory by asking for ever new names.
"""

from __future__ import annotations

import asyncio

from dnslib import QTYPE, RR, A, DNSRecord

from hutch.sandbox._host.egress import dns


class _Resolver(asyncio.DatagramProtocol):
    """Answers every A query with 192.0.2.<n> after `delay` seconds; counts the queries."""

    def __init__(self, delay: float):
        self.delay = delay
        self.queries: list[str] = []
        self.transport = None

    def connection_made(self, transport):
        self.transport = transport

    def datagram_received(self, data, addr):
        q = DNSRecord.parse(data)
        self.queries.append(str(q.q.qname).rstrip("."))
        reply = q.reply()
        reply.add_answer(RR(q.q.qname, QTYPE.A, rdata=A(f"192.0.2.{len(self.queries) % 250 + 1}"), ttl=300))
        asyncio.get_running_loop().call_later(self.delay, self.transport.sendto, reply.pack(), addr)


async def _serve(delay: float):
    loop = asyncio.get_running_loop()
    transport, proto = await loop.create_datagram_endpoint(lambda: _Resolver(delay), local_addr=("127.0.0.1", 0))
    return transport, proto, transport.get_extra_info("sockname")


def test_a_cancelled_asker_does_not_fail_the_others_waiting_for_the_same_name():
    async def main():
        transport, server, addr = await _serve(delay=0.3)
        try:
            up = dns.Upstream([addr])
            first = asyncio.ensure_future(up.resolve("www.example.test"))
            await asyncio.sleep(0.05)  # the first asker's lookup is on its way upstream
            second = asyncio.ensure_future(up.resolve("www.example.test"))
            await asyncio.sleep(0.05)
            first.cancel()  # e.g. its sandbox was detached
            addrs, ttl, _ = await asyncio.wait_for(second, 5)
            assert addrs == ("192.0.2.2",) and ttl > 0
            assert server.queries == ["www.example.test"]  # one lookup, shared
            assert first.cancelled()
            # and the answer was cached: a third asker sends nothing
            assert (await up.resolve("www.example.test"))[0] == ("192.0.2.2",)
            assert server.queries == ["www.example.test"]
        finally:
            transport.close()

    asyncio.run(main())


def test_the_cache_stays_bounded_when_names_keep_coming(monkeypatch):
    monkeypatch.setattr(dns, "CACHE_MAX", 50)

    async def main():
        transport, server, addr = await _serve(delay=0)
        try:
            up = dns.Upstream([addr])
            for i in range(200):
                await up.resolve(f"n{i}.example.test")
                assert len(up._cache) <= 50
            assert len(server.queries) == 200
            # the newest names are the ones kept
            assert "n199.example.test" in up._cache and "n0.example.test" not in up._cache
        finally:
            transport.close()

    asyncio.run(main())
