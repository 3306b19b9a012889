"""The SDK against a daemon served on TCP (`hutch serve --listen HOST:PORT --token-file F`), on loopback:
TLS with the certificate the daemon makes, pinned by its fingerprint or named as the CA; the token from a
file or the environment, never from argv."""

from __future__ import annotations

import os
import secrets
import signal
import socket
import ssl
import subprocess
import sys
import time
from pathlib import Path

import pytest

import hutch
from sdk_support import RUN_TAG, Remote, blocked_writer_then_kill, slow_read_of_random_bytes, start_remote, stop_remote
from sdk_support import token_file

@pytest.fixture
def remote(remote_dir):
    r = start_remote(remote_dir)
    try:
        yield r
    finally:
        stop_remote(r)


def _point_sdk(r: Remote, **extra: str) -> None:
    """Everything goes over TCP: no socket for the SDK to fall back on."""
    for k in ("HUTCH_TOKEN", "HUTCH_FINGERPRINT", "HUTCH_CA"):
        os.environ.pop(k, None)
    os.environ.update({"HUTCH_URL": r.url, "HUTCH_TOKEN_FILE": str(r.token_file),
                       "HUTCH_SOCKET": str(r.run_dir / "no-such.sock"), "HUTCH_RUN_DIR": str(r.run_dir / "client"),
                       **extra})


def test_sdk_over_tls_with_a_pinned_certificate_and_a_token_file(remote, busybox_root):
    _point_sdk(remote, HUTCH_FINGERPRINT=remote.fingerprint)
    with hutch.Sandbox.create(image=hutch.Image.from_directory(busybox_root), tags=RUN_TAG) as sb:
        p = sb.exec("sh", "-c", "read x; echo got $x")
        p.stdin.write("it\n")
        assert p.stdout.readline() == "got it\n" and p.wait() == 0
        sb.files.write("/tmp/a", b"1")
        assert sb.files.read("/tmp/a") == b"1"
        assert [s.id for s in hutch.Sandbox.list(tags=RUN_TAG)] == [sb.id]
    assert sb.status in ("terminated", "exited")
    (remote.run_dir / "client").mkdir(exist_ok=True)
    os.environ["HUTCH_TOKEN_FILE"] = str(token_file(remote.run_dir / "client", secrets.token_hex(16)))
    with pytest.raises(hutch.Error, match="token"):
        hutch.Sandbox.list()
    os.environ.pop("HUTCH_TOKEN_FILE")
    os.environ["HUTCH_TOKEN"] = remote.token   # the environment works as well as a file
    assert hutch.Sandbox.list(tags=RUN_TAG) == [] or all(s.status != "running" for s in hutch.Sandbox.list(tags=RUN_TAG))


def test_output_over_tcp_is_flow_controlled_and_capped(remote, busybox_root):
    """The same guarantees as on the Unix socket (test_sdk_output.py) through httpx's TCP transport."""
    _point_sdk(remote, HUTCH_FINGERPRINT=remote.fingerprint)
    with hutch.Sandbox.create(image=hutch.Image.from_directory(busybox_root), tags=RUN_TAG) as sb:
        # loopback TCP buffers grow to several MiB each way, so more may wait on the way than on the socket
        slow_read_of_random_bytes(sb, total=40_000_000, unread_max=30 << 20)
        blocked_writer_then_kill(sb, unread_max=30 << 20)
        r = sb.run("sh", "-c", "head -c 30000000 /dev/zero; echo end >&2", max_output=1000, text=False)
        assert (r.stdout, r.stdout_dropped, r.stderr) == (b"\0" * 1000, 30_000_000 - 1000, b"end\n")


def test_async_sdk_over_tls(remote, busybox_root):
    import asyncio

    _point_sdk(remote, HUTCH_FINGERPRINT=remote.fingerprint.replace(":", "").lower())

    async def main():
        async with await hutch.AsyncSandbox.create(image=hutch.Image.from_directory(busybox_root), tags=RUN_TAG) as sb:
            r = await sb.run("echo", "async")
            assert r.stdout == "async\n"
    asyncio.run(main())


def test_a_terminal_over_tls(remote, busybox_root):
    """exec(pty=True) is a WebSocket on the same verified TLS connection and token as every call."""
    import asyncio

    _point_sdk(remote, HUTCH_FINGERPRINT=remote.fingerprint)
    with hutch.Sandbox.create(image=hutch.Image.from_directory(busybox_root), tags=RUN_TAG) as sb:
        with sb.exec("sh", pty=(20, 70)) as p:
            p.read_until("# ")
            p.resize(21, 71)
            p.write("stty size; exit 6\r")
            assert b"21 71" in p.read_until("21 71") and p.wait(10) == 6

        async def main():
            asb = await hutch.AsyncSandbox.from_id(sb.id)
            async with await asb.exec("sh", "-c", "stty size", pty=(22, 72)) as ap:
                assert b"22 72" in await ap.read_until("22 72") and await ap.wait(10) == 0
        asyncio.run(main())
        from hutch.sandbox._client import Client, Endpoint
        from hutch.sandbox._terminal import PtyProcess

        with pytest.raises(hutch.DaemonError, match="token"):   # the upgrade needs the token too
            PtyProcess.start(Client(Endpoint(token=secrets.token_hex(16))), sb.id, ["sh"], (24, 80))
        with pytest.raises(hutch.NotFoundError):   # the daemon's refusal of the upgrade, as the error it names
            PtyProcess.start(sb._client, "no-such-sandbox", ["sh"], (24, 80))


def test_the_ca_file_verifies_the_daemon_too(remote):
    _point_sdk(remote, HUTCH_CA=str(remote.cert))
    assert isinstance(hutch.Sandbox.list(), list)


def test_an_unverified_or_wrongly_pinned_daemon_is_refused_before_the_token_is_sent(remote):
    _point_sdk(remote)   # neither a pin nor a CA: the self-signed certificate cannot be verified
    with pytest.raises(hutch.DaemonError) as e:
        hutch.Sandbox.list()
    assert "HUTCH_FINGERPRINT" in str(e.value) and "HUTCH_CA" in str(e.value)
    _point_sdk(remote, HUTCH_FINGERPRINT="AB:" * 31 + "AB")
    with pytest.raises(hutch.DaemonError) as e:
        hutch.Sandbox.list()
    assert "not the HUTCH_FINGERPRINT pin" in str(e.value) and "nothing was sent" in str(e.value)
    _point_sdk(remote, HUTCH_CA=str(_another_certificate(remote.run_dir / "other")))   # it did not sign the daemon's
    with pytest.raises(hutch.DaemonError) as e:
        hutch.Sandbox.list()
    assert "HUTCH_FINGERPRINT" in str(e.value) and "HUTCH_CA" in str(e.value)
    _point_sdk(remote, HUTCH_URL=remote.url.replace("https", "http"), HUTCH_FINGERPRINT=remote.fingerprint)
    with pytest.raises(hutch.DaemonError, match="plain http"):
        hutch.Sandbox.list()


def _another_certificate(state: Path) -> Path:
    """A self-signed certificate of another daemon (made as `hutch serve` makes one, in another state dir)."""
    env = dict(os.environ, HUTCH_STATE_DIR=str(state))
    subprocess.run([sys.executable, "-m", "hutch", "tls-fingerprint"], env=env, check=True, capture_output=True,
                   timeout=60)
    return state / "tls" / "daemon.crt"


def test_the_tcp_listener_speaks_only_tls(remote):
    with socket.create_connection(("127.0.0.1", remote.port), timeout=10) as s:
        s.sendall(b"GET /v1/health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        try:
            answer = s.recv(100)
        except ConnectionResetError:
            answer = b""
    assert not answer.startswith(b"HTTP/1.1 200"), answer
    # with TLS but without the token: 401, and the connection is closed
    ctx = ssl.create_default_context(cafile=str(remote.cert))
    with socket.create_connection(("127.0.0.1", remote.port), timeout=10) as raw, \
            ctx.wrap_socket(raw, server_hostname="127.0.0.1") as s:
        s.sendall(b"GET /v1/sandboxes HTTP/1.1\r\nHost: x\r\n\r\n")
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    assert data.startswith(b"HTTP/1.1 401") and b"bearer token" in data, data


def _cmdline(pid: int) -> bytes:
    return Path(f"/proc/{pid}/cmdline").read_bytes()


def _descendants(pid: int) -> list[int]:
    kids: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                ppid = int(Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            kids.setdefault(ppid, []).append(int(d))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(kids.get(p, []))
    return out


@pytest.mark.parametrize("token_env", [False, True], ids=["token-file", "HUTCH_TOKEN"])
def test_the_token_is_in_no_cmdline_and_no_child_environment(remote_dir, token_env):
    r = start_remote(remote_dir, token_env=token_env)
    try:
        deadline = time.monotonic() + 10
        while len(_descendants(r.proc.pid)) < 2 and time.monotonic() < deadline:   # the zygote
            time.sleep(0.05)
        procs = _descendants(r.proc.pid)
        assert len(procs) >= 2, procs
        for pid in procs:
            assert r.token.encode() not in _cmdline(pid), pid
            if pid != r.proc.pid:   # the daemon took HUTCH_TOKEN out of what it passes on
                assert r.token.encode() not in Path(f"/proc/{pid}/environ").read_bytes(), pid
        _point_sdk(r, HUTCH_FINGERPRINT=r.fingerprint)
        assert isinstance(hutch.Sandbox.list(), list)
    finally:
        stop_remote(r)


def test_a_token_on_argv_or_in_a_file_others_can_read_is_refused(remote_dir):
    env = dict(os.environ, HUTCH_RUN_DIR=str(remote_dir / "run"), HUTCH_STATE_DIR=str(remote_dir / "state"))
    env.pop("HUTCH_TOKEN", None)
    token = secrets.token_hex(16)
    r = subprocess.run([sys.executable, "-m", "hutch", "serve", "--listen", "127.0.0.1:1", "--token", token],
                       env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--token-file" in r.stderr and "cmdline" in r.stderr, r.stderr
    tf = token_file(remote_dir, token, 0o644)
    r = subprocess.run([sys.executable, "-m", "hutch", "serve", "--listen", "127.0.0.1:1", "--token-file", str(tf)],
                       env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "chmod 600" in r.stderr, r.stderr
    os.chmod(tf, 0o600)
    tf.write_text("short")
    r = subprocess.run([sys.executable, "-m", "hutch", "serve", "--listen", "127.0.0.1:1", "--token-file", str(tf)],
                       env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "at least 16" in r.stderr, r.stderr


def test_tls_fingerprint_prints_what_the_daemon_printed(remote):
    env = dict(os.environ, HUTCH_STATE_DIR=str(remote.run_dir / "state"))
    out = subprocess.run([sys.executable, "-m", "hutch", "tls-fingerprint"], env=env, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == remote.fingerprint, out
    key = remote.run_dir / "state" / "tls" / "daemon.key"
    assert oct(key.stat().st_mode & 0o777) == "0o600"


EXIT_CLIENT = """
import asyncio, os, signal, sys, hutch
sb = hutch.Sandbox.create(image=hutch.Image.from_directory(sys.argv[1]), tags={"suite": sys.argv[2]})
assert sb.run("true").returncode == 0 and hutch.Sandbox.list(tags={"suite": sys.argv[2]})

async def main():
    return await hutch.AsyncSandbox.list(tags={"suite": sys.argv[2]})
assert asyncio.run(main())
if sys.argv[3] == "daemon-stopped":   # the daemon answers nothing more: exit must not wait for it
    os.kill(int(sys.argv[4]), signal.SIGSTOP)
print("done", flush=True)
"""


@pytest.mark.parametrize("how", ["daemon-up", "daemon-stopped"])
def test_the_sdks_cached_clients_are_closed_at_exit(remote, busybox_root, how):
    """A session of the SDK over TLS (a sandbox whose lease it holds, sync and async calls) ends without a
    ResourceWarning of a socket left open, and without waiting for a daemon that no longer answers."""
    _point_sdk(remote, HUTCH_FINGERPRINT=remote.fingerprint)
    tag = f"{RUN_TAG['suite']}-exit-{how}"
    try:
        p = subprocess.run([sys.executable, "-X", "dev", "-W", "error::ResourceWarning", "-c", EXIT_CLIENT,
                            str(busybox_root), tag, how, str(remote.proc.pid)],
                           capture_output=True, text=True, timeout=120, env=dict(os.environ))   # a hang guard
    finally:
        if how == "daemon-stopped":
            os.kill(remote.proc.pid, signal.SIGCONT)
    assert p.returncode == 0 and p.stdout == "done\n", p.stdout + p.stderr
    assert "ResourceWarning" not in p.stderr and "unclosed" not in p.stderr, p.stderr
    deadline = time.monotonic() + 60   # the lease closed with the process: the daemon ends its sandbox
    while any(s.status == "running" for s in hutch.Sandbox.list(tags={"suite": tag})) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [s.id for s in hutch.Sandbox.list(tags={"suite": tag}) if s.status == "running"]
