"""A persistent shell in a sandbox, for bash tools: the working directory, variables and functions persist
from one command to the next, as in a terminal. Framework-free (used by the Anthropic adapter).

One `bash` (or `sh` where the image has no bash) runs for the session; each command is sent on its stdin
wrapped as `{ CMD\n} </dev/null 2>&1; printf '\\n<nonce>%d\\n' $?`, and its output is read up to that line
(the nonce is new for every command, and written split, so neither a command's output nor the echo of the
input can forge it). A command that outlives its timeout ends the shell (the next one starts afresh and
says so); so does `exit`. Output beyond MAX_OUTPUT is dropped from the front (the end is what a model needs).
"""

from __future__ import annotations

import queue
import threading
import time
import uuid
from dataclasses import dataclass

import hutch
from hutch.integrations._common import DEFAULT_TIMEOUT, MAX_OUTPUT


@dataclass(frozen=True)
class ShellResult:
    output: str
    exit_code: int | None      # None: the command did not finish (timed out, or the shell ended)
    note: str = ""             # what happened to the shell, for the model

    def text(self) -> str:
        return "\n".join(x for x in (self.output, self.note) if x)


def _pump(stream, q: queue.Queue) -> None:
    try:
        for line in stream:
            q.put(line)
    except hutch.Error:
        pass   # the sandbox or the daemon went away: the end of the stream, as far as we are concerned
    finally:
        q.put(None)


class Shell:
    """`run(command, timeout=)` -> ShellResult in one long-lived shell of `sandbox`; `restart()`, `close()`."""

    def __init__(self, sandbox) -> None:
        self.sandbox = sandbox
        self._p = None
        self._q: queue.Queue | None = None
        self._lock = threading.Lock()

    def _start(self) -> None:
        try:
            self._p = self.sandbox.exec("bash", "--noprofile", "--norc", stdin=True, text=False, stderr=False,
                                        env={"PS1": "", "PS2": "", "TERM": "dumb"})
        except hutch.NotFoundError:   # an image without bash (busybox): its sh does the same job
            self._p = self.sandbox.exec("sh", stdin=True, text=False, stderr=False,
                                        env={"PS1": "", "PS2": "", "TERM": "dumb"})
        self._p.stdin.write(b"exec 2>&1\n")
        self._q = queue.Queue(maxsize=32)   # a full queue stops the reader: the sandbox's writer then blocks
        threading.Thread(target=_pump, args=(self._p.stdout, self._q), name="hutch-shell", daemon=True).start()

    def close(self) -> None:
        """End the shell (the sandbox stays). Harmless if there is none."""
        with self._lock:
            self._close()

    def _close(self) -> None:
        p, self._p = self._p, None
        if p is not None:
            try:
                p.kill()
            except hutch.Error:
                pass

    def restart(self) -> None:
        with self._lock:
            self._close()
            self._start()

    def run(self, command: str, *, timeout: float = DEFAULT_TIMEOUT) -> ShellResult:
        with self._lock:
            note = ""
            if self._p is not None and self._p.poll() is not None:
                self._close()
                note = "(the previous shell had ended; this command ran in a new one: cwd and variables were reset)"
            if self._p is None:
                self._start()
            nonce = f"__HUTCH_{uuid.uuid4().hex}__"
            marker = nonce.encode()
            wrapped = f"{{ {command}\n}} </dev/null 2>&1; printf '\\n{nonce[:8]}''{nonce[8:]}%d\\n' $?\n"
            try:
                self._p.stdin.write(wrapped.encode())
            except hutch.Error as e:
                self._close()
                raise hutch.StateError(f"the shell could not take the command ({e}); run it again.") from e
            out, kept, dropped = [], 0, 0
            deadline = time.monotonic() + timeout
            while True:
                try:
                    line = self._q.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    self._close()
                    return self._result(out, dropped, None, f"(timed out after {timeout:g} s: the shell was "
                                                            "ended; the next command starts a new one)", note)
                if line is None:
                    self._close()
                    return self._result(out, dropped, None, "(the shell exited; the next command starts a new one)",
                                        note)
                if line.startswith(marker):
                    code = line[len(marker):].strip()
                    return self._result(out, dropped, int(code) if code.lstrip(b"-").isdigit() else None, "", note)
                out.append(line)
                kept += len(line)
                while kept > MAX_OUTPUT and len(out) > 1:   # keep the end
                    kept -= len(out[0])
                    dropped += len(out.pop(0))

    @staticmethod
    def _result(lines: list[bytes], dropped: int, code: int | None, why: str, note: str) -> ShellResult:
        text = b"".join(lines).decode("utf-8", errors="replace")
        text = text.rstrip("\n")[-MAX_OUTPUT:]   # with the newline printf put before the marker
        if dropped:
            text = f"[{dropped:,} bytes of output before this were dropped]\n" + text
        return ShellResult(text, code, " ".join(x for x in (note, why) if x))
