"""Another account of the host may not be a sandbox's host ids. Sandboxes run as host ids from
idmap.SANDBOX_HOST_IDS (1e9 - 65536 and up); a local user or group with such an id owns what sandboxes write (their
layers, volumes) and may signal their processes, and an /etc/subuid or /etc/subgid range over them lets its
user map those very ids into a user namespace of theirs (newuidmap). `hutch serve` refuses such a host,
naming the account and the fix.

The host's account files are the real ones with one line added, bound over /etc/passwd (or /etc/subuid) in a
mount namespace only the refused daemon runs in: the other daemons of this host never see the account.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from hutch.sandbox._host.native.idmap import SANDBOX_HOST_IDS, VOLUME_ID_BASE


@pytest.fixture
def d():
    p = Path(tempfile.mkdtemp(prefix="hutch-ids-"))
    try:
        yield p
    finally:
        shutil.rmtree(p, ignore_errors=True)


def _serve_with(d: Path, target: str, line: str) -> subprocess.CompletedProcess:
    """`hutch serve` in a mount namespace of its own whose `target` has `line` added."""
    f = d / Path(target).name
    text = Path(target).read_text()
    f.write_text(text + ("" if not text or text.endswith("\n") else "\n") + line + "\n")
    os.chmod(f, 0o644)
    run = d / "run"
    env = dict(os.environ, HUTCH_RUN_DIR=str(run), HUTCH_SOCKET=str(run / "hutch.sock"))
    env.pop("HUTCH_URL", None)
    script = 'mount --bind "$1" "$2" && shift 2 && exec "$@"'
    proc = subprocess.Popen(["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh", str(f),
                             target, sys.executable, "-m", "hutch", "serve"], env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=60)   # a hang guard: a refused start ends in about a second
    except subprocess.TimeoutExpired:
        proc.terminate()   # it served: the old code; the test fails below
        out, err = proc.communicate(timeout=60)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.mark.parametrize("uid", [VOLUME_ID_BASE, SANDBOX_HOST_IDS.start + 65536 * 3 + 5])
def test_a_host_user_with_a_sandboxs_id_is_refused(d, uid):
    got = _serve_with(d, "/etc/passwd", f"hutch-ids-x:x:{uid}:{uid}::/nonexistent:/usr/sbin/nologin")
    assert got.returncode != 0, got.stderr
    assert f"host user 'hutch-ids-x' has id {uid}" in got.stderr and "usermod -u" in got.stderr, got.stderr


def test_a_host_group_with_a_sandboxs_id_is_refused(d):
    gid = SANDBOX_HOST_IDS.start + 7
    got = _serve_with(d, "/etc/group", f"hutch-ids-g:x:{gid}:")
    assert got.returncode != 0 and f"host group 'hutch-ids-g' has id {gid}" in got.stderr, got.stderr


@pytest.mark.parametrize("target", ["/etc/subuid", "/etc/subgid"])
def test_a_subordinate_id_range_over_the_sandboxes_ids_is_refused(d, target):
    if not Path(target).exists():
        pytest.skip(f"{target} does not exist on this host (nothing to bind over)")
    got = _serve_with(d, target, f"hutch-ids-x:{SANDBOX_HOST_IDS.start - 10}:65536")
    assert got.returncode != 0, got.stderr
    assert f"gives 'hutch-ids-x' the ids {SANDBOX_HOST_IDS.start - 10}-" in got.stderr and "usermod" in got.stderr, \
        got.stderr


def test_accounts_and_ranges_below_the_sandboxes_ids_are_fine(d):
    from hutch.sandbox._host.native.idmap import check_host_accounts

    sub = d / "subuid"
    sub.write_text(f"someone:100000:65536\nedge:{VOLUME_ID_BASE - 65536}:65536\n")
    check_host_accounts(subid_files=(str(sub),))   # the host's own accounts, and ranges ending below
    sub.write_text(f"edge:{VOLUME_ID_BASE - 65535}:65536\n")   # its last id is the first of hutch's
    with pytest.raises(Exception, match="overlap those hutch gives sandboxes"):
        check_host_accounts(subid_files=(str(sub),))
