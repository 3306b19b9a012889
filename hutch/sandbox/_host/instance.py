"""A daemon instance and the names of everything host-wide it makes.

A run directory's path does not name a daemon: two daemons can have the same one in different mount
namespaces (one in a container or a chroot beside one on the host), and share the host's cgroup tree,
network stack and uid space. So the first daemon that starts with a run directory makes a random
instance id and keeps it there (`run_dir/instance-id`); a restarted daemon of that instance finds
its own id (and reaps its own leftovers), a daemon in another mount namespace finds another.
Every host-wide name derives from the id, and a daemon touches only names of its own:

    cgroup parent   hutch-<id>            (under each controller, or the v2 root)
    nft table       inet hutch_egress_<id>
    veth prefix     hv<id[:5]>            (+ the sandbox address in hex: 15 characters, IFNAMSIZ - 1)
    egress subnet   a /20 of 198.18.0.0/15, the first free one in an order derived from the id
"""

from __future__ import annotations

import ipaddress
import os
import re
import secrets
from dataclasses import dataclass
from pathlib import Path

from hutch._core.errors import ConfigError
from hutch._core.paths import KERNEL_NAME_PREFIX

ID_FILE = "instance-id"
_ID = re.compile(r"[0-9a-f]{8}")
#: Where the egress subnets come from: RFC 2544 benchmarking space, never routed on the internet.
EGRESS_SPACE = "198.18.0.0/15"
EGRESS_PREFIXLEN = 20       # 4093 sandboxes with a network per daemon, 32 daemons per host


def instance_id(run_dir: Path) -> str:
    """The id of the daemon instance of `run_dir`, made (once, race-free) if it has none yet."""
    path = Path(run_dir) / ID_FILE
    try:
        return _read(path)
    except FileNotFoundError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{ID_FILE}.{os.getpid()}.{secrets.token_hex(4)}")
    tmp.write_text(secrets.token_hex(4) + "\n")
    try:
        os.link(tmp, path)   # never replaces: of two starting at once, the first one's id wins
    except FileExistsError:
        pass
    finally:
        tmp.unlink()
    return _read(path)


def _read(path: Path) -> str:
    text = path.read_text().strip()
    if not _ID.fullmatch(text):
        raise ConfigError(f"{path} holds {text[:40]!r}, not a daemon instance id (8 hex digits); remove it "
                          "with no daemon running and the next one makes a new id.")
    return text


@dataclass(frozen=True)
class InstanceNames:
    """The host-wide names of one daemon instance (see the module docstring)."""

    id: str

    @property
    def cgroup_parent(self) -> str:
        return f"{KERNEL_NAME_PREFIX}-{self.id}"

    @property
    def nft_table(self) -> str:
        return f"{KERNEL_NAME_PREFIX}_egress_{self.id}"

    @property
    def link_prefix(self) -> str:
        return f"hv{self.id[:5]}"

    def egress_subnets(self) -> list[str]:
        """Every candidate subnet, in this instance's own order (so a restarted daemon tries the same one first)."""
        subnets = list(ipaddress.IPv4Network(EGRESS_SPACE).subnets(new_prefix=EGRESS_PREFIXLEN))
        start = int(self.id, 16) % len(subnets)
        return [str(n) for n in subnets[start:] + subnets[:start]]


def names_for(run_dir: Path) -> InstanceNames:
    return InstanceNames(instance_id(run_dir))


__all__ = ["InstanceNames", "instance_id", "names_for"]
