"""`GET /v1/doctor`: how this daemon runs sandboxes, in one small JSON object (`hutch doctor` prints it).

What a newcomer or an operator needs to see at a glance: the isolation mode (user namespaces or the
fallback, and why), the cgroup version, idmap support, the egress gateway, the gVisor runtime (runsc), the
freezer (pause), the warm pool, the default image's cache.
"""

from __future__ import annotations

import os
import platform

from hutch._core import paths
from hutch._version import VERSION
from hutch.sandbox._host import images


def report(mgr) -> dict:
    from hutch.sandbox._host.gvisor import runsc

    listed = images.list_images()
    default = next((i for i in listed if i.get("kind") == "base"), None)
    return {
        "version": VERSION,
        "pid": os.getpid(),
        "kernel": platform.release(),
        "userns": not mgr.no_userns,
        "userns_why_not": mgr.no_userns or None,
        "mode": mgr.mode(),
        # probed with the daemon's helper namespace: unknown without one
        "idmap": True if mgr.idmap.userns_fd >= 0 else None,
        "cgroup": {"version": 2 if mgr.cgroups.v2 else 1, "parent": mgr.cgroups.parent},
        "egress": mgr.network is not None,
        "gvisor": _gvisor(runsc),
        "freezer": mgr.cgroups.can_freeze,
        "warm_pool": {"ready": len(mgr.pool), "target": mgr.warm_pool},
        "sandboxes": sum(1 for sb in mgr.sandboxes.values() if sb.active),
        "run_dir": str(mgr.run_dir),
        "state_dir": str(paths.state_dir()),
        "images": {"dir": str(images.images_dir()), "default": images.default_image_status(),
                   "stored": len(listed) - (1 if default else 0)},
    }


def _gvisor(runsc) -> dict:
    """Whether runtime="gvisor" can run here: runsc present and new enough, and busybox for its pid 1."""
    p = runsc.probe()
    why = p.why or ("" if runsc.host_busybox() else "the host's static busybox is missing (busybox-static)")
    return {"available": not why, "version": p.version or None, "why_not": why or None}
