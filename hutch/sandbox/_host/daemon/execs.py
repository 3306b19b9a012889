"""Exec and file calls into a running sandbox: `Execs`, the part of the daemon that runs commands in
sandboxes and tracks them until they end (the Manager holds one and tells it of the init's exit events).

A command's record (`Exec`) lives in its sandbox's record (`LiveSandbox.exec_records`) as long as that does, so
a client may still ask how a command ended after its sandbox has.
"""

from __future__ import annotations

import asyncio
import fcntl
import math
import os
import secrets
import signal
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hutch._core import errors
from hutch._core.errors import ConfigError, NotFoundError, SandboxError, StateError
from hutch.sandbox._host.native.runtime import Channel, exec_env
from hutch.sandbox._api import PTY_DEFAULT_SIZE, check_pty_dims
from hutch.sandbox._spec import EXEC_USERS, SANDBOX_USER_ID

PIPE_SIZE = 1 << 20

if TYPE_CHECKING:  # pragma: no cover
    from hutch.sandbox._host.daemon.manager import LiveSandbox


@dataclass
class Exec:
    eid: str
    argv: list[str]
    out_r: int | None                  # None: the command's stdout is /dev/null (exec with stdout=false)
    err_r: int | None
    stdin_w: int | None
    oom_before: int
    exited: asyncio.Future
    max_output: int | None = None      # bytes of each stream sent to the client; the rest is read and dropped
    reason: str | None = None          # set when the daemon ended it: timeout, killed, sandbox_ended
    timer: asyncio.TimerHandle | None = None
    streaming: bool = True             # its output response is still open (the record is kept for /wait)
    result: dict | None = None         # how it ended, worked out once (the OOM check reads a counter)
    pty: int | None = None             # its terminal's master (a pty of the sandbox's devpts), else None


def live_channel(sb: LiveSandbox) -> Channel:
    """The channel to a running (or paused) sandbox's init; StateError once it runs nothing more."""
    if sb.status not in ("running", "paused") or sb.channel is None or sb.channel.closed:
        raise StateError(f"sandbox {sb.id} is {sb.status}, so it runs nothing more; create a new sandbox.")
    return sb.channel


class Execs:
    """Starts, signals and reports the commands of running sandboxes, and does their file calls.

    `cgroups` (native/cgroups.Cgroups) tells an OOM kill from another SIGKILL; `resume` (the Manager's) wakes a
    paused sandbox before a call runs something in it."""

    def __init__(self, cgroups, resume):
        self.cgroups = cgroups
        self.resume = resume

    # --- exec -----------------------------------------------------------------------------

    async def start(self, sb: LiveSandbox, argv, env=None, workdir=None, timeout=None, stdin=False,
                    stdout=True, stderr=True, max_output=None, user="root", pty=None) -> Exec:
        """Start `argv` in `sb`. `pty` ({"rows", "cols"}): on a terminal of its own, made inside the sandbox,
        whose master the record holds (`Exec.pty`) instead of pipes."""
        ch = live_channel(sb)
        await self.resume(sb)
        size = _pty_size(pty) if pty is not None else None
        if not isinstance(argv, list) or not argv or not all(isinstance(a, str) for a in argv):
            raise ConfigError(f"argv={argv!r} must be a non-empty list of strings, like ['python3', '-c', 'print(1)'].")
        if env is not None and not (isinstance(env, dict) and all(isinstance(k, str) and isinstance(v, str)
                                                                  for k, v in env.items())):
            raise ConfigError("env must map strings to strings.")
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                    or not 0 < timeout < math.inf):
            raise ConfigError(f"timeout={timeout!r} must be a positive, finite number of seconds, or null.")
        if not (isinstance(stdout, bool) and isinstance(stderr, bool)):
            raise ConfigError("stdout and stderr must be true (a pipe) or false (the command gets /dev/null).")
        if max_output is not None and (isinstance(max_output, bool) or not isinstance(max_output, int) or max_output < 0):
            raise ConfigError(f"max_output={max_output!r} must be a number of bytes per stream (0 or more), or null.")
        if user not in EXEC_USERS:
            raise ConfigError(f"user={user!r} must be one of {', '.join(EXEC_USERS)}.")
        if user == "user" and not sb.userns:
            raise ConfigError(f"sandbox {sb.id} runs without a user namespace (HUTCH_USERNS=0, or a kernel that "
                              "cannot idmap its image), where its uid 1000 would be the host's uid 1000, a real "
                              "account that could reach it; exec as root there (it has no capabilities either).")
        cwd = workdir or sb.spec.workdir
        if not isinstance(cwd, str) or not cwd.startswith("/"):
            raise ConfigError(f"workdir={cwd!r} must be an absolute path inside the sandbox.")
        sb.touch()
        if size is not None:   # the terminal is its stdin, stdout and stderr
            stdin, stdout, stderr = False, False, False
        out_r, out_w = _output_pipe() if stdout else (None, None)
        err_r, err_w = _output_pipe() if stderr else (None, None)
        in_r, in_w = os.pipe2(os.O_CLOEXEC) if stdin else (None, None)
        eid = secrets.token_hex(6)
        loop = asyncio.get_running_loop()
        ex = Exec(eid, argv, out_r, err_r, in_w, self.cgroups.oom_kills(sb.id), loop.create_future(), max_output)
        sb.exec_records[eid] = ex  # before the request: its exit may arrive right behind the reply
        fds = [fd for fd in (in_r, out_w, err_w) if fd is not None]
        cmd_env = exec_env(sb.spec, sb.image, sb.hostname, {**sb.egress_env, **(env or {})})
        msg = {"op": "exec", "eid": eid, "argv": argv, "env": cmd_env, "cwd": cwd,
               "streams": [bool(stdin), stdout, stderr], "uid": SANDBOX_USER_ID if user == "user" else 0}
        if size is not None:
            cmd_env.setdefault("TERM", "xterm-256color")
            msg["pty"] = list(size)
        rfds: list[int] = []
        try:
            reply, rfds = await ch.request(msg, fds)
        except BaseException:
            sb.exec_records.pop(eid, None)
            _close(out_r, err_r, in_w)
            raise
        finally:
            _close(out_w, err_w, in_r)
        if not reply["ok"] or (size is not None and len(rfds) != 1):
            sb.exec_records.pop(eid, None)
            _close(out_r, err_r, in_w, *rfds)
            raise error_from_reply(reply) if not reply["ok"] else SandboxError("the sandbox's init sent no terminal.")
        if size is not None:
            ex.pty = rfds[0]
        else:
            _close(*rfds)
        if timeout:
            ex.timer = loop.call_later(timeout, lambda: loop.create_task(self.kill(sb, ex, signal.SIGKILL, "timeout")))
        ex.exited.add_done_callback(lambda _f: (ex.timer and ex.timer.cancel(), sb.touch()))
        if len(sb.exec_records) > 256:  # forget finished execs, keep the recent ones for kill/stdin races
            for k in [k for k, e in sb.exec_records.items() if e.exited.done() and not e.streaming][:128]:
                del sb.exec_records[k]
        return ex

    async def kill(self, sb: LiveSandbox, ex: Exec, sig: int, reason: str = "killed", wait: bool = False) -> None:
        """Signal the command (its process group; a terminal's whole session for SIGKILL), resuming a paused
        sandbox first, as every call that acts in it does. `wait`: until the init has sent the signals."""
        if ex.exited.done() or sb.channel is None or sb.channel.closed:
            return
        ex.reason = ex.reason or reason
        if sb.status == "paused":   # frozen, it would take the signal only once resumed (and runsc hangs on it)
            await self.resume(sb)
        msg = {"op": "kill", "eid": ex.eid, "signal": int(sig)}
        if ex.pty is not None and sig == signal.SIGKILL:   # ending a terminal's command ends its session's jobs
            msg["session"] = True
        try:
            if wait:
                await sb.channel.request(msg)
            else:
                await sb.channel.notify(msg)
        except StateError:
            pass

    def result(self, sb: LiveSandbox, ex: Exec) -> dict:
        """How an ended command ended: {"returncode", "reason"}, worked out once."""
        if ex.result is None:
            ex.result = self._result(sb, ex)
        return ex.result

    def _result(self, sb: LiveSandbox, ex: Exec) -> dict:
        st = ex.exited.result()
        code = os.waitstatus_to_exitcode(st)
        if ex.reason:
            reason = ex.reason
        elif os.WIFSIGNALED(st) and os.WTERMSIG(st) == signal.SIGKILL and self.cgroups.oom_kills(sb.id) > ex.oom_before:
            reason = "oom"
        elif os.WIFSIGNALED(st):
            reason = "signaled"
        else:
            reason = "exited"
        return {"returncode": code, "reason": reason}

    def find(self, sb: LiveSandbox, eid: str) -> Exec:
        ex = sb.exec_records.get(eid)
        if ex is None:
            raise NotFoundError(f"no exec {eid!r} in sandbox {sb.id}; use the X-Hutch-Exec-Id of a running exec.")
        return ex

    def exited(self, sb: LiveSandbox, eid: str, status: int) -> None:
        """The init reports that command `eid` ended with wait status `status`."""
        ex = sb.exec_records.get(eid)
        if ex is not None and not ex.exited.done():
            ex.exited.set_result(status)
        sb.touch()

    def busy(self, sb: LiveSandbox) -> bool:
        """Whether a command of `sb` still runs (an idle timeout waits for it)."""
        return any(not ex.exited.done() for ex in sb.exec_records.values())

    def sandbox_ended(self, sb: LiveSandbox) -> None:
        """`sb` is gone: every command still running ended with it (killed, reason sandbox_ended)."""
        for ex in sb.exec_records.values():
            if not ex.exited.done():
                ex.reason = ex.reason or "sandbox_ended"
                ex.exited.set_result(signal.SIGKILL)  # a wait status: killed by SIGKILL

    # --- files ----------------------------------------------------------------------------

    async def file_call(self, sb: LiveSandbox, op: str, path: str, **kw) -> tuple[dict, list[int]]:
        ch = live_channel(sb)
        await self.resume(sb)
        if not isinstance(path, str) or not path or "\0" in path:
            raise ConfigError(f"path={path!r} must be a path inside the sandbox, like '/home/user/a.txt'.")
        if not path.startswith("/"):
            path = os.path.join(sb.spec.workdir, path)  # relative paths start at the sandbox's workdir
        sb.touch()
        reply, fds = await ch.request({"op": op, "path": path, **kw})
        if not reply["ok"]:
            _close(*fds)
            raise error_from_reply(reply)
        return reply, fds


def _pty_size(pty) -> tuple[int, int]:
    """A pty request {"rows", "cols"} -> (rows, cols), checked as the SDK checks them."""
    if not isinstance(pty, dict):
        raise ConfigError(f"pty={pty!r} must be an object {{\"rows\": 24, \"cols\": 80}} (the terminal's size).")
    return check_pty_dims(pty.get("rows", PTY_DEFAULT_SIZE[0]), pty.get("cols", PTY_DEFAULT_SIZE[1]))


def _output_pipe() -> tuple[int, int]:
    r, w = os.pipe2(os.O_CLOEXEC)
    try:  # bigger pipes: fewer, larger reads and frames for bulky output
        fcntl.fcntl(r, fcntl.F_SETPIPE_SZ, PIPE_SIZE)
    except OSError:
        pass
    return r, w


def _close(*fds) -> None:
    for fd in fds:
        if fd is not None and fd >= 0:
            try:
                os.close(fd)
            except OSError:
                pass


def error_from_reply(reply: dict) -> Exception:
    """The error an init's {"ok": false, "error", "message"} reply stands for (SandboxError if unknown)."""
    cls = getattr(errors, reply.get("error", ""), None)
    if not (isinstance(cls, type) and issubclass(cls, errors.Error)):
        cls = SandboxError
    return cls(reply.get("message") or "the sandbox refused the call.")


__all__ = ["Exec", "Execs", "error_from_reply", "live_channel"]
