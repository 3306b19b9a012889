"""Fixtures of the SDK suite: a private daemon, a tiny busybox root, and sandboxes that are always cleaned up.

The daemon runs with its own HUTCH_RUN_DIR / HUTCH_SOCKET, so it never meets a
host daemon; HUTCH_STATE_DIR stays the default so that the default image is
built once per machine and reused. Every sandbox a test makes carries the tag
suite=<this run>, and the session ends by terminating whatever has it.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from sdk_support import RUN_TAG

BUSYBOX = shutil.which("busybox")


def _wait_for_socket(sock: Path, proc: subprocess.Popen, log: Path, timeout: float = 30.0) -> None:
    from hutch.sandbox._client import Endpoint, _ping

    ep = Endpoint(socket_path=str(sock))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if _ping(ep, 1.0):
            return
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    raise RuntimeError(f"the test daemon did not start; its log:\n{log.read_text()[-3000:]}")


def start_daemon(run_dir: Path) -> subprocess.Popen:
    """`python -m hutch serve` on a private socket; the caller stops it with stop_daemon."""
    sock = run_dir / "hutch.sock"
    log = run_dir / "test-daemon.log"
    env = dict(os.environ, HUTCH_RUN_DIR=str(run_dir), HUTCH_SOCKET=str(sock))
    with open(log, "ab") as lf:
        proc = subprocess.Popen([sys.executable, "-m", "hutch", "serve"], env=env, stdin=subprocess.DEVNULL,
                                stdout=lf, stderr=lf, start_new_session=True)
    try:
        _wait_for_socket(sock, proc, log)
    except BaseException:
        stop_daemon(proc)
        raise
    return proc


def stop_daemon(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="session")
def daemon():
    """A private hutch daemon for the session; HUTCH_RUN_DIR/HUTCH_SOCKET point the SDK at it."""
    run_dir = Path(tempfile.mkdtemp(prefix="hutch-sdk-run-"))
    saved = {k: os.environ.get(k) for k in ("HUTCH_RUN_DIR", "HUTCH_SOCKET", "HUTCH_URL", "HUTCH_TOKEN")}
    os.environ.update(HUTCH_RUN_DIR=str(run_dir), HUTCH_SOCKET=str(run_dir / "hutch.sock"))
    os.environ.pop("HUTCH_URL", None)
    os.environ.pop("HUTCH_TOKEN", None)
    proc = None
    try:
        proc = start_daemon(run_dir)
        yield run_dir
    finally:
        try:
            if proc is not None and proc.poll() is None:
                import hutch

                for sb in hutch.Sandbox.list(tags=RUN_TAG):
                    sb.terminate()
        finally:
            if proc is not None:
                stop_daemon(proc)
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
            shutil.rmtree(run_dir, ignore_errors=True)


@pytest.fixture(scope="session")
def busybox_root():
    """A tiny root filesystem: static busybox and its applets, enough for sh, cat, sleep, ls ..."""
    if BUSYBOX is None:
        pytest.fail("busybox is not installed; run scripts/setup.sh (busybox-static is in scripts/debian-packages.txt).")
    root = Path(tempfile.mkdtemp(prefix="hutch-sdk-root-"))
    try:
        (root / "bin").mkdir()
        shutil.copy2(BUSYBOX, root / "bin" / "busybox")
        applets = subprocess.run([BUSYBOX, "--list"], capture_output=True, text=True, check=True).stdout.split()
        for a in applets:
            if a != "busybox":
                os.symlink("busybox", root / "bin" / a)
        for d in ("proc", "dev", "sys", "tmp", "etc", "home/user", "usr", "root"):
            (root / d).mkdir(parents=True, exist_ok=True)
        for link in ("sbin", "usr/bin", "usr/sbin"):
            os.symlink("/bin", root / link)
        (root / "etc" / "passwd").write_text("root:x:0:0:root:/root:/bin/sh\n")
        os.chmod(root / "tmp", 0o1777)
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def make_sandbox(daemon, busybox_root):
    """make_sandbox(*command, **create_kwargs) -> a Sandbox tagged for this run (busybox root by default),
    terminated when the test ends, also when it fails."""
    import hutch

    made = []

    def make(*command, **kw):
        kw.setdefault("image", hutch.Image.from_directory(busybox_root))
        kw.setdefault("timeout", 120)
        kw["tags"] = {**RUN_TAG, **(kw.get("tags") or {})}
        sb = hutch.Sandbox.create(*command, **kw)
        made.append(sb)
        return sb

    try:
        yield make
    finally:
        for sb in made:
            sb.terminate()


@pytest.fixture
def sb(make_sandbox):
    """One idle busybox sandbox."""
    return make_sandbox()
