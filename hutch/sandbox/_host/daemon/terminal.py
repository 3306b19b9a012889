"""An exec on a terminal (`GET /v1/sandboxes/{id}/exec/pty`, docs/api.md): a WebSocket to a pty of the sandbox.

The pty is made by the sandbox's init in the sandbox's own devpts (owned by the exec's user), or on gVisor by
the daemon in a devpts instance of the sandbox's on the host (gvisor.runtime.Runsc.open_pty, its slave given to
runsc exec: gVisor makes it the command's terminal); the daemon holds only its master, and moves bytes: binary messages are the terminal's bytes both ways, text messages JSON
control (the exec's body first; then resize and signal from the client; the exec id, an error or the exit
from the daemon). Nothing of the host's terminals is involved: the client's local terminal is a byte stream
to the sandbox, so nothing it runs can push input into it (TIOCSTI) or resize it.

Flow control, as for piped output: the daemon reads the master only once the client took the last chunk
(aiohttp's WebSocket writer drains past 64 KiB), so a client that stops reading blocks the command in its
write() on the full pty; and input is written to the master only as fast as the command reads it, while
aiohttp stops reading the connection past its queue.
"""

from __future__ import annotations

import asyncio
import errno
import fcntl
import json
import os
import select
import signal
import struct
import termios

from aiohttp import WSMsgType, web

from hutch._core import errors
from hutch._core.errors import ConfigError
from hutch.sandbox._api import PTY_START_TIMEOUT, check_pty_dims

DRAIN_AFTER_EXIT = 0.2   # seconds to keep reading output a background child may still hold the terminal for
LAST_OUTPUT = 1 << 20    # bytes read after that window, at most (a background child writing on and on)
READ_CHUNK = 1 << 16
MAX_MESSAGE = 1 << 20    # a client's input message
HANG_UP_POLL = 0.5       # seconds between checks of the client's connection while nothing else says it ended


async def serve_pty(request: web.Request, mgr, sb) -> web.WebSocketResponse:
    ws = web.WebSocketResponse(max_msg_size=MAX_MESSAGE, compress=False, autoping=True)
    if not ws.can_prepare(request).ok:   # else aiohttp answers a plain-text 400, not the API's JSON error
        raise ConfigError("GET /v1/sandboxes/{id}/exec/pty is a WebSocket: send Upgrade: websocket (the SDK's "
                          "exec(..., pty=True) does); docs/api.md, Terminals.")
    await ws.prepare(request)
    task = asyncio.current_task()
    mgr.streams.add(task)
    ex = None
    try:
        try:
            body = await _first_message(ws)
            ex = await mgr.execs.start(sb, body.get("argv"), body.get("env"), body.get("workdir"), body.get("timeout"),
                                       user=body.get("user", "root"), pty=body.get("pty", {}))
        except errors.Error as e:
            await ws.send_str(json.dumps({"error": type(e).__name__, "message": str(e)}))
            await ws.close()
            return ws
        await ws.send_str(json.dumps({"eid": ex.eid}))
        if await _pump(ws, sb, ex, mgr, request.transport.get_extra_info("socket")):
            status = mgr.execs.result(sb, ex)
            await ws.send_str(json.dumps({"exit": status}))
            await ws.close()
        return ws
    finally:
        mgr.streams.discard(task)
        if ex is not None:
            ex.streaming = False
            # its own task: a second cancellation of this handler must not leave the terminal open
            await asyncio.shield(asyncio.ensure_future(_end(mgr, sb, ex)))


async def _end(mgr, sb, ex) -> None:
    """The client went away: the command and its session's jobs go with it, then the terminal is closed. In
    that order: a hangup first would end the shell (SIGHUP), and its jobs would outlive it."""
    try:
        if not ex.exited.done():
            await mgr.execs.kill(sb, ex, signal.SIGKILL, "killed", wait=True)
    finally:
        if ex.pty is not None:
            os.close(ex.pty)   # what still holds the terminal gets a hangup
            ex.pty = None


async def _first_message(ws: web.WebSocketResponse) -> dict:
    try:
        msg = await asyncio.wait_for(ws.receive(), PTY_START_TIMEOUT)
    except asyncio.TimeoutError:
        raise ConfigError(f"no exec body within {PTY_START_TIMEOUT:g} s; send it as the first (text) message.") from None
    if msg.type != WSMsgType.TEXT:
        raise ConfigError("the first message must be the exec's JSON body as text, like "
                          '{"argv": ["bash"], "pty": {"rows": 24, "cols": 80}}.')
    try:
        body = json.loads(msg.data)
    except ValueError as e:
        raise ConfigError(f"the first message is not JSON ({e}); send the exec's JSON body.") from None
    if not isinstance(body, dict):
        raise ConfigError("the exec body must be a JSON object.")
    return body


async def _pump(ws, sb, ex, mgr, sock) -> bool:
    """Move the terminal's bytes until the command has ended and its output is read (True), or the client
    went away (False)."""
    loop = asyncio.get_running_loop()
    master = ex.pty
    os.set_blocking(master, False)
    ending: dict = {}   # set "now" once the command ended and its window passed; "wait" is _output's readiness wait
    out = asyncio.create_task(_output(loop, ws, master, ending))
    inp = asyncio.create_task(_input(loop, ws, sb, ex, master, mgr))
    gone = asyncio.create_task(_hung_up(sock))
    client = {inp, gone}   # either ending means the client is gone
    try:
        await asyncio.wait({out, *client, ex.exited}, return_when=asyncio.FIRST_COMPLETED)
        if not any(t.done() for t in client) and not out.done():   # exited: what it wrote is still to come
            await asyncio.wait({out, *client}, timeout=DRAIN_AFTER_EXIT, return_when=asyncio.FIRST_COMPLETED)
            if not out.done() and not any(t.done() for t in client):
                # a background child holds the terminal, or the client is slow to take what the command wrote
                # before it ended (then _output still sends, or the loop has not run it): what the terminal holds
                # now is sent all the same, and _output ends when it finds nothing more to read
                ending["now"] = True
                if (wait := ending.get("wait")) is not None and not wait.done():
                    wait.set_result(None)
                await asyncio.wait({out, *client}, return_when=asyncio.FIRST_COMPLETED)
        elif out.done() and not any(t.done() for t in client):    # nothing holds the terminal: the exit follows
            await asyncio.wait({*client, ex.exited}, return_when=asyncio.FIRST_COMPLETED)
        if out.done() and out.exception() is not None:
            raise out.exception()
        return not any(t.done() for t in client) and ex.exited.done()
    finally:
        for t in (out, inp, gone):
            t.cancel()
        await asyncio.gather(out, inp, gone, return_exceptions=True)


async def _hung_up(sock) -> None:
    """Return once the client's end of the connection is closed. The WebSocket says so too, but not while
    its reading is paused (input the command does not read: flow control), when the close frame and the
    end of the stream wait behind that input; the socket's hang-up flags show through it."""
    if sock is None:
        await asyncio.Event().wait()
    poll = select.poll()
    poll.register(sock.fileno(), select.POLLRDHUP)   # POLLHUP and POLLERR are always reported
    while not poll.poll(0):
        await asyncio.sleep(HANG_UP_POLL)


async def _output(loop, ws, master: int, ending: dict) -> None:
    after = 0
    while True:
        try:
            data = os.read(master, READ_CHUNK)   # (a pty's read first flushes what the slave wrote to it)
        except BlockingIOError:
            if ending.get("now"):
                return
            ending["wait"] = _ready(loop, master, False)
            await ending["wait"]
            continue
        except OSError as e:
            if e.errno == errno.EIO:   # no slave open any more (the kernel's EOF of a pty)
                return
            raise
        if not data:
            return
        if ending.get("now"):
            after += len(data)
            if after > LAST_OUTPUT:
                return
        await ws.send_bytes(data)   # waits while the client is slow: backpressure on the terminal


async def _input(loop, ws, sb, ex, master: int, mgr) -> None:
    """Until the client closes: its bytes to the terminal, its resize and signal requests."""
    async for msg in ws:
        if msg.type == WSMsgType.BINARY:
            view = memoryview(msg.data)
            while view:
                try:
                    view = view[os.write(master, view):]
                except BlockingIOError:
                    await _ready(loop, master, True)
                except OSError as e:
                    if e.errno != errno.EIO:
                        raise
                    view = view[:0]   # nobody holds the terminal any more: input goes nowhere
            sb.touch()
        elif msg.type == WSMsgType.TEXT:
            await _control(ws, sb, ex, master, mgr, msg.data)
        else:
            return


async def _control(ws, sb, ex, master: int, mgr, text: str) -> None:
    try:
        d = json.loads(text)
        if not isinstance(d, dict):
            raise ValueError("not an object")
    except ValueError:
        d = {}
    if "resize" in d:
        size = d["resize"]
        if not (isinstance(size, list) and len(size) == 2):
            return await _refuse(ws, "resize must be [rows, cols], like [24, 80].")
        try:
            rows, cols = check_pty_dims(*size)
        except ConfigError as e:
            return await _refuse(ws, str(e))
        # the kernel tells the terminal's foreground process group (SIGWINCH)
        fcntl.ioctl(master, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
    elif "signal" in d:
        sig = d["signal"]
        if isinstance(sig, bool) or not isinstance(sig, int) or not 1 <= sig <= 64:
            return await _refuse(ws, f"signal={sig!r} must be a signal number, like 2 or 15.")
        await mgr.execs.kill(sb, ex, sig, "killed")
    else:
        await _refuse(ws, 'a control message is {"resize": [rows, cols]} or {"signal": N}.')


async def _refuse(ws, message: str) -> None:
    # a bad control message is answered, not fatal: the session goes on
    await ws.send_str(json.dumps({"error": "ConfigError", "message": message}))


def _ready(loop, fd: int, write: bool) -> asyncio.Future:
    fut = loop.create_future()
    add, remove = (loop.add_writer, loop.remove_writer) if write else (loop.add_reader, loop.remove_reader)

    def fire():
        remove(fd)
        if not fut.done():
            fut.set_result(None)

    add(fd, fire)
    fut.add_done_callback(lambda _f: remove(fd))
    return fut


__all__ = ["serve_pty"]
