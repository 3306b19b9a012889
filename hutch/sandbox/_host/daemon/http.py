"""HTTP helpers shared by the daemon's route modules."""

from __future__ import annotations

import os

from aiohttp import web

from hutch._core.errors import ConfigError

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


async def json_body(request: web.Request, *, optional: bool = False) -> dict:
    """The request's JSON object body ({} for no body when `optional`); anything else is a ConfigError."""
    if optional and not request.can_read_body:
        return {}
    try:
        body = await request.json()
    except (ValueError, UnicodeDecodeError) as e:
        raise ConfigError(f"the request body is not JSON ({e}); send a JSON object.") from e
    if not isinstance(body, dict):
        raise ConfigError("the request body must be a JSON object.")
    return body
