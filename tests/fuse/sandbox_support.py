"""A private hutch daemon and a tiny busybox image for the tests that put memory inside sandboxes.

Imported by tests/fuse and tests/mcp; the daemon runs on its own socket
(HUTCH_RUN_DIR / HUTCH_SOCKET), never a host daemon, and is stopped at the end.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path


def busybox_root(root: Path) -> Path:
    """A root filesystem of static busybox and its applets: enough for sh, ls, cat, echo, sed."""
    bb = shutil.which("busybox")
    if bb is None:
        raise RuntimeError("busybox is not installed; run scripts/setup.sh (busybox-static).")
    (root / "bin").mkdir(parents=True)
    shutil.copy2(bb, root / "bin" / "busybox")
    for a in subprocess.run([bb, "--list"], capture_output=True, text=True, check=True).stdout.split():
        if a != "busybox":
            os.symlink("busybox", root / "bin" / a)
    for d in ("proc", "dev", "sys", "tmp", "etc", "home/user", "usr", "root"):
        (root / d).mkdir(parents=True, exist_ok=True)
    for link in ("sbin", "usr/bin", "usr/sbin"):
        os.symlink("/bin", root / link)
    os.chmod(root / "tmp", 0o1777)
    return root


@contextmanager
def private_daemon(**daemon_env: str):
    """Start `hutch serve` on a private socket, point this process's SDK at it; yields its env.

    `daemon_env` is extra environment for the daemon only (e.g. HUTCH_USERNS="1")."""
    run_dir = Path(tempfile.mkdtemp(prefix="hutch-fuse-run-"))
    sock = run_dir / "hutch.sock"
    env_over = {"HUTCH_RUN_DIR": str(run_dir), "HUTCH_SOCKET": str(sock)}
    saved = {k: os.environ.get(k) for k in ("HUTCH_RUN_DIR", "HUTCH_SOCKET", "HUTCH_URL", "HUTCH_TOKEN")}
    log = run_dir / "daemon.log"
    with open(log, "ab") as lf:
        proc = subprocess.Popen([sys.executable, "-m", "hutch", "serve"], env={**os.environ, **env_over, **daemon_env},
                                stdin=subprocess.DEVNULL, stdout=lf, stderr=lf, start_new_session=True)
    try:
        from hutch.sandbox._client import Endpoint, _ping

        deadline = time.monotonic() + 30
        while not _ping(Endpoint(socket_path=str(sock)), 1.0):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the test daemon did not start:\n{log.read_text()[-2000:]}")
            time.sleep(0.05)
        os.environ.update(env_over)
        os.environ.pop("HUTCH_URL", None)
        os.environ.pop("HUTCH_TOKEN", None)
        yield env_over
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        shutil.rmtree(run_dir, ignore_errors=True)


def views_alive() -> list[str]:
    """Memory view servers and their mounts still present on the host (there should be none)."""
    out = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                cmd = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if "hutch.fuse._mount" in cmd and "--handover" in cmd:
                out.append(f"pid {pid}: {cmd}")
    with open("/proc/self/mountinfo") as f:
        out += [f"mount: {line.split()[4]}" for line in f if "hutch-memory-" in line]
    return out
