"""HTTP helpers shared by the daemon's route modules: bodies and query parameters read as untrusted input."""

from __future__ import annotations

import json
import math
import os

from aiohttp import web

from hutch._core.errors import ConfigError

READ_CHUNK = 1 << 20
#: Bytes of a JSON request body at most (a spec, an exec, a policy: kilobytes; the rest is bytes routes).
MAX_JSON_BODY = 8 << 20
#: Seconds a long poll (a sandbox's or a command's wait) holds at most; the client polls again.
MAX_LONG_POLL = 60.0
_FLAGS = {"1": True, "true": True, "yes": True, "0": False, "false": False, "no": False}


async def send_fd(request, fd: int, size: int, content_type: str = "application/octet-stream") -> web.StreamResponse:
    """Answer with `size` bytes read from `fd` (a file a sandbox or volume call opened, an export's spool
    file), then close it."""
    try:
        resp = web.StreamResponse(headers={"Content-Type": content_type})
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


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")


async def json_body(request: web.Request, *, optional: bool = False) -> dict:
    """The request's JSON object body ({} for no body when `optional`); anything else is a ConfigError:
    more than MAX_JSON_BODY bytes, NaN or Infinity (Python's json takes them, JSON has none), nesting
    deeper than the parser's recursion allows."""
    if optional and not request.can_read_body:
        return {}
    if (request.content_length or 0) > MAX_JSON_BODY:
        raise ConfigError(f"the request body is larger than {MAX_JSON_BODY} bytes; a JSON request is small.")
    data = bytearray()
    while chunk := await request.content.read(READ_CHUNK):   # chunked bodies are counted as they come
        data += chunk
        if len(data) > MAX_JSON_BODY:
            raise ConfigError(f"the request body is larger than {MAX_JSON_BODY} bytes; a JSON request is small.")
    try:
        body = json.loads(data.decode("utf-8"), parse_constant=_no_constant)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise ConfigError(f"the request body is not JSON ({str(e)[:200]}); send a JSON object.") from e
    if not isinstance(body, dict):
        raise ConfigError("the request body must be a JSON object.")
    return body


def query_flag(request: web.Request, name: str) -> bool:
    """A boolean query parameter: 1/true/yes or 0/false/no (absent: false); anything else is refused."""
    value = request.query.get(name, "0")
    try:
        return _FLAGS[value.lower()]
    except KeyError:
        raise ConfigError(f"{name}={value[:50]!r} must be 1 or 0 (true/false, yes/no).") from None


def query_path(request: web.Request, example: str) -> str:
    path = request.query.get("path")
    if not path:
        raise ConfigError(f"the query parameter path= is required, e.g. ?path={example}.")
    return path


def query_mode(request: web.Request) -> int:
    """A file's permission bits: octal, 0 to 7777 (absent: 0644)."""
    value = request.query.get("mode", "0644")
    try:
        mode = int(value, 8)
    except ValueError:
        mode = -1
    if not 0 <= mode <= 0o7777 or not value.isdigit():
        raise ConfigError(f"mode={value[:50]!r} must be octal permission bits, like 0644.")
    return mode


def query_seconds(request: web.Request, name: str = "timeout") -> float:
    """A long poll's wait: a finite number of seconds >= 0, at most MAX_LONG_POLL (absent: MAX_LONG_POLL)."""
    value = request.query.get(name)
    if value is None:
        return MAX_LONG_POLL
    try:
        t = float(value)
    except ValueError:
        t = math.nan
    if not 0 <= t < math.inf:
        raise ConfigError(f"{name}={value[:50]!r} must be a number of seconds, 0 or more.")
    return min(t, MAX_LONG_POLL)
