"""A command on a terminal of its own in a sandbox: `Sandbox.exec(..., pty=True)` (and AsyncSandbox's).

Spoken over a WebSocket to the daemon (docs/api.md, "Terminals"): binary messages are the terminal's bytes,
text messages JSON control. The terminal is a pty of the sandbox's own (on gVisor one on the host, given to
the command by gVisor's kernel); what this handle reads is what the
command wrote to it, escape sequences and all, and what it writes is typed into it (b"\\x03" is Ctrl-C).
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
import weakref
from typing import Any

from hutch._core.errors import DaemonError, NotFoundError, SandboxTimeout, StateError
from hutch.sandbox._api import (PTY_ROUTE, WAIT_POLL, ExitStatus, check_pty_dims, error_from_answer, pty_body,
                                pty_message)

# No compression (keystrokes are a few bytes; latency is what counts) and no keepalive pings: a handle whose
# output nobody reads holds the daemon's writes back, and a ping stuck behind them would end the session.
_WS_OPTIONS: dict[str, Any] = {"compression": None, "ping_interval": None, "max_size": 1 << 22, "open_timeout": 20}


def _bytes(data) -> bytes:
    if isinstance(data, str):
        return data.encode()
    if isinstance(data, (bytes, bytearray, memoryview)):
        return bytes(data)
    raise TypeError(f"write() takes bytes or str, not {type(data).__name__}.")


def _uri(ep, sandbox_id: str) -> str:
    host = ep.url.split("://", 1)[1].rstrip("/") if ep.url else "hutch"
    return f"ws://{host}{PTY_ROUTE.format(id=sandbox_id)}"


class _State:
    """What both handles share: the output not read yet, and how the command ended."""

    def __init__(self, sandbox_id: str, argv, eid: str) -> None:
        self.id, self.argv, self.eid = sandbox_id, tuple(argv), eid
        self.buf = bytearray()
        self.eof = False
        self.exit: ExitStatus | None = None

    def take(self, n: int | None) -> bytes:
        n = len(self.buf) if n is None else n
        out = bytes(self.buf[:n])
        del self.buf[:n]
        return out

    def feed(self, msg) -> None:
        if isinstance(msg, (bytes, bytearray)):
            self.buf += msg
            return
        d = pty_message(msg)
        if "exit" in d:
            e = d["exit"]
            self.exit = ExitStatus(int(e["returncode"]), str(e.get("reason", "exited")))
            self.eof = True
        elif "error" in d:
            raise error_from_answer(400, msg.encode())

    def found(self, pattern: bytes) -> int:
        i = self.buf.find(pattern)
        return -1 if i < 0 else i + len(pattern)


def _hang_up(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass   # closed already


def _abandoned_async(ws, loop, what: str) -> None:
    """An AsyncPtyProcess was collected unclosed: warn, and abort its connection on its loop (the collector may
    run in any thread; a closing handshake cannot be awaited here)."""
    import warnings

    warnings.warn(what, ResourceWarning, stacklevel=2)
    transport = getattr(ws, "transport", None)
    if transport is None or loop.is_closed():
        return
    try:
        loop.call_soon_threadsafe(transport.abort)
    except RuntimeError:
        pass   # the loop closed meanwhile, and its transports with it


def _refused(e: Exception) -> Exception:
    """The hutch error a refused WebSocket upgrade stands for (a 401, 404 ... with the daemon's JSON body)."""
    from websockets.exceptions import InvalidStatus

    if isinstance(e, InvalidStatus):
        return error_from_answer(e.response.status_code, bytes(e.response.body or b""))
    return DaemonError(f"the terminal's connection to the daemon failed: {type(e).__name__}: {e}")


def _start_reply(text) -> str:
    if not isinstance(text, str):
        raise DaemonError("the daemon's first terminal message was not text; is HUTCH_URL a hutch daemon of this version?")
    d = pty_message(text)
    if "error" in d:
        raise error_from_answer(400, text.encode())
    return str(d["eid"])


def _timed_out(argv, what: str, timeout, got: bytes | bytearray) -> SandboxTimeout:
    return SandboxTimeout(f"{what} of {list(argv)}'s terminal took longer than {timeout:g} s; read so far: "
                          f"{bytes(got[-200:])!r}. Give a longer timeout, or check what the command is waiting for.")


class _Facts:
    """What both handles say of their command: its id, argv and, once it ended, how (kept in `_s`)."""

    _s: _State

    @property
    def id(self) -> str:
        """The exec's id (as the daemon's routes name it)."""
        return self._s.eid

    @property
    def argv(self) -> tuple[str, ...]:
        return self._s.argv

    @property
    def returncode(self) -> int | None:
        """Its exit code once known (a signal's death is -N), else None."""
        return self._s.exit.returncode if self._s.exit else None

    @property
    def reason(self) -> str | None:
        """How it ended (exited, signaled, timeout, oom, killed, sandbox_ended), None while it runs."""
        return self._s.exit.reason if self._s.exit else None


class PtyProcess(_Facts):
    """A command on a terminal in a sandbox (returned by `Sandbox.exec(..., pty=True)`).

    `write()` types into it, `read()` / `read_until()` return what it wrote (bytes, escape sequences
    included), `resize(rows, cols)` changes its size (the command gets SIGWINCH), `wait()` its exit code.
    Output nobody reads holds the command back once the buffers are full, as on a real terminal.
    Closing the handle (or leaving its `with` block) ends the command if it still runs.
    """

    def __init__(self, client, sandbox_id: str, argv, ws, eid: str) -> None:
        self._client, self._ws = client, ws
        self._s = _State(sandbox_id, argv, eid)
        self._base = f"/v1/sandboxes/{sandbox_id}/exec/{eid}"
        # websockets' reader thread keeps the connection alive: a dropped handle hangs up (the daemon then
        # ends the command), without blocking the collector on a closing handshake
        weakref.finalize(self, _hang_up, ws.socket)

    @classmethod
    def start(cls, client, sandbox_id: str, argv, size, **kw) -> "PtyProcess":
        """Start `argv` on a `size` (rows, cols) terminal in the sandbox; what `Sandbox.exec(..., pty=)` calls."""
        from websockets.exceptions import InvalidHandshake
        from websockets.sync.client import connect, unix_connect

        body = pty_body(argv, size=size, **kw)
        ep = client.ep
        if ep.remote:   # the TLS socket the lease uses: verified by the pin or CA, as every connection is
            sock = ep.raw_connect()
            try:
                ws = connect(_uri(ep, sandbox_id), sock=sock, additional_headers=ep.headers(), **_WS_OPTIONS)
            except BaseException as e:
                sock.close()
                if isinstance(e, (InvalidHandshake, OSError)):
                    raise _refused(e) from e
                raise
        else:
            try:
                ws = unix_connect(str(ep.socket), _uri(ep, sandbox_id), **_WS_OPTIONS)
            except (InvalidHandshake, OSError) as e:
                raise _refused(e) from e
        try:
            ws.send(json.dumps(body))
            eid = _start_reply(ws.recv(timeout=60))
        except BaseException:
            ws.close()
            raise
        return cls(client, sandbox_id, argv, ws, eid)

    def write(self, data: "bytes | str") -> None:
        """Type `data` into the terminal (str is sent as UTF-8; b"\\x03" is Ctrl-C, b"\\x04" Ctrl-D)."""
        data = _bytes(data)
        if self._s.eof:
            raise StateError(f"{list(self.argv)} has ended; its terminal takes no more input.")
        from websockets.exceptions import ConnectionClosed

        try:
            self._ws.send(data)
        except ConnectionClosed as e:
            raise StateError(f"the terminal of {list(self.argv)} is closed.") from e

    def resize(self, rows: int, cols: int) -> None:
        """Give the terminal `rows` x `cols`; its foreground programs get SIGWINCH."""
        rows, cols = check_pty_dims(rows, cols)
        self._control({"resize": [rows, cols]})

    def send_signal(self, signal: int) -> None:
        """Send `signal` to the command's process group (Ctrl-C is `write(b"\\x03")`, which reaches the
        terminal's foreground job instead)."""
        if self.returncode is None:
            self._control({"signal": int(signal)})

    def kill(self) -> None:
        """SIGKILL: the command and every process of its terminal's session end."""
        self.send_signal(9)

    def _control(self, d: dict) -> None:
        from websockets.exceptions import ConnectionClosed

        try:
            self._ws.send(json.dumps(d))
        except ConnectionClosed:
            pass   # it has ended

    def _recv(self, timeout) -> bool:
        """One message into the buffer; False at the end of the output."""
        from websockets.exceptions import ConnectionClosed

        if self._s.eof:
            return False
        try:
            self._s.feed(self._ws.recv(timeout=timeout))
        except ConnectionClosed:
            self._s.eof = True
        return not self._s.eof or bool(self._s.buf)

    def read(self, n: int | None = None, timeout: float | None = None) -> bytes:
        """Up to `n` bytes of output (all that arrived if None) as soon as there are any; b"" once the output
        has ended. hutch.SandboxTimeout after `timeout` seconds with nothing to read."""
        if not self._s.buf and not self._s.eof:
            try:
                self._recv(timeout)
            except TimeoutError:
                raise _timed_out(self.argv, "reading", timeout, b"") from None
        return self._s.take(n)

    def read_until(self, pattern: "bytes | str", timeout: float = 10.0) -> bytes:
        """Output up to and including the first `pattern`; hutch.SandboxTimeout if it does not come within
        `timeout` seconds (or the output ends first: StateError)."""
        pat = _bytes(pattern)
        deadline = time.monotonic() + timeout
        while (end := self._s.found(pat)) < 0:
            left = deadline - time.monotonic()
            try:
                if left <= 0:
                    raise TimeoutError
                more = self._recv(left)
            except TimeoutError:
                raise _timed_out(self.argv, f"waiting for {pat!r}", timeout, self._s.buf) from None
            if not more or (self._s.eof and self._s.found(pat) < 0):
                raise StateError(f"{list(self.argv)}'s output ended without {pat!r}; it ended with "
                                 f"{bytes(self._s.buf[-200:])!r}.")
        return self._s.take(end)

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the command to end and return its exit code. Output not read yet stays readable (the daemon
        holds back what does not fit, and says how the command ended over HTTP meanwhile)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._s.exit is None:
            left = WAIT_POLL if deadline is None else min(WAIT_POLL, deadline - time.monotonic())
            if left <= 0:
                raise SandboxTimeout(f"{list(self.argv)} was still running after {timeout:g} s.")
            try:
                d = self._client.json("POST", f"{self._base}/wait", params={"timeout": left})
            except NotFoundError as e:
                raise StateError(f"the daemon no longer knows exec {self.id}: {e}") from e
            if d.get("returncode") is not None:
                self._s.exit = ExitStatus(int(d["returncode"]), str(d.get("reason", "exited")))
        return self._s.exit.returncode

    def close(self) -> None:
        """Hang up: the command is ended if it still runs. Closing twice is harmless."""
        if self._s.exit is None:   # a write of another thread may hold the connection: no closing handshake
            _hang_up(self._ws.socket)
        self._ws.close()

    def __enter__(self) -> "PtyProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<hutch.PtyProcess {list(self.argv)} returncode={self.returncode}>"


class AsyncPtyProcess(_Facts):
    """`PtyProcess`, awaitable (returned by `AsyncSandbox.exec(..., pty=True)`)."""

    def __init__(self, client, sandbox_id: str, argv, ws, eid: str) -> None:
        self._client, self._ws = client, ws
        self._s = _State(sandbox_id, argv, eid)
        self._base = f"/v1/sandboxes/{sandbox_id}/exec/{eid}"
        # the loop's transport holds the connection, not this handle: a handle dropped unclosed hangs up on the
        # loop (the daemon then ends the command) and says so, as asyncio does of an unclosed transport
        self._finalizer = weakref.finalize(self, _abandoned_async, ws, asyncio.get_running_loop(),
                                           f"unclosed <hutch.AsyncPtyProcess {list(self._s.argv)}>")
        self._finalizer.atexit = False   # at exit the process's sockets close anyway

    @classmethod
    async def start(cls, client, sandbox_id: str, argv, size, **kw) -> "AsyncPtyProcess":
        """Start `argv` on a `size` (rows, cols) terminal in the sandbox; what `AsyncSandbox.exec(..., pty=)` calls."""
        from websockets.asyncio.client import connect, unix_connect
        from websockets.exceptions import InvalidHandshake

        body = pty_body(argv, size=size, **kw)
        ep = client.ep
        uri = _uri(ep, sandbox_id)
        try:
            if ep.remote:
                r = ep.remote
                ws = await connect(uri.replace("ws://", "wss://", 1), ssl=r.ssl_context(), server_hostname=r.host,
                                   additional_headers=ep.headers(), **_WS_OPTIONS)
            else:
                ws = await unix_connect(str(ep.socket), uri, **_WS_OPTIONS)
        except (InvalidHandshake, OSError) as e:
            raise _refused(e) from e
        try:
            await ws.send(json.dumps(body))
            eid = _start_reply(await asyncio.wait_for(ws.recv(), 60))
        except BaseException:
            await ws.close()
            raise
        return cls(client, sandbox_id, argv, ws, eid)

    async def write(self, data: "bytes | str") -> None:
        """Type `data` into the terminal (see `PtyProcess.write`)."""
        data = _bytes(data)
        if self._s.eof:
            raise StateError(f"{list(self.argv)} has ended; its terminal takes no more input.")
        from websockets.exceptions import ConnectionClosed

        try:
            await self._ws.send(data)
        except ConnectionClosed as e:
            raise StateError(f"the terminal of {list(self.argv)} is closed.") from e

    async def resize(self, rows: int, cols: int) -> None:
        """Give the terminal `rows` x `cols`; its foreground programs get SIGWINCH."""
        rows, cols = check_pty_dims(rows, cols)
        await self._control({"resize": [rows, cols]})

    async def send_signal(self, signal: int) -> None:
        """Send `signal` to the command's process group (see `PtyProcess.send_signal`)."""
        if self.returncode is None:
            await self._control({"signal": int(signal)})

    async def kill(self) -> None:
        """SIGKILL: the command and every process of its terminal's session end."""
        await self.send_signal(9)

    async def _control(self, d: dict) -> None:
        from websockets.exceptions import ConnectionClosed

        try:
            await self._ws.send(json.dumps(d))
        except ConnectionClosed:
            pass

    async def _recv(self, timeout) -> bool:
        from websockets.exceptions import ConnectionClosed

        if self._s.eof:
            return False
        try:
            self._s.feed(await asyncio.wait_for(self._ws.recv(), timeout))
        except ConnectionClosed:
            self._s.eof = True
        return not self._s.eof or bool(self._s.buf)

    async def read(self, n: int | None = None, timeout: float | None = None) -> bytes:
        """Up to `n` bytes of output as soon as there are any; b"" at its end (see `PtyProcess.read`)."""
        if not self._s.buf and not self._s.eof:
            try:
                await self._recv(timeout)
            except (TimeoutError, asyncio.TimeoutError):
                raise _timed_out(self.argv, "reading", timeout, b"") from None
        return self._s.take(n)

    async def read_until(self, pattern: "bytes | str", timeout: float = 10.0) -> bytes:
        """Output up to and including the first `pattern` (see `PtyProcess.read_until`)."""
        pat = _bytes(pattern)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while (end := self._s.found(pat)) < 0:
            left = deadline - loop.time()
            try:
                if left <= 0:
                    raise TimeoutError
                more = await self._recv(left)
            except (TimeoutError, asyncio.TimeoutError):
                raise _timed_out(self.argv, f"waiting for {pat!r}", timeout, self._s.buf) from None
            if not more or (self._s.eof and self._s.found(pat) < 0):
                raise StateError(f"{list(self.argv)}'s output ended without {pat!r}; it ended with "
                                 f"{bytes(self._s.buf[-200:])!r}.")
        return self._s.take(end)

    async def wait(self, timeout: float | None = None) -> int:
        """Wait for the command to end and return its exit code (see `PtyProcess.wait`)."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while self._s.exit is None:
            left = WAIT_POLL if deadline is None else min(WAIT_POLL, deadline - loop.time())
            if left <= 0:
                raise SandboxTimeout(f"{list(self.argv)} was still running after {timeout:g} s.")
            try:
                d = await self._client.json("POST", f"{self._base}/wait", params={"timeout": left})
            except NotFoundError as e:
                raise StateError(f"the daemon no longer knows exec {self.id}: {e}") from e
            if d.get("returncode") is not None:
                self._s.exit = ExitStatus(int(d["returncode"]), str(d.get("reason", "exited")))
        return self._s.exit.returncode

    async def close(self) -> None:
        """Hang up: the command is ended if it still runs."""
        self._finalizer.detach()
        await self._ws.close()

    async def __aenter__(self) -> "AsyncPtyProcess":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    def __repr__(self) -> str:
        return f"<hutch.AsyncPtyProcess {list(self.argv)} returncode={self.returncode}>"


__all__ = ["AsyncPtyProcess", "PtyProcess"]
