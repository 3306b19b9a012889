"""Shared by the SDK suite's conftest and tests (a unique module name: the tests/ tree has several conftests)."""

import hashlib
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

from hutch_testing import SDK_ENV

#: Every sandbox the suite makes carries this tag; the session ends by terminating whatever has it.
RUN_TAG = {"suite": f"sdk-{uuid.uuid4().hex[:8]}"}

MB = 1 << 20
#: what points the SDK at a remote daemon (SDK_ENV and its TLS and token files): a test that sets them restores them
REMOTE_ENV = (*SDK_ENV, "HUTCH_TOKEN_FILE", "HUTCH_FINGERPRINT", "HUTCH_CA")


def sandbox_file_size(sb, path: str) -> int:
    return int(sb.run("stat", "-c", "%s", path).stdout)


def slow_read_of_random_bytes(sb, total: int = 20_000_000, unread_max: int = 12 * MB) -> None:
    """A reader that pauses holds the command back (it has not written everything after a 1 s pause) and
    still gets every byte, in order: the sha256 of what it read is that of what the command wrote.

    `unread_max`: what the buffers on the way may hold (SDK, sockets, daemon, pipe); TCP's grow larger."""
    p = sb.exec("sh", "-c", f"head -c {total} /dev/urandom | tee /tmp/data", text=False)
    first = p.stdout.readline()
    time.sleep(1.0)
    size = sandbox_file_size(sb, "/tmp/data")
    assert size < unread_max, f"the command wrote {size} bytes while the reader slept: nothing held it back"
    digest, n = hashlib.sha256(first), len(first)
    for chunk in p.stdout:
        digest.update(chunk)
        n += len(chunk)
        if n % (2 * MB) < len(chunk):
            time.sleep(0.05)
    assert p.wait() == 0 and n == total
    assert digest.hexdigest() == sb.run("sha256sum", "/tmp/data").stdout.split()[0]


def blocked_writer_then_kill(sb, unread_max: int = 12 * MB) -> None:
    """Output nobody reads blocks the command (flow control); wait() after kill() returns all the same."""
    p = sb.exec("sh", "-c", "head -c 60000000 /dev/zero | tee /tmp/z", text=False)
    time.sleep(1.0)
    size = sandbox_file_size(sb, "/tmp/z")
    assert size < unread_max, f"{size} bytes written with nobody reading: the output was not flow-controlled"
    assert p.poll() is None
    p.kill()
    t0 = time.monotonic()
    assert p.wait() == -9 and p.reason == "killed"
    assert time.monotonic() - t0 < 60   # a hang guard, not a speed target

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def token_file(d: Path, token: str, mode: int = 0o600) -> Path:
    p = d / "token"
    p.write_text(token + "\n")
    os.chmod(p, mode)
    return p


class Remote:
    """A daemon started by start_remote: its process, port, token (and file), certificate and fingerprint."""

    def __init__(self, proc, port, token, token_file, fingerprint, cert, run_dir, log):
        self.proc, self.port, self.token, self.token_file = proc, port, token, token_file
        self.fingerprint, self.cert, self.run_dir, self.log = fingerprint, cert, run_dir, log
        self.url = f"https://127.0.0.1:{port}"


def start_remote(run_dir: Path, *args: str, token_env: bool = False, prefix: tuple = (),
                 extra_env: dict | None = None) -> Remote:
    """`hutch serve --listen` on a free loopback port with a private state dir (where it makes its
    certificate); ready when this returns."""
    port, token = _free_port(), secrets.token_hex(16)
    tf = token_file(run_dir, token)
    env = dict(os.environ, HUTCH_RUN_DIR=str(run_dir / "run"), HUTCH_SOCKET=str(run_dir / "run" / "hutch.sock"),
               HUTCH_STATE_DIR=str(run_dir / "state"), **(extra_env or {}))
    for k in ("HUTCH_URL", "HUTCH_TOKEN", "HUTCH_TOKEN_FILE"):
        env.pop(k, None)
    argv = [*prefix, sys.executable, "-m", "hutch", "serve", "--listen", f"127.0.0.1:{port}", *args]
    if token_env:
        env["HUTCH_TOKEN"] = token
    else:
        argv += ["--token-file", str(tf)]
    log = run_dir / "test-daemon.log"
    with open(log, "ab") as lf:
        proc = subprocess.Popen(argv, env=env, stdout=lf, stderr=lf, stdin=subprocess.DEVNULL, start_new_session=True)
    r = Remote(proc, port, token, tf, None, run_dir / "state" / "tls" / "daemon.crt", run_dir, log)
    try:
        deadline = time.monotonic() + 120   # a hang guard: a loaded 2-core machine takes 20 s and more
        while "serving on" not in log.read_text(errors="replace"):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        m = re.search(r"fingerprint ([0-9A-F:]{95})", log.read_text())
        assert m, log.read_text()
    except BaseException:
        stop_remote(r)   # a daemon that started but is not what the test needs must not outlive it
        raise
    r.fingerprint = m.group(1)
    return r


def stop_remote(r: Remote) -> None:
    if r.proc.poll() is None:
        r.proc.send_signal(signal.SIGTERM)
        try:
            r.proc.wait(60)   # a SIGKILL would leave its sandboxes' mounts and cgroups
        except subprocess.TimeoutExpired:
            r.proc.kill()
            r.proc.wait()
