"""The seam where the egress gateway gives a sandbox its network.

A daemon with no attacher serves only `Network.none()`: each sandbox has a new,
empty network namespace with loopback up. An attacher (hutch.sandbox._host.egress
exports `daemon_attacher()` returning one) is called after the sandbox's
namespaces exist and before its command runs, with the host pid of the
sandbox's init; `/proc/<pid>/ns/net` is its network namespace.
"""

from __future__ import annotations

import importlib
import sys
from typing import Protocol


class NetworkAttacher(Protocol):
    async def attach(self, sandbox_id: str, init_pid: int, network, *, plain: bool = False) -> None:
        """Give the sandbox (its netns: /proc/<init_pid>/ns/net) the network its policy allows (`plain`: a plain
        /32 address on its link, for gVisor's netstack)."""

    async def update(self, sandbox_id: str, network) -> None:
        """Replace the policy of a running sandbox; connections it forbids are reset."""

    async def detach(self, sandbox_id: str) -> None:
        """Remove everything attach made (veths, rules); called once the sandbox has ended."""

    def log(self, sandbox_id: str) -> dict:
        """The gateway's log of this sandbox: {"decisions": [...], oldest first, and the counters of the
        rest ("seen", "dropped", "refusals_by_reason", "refusals_by_target", "limits")}."""


def load_attacher() -> NetworkAttacher | None:
    """The egress gateway's attacher, if the gateway is installed and offers one."""
    try:
        mod = importlib.import_module("hutch.sandbox._host.egress")
    except ImportError:
        return None
    factory = getattr(mod, "daemon_attacher", None)
    if not callable(factory):
        return None
    try:
        return factory()
    except Exception as e:  # noqa: BLE001 - a broken gateway must not stop sandboxes without network
        print(f"hutch daemon: the egress gateway did not start ({e}); only Network.none() is served.", file=sys.stderr)
        return None
