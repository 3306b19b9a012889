"""Mount and unmount: the CLI, a clean unmount, and a SIGKILLed server that leaves no hung mount."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from hutch import fuse
from hutch._core.errors import ConfigError, MemoryStoreError


HUTCH = [sys.executable, "-m", "hutch"]


def _in_mountinfo(path) -> bool:
    """True while `path` is a mount point, dead or alive (os.path.ismount says False for a dead FUSE mount)."""
    with open("/proc/self/mountinfo") as f:
        return any(line.split()[4] == str(path) for line in f)


def _wait_gone(pid: int, timeout: float = 5.0) -> bool:
    return _until(lambda: not _alive(pid), timeout)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _until(cond, timeout=5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


def test_sigkill_of_the_server_leaves_no_hung_mount(store, tmp_path):
    mp = tmp_path / "mnt"
    mp.mkdir()
    procs = [fuse.mount(store.root, mp)]
    try:
        assert os.path.ismount(mp) and "actors" in os.listdir(mp)
        os.kill(procs[0].pid, signal.SIGKILL)
        procs[0].wait(5)
        assert _until(lambda: not _in_mountinfo(mp)), "the mount outlived its server"
        assert os.listdir(mp) == []  # usable at once: no ENOTCONN, no hang
        procs.append(fuse.mount(store.root, mp))  # and it can be mounted again
        assert "actors" in os.listdir(mp)
    finally:
        if _in_mountinfo(mp):
            subprocess.run(["fusermount3", "-u", "-z", str(mp)])
        for p in procs:
            p.wait(30)


def test_cli_mount_umount(store, tmp_path):
    mp = tmp_path / "mnt"
    mp.mkdir()
    out = subprocess.run([*HUTCH, "mem", "mount", str(store.root), str(mp)], capture_output=True, text=True,
                         timeout=60)
    try:
        assert out.returncode == 0, out.stderr
        pid = int(out.stdout.split("server pid ")[1].split(")")[0])
        assert os.path.ismount(mp)
        with open(mp / "profile.md") as f:
            assert "3 entities" in f.read()
        again = subprocess.run([*HUTCH, "mem", "mount", str(store.root), str(mp)], capture_output=True, text=True)
        assert again.returncode == 1 and "already a mount point" in again.stderr
        out = subprocess.run([*HUTCH, "mem", "umount", str(mp)], capture_output=True, text=True, timeout=30)
        assert out.returncode == 0, out.stderr
        assert not os.path.ismount(mp)
        assert _wait_gone(pid, 30), "the server did not exit after umount"
        out = subprocess.run([*HUTCH, "mem", "umount", str(mp)], capture_output=True, text=True)
        assert out.returncode == 1 and "not a mount point" in out.stderr
    finally:
        if os.path.ismount(mp):
            subprocess.run(["fusermount3", "-u", "-z", str(mp)])


def test_busy_unmount_names_the_fix_and_lazy_works(mounted):
    f = open(mounted.p("actors", "alice-chen.md"))
    try:
        with pytest.raises(MemoryStoreError, match="--lazy"):
            fuse.umount(mounted.path)
        fuse.umount(mounted.path, lazy=True)
        assert not os.path.ismount(mounted.path)
    finally:
        f.close()
    assert mounted.proc.wait(120) == 0  # a hang guard: seen to take >10 s, and >30 s at load 25, on a busy machine


def test_bad_mount_arguments(store, tmp_path):
    with pytest.raises(ConfigError, match="not a directory"):
        fuse.mount(store.root, tmp_path / "missing")
    (tmp_path / "mp").mkdir()
    with pytest.raises(MemoryStoreError, match="no memory store"):
        fuse.mount(tmp_path / "nostore", tmp_path / "mp")
    assert not os.path.ismount(tmp_path / "mp")


def test_foreground_mount_unmounts_on_sigterm(store, tmp_path):
    mp = tmp_path / "mnt"
    mp.mkdir()
    proc = subprocess.Popen([*HUTCH, "mem", "mount", "--foreground", "--read-only", str(store.root), str(mp)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert _until(lambda: _in_mountinfo(mp), 30), proc.stderr.read() if proc.poll() is not None else "no mount"
        assert "actors" in os.listdir(mp)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0
        assert not _in_mountinfo(mp)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        proc.stderr.close()
        if _in_mountinfo(mp):
            subprocess.run(["fusermount3", "-u", "-z", str(mp)])
