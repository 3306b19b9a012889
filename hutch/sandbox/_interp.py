"""The code interpreter's sessions: the bridge in a sandbox, driven over one exec (sync and async).

A session starts the bridge (hutch/sandbox/_inside/bridge.py, its source sent as `python3 -I -c`: every start
runs the bridge of this very SDK, so the two always speak the same protocol, on any image that has
ipykernel and jupyter_client, and nothing is written to the sandbox's disk) on first use, reads its
answers in a thread (or a task) and hands each to the call waiting for its id. The bridge starts the
default context's kernel at once, so a first cell waits for the kernel's start only once.

If the bridge ends (its kernels with it) while the sandbox runs, the cell that was running reports
KernelDied, and the next call starts a fresh bridge and says so (`Execution.restarted`).
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
import queue
import threading
from pathlib import Path

from hutch._core.errors import ConfigError, DaemonError, Error, ImageError, NotFoundError, SandboxError, StateError
from hutch.sandbox._inside import bridge
from hutch.sandbox._spec import DEFAULT_WORKDIR, SANDBOX_USER_ID
from hutch.sandbox.interpreter import (
    DEFAULT_CONTEXT, Cell, CodeContext, Execution, Lines, check_callback, check_code, check_new_context,
    check_timeout, context_id, request,
)

#: The bridge's program, sent with each start (python3 -I: no user site, no PYTHON* variables, no cwd on sys.path).
BRIDGE_SOURCE = Path(bridge.__file__).read_text()
BRIDGE_ARGV = ("python3", "-I", "-c", BRIDGE_SOURCE)
#: Seconds past a cell's own timeout (and the bridge's interrupt grace) after which the bridge itself is taken
#: for wedged (stopped, or starved) and restarted.
BRIDGE_SLACK = 15.0
_ERRORS = {"NotFoundError": NotFoundError, "ConfigError": ConfigError, "StateError": StateError,
           "ImageError": ImageError, "SandboxError": SandboxError}
_ENDED = object()   # put to every waiter when the bridge's output ends


def _fail(msg: dict) -> Error:
    return _ERRORS.get(str(msg.get("error")), SandboxError)(str(msg.get("message") or "the code interpreter failed.")[:8000])


def _no_python(e: NotFoundError) -> ImageError:
    return ImageError(f"this sandbox's image has no python3 for the code interpreter ({e}); create the sandbox with "
                      "image=hutch.Image.code_interpreter().")


def _user(owner_uid: int) -> str:
    # The interpreter runs as the sandbox's unprivileged user where its working directory is that user's
    # (Image.code_interpreter()); elsewhere (an image without the user) as the sandbox's root, which has
    # no capabilities either: a kernel that could not write its own working directory would be of little use.
    return "user" if owner_uid == SANDBOX_USER_ID else "root"


def _no_start(sandbox_id: str, p) -> Error:
    if p.reason == "sandbox_ended":
        return StateError(f"sandbox {sandbox_id} ended while its code interpreter started.")
    return ImageError(f"the code interpreter could not start in sandbox {sandbox_id} ({_why(p)} before it was ready): "
                      "its image needs python3 with ipykernel and jupyter_client; create the sandbox with "
                      "image=hutch.Image.code_interpreter(), or add .pip_install('ipykernel', 'jupyter_client').")


def _wait_limit(timeout: float | None) -> float | None:
    return None if timeout is None else timeout + bridge.INTERRUPT_GRACE + BRIDGE_SLACK


class _State:
    """What both sessions keep (no I/O): request ids, the contexts made, whether the state was lost."""

    def __init__(self, sandbox) -> None:
        self.sandbox = sandbox
        self.ids = itertools.count(1)
        self.waiters: dict = {}
        self.contexts: dict[str, CodeContext] = {}
        self.proc = None
        self.lost = False          # a bridge died since the last cell: the next one says restarted
        self.ended_why = ""

    def workdir(self) -> str:
        return (self.sandbox._info.get("spec") or {}).get("workdir") or DEFAULT_WORKDIR

    def default(self) -> CodeContext:
        return CodeContext(DEFAULT_CONTEXT, self.workdir(), "python")

    def route(self, msg: dict) -> None:
        rid = msg.get("id")
        w = self.waiters.get(rid) if isinstance(rid, int) else None   # (an unhashable id must not stop the reader)
        if w is not None:
            w.put_nowait(msg)

    def bridge_ended(self, why: str) -> None:
        self.proc, self.lost, self.ended_why = None, True, why
        self.contexts.clear()
        for w in list(self.waiters.values()):
            w.put_nowait(_ENDED)

    @staticmethod
    def dispatch(cbs: dict, events) -> list:
        """Call the callbacks named in `events`; returns the awaitables they returned (async callbacks)."""
        pending = []
        for name, value in events:
            fn = cbs.get(name)
            if fn is not None:
                r = fn(value)
                if inspect.isawaitable(r):
                    pending.append(r)
        return pending


def _why(proc) -> str:
    reason = proc.reason or "ended"
    return f"its process {reason}" + (f" with code {proc.returncode}" if reason == "exited" else "")


# --------------------------------------------------------------------------------------------- blocking


class Interpreter:
    """The code interpreter of one `hutch.Sandbox` handle."""

    def __init__(self, sandbox) -> None:
        self.s = _State(sandbox)
        self.lock = threading.Lock()

    def _start(self):
        s = self.s
        try:
            owner = s.sandbox.files.stat(s.workdir()).uid
        except Error:
            owner = 0
        try:
            try:
                p = s.sandbox.exec(*BRIDGE_ARGV, text=False, stderr=False, user=_user(owner))
            except ConfigError:   # a sandbox without a user namespace has no such user
                p = s.sandbox.exec(*BRIDGE_ARGV, text=False, stderr=False)
        except NotFoundError as e:
            raise _no_python(e) from None
        lines = Lines()
        first = []
        while not first:
            chunk = p.stdout.readline()
            if not chunk:
                p.wait()
                raise _no_start(s.sandbox.id, p)
            first = lines.feed(chunk)
        if first[0].get("kind") != "ready":
            p.kill()
            raise _fail(first[0])
        s.proc = p
        threading.Thread(target=self._read, args=(p, lines), name=f"hutch-interp-{s.sandbox.id}", daemon=True).start()
        return p

    def _read(self, p, lines: Lines) -> None:
        try:
            while chunk := p.stdout.readline():
                for msg in lines.feed(chunk):
                    self.s.route(msg)
        except Error:
            pass
        try:
            p.wait()
            why = _why(p)
        except Error as e:
            why = str(e)
        with self.lock:
            if self.s.proc is p:
                self.s.bridge_ended(why)

    def _call(self, op: str, cid: str | None, **fields):
        """Send one request; returns (its id, its queue, the bridge process)."""
        with self.lock:
            p = self.s.proc or self._start()
            rid = next(self.s.ids)
            q = self.s.waiters[rid] = queue.SimpleQueue()
            restarted = self.s.lost
            self.s.lost = False
        try:
            p.stdin.write(request(op, id=rid, context=cid, **fields))
        except BaseException:
            self.s.waiters.pop(rid, None)
            raise
        return rid, q, p, restarted

    def _answer(self, op: str, cid: str | None, **fields) -> dict:
        rid, q, p, _ = self._call(op, cid, **fields)
        try:
            msg = q.get(timeout=60)
        except queue.Empty:
            raise DaemonError("the code interpreter did not answer within 60 s; check that the sandbox runs.") from None
        finally:
            self.s.waiters.pop(rid, None)
        if msg is _ENDED:
            raise SandboxError(f"the code interpreter ended ({self.s.ended_why}); try again.")
        if msg.get("kind") == "fail":
            raise _fail(msg)
        return msg

    def run(self, code, context, timeout, callbacks: dict) -> Execution:
        code, timeout, cid = check_code(code), check_timeout(timeout), context_id(context)
        for name, fn in callbacks.items():
            check_callback(name, fn)
        rid, q, p, restarted = self._call("execute", cid, code=code, timeout=timeout)
        cell = Cell(cid)
        cell.restarted = restarted
        limit = _wait_limit(timeout)
        interrupted = None
        try:
            while not cell.done:
                try:
                    try:
                        msg = q.get(timeout=limit)
                    except queue.Empty:   # the bridge did not end the cell in time: it is wedged
                        p.kill()
                        limit = None
                        continue
                    if msg is _ENDED:
                        events = cell.interpreter_lost(self.s.ended_why)
                    elif msg.get("kind") == "fail":
                        raise _fail(msg)
                    else:
                        events = cell.feed(msg)
                    _State.dispatch(callbacks, events)
                except KeyboardInterrupt as e:   # Ctrl-C: interrupt the cell, let it end, then raise
                    interrupted = e
                    p.stdin.write(request("interrupt", context=cid))
                    limit = bridge.INTERRUPT_GRACE + BRIDGE_SLACK
        finally:
            self.s.waiters.pop(rid, None)
        if interrupted is not None:
            raise interrupted
        if self.s.proc is None and self.s.sandbox.poll() is not None:
            from hutch.sandbox._api import terminated_error

            raise terminated_error(self.s.sandbox.id, self.s.sandbox.info)
        return cell.execution()

    def create_context(self, cwd, language) -> CodeContext:
        cwd = check_new_context(cwd, language)
        d = self._answer("create_context", None, cwd=cwd).get("context") or {}
        ctx = CodeContext(str(d.get("id")), d.get("cwd"), "python")
        self.s.contexts[ctx.id] = ctx
        return ctx

    def list_contexts(self) -> list[CodeContext]:
        return [self.s.default(), *self.s.contexts.values()]

    def remove_context(self, context) -> None:
        cid = context_id(context)
        if cid == DEFAULT_CONTEXT:
            raise ConfigError("the default code context cannot be removed; remove contexts you made with "
                              "create_code_context().")
        if self.s.proc is None:
            raise NotFoundError(f"no code context {cid!r} in this sandbox (removed, or lost with its interpreter).")
        self._answer("remove_context", cid)
        self.s.contexts.pop(cid, None)

    def warm(self) -> None:
        """Start the bridge and wait until the default kernel has run a cell (for pools)."""
        ex = self.run("None", None, 60.0, {})
        if ex.error is not None:
            raise SandboxError(f"the code interpreter did not come up: {ex.error.name}: {ex.error.value}")
        self.s.lost = False

    def close(self) -> None:
        with self.lock:
            p, self.s.proc = self.s.proc, None
        if p is not None and p.returncode is None:
            try:
                p.stdin.write(request("shutdown"))
            except Error:
                pass


# --------------------------------------------------------------------------------------------- awaitable


class AsyncInterpreter:
    """The code interpreter of one `hutch.AsyncSandbox` handle (the same protocol, awaitable)."""

    def __init__(self, sandbox) -> None:
        self.s = _State(sandbox)
        self.lock = asyncio.Lock()

    async def _start(self):
        s = self.s
        try:
            owner = (await s.sandbox.files.stat(s.workdir())).uid
        except Error:
            owner = 0
        try:
            try:
                p = await s.sandbox.exec(*BRIDGE_ARGV, text=False, stderr=False, user=_user(owner))
            except ConfigError:   # a sandbox without a user namespace has no such user
                p = await s.sandbox.exec(*BRIDGE_ARGV, text=False, stderr=False)
        except NotFoundError as e:
            raise _no_python(e) from None
        lines = Lines()
        first = []
        while not first:
            chunk = await p.stdout.readline()
            if not chunk:
                await p.wait()
                raise _no_start(s.sandbox.id, p)
            first = lines.feed(chunk)
        if first[0].get("kind") != "ready":
            await p.kill()
            raise _fail(first[0])
        s.proc = p
        self.task = asyncio.get_running_loop().create_task(self._read(p, lines))
        return p

    async def _read(self, p, lines: Lines) -> None:
        try:
            while chunk := await p.stdout.readline():
                for msg in lines.feed(chunk):
                    self.s.route(msg)
        except Error:
            pass
        try:
            await p.wait()
            why = _why(p)
        except Error as e:
            why = str(e)
        if self.s.proc is p:
            self.s.bridge_ended(why)

    async def _call(self, op: str, cid: str | None, **fields):
        async with self.lock:
            p = self.s.proc or await self._start()
            rid = next(self.s.ids)
            q = self.s.waiters[rid] = asyncio.Queue()
            restarted = self.s.lost
            self.s.lost = False
        try:
            await p.stdin.write(request(op, id=rid, context=cid, **fields))
        except BaseException:
            self.s.waiters.pop(rid, None)
            raise
        return rid, q, p, restarted

    async def _answer(self, op: str, cid: str | None, **fields) -> dict:
        rid, q, p, _ = await self._call(op, cid, **fields)
        try:
            msg = await asyncio.wait_for(q.get(), 60)
        except asyncio.TimeoutError:
            raise DaemonError("the code interpreter did not answer within 60 s; check that the sandbox runs.") from None
        finally:
            self.s.waiters.pop(rid, None)
        if msg is _ENDED:
            raise SandboxError(f"the code interpreter ended ({self.s.ended_why}); try again.")
        if msg.get("kind") == "fail":
            raise _fail(msg)
        return msg

    async def run(self, code, context, timeout, callbacks: dict) -> Execution:
        code, timeout, cid = check_code(code), check_timeout(timeout), context_id(context)
        for name, fn in callbacks.items():
            check_callback(name, fn)
        rid, q, p, restarted = await self._call("execute", cid, code=code, timeout=timeout)
        cell = Cell(cid)
        cell.restarted = restarted
        limit = _wait_limit(timeout)
        try:
            while not cell.done:
                try:
                    msg = await asyncio.wait_for(q.get(), limit)
                except asyncio.TimeoutError:   # the bridge did not end the cell in time: it is wedged
                    await p.kill()
                    limit = None
                    continue
                except asyncio.CancelledError:   # the caller gave up: stop the cell too
                    asyncio.get_running_loop().create_task(_quietly(p.stdin.write(request("interrupt", context=cid))))
                    raise
                if msg is _ENDED:
                    events = cell.interpreter_lost(self.s.ended_why)
                elif msg.get("kind") == "fail":
                    raise _fail(msg)
                else:
                    events = cell.feed(msg)
                for r in _State.dispatch(callbacks, events):
                    await r
        finally:
            self.s.waiters.pop(rid, None)
        if self.s.proc is None and await self.s.sandbox.poll() is not None:
            from hutch.sandbox._api import terminated_error

            raise terminated_error(self.s.sandbox.id, self.s.sandbox.info)
        return cell.execution()

    async def create_context(self, cwd, language) -> CodeContext:
        cwd = check_new_context(cwd, language)
        d = (await self._answer("create_context", None, cwd=cwd)).get("context") or {}
        ctx = CodeContext(str(d.get("id")), d.get("cwd"), "python")
        self.s.contexts[ctx.id] = ctx
        return ctx

    def list_contexts(self) -> list[CodeContext]:
        return [self.s.default(), *self.s.contexts.values()]

    async def remove_context(self, context) -> None:
        cid = context_id(context)
        if cid == DEFAULT_CONTEXT:
            raise ConfigError("the default code context cannot be removed; remove contexts you made with "
                              "create_code_context().")
        if self.s.proc is None:
            raise NotFoundError(f"no code context {cid!r} in this sandbox (removed, or lost with its interpreter).")
        await self._answer("remove_context", cid)
        self.s.contexts.pop(cid, None)

    async def warm(self) -> None:
        ex = await self.run("None", None, 60.0, {})
        if ex.error is not None:
            raise SandboxError(f"the code interpreter did not come up: {ex.error.name}: {ex.error.value}")
        self.s.lost = False

    async def close(self) -> None:
        p, self.s.proc = self.s.proc, None
        if p is not None and p.returncode is None:
            await _quietly(p.stdin.write(request("shutdown")))


async def _quietly(aw) -> None:
    try:
        await aw
    except Error:
        pass
