"""Who may use the daemon's Unix socket: root, members of `hutch serve --group`, nobody else.

The other side is a real second host account (made and removed here), connecting
with nothing but the Python standard library, as an attacker on the host would.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import stat
import struct
import tempfile
import threading
import time
from pathlib import Path

import pytest
from hutch_testing import HOST_PYTHON, host_group, host_user, run_as, start_daemon, stop_daemon, unix_get_as

pytestmark = pytest.mark.skipif(HOST_PYTHON is None, reason="needs the host's python3.11 for the second account")


@pytest.fixture
def run_dir():
    """A daemon's run directory (made by the daemon) in a temporary directory that also holds its log."""
    d = Path(tempfile.mkdtemp(prefix="hutch-access-"))
    os.chmod(d, 0o755)   # every user may come this far: the run directory is what has to keep them out
    try:
        yield d / "run"
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def other():
    with host_user() as u:
        yield u


def _log(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


def test_another_user_is_refused_by_the_peer_check_even_through_a_0666_socket(run_dir, other):
    log = run_dir.parent / "daemon.log"
    proc = start_daemon(run_dir, log=log)
    try:
        sock = run_dir / "hutch.sock"
        assert stat.S_IMODE(os.stat(run_dir).st_mode) == 0o700 and os.stat(run_dir).st_uid == 0
        assert stat.S_IMODE(os.stat(sock).st_mode) == 0o600
        assert unix_get_as(other, sock)["connect"] == "EACCES"   # the directory keeps it away
        # Open every door the file system has: only the daemon's own check is left.
        os.chmod(run_dir, 0o755)
        os.chmod(sock, 0o666)
        for _ in range(3):
            got = unix_get_as(other, sock)
            assert got["connect"] == "ok" and got["status"] == 403, got
            assert '"error": "DaemonError"' in got["body"] and "may not drive it" in got["body"], got
        assert f"refused a connection from uid {other.pw_uid}" in _log(log)
        # root still is served, on the same socket
        from hutch.sandbox._client import Endpoint, _ping
        assert _ping(Endpoint(socket_path=str(sock)))
    finally:
        stop_daemon(proc)


# --- inotify, to look at the socket the instant it appears ---------------------------------------------

_IN_CREATE, _IN_MOVED_TO = 0x100, 0x80


class _Watch:
    """Records the mode of every new entry of `directory` the moment the kernel reports it."""

    def __init__(self, directory: Path):
        self.libc = ctypes.CDLL(None, use_errno=True)
        self.fd = self.libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        assert self.fd >= 0
        assert self.libc.inotify_add_watch(self.fd, str(directory).encode(), _IN_CREATE | _IN_MOVED_TO) >= 0
        self.dir, self.seen, self.stop = directory, [], False
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        import select
        while not self.stop:
            if not select.select([self.fd], [], [], 0.05)[0]:
                continue
            buf = os.read(self.fd, 65536)
            i = 0
            while i < len(buf):
                _, mask, _, n = struct.unpack_from("iIII", buf, i)
                name = buf[i + 16:i + 16 + n].rstrip(b"\0").decode()
                i += 16 + n
                try:
                    st = os.lstat(self.dir / name)
                except FileNotFoundError:
                    continue
                if stat.S_ISSOCK(st.st_mode):
                    self.seen.append((name, stat.S_IMODE(st.st_mode)))

    def close(self):
        self.stop = True
        self.thread.join()
        os.close(self.fd)


ATTACK_LOOP = r"""
import errno, json, socket, sys, time
path, until = sys.argv[1], time.monotonic() + float(sys.argv[2])
held, errors = [], set()
while time.monotonic() < until:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(path)
        held.append(s)
    except OSError as e:
        errors.add(errno.errorcode.get(e.errno, str(e.errno)))
        s.close()
statuses = []
for s in held:   # a connection made in some window, used once the daemon serves
    try:
        s.settimeout(5)
        s.sendall(b"GET /v1/health HTTP/1.1\r\nHost: hutch\r\nConnection: close\r\n\r\n")
        statuses.append(s.recv(12).decode(errors="replace"))
    except OSError as e:
        statuses.append(str(e))
print(json.dumps({"held": len(held), "statuses": statuses, "errors": sorted(errors)}))
"""


def test_under_umask_000_the_socket_is_never_connectable_by_another_user(run_dir, other):
    # The socket goes in a directory every user may enter, so only the socket's own mode (from its first
    # instant) and the peer check stand between the other user and the daemon.
    public = Path(tempfile.mkdtemp(prefix="hutch-access-pub-"))
    os.chmod(public, 0o755)
    sock = public / "hutch.sock"
    log = public / "daemon.log"
    watch = _Watch(public)
    attacker = {}

    def attack():
        attacker["r"] = run_as(other, ATTACK_LOOP, str(sock), "12", timeout=60)

    t = threading.Thread(target=attack)
    t.start()
    proc = None
    try:
        time.sleep(0.3)   # the attacker spins before the daemon binds
        proc = start_daemon(run_dir, sock=sock, log=log, preexec_fn=lambda: os.umask(0))
        t.join(60)
        r = attacker["r"]
        assert r.returncode == 0, r.stderr
        import json
        got = json.loads(r.stdout)
        assert not any(s.startswith("HTTP/1.1 200") for s in got["statuses"]), got
        assert got["held"] == 0 and "EACCES" in got["errors"], got   # never connected: the mode was there first
        assert stat.S_IMODE(os.stat(sock).st_mode) == 0o600
        socks = [mode for name, mode in watch.seen if name == "hutch.sock" or name.startswith(".s")]
        assert socks and all(mode & 0o077 == 0 for mode in socks), watch.seen
    finally:
        t.join(60)
        watch.close()
        if proc is not None:
            stop_daemon(proc)
        shutil.rmtree(public, ignore_errors=True)


def test_a_member_of_the_group_is_served_and_a_non_member_is_not(run_dir):
    with host_group() as g, host_user(groups=(g.gr_name,)) as member, host_user() as outsider:
        log = run_dir.parent / "daemon.log"
        proc = start_daemon(run_dir, log=log, args=("--group", g.gr_name))
        try:
            sock = run_dir / "hutch.sock"
            st_dir, st_sock = os.stat(run_dir), os.stat(sock)
            assert (stat.S_IMODE(st_dir.st_mode), st_dir.st_uid, st_dir.st_gid) == (0o750, 0, g.gr_gid)
            assert (stat.S_IMODE(st_sock.st_mode), st_sock.st_uid, st_sock.st_gid) == (0o660, 0, g.gr_gid)
            got = unix_get_as(member, sock)
            assert got["status"] == 200 and '"version"' in got["body"], got
            assert unix_get_as(outsider, sock)["connect"] == "EACCES"
            os.chmod(run_dir, 0o755)
            os.chmod(sock, 0o666)
            got = unix_get_as(outsider, sock)
            assert got["status"] == 403 and f"members of group {g.gr_name}" in got["body"], got
            assert unix_get_as(member, sock)["status"] == 200
        finally:
            stop_daemon(proc)


#: As another user, through the SDK itself (this worktree and the venv's packages on sys.path: the host's
#: python is the venv's version): list the sandboxes of the daemon on argv[1]; print "ok N" or the error.
SDK_LIST = r"""
import os, sys
sys.path[:0] = [sys.argv[2], sys.argv[3]]
os.environ["HUTCH_SOCKET"] = sys.argv[1]
import hutch
try:
    print("ok", len(hutch.Sandbox.list()))
except hutch.Error as e:
    print(type(e).__name__, e)
"""


def _sdk_list_as(user, sock: Path) -> str:
    import site

    import hutch
    r = run_as(user, SDK_LIST, str(sock), str(Path(hutch.__file__).parent.parent), site.getsitepackages()[0])
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def test_the_sdk_tells_a_refused_user_what_to_do(run_dir):
    with host_group() as g, host_user(groups=(g.gr_name,)) as member, host_user() as outsider:
        log = run_dir.parent / "daemon.log"
        proc = start_daemon(run_dir, log=log, args=("--group", g.gr_name))
        try:
            sock = run_dir / "hutch.sock"
            assert _sdk_list_as(member, sock).startswith("ok ")
            got = _sdk_list_as(outsider, sock)   # the directory stops it: no daemon is started in its name
            assert got.startswith("DaemonError") and "permission denied" in got and "--group" in got, got
            os.chmod(run_dir, 0o755)
            os.chmod(sock, 0o666)
            got = _sdk_list_as(outsider, sock)   # the peer check stops it
            assert got.startswith("DaemonError") and f"members of group {g.gr_name}" in got, got
        finally:
            stop_daemon(proc)


def test_serve_refuses_an_unknown_or_root_group(run_dir):
    import subprocess
    import sys
    env = dict(os.environ, HUTCH_RUN_DIR=str(run_dir), HUTCH_SOCKET=str(run_dir / "hutch.sock"))
    r = subprocess.run([sys.executable, "-m", "hutch", "serve", "--group", "hutch-no-such-group"], env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "groupadd" in r.stderr, r.stderr
    r = subprocess.run([sys.executable, "-m", "hutch", "serve", "--group", "root"], env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "dedicated group" in r.stderr, r.stderr
