"""Where hutch keeps its state. The defaults are in the settings table (hutch/_core/settings.py).

Which setting wins: an explicit argument, then the environment variable, then
the default.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from hutch._core import settings
from hutch._core.errors import ConfigError

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


def owned_by_root(path: Path, what: str = "HUTCH_RUN_DIR / HUTCH_SOCKET (the default is /run/hutch)", *,
                  sticky: bool = False) -> None:
    """Refuse `path` unless it (if it exists) and every directory above it are root's and writable by no other
    user; an ancestor may be writable by all if it is sticky (/tmp): nobody else can rename what root made there.
    Both the path as given and the one its symlinks lead to are checked (e.g. /var/run and /run). The root daemon
    (and the SDK's autostart, as root) calls it before it makes or writes anything there. `sticky`: `path` itself
    may be sticky and writable by all too (the directory of a socket elsewhere, /tmp: others make no name of its)."""
    path = Path(os.path.abspath(path))
    real = Path(os.path.realpath(path))
    for p in dict.fromkeys([path, *path.parents, real, *real.parents]):
        try:
            st = os.stat(p)
        except FileNotFoundError:
            continue
        top = p in (path, real)
        if st.st_uid != 0:
            raise ConfigError(f"{p} belongs to uid {st.st_uid}, not root: whoever owns it could plant links there or "
                              f"swap it while the daemon runs; `chown root {p}` (and `chmod go-w`), or give the daemon "
                              f"a directory of root's own in {what}.")
        if st.st_mode & 0o022 and ((top and not sticky) or not st.st_mode & stat.S_ISVTX):
            raise ConfigError(f"{p} is writable by other users ({stat.S_IMODE(st.st_mode):04o}): they could plant "
                              f"links there or swap what is inside; `chmod go-w {p}`, or give the daemon a directory "
                              f"of root's own in {what}.")
