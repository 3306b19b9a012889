"""The HTTP wire format (docs/api.md), I/O-free: the contract of the SDK and the daemon.

The daemon frames exec output with these kinds and this header and reports these statuses; the SDK's sync
and async shells (sandbox.py, aio.py) share the rest: frame decoding, error mapping, turning daemon
answers into values, and incremental text decoding of output streams.
"""

from __future__ import annotations

import codecs
import json
import struct
from dataclasses import dataclass, field
from typing import Any

from hutch._core import errors

# Frame kinds of an exec output stream.
STDOUT, STDERR, EXIT = 1, 2, 3
#: Bytes of each stream `run()` keeps unless told otherwise (`max_output=`); the rest is counted and dropped.
DEFAULT_MAX_OUTPUT = 4 << 20
#: Unread output an exec handle holds per stream; at this much it stops reading from the daemon, so the
#: command blocks in its pipe until `p.stdout` / `p.stderr` are read (flow control, as with OS pipes).
OUTPUT_BUFFER = 2 << 20
WAIT_POLL = 30.0   # seconds per long-poll request of a wait() (of a sandbox, or of a command's exit)
_HEADER = struct.Struct(">BI")
FRAMES_CONTENT_TYPE = "application/x-hutch-frames"
#: An exec on a terminal is a WebSocket on this route; its first message, the exec's body, is due within
#: PTY_START_TIMEOUT seconds (docs/api.md, "Terminals").
PTY_ROUTE = "/v1/sandboxes/{id}/exec/pty"
PTY_START_TIMEOUT = 10.0
PTY_DEFAULT_SIZE = (24, 80)
PTY_MAX_SIZE = 0xFFFF   # rows and columns: what struct winsize holds

# Statuses after which a sandbox runs nothing more.
ENDED = frozenset({"exited", "terminated", "timeout", "idle_timeout", "oom", "failed", "lost"})


class SandboxState:
    """The state properties Sandbox and AsyncSandbox share. `status`, `reason` and `returncode` ask the daemon
    when read, until the sandbox has ended (an ended sandbox never changes again); the rest is its last answer."""

    _info: dict

    def _fetch_info(self) -> dict:   # a blocking GET /v1/sandboxes/{id}; each shell supplies it
        raise NotImplementedError

    def _fresh(self) -> dict:
        if self._info.get("status", "running") not in ENDED:
            try:
                self._info = self._fetch_info()
            except errors.SandboxLostError:   # its fleet node is gone, and it with it
                self._info = {**self._info, "status": "lost"}
        return self._info

    @property
    def info(self) -> dict:
        """The daemon's last answer about this sandbox (id, name, tags, status, returncode, times, spec)."""
        return dict(self._info)

    @property
    def name(self) -> "str | None":
        return self._info.get("name")

    @property
    def tags(self) -> dict:
        return dict(self._info.get("tags") or {})

    @property
    def status(self) -> str:
        """The daemon's status of it now: starting, running, paused, exited, terminated, timeout, idle_timeout, oom
        or failed; "lost" when the fleet node that ran it is gone (docs/fleet.md)."""
        return self._fresh().get("status", "running")

    @property
    def reason(self) -> "str | None":
        """Why it ended, None while it runs: exited (its command ended), terminated, timeout, idle_timeout, oom
        (its main process was killed at the memory limit) or failed."""
        status = self.status
        return status if status in ENDED else None

    @property
    def returncode(self) -> "int | None":
        """Its command's exit code once it has ended (None without a command, or while it runs)."""
        return self._fresh().get("returncode")


class FrameDecoder:
    """Split a byte stream into (kind, payload) frames: 1 byte kind, 4 bytes big-endian length, payload."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[tuple[int, bytes]]:
        self._buf += data
        out = []
        while len(self._buf) >= _HEADER.size:
            kind, n = _HEADER.unpack_from(self._buf)
            end = _HEADER.size + n
            if len(self._buf) < end:
                break
            out.append((kind, bytes(self._buf[_HEADER.size:end])))
            del self._buf[:end]
        return out

    @property
    def pending(self) -> int:
        """Bytes of an incomplete frame still buffered."""
        return len(self._buf)


def encode_frame(kind: int, payload: bytes) -> bytes:
    """One frame of exec output: kind (STDOUT, STDERR, EXIT), length, payload."""
    return _HEADER.pack(kind, len(payload)) + payload


def error_from_answer(status: int, body: bytes) -> errors.Error:
    """Map a daemon error answer `{"error": ClassName, "message": ...}` to the hutch.Error subclass of that name."""
    try:
        d = json.loads(body)
        name, message = d["error"], d["message"]
    except (ValueError, KeyError, TypeError):
        text = body[:300].decode("utf-8", "replace").strip()
        return errors.DaemonError(
            f"the hutch daemon answered HTTP {status} without a hutch error body ({text!r}); "
            "check that HUTCH_URL or HUTCH_SOCKET points at a hutch daemon."
        )
    cls = getattr(errors, str(name), None)
    if not (isinstance(cls, type) and issubclass(cls, errors.Error)):
        cls = errors.DaemonError
    if cls is errors.ExecError:
        return errors.ExecError(str(message))
    if cls is errors.QuotaExceededError:
        return cls(str(message), quota=d.get("quota"), limit=d.get("limit"), used=d.get("used"))
    return cls(str(message))


@dataclass(frozen=True)
class ExitStatus:
    """How an exec'd command ended: its returncode and why (exited, signaled, timeout, oom, killed, sandbox_ended)."""

    returncode: int
    reason: str
    stdout_dropped: int = 0   # bytes the daemon read and dropped beyond the exec's max_output
    stderr_dropped: int = 0

    @classmethod
    def from_payload(cls, payload: bytes) -> "ExitStatus":
        d = json.loads(payload)
        return cls(int(d["returncode"]), str(d.get("reason", "exited")),
                   int(d.get("stdout_dropped", 0)), int(d.get("stderr_dropped", 0)))


@dataclass(frozen=True)
class ExecResult:
    """A finished command: what `Sandbox.run` returns and what `hutch.ExecError` carries."""

    argv: tuple[str, ...]
    returncode: int
    stdout: str | bytes
    stderr: str | bytes
    reason: str = "exited"
    stdout_dropped: int = 0   # bytes of stdout beyond run(max_output=), dropped
    stderr_dropped: int = 0

    @property
    def truncated(self) -> bool:
        """True if run() dropped output beyond its max_output (see stdout_dropped / stderr_dropped)."""
        return bool(self.stdout_dropped or self.stderr_dropped)

    def check(self, sandbox: "dict | None" = None) -> "ExecResult":
        """Return self if the command exited 0, else raise what says why, carrying this result:
        hutch.OutOfMemoryError (killed at the memory limit), hutch.SandboxTimeout (it, or its sandbox, ran past
        a timeout), else hutch.ExecError. `sandbox`: the sandbox's info, to tell why it ended under the command."""
        if self.returncode == 0 and self.reason == "exited":
            return self
        why, _code, cls = command_end(self.reason, self.returncode, sandbox)
        err = _tail(self.stderr)
        cut = (f" (output truncated: {self.stdout_dropped} bytes of stdout and {self.stderr_dropped} of stderr "
               "dropped beyond max_output)") if self.truncated else ""
        head = f"command {list(self.argv)} " + (why or f"exited with code {self.returncode} ({self.reason})")
        raise cls(
            head + (f"; stderr ends with: {err!r}" if err else "") + cut
            + ". Fix the command, or call run() with check=False to get the result without raising.",
            argv=self.argv, stdout=self.stdout, stderr=self.stderr, returncode=self.returncode,
            stdout_dropped=self.stdout_dropped, stderr_dropped=self.stderr_dropped, reason=self.reason,
            sandbox_id=(sandbox or {}).get("id"), sandbox_status=(sandbox or {}).get("status"),
        )


# How the CLI exits when a command or sandbox did not end by itself (documented in README.md):
EXIT_TIMEOUT = 124        # as coreutils' timeout(1)
EXIT_OOM = 137            # 128 + SIGKILL, as Docker reports an OOM-killed container
EXIT_SIGNAL_BASE = 128    # killed by signal N: 128 + N, as a shell does


def _mib(n) -> str:
    return f"{n / 2**20:.0f} MiB" if isinstance(n, (int, float)) else "its limit"


def _secs(x) -> str:
    return f"{x:g} s" if isinstance(x, (int, float)) else "its timeout"


def sandbox_end(info: dict) -> "tuple[str | None, int, type]":
    """Why a sandbox ended, from its info: (a sentence, or None for a command that exited by itself; the CLI's
    exit code; the hutch error class that says so)."""
    status, spec = info.get("status"), info.get("spec") or {}
    rc = info.get("returncode")
    if status == "exited":
        return None, rc if isinstance(rc, int) and rc >= 0 else EXIT_SIGNAL_BASE - (rc or 0), errors.ExecError
    if status == "timeout":
        return (f"the sandbox ran past its timeout of {_secs(spec.get('timeout'))} and was ended; "
                "give it a longer timeout (timeout=, --timeout)"), EXIT_TIMEOUT, errors.SandboxTimeout
    if status == "idle_timeout":
        return (f"the sandbox was idle for {_secs(spec.get('idle_timeout'))} and was ended (idle_timeout=, "
                "--idle-timeout)"), EXIT_TIMEOUT, errors.SandboxTimeout
    if status == "oom":
        return (f"the sandbox was ended: out of memory (its limit is {_mib((spec.get('limits') or {}).get('memory'))};"
                " give it more with memory=, --memory)"), EXIT_OOM, errors.OutOfMemoryError
    if status == "terminated":
        return "the sandbox was terminated", EXIT_SIGNAL_BASE + 9, errors.ExecError
    if status == "lost":
        return ("the sandbox is lost: the fleet node that ran it is gone, and it with it",
                EXIT_SIGNAL_BASE + 9, errors.SandboxLostError)
    return (f"the sandbox failed ({status}): its init died; see the daemon's log", EXIT_SIGNAL_BASE + 9,
            errors.ExecError)


def command_end(reason: str, returncode: int, sandbox: "dict | None" = None) -> "tuple[str | None, int, type]":
    """Why a command ended (its exec `reason`, see docs/api.md): (a sentence, or None if it exited by itself;
    the CLI's exit code; the hutch error class that says so). `sandbox`: its sandbox's info, which says why the
    sandbox ended under it (reason sandbox_ended) and holds the limits the sentence names."""
    spec = (sandbox or {}).get("spec") or {}
    sig = -returncode if returncode < 0 else 9
    if reason == "exited":
        return None, returncode, errors.ExecError
    if reason == "oom":
        return (f"was killed: out of memory (its sandbox's limit is {_mib((spec.get('limits') or {}).get('memory'))};"
                " give it more with memory=, --memory)"), EXIT_OOM, errors.OutOfMemoryError
    if reason == "timeout":
        return ("ran past its timeout and was killed; give it a longer one (exec timeout=, --timeout of "
                "`hutch sandbox exec`)"), EXIT_TIMEOUT, errors.SandboxTimeout
    if reason == "killed":
        return f"was killed (signal {sig}) by a kill() call", EXIT_SIGNAL_BASE + sig, errors.ExecError
    if reason == "signaled":
        return f"was killed by signal {sig} ({_signame(sig)})", EXIT_SIGNAL_BASE + sig, errors.ExecError
    if reason == "sandbox_ended" and sandbox and sandbox.get("status") in ENDED:
        why, code, cls = sandbox_end(sandbox)
        return f"was killed because {why}", code, cls
    return "was killed because its sandbox ended", EXIT_SIGNAL_BASE + sig, errors.ExecError


def _signame(n: int) -> str:
    import signal

    try:
        return signal.Signals(n).name
    except ValueError:
        return f"signal {n}"


@dataclass(frozen=True)
class NetworkLog:
    """What `Sandbox.network_log()` returns: the egress decisions kept, and counts of all of them.

    Iterating (or indexing) it walks `decisions`, dicts of time, name, address, port, protocol (dns,
    tls, http, tcp, policy), verdict (allow, deny) and reason, oldest first. Refusals and policy
    changes are kept apart from allowed decisions; what was not kept is counted:

    - `seen` / `dropped`: per kind (allowed, refused, policy), the decisions made / those not in
      `decisions` (over the log's rate limit, or pushed out by newer ones of the same kind);
    - `refusals_by_reason` / `refusals_by_target`: every refusal counted by reason (protocol, reason,
      count, first, last, last_target) and by the name or address refused (protocol, target, count,
      first, last, last_reason); a row with reason (target) None counts all beyond the first ones;
    - `limits`: what the resolver's and the proxy's per-sandbox limits held back, by limit.
    """

    decisions: tuple[dict, ...] = ()
    seen: dict = field(default_factory=dict)
    dropped: dict = field(default_factory=dict)
    refusals_by_reason: tuple[dict, ...] = ()
    refusals_by_target: tuple[dict, ...] = ()
    limits: dict = field(default_factory=dict)

    @classmethod
    def from_json(cls, d: dict) -> "NetworkLog":
        return cls(tuple(d.get("decisions", ())), dict(d.get("seen") or {}), dict(d.get("dropped") or {}),
                   tuple(d.get("refusals_by_reason", ())), tuple(d.get("refusals_by_target", ())),
                   dict(d.get("limits") or {}))

    def __iter__(self):
        return iter(self.decisions)

    def __len__(self) -> int:
        return len(self.decisions)

    def __getitem__(self, i):
        return self.decisions[i]


def _tail(s: str | bytes, n: int = 200) -> str:
    if isinstance(s, bytes):
        s = s.decode("utf-8", "replace")
    return s.strip()[-n:]


def check_max_output(max_output) -> "int | None":
    """run(max_output=): a positive number of bytes per stream, or None to keep everything."""
    if max_output is not None and (isinstance(max_output, bool) or not isinstance(max_output, int) or max_output <= 0):
        raise errors.InvalidSpecError(
            f"max_output={max_output!r} must be a positive number of bytes kept per stream (e.g. 1 << 20), "
            "or None to keep all of the output."
        )
    return max_output


def exec_body(argv, *, timeout=None, workdir=None, env=None, stdin=False, stdout=True, stderr=True,
              max_output=None, user="root") -> dict[str, Any]:
    """Validate exec arguments and build the JSON body of POST /v1/sandboxes/{id}/exec."""
    args = tuple(argv)
    if not args:
        raise errors.InvalidSpecError("exec() needs a command: pass argv as strings, e.g. exec('ls', '-l').")
    for a in args:
        if not isinstance(a, str):
            raise errors.InvalidSpecError(f"exec argument {a!r} is not a string; pass argv as strings, not a shell line.")
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0):
        raise errors.InvalidSpecError(f"timeout={timeout!r} must be a positive number of seconds, or None.")
    if workdir is not None and (not isinstance(workdir, str) or not workdir.startswith("/")):
        raise errors.InvalidSpecError(f"workdir={workdir!r} must be an absolute path inside the sandbox, like '/tmp'.")
    envd = {}
    for k, v in (env or {}).items():
        if not isinstance(k, str) or not isinstance(v, str) or not k or "=" in k:
            raise errors.InvalidSpecError(f"env entry {k!r}: {v!r} must map a variable name to a str value.")
        envd[k] = v
    for name, v in (("stdout", stdout), ("stderr", stderr)):
        if not isinstance(v, bool):
            raise errors.InvalidSpecError(f"{name}={v!r} must be True (a pipe to read) or False (discarded: /dev/null).")
    body = {"argv": list(args), "env": envd, "workdir": workdir,
            "timeout": None if timeout is None else float(timeout), "stdin": bool(stdin)}
    if not (stdout and stderr):
        body["stdout"], body["stderr"] = stdout, stderr
    if check_max_output(max_output) is not None:
        body["max_output"] = max_output
    if user not in ("root", "user"):
        raise errors.InvalidSpecError(f"user={user!r} must be 'root' (the sandbox's root, without capabilities) or "
                                      "'user' (its unprivileged user, uid 1000).")
    if user != "root":   # only when said: a daemon of an earlier version knows no such field
        body["user"] = user
    return body


def pty_size(pty) -> "tuple[int, int]":
    """exec(pty=...) -> (rows, cols): True for 24 x 80, or a (rows, cols) pair."""
    if pty is True:
        return PTY_DEFAULT_SIZE
    if isinstance(pty, (tuple, list)) and len(pty) == 2:
        return check_pty_dims(*pty)
    raise errors.InvalidSpecError(f"pty={pty!r} must be True (a 24 x 80 terminal) or (rows, cols), like (40, 120).")


def check_pty_dims(rows, cols) -> "tuple[int, int]":
    for name, v in (("rows", rows), ("cols", cols)):
        if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= PTY_MAX_SIZE:
            raise errors.InvalidSpecError(f"{name}={v!r} must be a whole number from 1 to {PTY_MAX_SIZE} "
                                          "(a terminal's size).")
    return rows, cols


def pty_body(argv, *, size, timeout=None, workdir=None, env=None, user="root") -> dict[str, Any]:
    """The first message of an exec on a terminal: exec_body's checks, and the terminal's size."""
    body = exec_body(argv, timeout=timeout, workdir=workdir, env=env, user=user)
    del body["stdin"]
    body["pty"] = {"rows": size[0], "cols": size[1]}
    return body


def pty_message(text: str) -> dict:
    """A daemon's text message on a terminal: {"eid"}, {"exit": {returncode, reason}} or {"error", "message"}."""
    try:
        d = json.loads(text)
    except ValueError:
        d = None
    if not isinstance(d, dict):
        raise errors.DaemonError(f"the daemon sent a terminal message that is not a JSON object ({text[:200]!r}).")
    return d


def stdin_payload(stdin) -> tuple[bool, bytes | None]:
    """exec(stdin=...) -> (open a stdin pipe?, bytes to send then close, or None to leave it open).

    True: a pipe the caller writes with `p.stdin.write()` and closes; False: no input (EOF);
    bytes or str: sent, then closed.
    """
    if stdin is True:
        return True, None
    if stdin is False or stdin is None:
        return False, None
    if isinstance(stdin, str):
        return True, stdin.encode()
    if isinstance(stdin, (bytes, bytearray, memoryview)):
        return True, bytes(stdin)
    raise errors.InvalidSpecError(f"stdin={stdin!r} must be True (a pipe), False (no input), or the bytes/str to send.")


def terminated_error(sandbox_id: str, info: dict) -> errors.Error:
    if info.get("status") == "lost":
        return errors.SandboxLostError(f"sandbox {sandbox_id} is lost: the fleet node that ran it is gone, and it "
                                       "with it. Create a new one.")
    why = sandbox_end(info)[0] or f"its command exited with code {info.get('returncode')}"
    return errors.StateError(
        f"sandbox {sandbox_id} has ended (status {info.get('status')!r}: {why}); it runs nothing more. "
        "Create a new one with hutch.Sandbox.create()."
    )


def tag_params(tags) -> list[tuple[str, str]]:
    """tags={k: v} -> repeatable ?tag=k:v query parameters."""
    if tags is None:
        return []
    if not isinstance(tags, dict):
        raise errors.InvalidSpecError(f"tags={tags!r} must be a dict of str to str, like {{'job': 'ci'}}.")
    out = []
    for k, v in sorted(tags.items()):
        if not isinstance(k, str) or not isinstance(v, str) or ":" in k:
            raise errors.InvalidSpecError(f"tag {k!r}: {v!r} must map a str without ':' to a str.")
        out.append(("tag", f"{k}:{v}"))
    return out


class TextStreamDecoder:
    """Bytes in, text out, never splitting a UTF-8 sequence across chunks (undecodable bytes become U+FFFD)."""

    def __init__(self) -> None:
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def decode(self, data: bytes, final: bool = False) -> str:
        return self._dec.decode(data, final)


def split_line(buf, sep):
    """(line including sep, rest) if buf holds a whole line, else (None, buf)."""
    i = buf.find(sep)
    if i < 0:
        return None, buf
    return buf[: i + 1], buf[i + 1:]


def check_path(path) -> str:
    """Paths of sb.files: absolute strings inside the sandbox (the daemon confines them)."""
    import os

    p = os.fspath(path) if isinstance(path, os.PathLike) else path
    if not isinstance(p, str) or not p.startswith("/") or "\0" in p:
        raise errors.InvalidSpecError(f"path {path!r} must be an absolute path inside the sandbox, like '/home/user/a.txt'.")
    return p
