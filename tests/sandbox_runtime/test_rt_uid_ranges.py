"""Host uid ranges are handed out once per host, also to daemons whose /run differs (other mount
namespaces), and no local user can block them by locking the shared file."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from hutch.sandbox._host.native.cgroups import Cgroups
from hutch.sandbox._host.native.idmap import CGROUP_LOCK_OFFSET, HOST_ID_BASE, ID_COUNT, RANGES, UidRanges

CGROUP_LOCK = str(Cgroups("hutch-unused").lock_file())

TAKER = textwrap.dedent(f"""
    import sys
    from hutch.sandbox._host.native.idmap import UidRanges
    r = UidRanges(cgroup_lock={CGROUP_LOCK!r})
    print(*[r.take() for _ in range(3)], flush=True)
    sys.stdin.read()
""")


def test_a_daemon_with_another_run_dir_gets_other_ranges(tmp_path):
    # another mount namespace, whose /run is a directory of its own: its RANGE_LOCK is another file (and so
    # is ours: a fresh one, as theirs is, so the two would start at the same range)
    other = subprocess.Popen(["unshare", "-m", "--propagation", "private", "sh", "-c",
                              f"mount -t tmpfs none /run && exec {sys.executable} -c \"$0\"", TAKER],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    ours = UidRanges(str(tmp_path / "uid-ranges.lock"), cgroup_lock=CGROUP_LOCK)
    try:
        theirs = [int(x) for x in other.stdout.readline().split()]
        assert len(theirs) == 3, "the other daemon took no ranges"
        mine = [ours.take() for _ in range(3)]
        assert not set(mine) & set(theirs), (mine, theirs)
        assert all((b - HOST_ID_BASE) % ID_COUNT == 0 for b in mine + theirs)
    finally:
        ours.close()
        other.stdin.close()
        other.wait(10)
        other.stdout.close()


def test_read_locks_of_a_local_user_block_nothing():
    code = textwrap.dedent(f"""
        import fcntl, os, sys
        fd = os.open({CGROUP_LOCK!r}, os.O_RDONLY)   # any user may read the file, and so read-lock it
        held = 0
        for k in range({RANGES}):   # every range's byte that no daemon holds now
            try:
                fcntl.lockf(fd, fcntl.LOCK_SH | fcntl.LOCK_NB, 1, {CGROUP_LOCK_OFFSET} + k)
                held += 1
            except OSError:
                pass
        print("locked" if held > {RANGES} // 2 else "failed", flush=True)
        sys.stdin.read()
    """)
    squatter = subprocess.Popen(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable,
                                 "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    ours = UidRanges(cgroup_lock=CGROUP_LOCK)
    try:
        assert squatter.stdout.readline().strip() == "locked"
        first = ours.take()
        assert first >= HOST_ID_BASE
        ours.give(first)
    finally:
        ours.close()
        squatter.stdin.close()
        squatter.wait(10)
        squatter.stdout.close()
