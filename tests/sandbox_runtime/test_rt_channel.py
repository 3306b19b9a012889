"""Many calls at once on one sandbox: every one is sent, in order, and answered."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import httpx

from hutch.sandbox._host.native.runtime import Channel
from rt_support import split_frames


def test_a_full_socket_queues_every_sender_in_order():
    async def main():
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)   # full after a few messages
        theirs.setblocking(False)
        ch = Channel(ours, lambda msg, fds: None)
        senders = [asyncio.ensure_future(ch.notify({"op": "x", "i": i, "pad": "y" * 200})) for i in range(500)]
        await asyncio.sleep(0.05)   # every sender has tried once; most wait for room now
        assert sum(s.done() for s in senders) < 500
        got = []

        async def reader():
            while len(got) < 500:
                try:
                    got.append(json.loads(theirs.recv(65536))["i"])
                except BlockingIOError:
                    await asyncio.sleep(0.001)

        try:
            await asyncio.wait_for(asyncio.gather(reader(), *senders), 10)
        finally:
            ch.close()
            theirs.close()
        assert got == list(range(500))

    asyncio.run(main())


def test_a_sender_cancelled_while_queued_is_never_sent():
    async def main():
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        theirs.setblocking(False)
        ch = Channel(ours, lambda msg, fds: None)
        senders = [asyncio.ensure_future(ch.notify({"i": i, "pad": "y" * 200})) for i in range(50)]
        await asyncio.sleep(0.02)
        waiting = [i for i, s in enumerate(senders) if not s.done()]
        assert len(waiting) > 2
        senders[waiting[1]].cancel()
        got = []
        while len(got) < 49:
            try:
                got.append(json.loads(theirs.recv(65536))["i"])
            except BlockingIOError:
                await asyncio.sleep(0.001)
        await asyncio.gather(*senders, return_exceptions=True)
        ch.close()
        theirs.close()
        assert got == [i for i in range(50) if i != waiting[1]]

    asyncio.run(main())


def test_500_concurrent_execs_on_one_sandbox_all_finish(api, daemon, image):
    # a slow init (a tenth of a CPU) lets the daemon fill the socket to it: the case where senders must queue
    sid = api.create(image, limits={"pids": 2048, "cpu": 0.1})["id"]
    n = 500
    pad = {"PAD": "x" * 16000}   # 500 requests of 16 kB: far more than the socket's buffer holds

    async def main():
        transport = httpx.AsyncHTTPTransport(uds=str(daemon.sock))
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
        async with httpx.AsyncClient(transport=transport, base_url="http://hutch", timeout=None,
                                     limits=limits) as c:
            async def one(i):
                r = await c.post(f"/v1/sandboxes/{sid}/exec", json={"argv": ["echo", str(i)], "env": pad})
                assert r.status_code == 200, r.text
                return split_frames(r.content)

            return await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(n))), 120)

    t0 = time.monotonic()
    results = asyncio.run(main())
    took = time.monotonic() - t0
    assert [out for out, _, _ in results] == [f"{i}\n".encode() for i in range(n)]
    assert all(res == {"returncode": 0, "reason": "exited"} for _, _, res in results), took
    assert api.sh(sid, "echo still")[0] == "still\n"
