"""Helpers of the image suite (a unique module name: the tests/ tree has several conftests)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

#: Every sandbox the suite makes carries this tag; the session ends by terminating whatever has it.
RUN_TAG = {"suite": f"img-{uuid.uuid4().hex[:8]}"}


def start_daemon(run_dir: Path, extra_env: dict | None = None) -> subprocess.Popen:
    """`python -m hutch serve` on a private socket and state dir (from os.environ)."""
    from hutch.sandbox._client import Endpoint, _ping

    sock = run_dir / "hutch.sock"
    log = run_dir / "test-daemon.log"
    env = dict(os.environ, HUTCH_RUN_DIR=str(run_dir), HUTCH_SOCKET=str(sock), **(extra_env or {}))
    with open(log, "ab") as lf:
        proc = subprocess.Popen([sys.executable, "-m", "hutch", "serve"], env=env, stdin=subprocess.DEVNULL,
                                stdout=lf, stderr=lf, start_new_session=True)
    ep = Endpoint(socket_path=str(sock))
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if _ping(ep, 1.0):
            return proc
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    stop_daemon(proc)
    raise RuntimeError(f"the test daemon did not start; its log:\n{log.read_text()[-3000:]}")


def stop_daemon(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def make_busybox_root(root: Path, busybox: str) -> Path:
    """A tiny root filesystem: static busybox and its applets."""
    import shutil

    (root / "bin").mkdir(parents=True)
    shutil.copy2(busybox, root / "bin" / "busybox")
    applets = subprocess.run([busybox, "--list"], capture_output=True, text=True, check=True).stdout.split()
    for a in applets:
        if a != "busybox":
            os.symlink("busybox", root / "bin" / a)
    for d in ("proc", "dev", "sys", "tmp", "etc", "home/user", "usr", "root"):
        (root / d).mkdir(parents=True, exist_ok=True)
    for link in ("sbin", "usr/bin", "usr/sbin"):
        os.symlink("/bin", root / link)
    (root / "etc" / "passwd").write_text("root:x:0:0:root:/root:/bin/sh\n")
    os.chmod(root / "tmp", 0o1777)
    return root
