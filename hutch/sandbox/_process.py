"""The handle of a command running in a sandbox, similar to subprocess.Popen / asyncio.subprocess.Process.

`p.stdout` and `p.stderr` yield the command's output line by line while it
runs (text by default, bytes with `text=False`); `p.stdin.write()` feeds it;
`p.wait()`, `p.poll()`, `p.returncode` and `p.kill()` work as in subprocess.
The daemon sends both streams multiplexed on one HTTP response; a reader
(a thread, or a task for the async handle) sorts the frames into buffers.

Flow control, as with OS pipes: once OUTPUT_BUFFER bytes of one stream wait
unread, the reader stops taking from the connection, the daemon stops reading
the command's pipe, and the command blocks in write() until `p.stdout` /
`p.stderr` are read. So, as with subprocess.Popen and pipes, a caller that
reads only stdout of a command that floods stderr waits forever: read both
(`p.result()`, threads or tasks), or discard one (`exec(stderr=False)`).
`wait()` asks the daemon for the exit status when unread output holds the
stream back, so it returns once the command has ended (killed, timed out)
even if nobody reads; it cannot return while the command is itself blocked
writing output nobody reads.
"""

from __future__ import annotations

import asyncio
import threading
import weakref

from hutch._core.errors import DaemonError, NotFoundError, SandboxLostError, StateError
from hutch.sandbox._api import (
    EXIT, OUTPUT_BUFFER, STDERR, STDOUT, WAIT_POLL, ExecResult, ExitStatus, FrameDecoder, TextStreamDecoder,
)


class _Output:
    """I/O-free state shared by the sync and async handles: per-stream buffers and the exit status.

    `limit`: unread bytes of one stream at which the reader stops taking from the connection (None: never,
    for run(), which takes everything as it comes); `cap`: bytes of each stream kept at all (run's
    max_output), the rest counted in `dropped`.
    """

    def __init__(self, limit: int | None = OUTPUT_BUFFER, cap: int | None = None) -> None:
        self.decoder = FrameDecoder()
        self.bufs = {STDOUT: bytearray(), STDERR: bytearray()}
        self.limit, self.cap = limit, cap
        self.kept = {STDOUT: 0, STDERR: 0}
        self.dropped = {STDOUT: 0, STDERR: 0}
        self.exit: ExitStatus | None = None
        self.error: Exception | None = None
        self.done = False
        self.abandoned = False   # the handle was dropped: nobody reads again

    def feed(self, data: bytes) -> None:
        for kind, payload in self.decoder.feed(data):
            if kind in self.bufs:
                if self.cap is not None:
                    room = max(0, self.cap - self.kept[kind])
                    if len(payload) > room:
                        self.dropped[kind] += len(payload) - room
                        payload = payload[:room]
                    self.kept[kind] += len(payload)
                self.bufs[kind] += payload
            elif kind == EXIT:   # the frame wins over an answer of /wait: it also counts what the daemon dropped
                self.exit = ExitStatus.from_payload(payload)

    @property
    def full(self) -> bool:
        """True while one stream holds `limit` unread bytes: the reader must stop taking from the connection."""
        return self.limit is not None and any(len(b) >= self.limit for b in self.bufs.values())

    def all_dropped(self, fd: int) -> int:
        """Bytes of stream `fd` beyond max_output: dropped by the daemon, plus any dropped here."""
        if self.exit is None:
            return self.dropped[fd]
        return self.dropped[fd] + (self.exit.stdout_dropped if fd == STDOUT else self.exit.stderr_dropped)

    def finish(self, error: Exception | None = None) -> None:
        if self.exit is None and self.error is None:
            self.error = error or DaemonError(
                "the hutch daemon closed the output of a command before it reported the exit status; "
                "check the daemon's log (run_dir/daemon.log) and that the sandbox still exists."
            )
        self.done = True

    def take_line(self, fd: int) -> bytes | None:
        """The next line; b"" at the end; None if none is complete yet. A line longer than `limit` comes in
        pieces of that size (its rest could never arrive: the full buffer holds the stream back)."""
        buf = self.bufs[fd]
        i = buf.find(b"\n")
        if i >= 0:
            n = i + 1
        elif self.done or (self.limit is not None and len(buf) >= self.limit):
            n = len(buf)
        else:
            return None
        line = bytes(buf[:n])
        del buf[:n]
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

    def result(self, argv, out: bytes, err: bytes, texts) -> ExecResult:
        st = self.status()
        return ExecResult(argv, st.returncode, texts[0].out(out, final=True), texts[1].out(err, final=True),
                          st.reason or "exited", self.all_dropped(STDOUT), self.all_dropped(STDERR))


def _exit_from(answer: dict) -> ExitStatus | None:
    """An answer of POST .../exec/{eid}/wait: how the command ended, or None while it runs."""
    if answer.get("returncode") is None:
        return None
    return ExitStatus(int(answer["returncode"]), str(answer.get("reason") or "exited"))


class _Text:
    def __init__(self, text: bool) -> None:
        self.dec = TextStreamDecoder() if text else None

    def out(self, data: bytes, final: bool = False):
        return self.dec.decode(data, final) if self.dec else data


def _lost(argv, e: Exception, node: str | None = None) -> DaemonError | SandboxLostError:
    if node:   # a fleet node's daemon: its connection broke because it is gone, with its sandboxes
        return SandboxLostError(f"lost the output stream of {list(argv)}: {e}; its sandbox is lost with fleet node "
                                f"{node} (create a new one).")
    return DaemonError(f"lost the output stream of {list(argv)}: {e}; check that the daemon still runs.")


def _read_output(resp, out: _Output, cond: threading.Condition, argv, node: str | None = None) -> None:
    """Read an exec's response into `out` (the thread of a Process, or run()'s caller)."""
    error = None
    try:
        for chunk in resp.iter_raw():
            with cond:
                out.feed(chunk)
                cond.notify_all()
                while out.full and not out.abandoned:   # flow control: the connection waits for a reader
                    cond.wait()
                if out.full:   # its handle is gone with output unread: hang up, as a closed pipe would
                    break
    except Exception as e:  # the connection broke: report it from wait()
        error = _lost(argv, e, node)
    finally:
        resp.close()
        with cond:
            out.finish(error)
            cond.notify_all()


def _abandon(out: _Output, cond: threading.Condition) -> None:
    with cond:
        out.abandoned = True
        cond.notify_all()


# ---------------------------------------------------------------- blocking handle


class _ExitState:
    """Which command this is and how it ended, read from its output state; shared by Process and AsyncProcess
    (no I/O)."""

    _out: _Output

    def _bind(self, client, sandbox_id: str, argv, response, background: bool, max_output: int | None) -> None:
        """The fields both kinds of process set from the daemon's reply to an exec. A handle read in the
        background holds at most OUTPUT_BUFFER unread bytes per stream; run()'s (not in the background)
        takes everything as it arrives and keeps at most `max_output` bytes per stream."""
        self._client = client
        self.argv = tuple(argv)
        self.sandbox_id = sandbox_id
        self.id = response.headers.get("x-hutch-exec-id", "")
        self._base = f"/v1/sandboxes/{sandbox_id}/exec/{self.id}"
        self._resp = response
        self._out = _Output(OUTPUT_BUFFER if background else None, max_output)

    def _forgotten(self) -> DaemonError:
        return DaemonError(
            f"the daemon no longer knows the command {list(self.argv)} (its sandbox is gone or the daemon restarted), "
            "so its exit status could only follow the output not read yet; read p.stdout and p.stderr to their end."
        )

    def _stalled(self) -> bool:
        """True while unread output holds the stream back (so its exit frame cannot arrive)."""
        return self._out.exit is None and not self._out.done and self._out.full

    @property
    def returncode(self) -> int | None:
        """The exit code once the command has ended (negative: killed by that signal), else None."""
        return self._out.exit.returncode if self._out.exit else None

    @property
    def reason(self) -> str | None:
        """Why it ended: 'exited', 'signaled', 'timeout', 'oom', 'killed' or 'sandbox_ended'; None while running."""
        return self._out.exit.reason if self._out.exit else None

    def poll(self) -> int | None:
        """The exit code if the command has ended, else None. Never blocks (and never asks the daemon: while
        OUTPUT_BUFFER bytes of a stream wait unread, the end shows once they are read or after wait())."""
        return self.returncode


class StreamReader:
    """`p.stdout` / `p.stderr`: iterate for lines as they arrive; `read()` waits for the rest."""

    def __init__(self, proc: "Process", fd: int, text: bool) -> None:
        self._p, self._fd, self._t = proc, fd, _Text(text)

    def readline(self):
        """The next line (with its newline), or an empty string/bytes at the end of the stream.

        A line longer than OUTPUT_BUFFER bytes comes in pieces of that size."""
        with self._p._cond:
            while (line := self._p._out.take_line(self._fd)) is None:
                self._p._cond.wait()
            self._p._cond.notify_all()   # room again: the reader may go on
        return self._t.out(line, final=not line)

    def read(self):
        """Everything the command writes to this stream from here until it ends (all of it, unbounded;
        read the other stream too meanwhile, or use `p.result()`, if the command writes much there)."""
        parts, out = [], self._p._out
        with self._p._cond:
            while True:
                parts.append(out.take_all(self._fd))
                self._p._cond.notify_all()
                if out.done:
                    break
                self._p._cond.wait()
        out.status()   # raises if the stream broke
        return self._t.out(b"".join(parts), final=True)

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

    def __init__(self, client, sandbox_id: str, argv, response, *, text: bool, stdin_open: bool, background: bool = True,
                 max_output: int | None = None):
        self._bind(client, sandbox_id, argv, response, background, max_output)
        self._cond = threading.Condition()
        self._text = text
        self.stdout = StreamReader(self, STDOUT, text)
        self.stderr = StreamReader(self, STDERR, text)
        self.stdin = StdinWriter(self, stdin_open)
        self._thread = None
        if background:
            # the thread holds no reference to this handle: once it is dropped, the finalizer tells the
            # reader that nobody will read again (see _read_output)
            self._thread = threading.Thread(target=_read_output, args=(response, self._out, self._cond, self.argv, client.ep.node),
                                            name=f"hutch-exec-{self.id}", daemon=True)
            self._thread.start()
            weakref.finalize(self, _abandon, self._out, self._cond)

    def _pump(self) -> None:
        _read_output(self._resp, self._out, self._cond, self.argv, self._client.ep.node)

    def wait(self) -> int:
        """Wait for the command to end and return its exit code.

        Output not read yet stays readable. A command that writes more than the buffers hold (OUTPUT_BUFFER
        per stream, plus the pipe and the daemon's window) blocks until it is read, so then wait() does too:
        read while waiting (threads, or `p.result()`), or exec with stdout=False / stderr=False.
        """
        if self._thread is None and not self._out.done:
            self._pump()
        with self._cond:
            while self._out.exit is None and not self._out.done and not self._stalled():
                self._cond.wait()
        while self._stalled():   # the exit frame is queued behind unread output: ask the daemon
            try:
                st = _exit_from(self._client.json("POST", f"{self._base}/wait", params={"timeout": WAIT_POLL}))
            except NotFoundError as e:
                raise self._forgotten() from e
            with self._cond:
                if st is not None and self._out.exit is None:
                    self._out.exit = st
                    self._cond.notify_all()
                while self._out.exit is None and not self._out.done and not self._stalled():
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
                self._cond.notify_all()
            yield from ((fd, b) for fd, b in got if b)
            if done:
                return

    def result(self) -> ExecResult:
        """Read both streams to their end (like Popen.communicate), then return them and the exit code."""
        if self._thread is None and not self._out.done:
            self._pump()
        parts: dict[int, list[bytes]] = {STDOUT: [], STDERR: []}
        with self._cond:
            while True:
                for fd in parts:
                    parts[fd].append(self._out.take_all(fd))
                self._cond.notify_all()
                if self._out.done:
                    break
                self._cond.wait()
        return self._out.result(self.argv, b"".join(parts[STDOUT]), b"".join(parts[STDERR]),
                                (self.stdout._t, self.stderr._t))

    def __repr__(self) -> str:
        return f"<hutch.Process {list(self.argv)} returncode={self.returncode}>"


# ---------------------------------------------------------------- awaitable handle


class AsyncStreamReader:
    """`p.stdout` / `p.stderr` of an AsyncProcess: `async for line in p.stdout`, `await read()`."""

    def __init__(self, proc: "AsyncProcess", fd: int, text: bool) -> None:
        self._p, self._fd, self._t = proc, fd, _Text(text)

    async def readline(self):
        """The next line (with its newline), or an empty string/bytes at the end of the stream.

        A line longer than OUTPUT_BUFFER bytes comes in pieces of that size."""
        while (line := self._p._out.take_line(self._fd)) is None:
            await self._p._changed()
        self._p._event.set()   # room again: the reader may go on
        return self._t.out(line, final=not line)

    async def read(self):
        """Everything the command writes to this stream from here until it ends (see `StreamReader.read`)."""
        parts, out = [], self._p._out
        while True:
            parts.append(out.take_all(self._fd))
            self._p._event.set()
            if out.done:
                break
            await self._p._changed()
        out.status()
        return self._t.out(b"".join(parts), final=True)

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


async def _aread_output(resp, out: _Output, event: asyncio.Event, argv, node: str | None = None) -> None:
    """Read an exec's response into `out` (the task of an AsyncProcess, or run()'s caller)."""
    error = None
    try:
        async for chunk in resp.aiter_raw():
            out.feed(chunk)
            event.set()
            while out.full and not out.abandoned:   # flow control: the connection waits for a reader
                event.clear()
                await event.wait()
            if out.full:   # its handle is gone with output unread: hang up, as a closed pipe would
                break
    except Exception as e:
        error = _lost(argv, e, node)
    finally:
        await resp.aclose()
        out.finish(error)
        event.set()


def _abandon_async(out: _Output, event: asyncio.Event, loop: asyncio.AbstractEventLoop) -> None:
    out.abandoned = True
    try:
        loop.call_soon_threadsafe(event.set)
    except RuntimeError:   # the loop is closed: asyncio.run() cancelled the task already
        pass


class AsyncProcess(_ExitState):
    """A command running in an AsyncSandbox. Similar to asyncio.subprocess.Process."""

    def __init__(self, client, sandbox_id: str, argv, response, *, text: bool, stdin_open: bool, background: bool = True,
                 max_output: int | None = None):
        self._bind(client, sandbox_id, argv, response, background, max_output)
        self._event = asyncio.Event()   # set on every change (output fed or taken, the end): waiters re-check
        self.stdout = AsyncStreamReader(self, STDOUT, text)
        self.stderr = AsyncStreamReader(self, STDERR, text)
        self.stdin = AsyncStdinWriter(self, stdin_open)
        self._task = None
        if background:
            loop = asyncio.get_running_loop()
            self._task = loop.create_task(_aread_output(response, self._out, self._event, self.argv, client.ep.node))
            # once this handle is dropped, tells the task that nobody will read again
            weakref.finalize(self, _abandon_async, self._out, self._event, loop)

    async def _pump(self) -> None:
        await _aread_output(self._resp, self._out, self._event, self.argv, self._client.ep.node)

    async def _changed(self) -> None:
        self._event.clear()
        await self._event.wait()

    async def wait(self) -> int:
        """Wait for the command to end and return its exit code (see `Process.wait` for unread output)."""
        if self._task is None and not self._out.done:
            await self._pump()
        while self._out.exit is None and not self._out.done:
            if not self._stalled():
                await self._changed()
                continue
            try:   # the exit frame is queued behind unread output: ask the daemon
                answer = await self._client.json("POST", f"{self._base}/wait", params={"timeout": WAIT_POLL})
            except NotFoundError as e:
                raise self._forgotten() from e
            st = _exit_from(answer)
            if st is not None and self._out.exit is None:
                self._out.exit = st
                self._event.set()
        return self._out.status().returncode

    async def kill(self, signal: int = 9) -> None:
        """Send `signal` (SIGKILL by default) to the command. Does nothing if it has ended."""
        if self.returncode is None:
            await self._client.request("POST", f"{self._base}/kill", json={"signal": int(signal)})

    async def result(self) -> ExecResult:
        """Read both streams to their end (like Popen.communicate), then return them and the exit code."""
        if self._task is None and not self._out.done:
            await self._pump()
        parts: dict[int, list[bytes]] = {STDOUT: [], STDERR: []}
        while True:
            for fd in parts:
                parts[fd].append(self._out.take_all(fd))
            self._event.set()
            if self._out.done:
                break
            await self._changed()
        return self._out.result(self.argv, b"".join(parts[STDOUT]), b"".join(parts[STDERR]),
                                (self.stdout._t, self.stderr._t))

    def __repr__(self) -> str:
        return f"<hutch.AsyncProcess {list(self.argv)} returncode={self.returncode}>"
