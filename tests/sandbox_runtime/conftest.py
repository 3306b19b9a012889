"""Fixtures for the native runtime and daemon tests: a tiny busybox root, private daemons, a raw API client.

Each daemon runs as a subprocess with its own HUTCH_RUN_DIR and socket (so its
cgroups live under their own hutch-<hash> parent) and is stopped afterwards;
every sandbox a test creates is terminated by the client's cleanup.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from hutch_testing import make_busybox_root
from rt_support import Api, Daemon

BUSYBOX = shutil.which("busybox") or "/bin/busybox"
HOST_PYTHON = "/usr/bin/python3"


def _require_root():
    if os.geteuid() != 0:
        pytest.skip("the native runtime needs root")


@pytest.fixture(scope="session")
def busybox_root(tmp_path_factory) -> Path:
    """A root filesystem holding only a static busybox and its applets."""
    _require_root()
    if not os.path.exists(BUSYBOX):
        pytest.skip("busybox-static is not installed (scripts/debian-packages.txt lists it)")
    root = make_busybox_root(tmp_path_factory.mktemp("bbroot") / "root", BUSYBOX)
    (root / "lib").symlink_to("usr/lib")
    (root / "lib64").symlink_to("usr/lib64")
    (root / "etc" / "group").write_text("root:x:0:\n")
    (root / "etc" / "marker").write_text("sandbox image\n")
    (root / "etc" / "shadow").write_text("root:sandbox-shadow:0:0:99999:7:::\n")
    return root


@pytest.fixture(scope="session")
def daemon(tmp_path_factory):
    """One daemon for most tests, also listening on loopback TCP with a token."""
    _require_root()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    tls = tmp_path_factory.mktemp("rt-tls")   # a certificate of its own, not the host's state dir's
    subprocess.run([sys.executable, "-m", "hutch", "tls-fingerprint"], env=dict(os.environ, HUTCH_STATE_DIR=str(tls)),
                   check=True, capture_output=True, timeout=60)
    d = Daemon(tmp_path_factory.mktemp("rt") / "run", listen=f"127.0.0.1:{port}", token="t0ken-for-the-tests",
               tls=(tls / "tls" / "daemon.crt", tls / "tls" / "daemon.key"))
    d.port = port
    try:
        yield d.start()
    finally:
        d.stop()
        d.cleanup_cgroups()


@pytest.fixture
def api(daemon):
    a = Api(daemon.sock, daemon.run_dir)
    try:
        yield a
    finally:
        a.close()


@pytest.fixture
def image(busybox_root) -> str:
    return f"dir:{busybox_root}"


@pytest.fixture
def py_mounts() -> list[dict]:
    """Read-only binds of the host's /usr so that the busybox root can run python3 (escape tests)."""
    if not os.path.exists(HOST_PYTHON):
        pytest.skip(f"{HOST_PYTHON} is needed for the syscall-level tests")
    return [{"kind": "bind", "source": "/usr", "target": "/usr", "readonly": True, "size": None}]


