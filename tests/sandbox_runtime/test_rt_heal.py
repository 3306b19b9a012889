"""A daemon heals itself: a zygote that dies is restarted (retried while that fails, with the reason in
/v1/health), leaves no zombie, and the SDK names an unhealthy daemon instead of starting a second one."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from hutch._core.errors import DaemonError
from hutch.sandbox._client import Endpoint, ensure_daemon
from hutch_testing import restore_env
from rt_support import Api, Daemon

CGROUP = Path("/sys/fs/cgroup")


def _stat(pid: int) -> tuple[str, int]:
    """(state, parent pid) of a process, ("", 0) once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return "", 0
    return fields[0], int(fields[1])


def children(pid: int) -> dict[int, str]:
    out = {}
    for e in os.scandir("/proc"):
        if e.name.isdigit():
            state, ppid = _stat(int(e.name))
            if ppid == pid:
                out[int(e.name)] = state
    return out


def zygotes(d: Daemon) -> list[int]:
    """The daemon's live zygotes (not an init just cloned from one, nor a zombie)."""
    try:
        procs = (d.cgroup_dirs("_zygote")[0] / "cgroup.procs").read_text().split()
    except FileNotFoundError:
        return []
    return [int(p) for p in procs if _stat(int(p))[1] == d.proc.pid and _stat(int(p))[0] != "Z"]


def zygote_of(d: Daemon) -> int:
    pids = zygotes(d)
    assert len(pids) == 1, pids
    return pids[0]


def health(d: Daemon) -> httpx.Response:
    with httpx.Client(transport=httpx.HTTPTransport(uds=str(d.sock))) as c:   # closed: not left to the gc
        return c.get("http://hutch/v1/health", timeout=5)


def wait_for(pred, within: float, step: float = 0.02):
    deadline = time.monotonic() + within
    while True:
        got = pred()
        if got or time.monotonic() > deadline:
            return got
        time.sleep(step)


def in_daemon_ns(d: Daemon, *argv: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["nsenter", "-t", str(d.proc.pid), "-m", *argv], capture_output=True, text=True,
                          check=check, timeout=10)


def controllers(d: Daemon) -> list[Path]:
    """Where the daemon's cgroups live: the v2 root, or the v1 controllers it uses."""
    if (CGROUP / "cgroup.controllers").exists():
        return [CGROUP]
    return [CGROUP / c for c in ("memory", "pids", "cpu")]


def remove_tree(d: Daemon) -> None:
    """Remove the daemon's cgroup parents and everything under them (all empty by now), as a sweep on a shared
    host did."""
    for c in controllers(d):
        parent = c / d.cgroup_parent
        if parent.is_dir():
            for child in [p for p in parent.iterdir() if p.is_dir()]:
                wait_for(lambda: _rmdir(child), 5)
            wait_for(lambda: _rmdir(parent), 5)
        assert not parent.exists()


def _rmdir(p: Path) -> bool:
    try:
        p.rmdir()
    except FileNotFoundError:
        pass
    except OSError:
        return False
    return True


@pytest.fixture
def isolated_daemon(tmp_path):
    """A daemon in a mount namespace of its own, so a test can make its cgroups unwritable for it alone."""
    d = Daemon(tmp_path / "run", prefix=("unshare", "-m", "--propagation", "private")).start()
    try:
        yield d
    finally:
        for c in controllers(d):
            in_daemon_ns(d, "umount", str(c), check=False)
        d.stop()
        d.cleanup_cgroups()


def _attempt(health_text: str) -> int:
    """The restart attempt a 503 health answer names ("attempt N"), else 0."""
    m = re.search(r"attempt (\d+)", health_text)
    return int(m.group(1)) if m else 0


def test_a_failed_zygote_restart_is_retried_reported_and_heals(isolated_daemon, image):
    d = isolated_daemon
    a = Api(d.sock, d.run_dir)
    try:
        sid = a.create(image)["id"]
        zygote = zygote_of(d)
        # The daemon can no longer make its cgroups (a read-only tmpfs over the controllers, in its namespace
        # only), then its zygote dies: the restart fails until the cgroups are writable again.
        for c in controllers(d):
            in_daemon_ns(d, "mount", "-t", "tmpfs", "-o", "ro,size=4k", "blocked", str(c))
        os.kill(zygote, signal.SIGKILL)
        assert a.http.post(f"/v1/sandboxes/{sid}/wait", params={"timeout": 5}).json()["status"] == "failed"

        # at least three attempts failed (a loaded machine's slow polls may first see a later one)
        r = wait_for(lambda: (h := health(d)).status_code == 503 and _attempt(h.text) >= 3 and h, 30)
        assert r, health(d).text
        body = r.json()
        assert body["error"] == "DaemonError" and body["pid"] == d.proc.pid
        assert "could not be restarted" in body["message"] and "Read-only file system" in body["message"]
        status, err = a.create_error(image)
        assert status == 503 and "cannot start sandboxes" in err["message"], err
        assert "could not be restarted" in err["message"], err
        # the dead zygote and every failed attempt were reaped: the daemon has no zombie child
        assert _stat(zygote)[0] == ""
        assert "Z" not in children(d.proc.pid).values(), children(d.proc.pid)

        # Meanwhile the daemon's cgroup directories disappear altogether; then cgroups work again.
        remove_tree(d)
        for c in controllers(d):
            in_daemon_ns(d, "umount", str(c))
        # the next attempt comes within the backoff's cap (5 s); a loaded machine may add a zygote's slow start
        assert wait_for(lambda: health(d).status_code == 200, 30), f"{health(d).text}\n{d.log.read_text()[-3000:]}"
        assert all((c / d.cgroup_parent / "_zygote").is_dir() for c in controllers(d))
        sid = a.create(image)["id"]
        assert a.sh(sid, "echo healed")[0] == "healed\n"
        assert "Z" not in children(d.proc.pid).values(), children(d.proc.pid)
    finally:
        a.close()


def test_a_killed_zygote_leaves_no_zombie(tmp_path, image):
    d = Daemon(tmp_path / "run").start()
    try:
        zygote = zygote_of(d)
        os.kill(zygote, signal.SIGKILL)
        assert wait_for(lambda: health(d).status_code == 200 and zygotes(d) not in ([], [zygote]), 10)
        assert wait_for(lambda: _stat(zygote)[0] == "", 2), f"the old zygote is {_stat(zygote)}"
        assert "Z" not in children(d.proc.pid).values(), children(d.proc.pid)
    finally:
        d.stop()
        d.cleanup_cgroups()


def test_autostart_names_an_unhealthy_daemon_and_starts_no_second_one(isolated_daemon):
    d = isolated_daemon
    for c in controllers(d):
        in_daemon_ns(d, "mount", "-t", "tmpfs", "-o", "ro,size=4k", "blocked", str(c))
    os.kill(zygote_of(d), signal.SIGKILL)
    assert wait_for(lambda: health(d).status_code == 503, 10)
    saved = {"HUTCH_RUN_DIR": os.environ.get("HUTCH_RUN_DIR")}
    os.environ["HUTCH_RUN_DIR"] = str(d.run_dir)
    try:
        with pytest.raises(DaemonError) as e:
            ensure_daemon(Endpoint(socket_path=str(d.sock)))
    finally:
        restore_env(saved)
    msg = str(e.value)
    assert "cannot start sandboxes" in msg and "could not be restarted" in msg, msg
    assert str(d.run_dir / "daemon.log") in msg, msg
    assert not (d.run_dir / "daemon.log").exists(), "a second daemon was started"
    assert health(d).json()["pid"] == d.proc.pid
