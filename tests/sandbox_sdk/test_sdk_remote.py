"""The SDK against a daemon served on TCP with a token (`hutch serve --listen HOST:PORT --token T`), on loopback."""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

import hutch
from hutch_testing import restore_env
from sdk_support import RUN_TAG, blocked_writer_then_kill, slow_read_of_random_bytes


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def remote(busybox_root):
    run_dir = Path(tempfile.mkdtemp(prefix="hutch-sdk-remote-"))
    port, token = _free_port(), secrets.token_hex(16)
    env = dict(os.environ, HUTCH_RUN_DIR=str(run_dir), HUTCH_SOCKET=str(run_dir / "hutch.sock"))
    env.pop("HUTCH_URL", None)
    log = open(run_dir / "test-daemon.log", "ab")
    proc = subprocess.Popen([sys.executable, "-m", "hutch", "serve", "--listen", f"127.0.0.1:{port}", "--token", token],
                            env=env, stdout=log, stderr=log, stdin=subprocess.DEVNULL, start_new_session=True)
    saved = {k: os.environ.get(k) for k in ("HUTCH_URL", "HUTCH_TOKEN", "HUTCH_SOCKET", "HUTCH_RUN_DIR")}
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, (run_dir / "test-daemon.log").read_text()
                time.sleep(0.05)
        # no socket for the SDK to fall back on: everything goes over TCP
        os.environ.update(HUTCH_URL=f"http://127.0.0.1:{port}", HUTCH_TOKEN=token,
                          HUTCH_SOCKET=str(run_dir / "no-such.sock"), HUTCH_RUN_DIR=str(run_dir / "client"))
        yield token
    finally:
        restore_env(saved)
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
        shutil.rmtree(run_dir, ignore_errors=True)


def test_sdk_over_tcp_with_a_token(remote, busybox_root):
    with hutch.Sandbox.create(image=hutch.Image.from_directory(busybox_root), tags=RUN_TAG) as sb:
        p = sb.exec("sh", "-c", "read x; echo got $x")
        p.stdin.write("it\n")
        assert p.stdout.readline() == "got it\n" and p.wait() == 0
        sb.files.write("/tmp/a", b"1")
        assert sb.files.read("/tmp/a") == b"1"
        assert [s.id for s in hutch.Sandbox.list(tags=RUN_TAG)] == [sb.id]
    assert sb.status in ("terminated", "exited")
    os.environ["HUTCH_TOKEN"] = "wrong"
    with pytest.raises(hutch.Error, match="token"):
        hutch.Sandbox.list()


def test_output_over_tcp_is_flow_controlled_and_capped(remote, busybox_root):
    """The same guarantees as on the Unix socket (test_sdk_output.py) through httpx's TCP transport."""
    with hutch.Sandbox.create(image=hutch.Image.from_directory(busybox_root), tags=RUN_TAG) as sb:
        # loopback TCP buffers grow to several MiB each way, so more may wait on the way than on the socket
        slow_read_of_random_bytes(sb, total=40_000_000, unread_max=30 << 20)
        blocked_writer_then_kill(sb, unread_max=30 << 20)
        r = sb.run("sh", "-c", "head -c 30000000 /dev/zero; echo end >&2", max_output=1000, text=False)
        assert (r.stdout, r.stdout_dropped, r.stderr) == (b"\0" * 1000, 30_000_000 - 1000, b"end\n")
