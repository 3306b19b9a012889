"""The handle of a command running in a sandbox, similar to subprocess.Popen / asyncio.subprocess.Process.

`p.stdout` and `p.stderr` yield the command's output line by line while it
runs (text by default, bytes with `text=False`); `p.stdin.write()` feeds it;
`p.wait()`, `p.poll()`, `p.returncode` and `p.kill()` work as in subprocess.
The daemon sends both streams multiplexed on one HTTP response; a reader
(a thread, or a task for the async handle) sorts the frames into buffers.
"""

from __future__ import annotations

import asyncio
import threading

from hutch._core.errors import DaemonError, StateError
from hutch.sandbox._wire import EXIT, STDERR, STDOUT, ExecResult, ExitStatus, FrameDecoder, TextStreamDecoder


class _Output:
    """I/O-free state shared by the sync and async handles: per-stream buffers and the exit status."""

    def __init__(self) -> None:
        self.decoder = FrameDecoder()
        self.bufs = {STDOUT: bytearray(), STDERR: bytearray()}
        self.exit: ExitStatus | None = None
        self.error: Exception | None = None
        self.done = False

    def feed(self, data: bytes) -> None:
        for kind, payload in self.decoder.feed(data):
            if kind in self.bufs:
                self.bufs[kind] += payload
            elif kind == EXIT:
                self.exit = ExitStatus.from_payload(payload)

    def finish(self, error: Exception | None = None) -> None:
        if self.exit is None and self.error is None:
            self.error = error or DaemonError(
                "the hutch daemon closed the output of a command before it reported the exit status; "
                "check the daemon's log (run_dir/daemon.log) and that the sandbox still exists."
            )
        self.done = True

    def take_line(self, fd: int) -> bytes | None:
        buf = self.bufs[fd]
        i = buf.find(b"\n")
        if i < 0:
            if not self.done or not buf:
                return None if not self.done else b""
            i = len(buf) - 1
        line = bytes(buf[: i + 1])
        del buf[: i + 1]
        return line

    def take_all(self, fd: int) -> bytes:
        buf = self.bufs[fd]
        data = bytes(buf)
        buf.clear()
        return data

    def status(self) -> ExitStatus:
        if self.exit is None:
            raise self.error or DaemonError("the command's exit status is unknown.")
        return self.exit


class _Text:
    def __init__(self, text: bool) -> None:
        self.dec = TextStreamDecoder() if text else None

    def out(self, data: bytes, final: bool = False):
        return self.dec.decode(data, final) if self.dec else data


# ---------------------------------------------------------------- blocking handle


class _ExitState:
    """Which command this is and how it ended, read from its output state; shared by Process and AsyncProcess
    (no I/O)."""

    _out: _Output

    def _bind(self, client, sandbox_id: str, argv, response) -> None:
        """The fields both kinds of process set from the daemon's reply to an exec."""
        self._client = client
        self.argv = tuple(argv)
        self.sandbox_id = sandbox_id
        self.id = response.headers.get("x-hutch-exec-id", "")
        self._base = f"/v1/sandboxes/{sandbox_id}/exec/{self.id}"
        self._resp = response
        self._out = _Output()

    @property
    def returncode(self) -> int | None:
        """The exit code once the command has ended (negative: killed by that signal), else None."""
        return self._out.exit.returncode if self._out.exit else None

    @property
    def reason(self) -> str | None:
        """Why it ended: 'exited', 'signaled', 'timeout', 'oom', 'killed' or 'sandbox_ended'; None while running."""
        return self._out.exit.reason if self._out.exit else None

    def poll(self) -> int | None:
        """The exit code if the command has ended, else None. Never blocks."""
        return self.returncode


class StreamReader:
    """`p.stdout` / `p.stderr`: iterate for lines as they arrive; `read()` waits for the rest."""

    def __init__(self, proc: "Process", fd: int, text: bool) -> None:
        self._p, self._fd, self._t = proc, fd, _Text(text)

    def readline(self):
        """The next line (with its newline), or an empty string/bytes at the end of the stream."""
        with self._p._cond:
            while (line := self._p._out.take_line(self._fd)) is None:
                self._p._cond.wait()
        return self._t.out(line, final=not line)

    def read(self):
        """Everything the command writes from here until it exits."""
        self._p.wait()
        with self._p._cond:
            return self._t.out(self._p._out.take_all(self._fd), final=True)

    def __iter__(self):
        while line := self.readline():
            yield line


class StdinWriter:
    """`p.stdin`: `write()` sends bytes (or str) to the command, `close()` sends end-of-file."""

    def __init__(self, proc: "Process", is_open: bool) -> None:
        self._p, self._open = proc, is_open

    def write(self, data) -> None:
        """Send `data` (bytes, or str as UTF-8) to the command's standard input."""
        self._p._client.request("POST", self._path(), content=self._bytes(data))

    def close(self) -> None:
        """Close the command's standard input (it reads end-of-file). Closing twice is harmless."""
        if self._open and self._p.returncode is None:
            self._open = False
            self._p._client.request("POST", self._path(True), params={"eof": "1"}, content=b"")
        self._open = False

    def _path(self, closing: bool = False) -> str:
        if not self._open and not closing:
            raise StateError("this command's stdin is closed (or was not opened); pass stdin=True to exec() to write to it.")
        return f"{self._p._base}/stdin"

    @staticmethod
    def _bytes(data) -> bytes:
        return data.encode() if isinstance(data, str) else bytes(data)


class Process(_ExitState):
    """A command running in a sandbox (returned by `Sandbox.exec`). Similar to subprocess.Popen."""

    def __init__(self, client, sandbox_id: str, argv, response, *, text: bool, stdin_open: bool, background: bool = True):
        self._bind(client, sandbox_id, argv, response)
        self._cond = threading.Condition()
        self._text = text
        self.stdout = StreamReader(self, STDOUT, text)
        self.stderr = StreamReader(self, STDERR, text)
        self.stdin = StdinWriter(self, stdin_open)
        self._thread = None
        if background:
            self._thread = threading.Thread(target=self._pump, name=f"hutch-exec-{self.id}", daemon=True)
            self._thread.start()

    def _pump(self) -> None:
        error = None
        try:
            for chunk in self._resp.iter_raw():
                with self._cond:
                    self._out.feed(chunk)
                    self._cond.notify_all()
        except Exception as e:  # the connection broke: report it from wait()
            error = DaemonError(f"lost the output stream of {list(self.argv)}: {e}; check that the daemon still runs.")
        finally:
            self._resp.close()
            with self._cond:
                self._out.finish(error)
                self._cond.notify_all()

    def wait(self) -> int:
        """Wait for the command to end and return its exit code."""
        if self._thread is None and not self._out.done:
            self._pump()
        with self._cond:
            while not self._out.done:
                self._cond.wait()
        return self._out.status().returncode

    def kill(self, signal: int = 9) -> None:
        """Send `signal` (SIGKILL by default) to the command. Does nothing if it has ended."""
        if self.returncode is None:
            self._client.request("POST", f"{self._base}/kill", json={"signal": int(signal)})

    def _chunks(self):
        """(fd, bytes) as output arrives, both streams, until the command ends (for the CLI's passthrough)."""
        while True:
            with self._cond:
                while not self._out.done and not any(self._out.bufs.values()):
                    self._cond.wait()
                got = [(fd, self._out.take_all(fd)) for fd in (STDOUT, STDERR)]
                done = self._out.done
            yield from ((fd, b) for fd, b in got if b)
            if done:
                return

    def result(self) -> ExecResult:
        """Wait, then return stdout, stderr and the exit code as one value."""
        rc = self.wait()
        return ExecResult(self.argv, rc, self.stdout.read(), self.stderr.read(), self.reason or "exited")

    def __repr__(self) -> str:
        return f"<hutch.Process {list(self.argv)} returncode={self.returncode}>"


# ---------------------------------------------------------------- awaitable handle


class AsyncStreamReader:
    """`p.stdout` / `p.stderr` of an AsyncProcess: `async for line in p.stdout`, `await read()`."""

    def __init__(self, proc: "AsyncProcess", fd: int, text: bool) -> None:
        self._p, self._fd, self._t = proc, fd, _Text(text)

    async def readline(self):
        """The next line (with its newline), or an empty string/bytes at the end of the stream."""
        while (line := self._p._out.take_line(self._fd)) is None:
            await self._p._changed()
        return self._t.out(line, final=not line)

    async def read(self):
        """Everything the command writes from here until it exits."""
        await self._p.wait()
        return self._t.out(self._p._out.take_all(self._fd), final=True)

    def __aiter__(self):
        return self._lines()

    async def _lines(self):
        while line := await self.readline():
            yield line


class AsyncStdinWriter:
    """`p.stdin` of an AsyncProcess: `await write()`, `await close()`."""

    def __init__(self, proc: "AsyncProcess", is_open: bool) -> None:
        self._p, self._open = proc, is_open

    async def write(self, data) -> None:
        """Send `data` (bytes, or str as UTF-8) to the command's standard input."""
        await self._p._client.request("POST", self._path(), content=StdinWriter._bytes(data))

    async def close(self) -> None:
        """Close the command's standard input (it reads end-of-file). Closing twice is harmless."""
        if self._open and self._p.returncode is None:
            self._open = False
            await self._p._client.request("POST", self._path(True), params={"eof": "1"}, content=b"")
        self._open = False

    def _path(self, closing: bool = False) -> str:
        if not self._open and not closing:
            raise StateError("this command's stdin is closed (or was not opened); pass stdin=True to exec() to write to it.")
        return f"{self._p._base}/stdin"


class AsyncProcess(_ExitState):
    """A command running in an AsyncSandbox. Similar to asyncio.subprocess.Process."""

    def __init__(self, client, sandbox_id: str, argv, response, *, text: bool, stdin_open: bool, background: bool = True):
        self._bind(client, sandbox_id, argv, response)
        self._event = asyncio.Event()
        self.stdout = AsyncStreamReader(self, STDOUT, text)
        self.stderr = AsyncStreamReader(self, STDERR, text)
        self.stdin = AsyncStdinWriter(self, stdin_open)
        self._task = asyncio.get_running_loop().create_task(self._pump()) if background else None

    async def _pump(self) -> None:
        error = None
        try:
            async for chunk in self._resp.aiter_raw():
                self._out.feed(chunk)
                self._event.set()
        except Exception as e:
            error = DaemonError(f"lost the output stream of {list(self.argv)}: {e}; check that the daemon still runs.")
        finally:
            await self._resp.aclose()
            self._out.finish(error)
            self._event.set()

    async def _changed(self) -> None:
        self._event.clear()
        await self._event.wait()

    async def wait(self) -> int:
        """Wait for the command to end and return its exit code."""
        if self._task is None and not self._out.done:
            await self._pump()
        while not self._out.done:
            await self._changed()
        return self._out.status().returncode

    async def kill(self, signal: int = 9) -> None:
        """Send `signal` (SIGKILL by default) to the command. Does nothing if it has ended."""
        if self.returncode is None:
            await self._client.request("POST", f"{self._base}/kill", json={"signal": int(signal)})

    async def result(self) -> ExecResult:
        """Wait, then return stdout, stderr and the exit code as one value."""
        rc = await self.wait()
        return ExecResult(self.argv, rc, await self.stdout.read(), await self.stderr.read(), self.reason or "exited")

    def __repr__(self) -> str:
        return f"<hutch.AsyncProcess {list(self.argv)} returncode={self.returncode}>"
