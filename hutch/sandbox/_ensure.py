"""Making an image ready on the daemon (POST /v1/images/ensure, NDJSON progress events), once per process.

The sync and async shells (`ensure_image`, `aensure_image`: Sandbox.create, AsyncSandbox.create, the image
builder) only move bytes; what the events mean, the progress shown on stderr and which images this
process has already ensured are `Ensure`'s, which does no I/O.
"""

from __future__ import annotations

import json
import sys
import threading
import time

from hutch._core.errors import NotFoundError
from hutch.sandbox._api import error_from_answer

PATH = "/v1/images/ensure"


#: Seconds between two progress lines of one build unless it reaches a phase it had not reached before
#: (debootstrap alternates between its phases hundreds of times; a newcomer's first build is ~3 minutes).
EVERY = 15.0


class ImageProgress:
    """Consumes the NDJSON events of POST /v1/images/ensure and shows build progress on stderr: a line
    when the build reaches a new phase, else at most one every `every` seconds."""

    def __init__(self, ref: str, stream=None, quiet_for: float = 0.5, every: float = EVERY) -> None:
        self.ref, self.stream, self.every = ref, stream if stream is not None else sys.stderr, every
        self._phases: set = set()
        self._last_time, self._shown = 0.0, False
        # an image that is ready answers at once: say nothing unless a build is really under way
        self._quiet_until = time.monotonic() + quiet_for
        self.result: dict | None = None

    def line(self, raw: str | bytes) -> None:
        if not raw.strip():
            return
        ev = json.loads(raw)
        if ev.get("done"):
            self.result = ev
            if self._shown:
                self._show(f"image {self.ref} ready")
        elif "error" in ev:
            raise error_from_answer(500, json.dumps(ev).encode())
        else:
            now = time.monotonic()
            phase = ev.get("phase")
            if now >= self._quiet_until and (phase not in self._phases or now - self._last_time >= self.every):
                self._phases.add(phase)
                self._last_time = now
                mb = (ev.get("bytes") or 0) / 1e6
                self._show(f"building image {self.ref}: {phase}: {ev.get('message', '')} "
                           f"({mb:.0f} MB, {ev.get('elapsed', 0):.0f} s)")

    def _show(self, text: str) -> None:
        self._shown = True
        print(f"hutch: {text}", file=self.stream, flush=True)

    def finish(self) -> dict:
        if self.result is None:
            raise error_from_answer(500, b'{"error": "ImageError", "message": "the daemon ended the image build '
                                    b'without a result; see its log and try again."}')
        return self.result


# (endpoint, ref) pairs this process has ensured: the daemon is asked once per image.
_ensured: set[tuple] = set()
_ensured_lock = threading.Lock()


class Ensure:
    """One ensure of image `ref` on the daemon at `endpoint` (the client's Endpoint): `needed` says whether
    to ask at all (this process may have ensured it already), `feed` takes each line of the answer, `done`
    the daemon's last event ({"done": true, "id": ...}), remembered unless `remember=False`."""

    def __init__(self, endpoint, ref: str, *, remember: bool = True) -> None:
        self.ref, self.remember = ref, remember
        self.key = (endpoint.describe(), ref)
        self.body = {"ref": ref}
        self.progress = ImageProgress(ref)

    @property
    def needed(self) -> bool:
        return not (self.remember and self.key in _ensured)

    def feed(self, line: "str | bytes") -> None:
        self.progress.line(line)

    def done(self) -> dict:
        result = self.progress.finish()
        if self.remember:
            with _ensured_lock:
                _ensured.add(self.key)
        return result


def ensure_image(client, ref: str, *, remember: bool = True) -> "dict | None":
    """Make `ref` ready on `client`'s daemon (building it if need be, progress on stderr); its last event,
    or None if this process had ensured it already. A fleet node that lacks the image fetches it from another
    node first (its endpoint's `fetch_image`: hutch/sandbox/_fleet.py)."""
    try:
        return _ensure_once(client, ref, remember)
    except NotFoundError:
        fetch = client.ep.fetch_image
        if fetch is None or not fetch(ref):
            raise
    return _ensure_once(client, ref, remember)


def _ensure_once(client, ref: str, remember: bool) -> "dict | None":
    e = Ensure(client.ep, ref, remember=remember)
    if not e.needed:
        return None
    resp = client.request("POST", PATH, json=e.body, stream=True)
    try:
        for line in resp.iter_lines():
            e.feed(line)
    finally:
        resp.close()
    return e.done()


async def aensure_image(client, ref: str, *, remember: bool = True) -> "dict | None":
    """`ensure_image` on an async client (a fleet node's fetch from another node runs in a thread)."""
    import asyncio

    try:
        return await _aensure_once(client, ref, remember)
    except NotFoundError:
        fetch = client.ep.fetch_image
        if fetch is None or not await asyncio.to_thread(fetch, ref):
            raise
    return await _aensure_once(client, ref, remember)


async def _aensure_once(client, ref: str, remember: bool) -> "dict | None":
    e = Ensure(client.ep, ref, remember=remember)
    if not e.needed:
        return None
    resp = await client.request("POST", PATH, json=e.body, stream=True)
    try:
        async for line in resp.aiter_lines():
            e.feed(line)
    finally:
        await resp.aclose()
    return e.done()


__all__ = ["Ensure", "ImageProgress", "aensure_image", "ensure_image"]
