"""`hutch run -it` and `hutch sandbox exec -it`: our terminal joined to a terminal in the sandbox.

The sandbox's pty is made inside it (Sandbox.exec(..., pty=...)); ours only carries bytes. In raw mode every
key (Ctrl-C, Ctrl-Z, arrows) goes to the sandbox's line discipline, and a SIGWINCH here becomes a resize there.
Nothing in the sandbox can reach this terminal but by writing to it (no TIOCSTI, no ioctl), and what a terminal
answers to the sandbox's queries goes back to the sandbox, not to the shell this was started from: input left
over when the session ends is flushed before our terminal is restored.
"""

from __future__ import annotations

import os
import select
import signal
import sys
import termios
import threading
import tty

from hutch._core import settings

DEFAULT_SIZE = (24, 80)


def local_size() -> tuple[int, int]:
    for fd in (0, 1, 2):
        try:
            cols, rows = os.get_terminal_size(fd)
        except OSError:
            continue
        if rows > 0 and cols > 0:
            return rows, cols
    return DEFAULT_SIZE


def pty_env(env: dict) -> dict:
    """Our TERM for the sandbox's programs (unless --env set one), so colours and keys match this terminal."""
    term = settings.TERM.get()
    return {"TERM": term, **env} if term and "TERM" not in env else env


def attach(p, interactive: bool) -> None:
    """Copy the sandbox's terminal to our stdout and (with `interactive`) our stdin to it, until its output ends."""
    raw = interactive and os.isatty(0)
    saved = termios.tcgetattr(0) if raw else None
    wake_r, wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
    old_winch = signal.signal(signal.SIGWINCH, lambda *_: _poke(wake_w)) if raw or os.isatty(1) else None
    stop = threading.Event()
    helper = _forward_input if interactive else _forward_resizes if old_winch is not None else None
    try:
        if raw:
            tty.setraw(0)
        if helper is not None:   # it owns wake_r from here on
            threading.Thread(target=helper, args=(p, wake_r, stop), daemon=True).start()
        else:
            os.close(wake_r)
        out = sys.stdout.buffer
        while data := p.read():
            out.write(data)
            out.flush()
        p.wait()
    finally:
        stop.set()
        _poke(wake_w)
        if old_winch is not None:
            signal.signal(signal.SIGWINCH, old_winch)
        if saved is not None:
            termios.tcflush(0, termios.TCIFLUSH)   # late answers to the sandbox's queries: not for our shell
            termios.tcsetattr(0, termios.TCSAFLUSH, saved)
        p.close()
        os.close(wake_w)


def _poke(fd: int) -> None:
    try:
        os.write(fd, b"\0")
    except OSError:
        pass


def _forward_input(p, wake_r: int, stop: threading.Event) -> None:
    try:
        while not stop.is_set():
            ready, _, _ = select.select([0, wake_r], [], [])
            if wake_r in ready:
                _drain(wake_r)
                if not stop.is_set():
                    p.resize(*local_size())
            if 0 in ready:
                data = os.read(0, 65536)
                if not data:   # our input ended: a terminal's end-of-file is Ctrl-D, typed in it
                    return
                p.write(data)
    except Exception:
        pass   # the command ended, or our stdin went away
    finally:
        os.close(wake_r)


def _forward_resizes(p, wake_r: int, stop: threading.Event) -> None:
    try:
        while not stop.is_set():
            select.select([wake_r], [], [])
            _drain(wake_r)
            if not stop.is_set():
                p.resize(*local_size())
    except Exception:
        pass
    finally:
        os.close(wake_r)


def _drain(fd: int) -> None:
    try:
        while os.read(fd, 512):
            pass
    except OSError:
        pass
