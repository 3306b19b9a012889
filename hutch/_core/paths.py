"""Where hutch keeps its state. The defaults are in the settings table (hutch/_core/settings.py).

Which setting wins: an explicit argument, then the environment variable, then
the default.
"""

from __future__ import annotations

from pathlib import Path

from hutch._core import settings

#: Persistent state: images, layers, volumes, snapshots. Env: HUTCH_STATE_DIR.
DEFAULT_STATE_DIR = settings.STATE_DIR.default
#: Runtime state: the daemon's socket, pid file, per-sandbox records. Env: HUTCH_RUN_DIR.
DEFAULT_RUN_DIR = settings.RUN_DIR.default
#: Name prefix of the kernel objects a daemon makes (cgroup parents, nft tables); each carries the daemon's
#: instance id too (hutch/sandbox/_host/instance.py). Veths are `hv<id>...`: IFNAMSIZ leaves no room for more.
KERNEL_NAME_PREFIX = "hutch"
#: The directory holding the hutch package: the zygote and gVisor's keeper (python -I -S) import from here.
PACKAGE_PARENT = Path(__file__).resolve().parents[2]


def state_dir() -> Path:
    return settings.STATE_DIR.get()


def run_dir() -> Path:
    return settings.RUN_DIR.get()


def daemon_socket() -> Path:
    """The Unix socket the host daemon listens on. Env: HUTCH_SOCKET."""
    return settings.SOCKET.get() or run_dir() / "hutch.sock"
