"""Test support shared by the suites that run real sandboxes: a tiny busybox root and private daemons.

Importable from every test module because tests/conftest.py puts this directory on sys.path
(pytest's default import mode for a conftest outside a package).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

#: The variables that point the SDK at a daemon; a test that changes them restores them.
SDK_ENV = ("HUTCH_RUN_DIR", "HUTCH_SOCKET", "HUTCH_URL", "HUTCH_TOKEN", "HUTCH_STATE_DIR")


def make_busybox_root(root: Path, busybox: str | None = None) -> Path:
    """Fill `root` with a root filesystem of static busybox and its applets (sh, cat, ls, sleep, wget ...)."""
    busybox = busybox or shutil.which("busybox")
    if busybox is None:
        raise RuntimeError("busybox is not installed; run scripts/setup.sh (busybox-static is in scripts/debian-packages.txt).")
    (root / "bin").mkdir(parents=True)
    shutil.copy2(busybox, root / "bin" / "busybox")
    for a in subprocess.run([busybox, "--list"], capture_output=True, text=True, check=True).stdout.split():
        if a != "busybox":
            os.symlink("busybox", root / "bin" / a)
    for d in ("proc", "dev", "sys", "tmp", "etc", "home/user", "usr", "root"):
        (root / d).mkdir(parents=True, exist_ok=True)
    for link in ("sbin", "usr/bin", "usr/sbin"):
        os.symlink("/bin", root / link)
    (root / "etc" / "passwd").write_text("root:x:0:0:root:/root:/bin/sh\n")
    os.chmod(root / "tmp", 0o1777)
    return root


def start_daemon(run_dir: Path, extra_env: dict | None = None, prefix: tuple[str, ...] = (),
                 timeout: float = 30.0) -> subprocess.Popen:
    """`python -m hutch serve` on run_dir/hutch.sock (state dir from os.environ), ready when this returns.

    `prefix` runs it under another command (e.g. nsenter into a test network namespace)."""
    from hutch.sandbox._client import Endpoint, _ping

    sock = run_dir / "hutch.sock"
    log = run_dir / "test-daemon.log"
    env = dict(os.environ, HUTCH_RUN_DIR=str(run_dir), HUTCH_SOCKET=str(sock), **(extra_env or {}))
    with open(log, "ab") as lf:
        proc = subprocess.Popen([*prefix, sys.executable, "-m", "hutch", "serve"], env=env,
                                stdin=subprocess.DEVNULL, stdout=lf, stderr=lf, start_new_session=True)
    ep = Endpoint(socket_path=str(sock))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if _ping(ep, 1.0):
            return proc
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    stop_daemon(proc)
    raise RuntimeError(f"the test daemon did not start; its log:\n{log.read_text()[-3000:]}")


def stop_daemon(proc: subprocess.Popen, timeout: float = 20.0) -> None:
    """SIGTERM (the daemon tears every sandbox down), SIGKILL only if it does not end in time."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextmanager
def sdk_pointed_at(run_dir: Path, **extra: str):
    """Point this process's SDK at the daemon of `run_dir` (and `extra` variables); restore on exit."""
    saved = {k: os.environ.get(k) for k in (*SDK_ENV, *extra)}
    os.environ.update(HUTCH_RUN_DIR=str(run_dir), HUTCH_SOCKET=str(run_dir / "hutch.sock"), **extra)
    os.environ.pop("HUTCH_URL", None)
    os.environ.pop("HUTCH_TOKEN", None)
    try:
        yield
    finally:
        restore_env(saved)


def restore_env(saved: dict) -> None:
    """Put back environment variables saved as {name: value or None (was unset)}."""
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@contextmanager
def sandbox_maker(root: Path, tags: dict):
    """Yield make(*command, **create_kwargs) -> a Sandbox from the busybox `root`, carrying `tags`;
    every sandbox it made is terminated on exit, also when the test failed."""
    import hutch

    made = []

    def make(*command, **kw):
        kw.setdefault("image", hutch.Image.from_directory(root))
        kw.setdefault("timeout", 120)
        kw["tags"] = {**tags, **(kw.get("tags") or {})}
        sb = hutch.Sandbox.create(*command, **kw)
        made.append(sb)
        return sb

    try:
        yield make
    finally:
        for sb in made:
            sb.terminate()
