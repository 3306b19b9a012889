"""HTTP helpers shared by the daemon's route modules."""

from __future__ import annotations

import os

from aiohttp import web

READ_CHUNK = 1 << 20


async def send_fd(request, fd: int, size: int) -> web.StreamResponse:
    """Answer with `size` bytes read from `fd` (a file a sandbox or volume call opened), then close it."""
    try:
        resp = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
        resp.content_length = size
        await resp.prepare(request)
        left = size
        while left > 0 and (chunk := os.read(fd, min(READ_CHUNK, left))):
            left -= len(chunk)
            await resp.write(chunk)
        await resp.write_eof()
        return resp
    finally:
        os.close(fd)
