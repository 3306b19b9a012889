"""A local user who made the daemon's run directory first (in a /tmp-like directory every user may write)
must not get the root daemon to write through what they planted there, nor keep a way back in.

The attacker is a real second host account (made and removed here), acting with the standard library.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hutch_testing import HOST_PYTHON, host_user, run_as

pytestmark = pytest.mark.skipif(HOST_PYTHON is None, reason="needs the host's python3.11 for the second account")

#: As another user: make the directory argv[1] (0755, theirs) with daemon.pid, daemon.lock and records
#: symlinks to argv[2] (a root file they cannot write).
PLANT = r"""
import os, sys
run, victim = sys.argv[1], sys.argv[2]
os.mkdir(run, 0o755)
for name in ("daemon.pid", "daemon.lock", "hutch.sock", "daemon.log", "autostart.lock"):
    os.symlink(victim, os.path.join(run, name))
print("planted")
"""


def _serve(run: Path, log: Path, sock: Path | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, HUTCH_RUN_DIR=str(run), HUTCH_SOCKET=str(sock or run / "hutch.sock"))
    env.pop("HUTCH_URL", None)
    with open(log, "ab") as lf:
        proc = subprocess.Popen([sys.executable, "-m", "hutch", "serve"], env=env, stdin=subprocess.DEVNULL,
                                stdout=lf, stderr=lf, start_new_session=True)
    try:
        rc = proc.wait(60)   # a hang guard: a refused start ends in about a second
    except subprocess.TimeoutExpired:
        proc.terminate()
        rc = proc.wait(60)
    return subprocess.CompletedProcess(proc.args, rc, "", log.read_text(errors="replace"))


def test_a_run_directory_another_user_made_is_refused_and_nothing_is_written_through_it(public):
    victim = public / "victim"
    victim.write_text("root's own\n")
    os.chmod(victim, 0o644)
    run = public / "run"
    with host_user() as other:
        r = run_as(other, PLANT, str(run), str(victim))
        assert r.returncode == 0 and "planted" in r.stdout, r.stderr
        got = _serve(run, public / "daemon.log")
        assert victim.read_text() == "root's own\n"   # no pid, no socket, no lock written through the links
        assert got.returncode != 0, got.stderr
        assert f"{run} belongs to uid {other.pw_uid}" in got.stderr and "chown root" in got.stderr, got.stderr
        assert os.stat(run).st_uid == other.pw_uid   # refused before anything was changed


def test_a_run_directory_in_a_directory_another_user_may_rename_in_is_refused(public):
    # The run directory is root's, but its parent is the other user's: they could rename it away while the
    # daemon runs and put their own (with links in it) in its place.
    with host_user() as other:
        parent = public / "theirs"
        r = run_as(other, "import os, sys; os.mkdir(sys.argv[1], 0o755); print('made')", str(parent))
        assert r.returncode == 0, r.stderr
        run = parent / "run"
        run.mkdir(mode=0o700)
        got = _serve(run, public / "daemon.log")
        assert got.returncode != 0, got.stderr
        assert f"{parent} belongs to uid {other.pw_uid}" in got.stderr, got.stderr
        shutil.rmtree(run)


def test_a_socket_in_a_directory_another_user_owns_is_refused(public, tmp_path):
    # Its owner could swap the daemon's stage directory between the bind and the chmod, which follows a link.
    with host_user() as other:
        theirs = public / "sockets"
        r = run_as(other, "import os, sys; os.mkdir(sys.argv[1], 0o755); print('made')", str(theirs))
        assert r.returncode == 0, r.stderr
        got = _serve(tmp_path / "run", public / "daemon.log", sock=theirs / "hutch.sock")
        assert got.returncode != 0 and f"{theirs} belongs to uid {other.pw_uid}" in got.stderr, got.stderr
        assert os.listdir(theirs) == []


def test_the_sdks_autostart_writes_nothing_through_a_run_directory_another_user_made(public):
    victim = public / "victim"
    victim.write_text("root's own\n")
    run = public / "run"
    with host_user() as other:
        r = run_as(other, PLANT, str(run), str(victim))
        assert r.returncode == 0, r.stderr
        env = dict(os.environ, HUTCH_RUN_DIR=str(run), HUTCH_SOCKET=str(run / "hutch.sock"))
        env.pop("HUTCH_URL", None)
        got = subprocess.run([sys.executable, "-c", "import hutch; hutch.Sandbox.list()"], env=env,
                             capture_output=True, text=True, timeout=120)
        assert victim.read_text() == "root's own\n"   # neither the autostart lock nor the daemon's log
        assert got.returncode != 0 and f"{run} belongs to uid {other.pw_uid}" in got.stderr, got.stderr


# --- files the daemon reads its secrets from ----------------------------------------------------------

def _serve_args(run: Path, *args: str) -> subprocess.CompletedProcess:
    """`hutch serve --listen` on a free loopback port; one that starts (it should not) is stopped with SIGTERM."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, HUTCH_RUN_DIR=str(run), HUTCH_SOCKET=str(run / "hutch.sock"))
    for k in ("HUTCH_URL", "HUTCH_TOKEN"):
        env.pop(k, None)
    proc = subprocess.Popen([sys.executable, "-m", "hutch", "serve", "--listen", f"127.0.0.1:{port}", *args], env=env,
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=60)   # a hang guard: a refused start ends in about a second
    except subprocess.TimeoutExpired:
        proc.terminate()
        out, err = proc.communicate(timeout=60)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def test_a_token_file_or_tls_key_another_user_owns_is_refused(public, tmp_path):
    # Mode 0600 keeps others out, but not the file's owner: a token another user wrote is theirs to use (and
    # to change), and so is a TLS key they hold; the root daemon takes neither.
    from hutch.sandbox._host.daemon.tls import _make_self_signed

    with host_user() as other:
        token = public / "token"
        r = run_as(other, "import os, sys; fd = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600); "
                          "os.write(fd, b'a' * 32); print('ok')", str(token))
        assert r.returncode == 0, r.stderr
        got = _serve_args(tmp_path / "run1", "--token-file", str(token))
        assert got.returncode == 1 and f"belongs to uid {other.pw_uid}" in got.stderr and "chown root" in got.stderr, \
            got.stderr
        crt, key = tmp_path / "d.crt", tmp_path / "d.key"
        _make_self_signed(crt, key)
        os.chmod(key, 0o600)
        os.chown(key, other.pw_uid, other.pw_gid)
        mine = tmp_path / "token"
        mine.write_text("b" * 32)
        os.chmod(mine, 0o600)
        got = _serve_args(tmp_path / "run2", "--token-file", str(mine), "--tls-cert", str(crt), "--tls-key", str(key))
        assert got.returncode == 1 and f"belongs to uid {other.pw_uid}" in got.stderr and "chown root" in got.stderr, \
            got.stderr
