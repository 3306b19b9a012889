"""`hutch.SandboxPool`: interpreter sandboxes started ahead of time, handed out ready.

    with hutch.SandboxPool(size=4) as pool:          # the code-interpreter image by default
        sb = pool.create()                           # a running sandbox whose kernel is already up
        with sb:
            sb.run_code("1 + 1").text                # '2', in a few milliseconds

Each pooled sandbox is made with `Sandbox.create(image=..., **create_kwargs)` and has run one empty cell,
so its interpreter's bridge and default kernel run; a background thread (a task, for
`hutch.AsyncSandboxPool`) makes another whenever one is handed out. Pooled sandboxes are never detached:
like every sandbox, each holds its creator's lease on the daemon, so if the pool's process dies, however it
dies, the daemon ends all of them (handed out or not). A sandbox's `timeout` runs from when the pool made it:
one that waited in the pool longer than `max_age` (default: half its timeout) is replaced, never handed out.
`create()` on an empty pool (all handed out, or still starting) makes a sandbox there and then, as
`Sandbox.create` would, so it never fails for want of a pooled one.

The pool lives in the SDK, in its process; its interface does not depend on where sandboxes are kept, so a
pool kept by the daemon can take its place.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque

from hutch._core.errors import ConfigError, Error, SandboxError
from hutch.sandbox.aio import AsyncSandbox
from hutch.sandbox.image import Image
from hutch.sandbox.sandbox import Sandbox
from hutch.sandbox._spec import DEFAULT_TIMEOUT

MAX_SIZE = 64
WARM_CODE = "None"          # the cell that starts a pooled sandbox's interpreter
WARM_TIMEOUT = 120.0        # seconds the first cell (the kernel's start) may take
RETRY_MIN, RETRY_MAX = 1.0, 30.0   # back-off of a refill that failed


def _check(size, max_age, kw) -> tuple[int, float | None]:
    if isinstance(size, bool) or not isinstance(size, int) or not 1 <= size <= MAX_SIZE:
        raise ConfigError(f"size={size!r} must be a whole number of sandboxes from 1 to {MAX_SIZE}.")
    if kw.get("detach"):
        raise ConfigError("a pool's sandboxes end with the pool's process (that is what keeps an unused one from "
                          "leaking); detach=True cannot be pooled: create detached sandboxes with Sandbox.create().")
    timeout = kw.get("timeout", DEFAULT_TIMEOUT)
    if max_age is None:
        max_age = None if timeout is None else float(timeout) / 2
    elif isinstance(max_age, bool) or not isinstance(max_age, (int, float)) or max_age <= 0:
        raise ConfigError(f"max_age={max_age!r} must be a positive number of seconds, or None.")
    return size, max_age


class _Ready:
    """The pooled sandboxes, oldest first, with when each was made (no I/O)."""

    def __init__(self, max_age: float | None) -> None:
        self.items: deque = deque()
        self.max_age = max_age
        self.making = 0
        self.closed = False
        self.error: Exception | None = None

    def stale(self, now: float) -> list:
        out = []
        while self.items and self.max_age is not None and now - self.items[0][0] > self.max_age:
            out.append(self.items.popleft()[1])
        return out

    def wanted(self, size: int) -> bool:
        return not self.closed and len(self.items) + self.making < size

    def next_expiry(self) -> float | None:
        return None if not self.items or self.max_age is None else self.items[0][0] + self.max_age


class SandboxPool:
    """Sandboxes with a running interpreter, made ahead of time (see the module's docstring)."""

    def __init__(self, size: int = 2, *, image: "Image | str | None" = None, max_age: "float | None" = None,
                 **create_kwargs) -> None:
        self.size, max_age = _check(size, max_age, create_kwargs)
        image = Image.code_interpreter() if image is None else Image.of(image)
        self._kw = dict(create_kwargs, image=image.build(quiet=True) if image.steps else image)
        self._ready = _Ready(max_age)
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._refill, name="hutch-sandbox-pool", daemon=True)
        self._thread.start()

    @property
    def available(self) -> int:
        """How many ready sandboxes wait in the pool now."""
        return len(self._ready.items)

    def _make(self) -> Sandbox:
        sb = Sandbox.create(**self._kw)
        try:
            ex = sb.run_code(WARM_CODE, timeout=WARM_TIMEOUT)
            if ex.error is not None:
                raise SandboxError(f"a pooled sandbox's interpreter did not start: {ex.error.name}: {ex.error.value}")
        except BaseException:
            sb.terminate()
            raise
        return sb

    def _refill(self) -> None:
        backoff = RETRY_MIN
        while True:
            with self._cond:
                while not self._ready.closed and not self._ready.wanted(self.size) and not self._expired():
                    exp = self._ready.next_expiry()
                    self._cond.wait(None if exp is None else max(0.05, exp - time.monotonic()))
                if self._ready.closed:
                    return
                old = self._ready.stale(time.monotonic())
                want = self._ready.wanted(self.size)
                if want:
                    self._ready.making += 1
            for sb in old:
                sb.terminate()
            if not want:
                continue
            try:
                sb = self._make()
            except Error as e:
                with self._cond:
                    self._ready.making -= 1
                    self._ready.error = e
                    self._cond.wait(backoff)
                backoff = min(backoff * 2, RETRY_MAX)
                continue
            backoff = RETRY_MIN
            with self._cond:
                self._ready.making -= 1
                if self._ready.closed:
                    sb.terminate()
                    return
                self._ready.items.append((time.monotonic(), sb))
                self._cond.notify_all()

    def _expired(self) -> bool:
        exp = self._ready.next_expiry()
        return exp is not None and time.monotonic() >= exp

    def create(self) -> Sandbox:
        """A running sandbox from the pool (its interpreter ready), or a new one if none is ready. It is the
        caller's from here on: terminate it (or use it as a context manager) when done."""
        with self._cond:
            if self._ready.closed:
                raise ConfigError("this pool is closed; make a new hutch.SandboxPool.")
            old = self._ready.stale(time.monotonic())
            got = self._ready.items.popleft()[1] if self._ready.items else None
            self._cond.notify_all()   # the refill makes the next one
        for sb in old:
            sb.terminate()
        return got if got is not None else self._make()

    def close(self) -> None:
        """Stop refilling and end every sandbox still in the pool (those handed out are the caller's)."""
        with self._cond:
            self._ready.closed = True
            left = [sb for _, sb in self._ready.items]
            self._ready.items.clear()
            self._cond.notify_all()
        for sb in left:
            sb.terminate()

    def __enter__(self) -> "SandboxPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<hutch.SandboxPool size={self.size} available={self.available}>"


class AsyncSandboxPool:
    """`hutch.SandboxPool`, awaitable: `async with hutch.AsyncSandboxPool(size=4) as pool: sb = await pool.create()`.
    Its refill is a task of the running event loop, started by `async with` or the first `create()`."""

    def __init__(self, size: int = 2, *, image: "Image | str | None" = None, max_age: "float | None" = None,
                 **create_kwargs) -> None:
        self.size, max_age = _check(size, max_age, create_kwargs)
        self._image = Image.code_interpreter() if image is None else Image.of(image)
        self._kw = dict(create_kwargs)
        self._ready = _Ready(max_age)
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None

    @property
    def available(self) -> int:
        """How many ready sandboxes wait in the pool now."""
        return len(self._ready.items)

    async def _start(self) -> None:
        if self._task is None:
            if self._image.steps:
                self._image = await asyncio.to_thread(self._image.build, quiet=True)
            self._kw["image"] = self._image
            self._task = asyncio.get_running_loop().create_task(self._refill())

    async def _make(self) -> AsyncSandbox:
        sb = await AsyncSandbox.create(**self._kw)
        try:
            ex = await sb.run_code(WARM_CODE, timeout=WARM_TIMEOUT)
            if ex.error is not None:
                raise SandboxError(f"a pooled sandbox's interpreter did not start: {ex.error.name}: {ex.error.value}")
        except BaseException:
            await sb.terminate()
            raise
        return sb

    async def _refill(self) -> None:
        backoff = RETRY_MIN
        while not self._ready.closed:
            for sb in self._ready.stale(time.monotonic()):
                await sb.terminate()
            if not self._ready.wanted(self.size):
                self._wake.clear()
                exp = self._ready.next_expiry()
                try:
                    await asyncio.wait_for(self._wake.wait(), None if exp is None else max(0.05, exp - time.monotonic()))
                except asyncio.TimeoutError:
                    pass
                continue
            self._ready.making += 1
            try:
                sb = await self._make()
            except Error as e:
                self._ready.error = e
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, RETRY_MAX)
                continue
            finally:
                self._ready.making -= 1
            backoff = RETRY_MIN
            if self._ready.closed:
                await sb.terminate()
                return
            self._ready.items.append((time.monotonic(), sb))

    async def create(self) -> AsyncSandbox:
        """A running sandbox from the pool (its interpreter ready), or a new one if none is ready (see
        `SandboxPool.create`)."""
        if self._ready.closed:
            raise ConfigError("this pool is closed; make a new hutch.AsyncSandboxPool.")
        await self._start()
        for sb in self._ready.stale(time.monotonic()):
            await sb.terminate()
        got = self._ready.items.popleft()[1] if self._ready.items else None
        self._wake.set()
        return got if got is not None else await self._make()

    async def close(self) -> None:
        """Stop refilling and end every sandbox still in the pool (those handed out are the caller's)."""
        self._ready.closed = True
        left = [sb for _, sb in self._ready.items]
        self._ready.items.clear()
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Error):
                pass
        for sb in left:
            await sb.terminate()

    async def __aenter__(self) -> "AsyncSandboxPool":
        await self._start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    def __repr__(self) -> str:
        return f"<hutch.AsyncSandboxPool size={self.size} available={self.available}>"
