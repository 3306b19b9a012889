"""A local user who made the daemon's run directory first (in a /tmp-like directory every user may write)
must not get the root daemon to write through what they planted there, nor keep a way back in.

The attacker is a real second host account (made and removed here), acting with the standard library.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
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


@pytest.fixture
def public():
    """A sticky directory every user may write, as /tmp is (root's, 1777)."""
    d = Path(tempfile.mkdtemp(prefix="hutch-planted-"))
    os.chmod(d, 0o1777)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _serve(run: Path, log: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, HUTCH_RUN_DIR=str(run), HUTCH_SOCKET=str(run / "hutch.sock"))
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
