"""A private hutch daemon and a tiny busybox image for the tests that put memory inside sandboxes.

Imported by tests/fuse and tests/mcp; the daemon runs on its own socket
(HUTCH_RUN_DIR / HUTCH_SOCKET), never a host daemon, and is stopped at the end.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

from hutch_testing import make_busybox_root, sdk_pointed_at, start_daemon, stop_daemon


def busybox_root(root: Path) -> Path:
    """A root filesystem of static busybox and its applets: enough for sh, ls, cat, echo, sed."""
    return make_busybox_root(root)


@contextmanager
def private_daemon(**daemon_env: str):
    """Start `hutch serve` on a private socket, point this process's SDK at it; yields its env.

    `daemon_env` is extra environment for the daemon only (e.g. HUTCH_USERNS="1")."""
    run_dir = Path(tempfile.mkdtemp(prefix="hutch-fuse-run-"))
    try:
        proc = start_daemon(run_dir, daemon_env)
        try:
            with sdk_pointed_at(run_dir):
                yield {"HUTCH_RUN_DIR": str(run_dir), "HUTCH_SOCKET": str(run_dir / "hutch.sock")}
        finally:
            stop_daemon(proc)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


def views_alive() -> list[str]:
    """Memory view servers and their mounts still present on the host (there should be none)."""
    out = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if "hutch.fuse._mount" in cmd and "--handover" in cmd:
                out.append(f"pid {pid}: {cmd}")
    with open("/proc/self/mountinfo") as f:
        out += [f"mount: {line.split()[4]}" for line in f if "hutch-memory-" in line]
    return out


def views_settled(timeout: float = 15.0) -> list[str]:
    """views_alive() once the view servers of ended sandboxes had `timeout` seconds to go."""
    deadline = time.monotonic() + timeout
    while views_alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    return views_alive()

