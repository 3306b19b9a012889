"""Where hutch keeps its state. Defaults are named here, and only here.

Which setting wins: an explicit argument, then the environment variable, then
the default below.
"""

from __future__ import annotations

import os
from pathlib import Path

#: Persistent state: images, layers, volumes, snapshots. Env: HUTCH_STATE_DIR.
DEFAULT_STATE_DIR = Path("/var/lib/hutch")
#: Runtime state: the daemon's socket, pid file, per-sandbox records. Env: HUTCH_RUN_DIR.
DEFAULT_RUN_DIR = Path("/run/hutch")
#: Name prefix of the kernel objects a daemon makes (cgroup parents, nft tables); each carries the daemon's
#: instance id too (hutch/sandbox/_host/instance.py). Veths are `hv<id>...`: IFNAMSIZ leaves no room for more.
KERNEL_NAME_PREFIX = "hutch"


def state_dir() -> Path:
    return Path(os.environ.get("HUTCH_STATE_DIR") or DEFAULT_STATE_DIR)


def run_dir() -> Path:
    return Path(os.environ.get("HUTCH_RUN_DIR") or DEFAULT_RUN_DIR)


def daemon_socket() -> Path:
    """The Unix socket the host daemon listens on. Env: HUTCH_SOCKET."""
    return Path(os.environ.get("HUTCH_SOCKET") or run_dir() / "hutch.sock")
