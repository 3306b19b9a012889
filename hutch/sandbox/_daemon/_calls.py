"""Exec and file calls into a running sandbox (a part of the Manager, kept apart for size)."""

from __future__ import annotations

import asyncio
import fcntl
import os
import secrets
import signal
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hutch._core.errors import ConfigError, NotFoundError, SandboxError, StateError
from hutch.sandbox._native._runtime import Channel, exec_env

PIPE_SIZE = 1 << 20

if TYPE_CHECKING:  # pragma: no cover
    from hutch.sandbox._daemon._manager import Sandbox


@dataclass
class Exec:
    eid: str
    argv: list[str]
    out_r: int
    err_r: int
    stdin_w: int | None
    oom_before: int
    exited: asyncio.Future
    reason: str | None = None          # set when the daemon ended it: timeout, killed, sandbox_ended
    timer: asyncio.TimerHandle | None = None




class Calls:
    """Mixed into Manager: needs self.cgroups."""

    # --- exec -----------------------------------------------------------------------------

    def _live(self, sb: Sandbox) -> Channel:
        if sb.status != "running" or sb.channel is None or sb.channel.closed:
            raise StateError(f"sandbox {sb.id} is {sb.status}, so it runs nothing more; create a new sandbox.")
        return sb.channel

    async def exec_start(self, sb: Sandbox, argv, env=None, workdir=None, timeout=None, stdin=False) -> Exec:
        ch = self._live(sb)
        if not isinstance(argv, list) or not argv or not all(isinstance(a, str) for a in argv):
            raise ConfigError(f"argv={argv!r} must be a non-empty list of strings, like ['python3', '-c', 'print(1)'].")
        if env is not None and not (isinstance(env, dict) and all(isinstance(k, str) and isinstance(v, str)
                                                                  for k, v in env.items())):
            raise ConfigError("env must map strings to strings.")
        if timeout is not None and (not isinstance(timeout, (int, float)) or timeout <= 0):
            raise ConfigError(f"timeout={timeout!r} must be a positive number of seconds, or null.")
        cwd = workdir or sb.spec.workdir
        if not isinstance(cwd, str) or not cwd.startswith("/"):
            raise ConfigError(f"workdir={cwd!r} must be an absolute path inside the sandbox.")
        sb.touch()
        out_r, out_w = os.pipe2(os.O_CLOEXEC)
        err_r, err_w = os.pipe2(os.O_CLOEXEC)
        for fd in (out_r, err_r):  # bigger pipes: fewer, larger reads and frames for bulky output
            try:
                fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, PIPE_SIZE)
            except OSError:
                pass
        in_r, in_w = os.pipe2(os.O_CLOEXEC) if stdin else (None, None)
        eid = secrets.token_hex(6)
        loop = asyncio.get_running_loop()
        ex = Exec(eid, argv, out_r, err_r, in_w, self.cgroups.oom_kills(sb.id), loop.create_future())
        sb.execs[eid] = ex  # before the request: its exit may arrive right behind the reply
        fds = ([in_r] if stdin else []) + [out_w, err_w]
        try:
            reply, _ = await ch.request({"op": "exec", "eid": eid, "argv": argv,
                                         "env": exec_env(sb.spec, sb.image, sb.hostname, env),
                                         "cwd": cwd, "streams": [bool(stdin), True, True]}, fds)
        except BaseException:
            sb.execs.pop(eid, None)
            _close(out_r, err_r, in_w)
            raise
        finally:
            _close(out_w, err_w, in_r)
        if not reply["ok"]:
            sb.execs.pop(eid, None)
            _close(out_r, err_r, in_w)
            raise _error(reply)
        if timeout:
            ex.timer = loop.call_later(timeout, lambda: loop.create_task(self.exec_kill(sb, ex, signal.SIGKILL, "timeout")))
        ex.exited.add_done_callback(lambda _f: (ex.timer and ex.timer.cancel(), sb.touch()))
        if len(sb.execs) > 256:  # forget finished execs, keep the recent ones for kill/stdin races
            for k in [k for k, e in sb.execs.items() if e.exited.done()][:128]:
                del sb.execs[k]
        return ex

    async def exec_kill(self, sb: Sandbox, ex: Exec, sig: int, reason: str = "killed") -> None:
        if ex.exited.done() or sb.channel is None or sb.channel.closed:
            return
        ex.reason = ex.reason or reason
        try:
            await sb.channel.notify({"op": "kill", "eid": ex.eid, "signal": int(sig)})
        except StateError:
            pass

    def exec_result(self, sb: Sandbox, ex: Exec) -> dict:
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

    def find_exec(self, sb: Sandbox, eid: str) -> Exec:
        ex = sb.execs.get(eid)
        if ex is None:
            raise NotFoundError(f"no exec {eid!r} in sandbox {sb.id}; use the X-Hutch-Exec-Id of a running exec.")
        return ex

    # --- files ----------------------------------------------------------------------------

    async def file_call(self, sb: Sandbox, op: str, path: str, **kw) -> tuple[dict, list[int]]:
        ch = self._live(sb)
        if not isinstance(path, str) or not path or "\0" in path:
            raise ConfigError(f"path={path!r} must be a path inside the sandbox, like '/home/user/a.txt'.")
        if not path.startswith("/"):
            path = os.path.join(sb.spec.workdir, path)  # relative paths start at the sandbox's workdir
        sb.touch()
        reply, fds = await ch.request({"op": op, "path": path, **kw})
        if not reply["ok"]:
            _close(*fds)
            raise _error(reply)
        return reply, fds




def _close(*fds) -> None:
    for fd in fds:
        if fd is not None and fd >= 0:
            try:
                os.close(fd)
            except OSError:
                pass


def _error(reply: dict) -> Exception:
    from hutch._core import errors

    cls = getattr(errors, reply.get("error", ""), None)
    if not (isinstance(cls, type) and issubclass(cls, errors.Error)):
        cls = SandboxError
    return cls(reply.get("message") or "the sandbox refused the call.")


__all__ = ["Calls", "Exec"]
