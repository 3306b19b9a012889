"""The runsc binary: whether this host has a usable one, the flags every call of a sandbox shares, and the
OCI bundle (config.json) of a sandbox.

Measured on this kind of host (docs/architecture.md, "The gVisor runtime"): `--platform=systrap` (kvm hangs
without vmx, ptrace is slower), `--overlay2=none` (the sandbox writes into the daemon's overlay on the host:
its disk= limit holds, the files API and filesystem snapshots work on it), `--file-access=shared` (a file the
daemon renames into place is seen inside), `--network=sandbox` (gVisor's netstack on the eth0 the egress
gateway plumbed: the host rules see its frames as the kernel's) or `none`.
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
import shutil
import subprocess
from dataclasses import dataclass

RUNSC = "runsc"
#: The oldest runsc build that works here: bookworm main's 0.0~20221219 has no systrap and its checkpoint
#: never returns; scripts/setup.sh installs this one from bookworm-backports.
MIN_VERSION = 20240729
PLATFORM = "systrap"
SHM_SIZE = 64 * 1024**2   # bytes of /dev/shm, as native/plan.py's
#: Where a sandbox's busybox (the host's static one, bound read-only) sits inside: the pid 1 of a sandbox
#: without a command (`sleep`), whatever the image has.
BUSYBOX_AT = "/dev/.hutch/busybox"
HOST_BUSYBOX = ("/bin/busybox", "/usr/bin/busybox")
#: A gVisor sandbox's host tasks: the sentry's ~20 threads and about 2 per process inside (systrap stubs).
#: Reaching the host pids.max kills the whole sandbox (the sentry cannot make a stub), so the host limit is
#: this much above the spec's: a fork bomb ends the sandbox instead of failing with EAGAIN inside.
def host_pids(pids: int) -> int:
    return 2 * pids + 64


@dataclass(frozen=True)
class Probe:
    """What this host's runsc is: `ok` (usable), its `version` line, and `why` not."""

    ok: bool
    version: str
    why: str
    path: str = ""


@functools.lru_cache(maxsize=1)
def probe() -> Probe:
    """Look runsc up once per daemon: present, and new enough (its build date in the version)."""
    path = shutil.which(RUNSC) or ""
    if not path:
        return Probe(False, "", "runsc (gVisor) is not installed; run scripts/setup.sh as root (it installs runsc "
                                "from Debian bookworm-backports)")
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError) as e:
        return Probe(False, "", f"`runsc --version` failed ({e}); reinstall it with scripts/setup.sh", path)
    first = out.splitlines()[0] if out else ""
    m = re.search(r"version \S*?(\d{8})", first)
    if not m:
        return Probe(False, first, f"cannot read runsc's version from {first!r}; reinstall it with scripts/setup.sh", path)
    if int(m.group(1)) < MIN_VERSION:
        return Probe(False, first, f"runsc {m.group(1)} is too old (needs {MIN_VERSION} or newer, from bookworm-backports: "
                                   "the older one cannot checkpoint); run scripts/setup.sh as root", path)
    return Probe(True, first, "", path)


def host_busybox() -> str:
    for p in HOST_BUSYBOX:
        if os.path.exists(p):
            return p
    return ""


@functools.lru_cache(maxsize=1)
def bundle_id() -> str:
    """What of a sandbox's bundle is this host's rather than its spec's: the busybox bound in at BUSYBOX_AT (a
    restored pid 1 may be running it). Its sha256, recorded in every memory snapshot; a restore needs the same."""
    h = hashlib.sha256()
    path = host_busybox()
    if path:
        with open(path, "rb") as f:
            while data := f.read(1 << 20):
                h.update(data)
    return "busybox-sha256:" + h.hexdigest()


def global_flags(root: str, network: bool) -> list[str]:
    """The flags every runsc call of one sandbox must repeat (a restore needs the same ones too)."""
    return [f"--root={root}", f"--platform={PLATFORM}", f"--network={'sandbox' if network else 'none'}",
            "--overlay2=none", "--file-access=shared"]


def bundle_config(*, args: list[str], env: dict, cwd: str, root: str, hostname: str, netns: str, cgroups_path: str,
                  memory: int, cpu: float, pids: int, uid_base: int, caps=(), resolv_conf: str = "",
                  tmpfs=(), binds=()) -> dict:
    """config.json of a sandbox. Every copy restored from it must list the same mounts (by destination)."""
    capabilities = [f"CAP_{c}" for c in caps]
    mounts = [
        {"destination": "/proc", "type": "proc", "source": "proc"},
        {"destination": "/dev", "type": "tmpfs", "source": "tmpfs", "options": ["nosuid", "mode=755"]},
        {"destination": "/sys", "type": "sysfs", "source": "sysfs", "options": ["nosuid", "noexec", "nodev", "ro"]},
        {"destination": BUSYBOX_AT, "type": "bind", "source": host_busybox(), "options": ["rbind", "ro"]},
    ]
    if resolv_conf:
        mounts.append({"destination": "/etc/resolv.conf", "type": "bind", "source": resolv_conf,
                       "options": ["rbind", "ro"]})
    # /dev/shm as a native sandbox's (plan.SHM_SIZE): gVisor's own would take up to half its memory
    mounts.append({"destination": "/dev/shm", "type": "tmpfs", "source": "tmpfs",
                   "options": ["nosuid", "nodev", "mode=1777", f"size={min(SHM_SIZE, memory)}"]})
    for target, size in tmpfs:
        mounts.append({"destination": target, "type": "tmpfs", "source": "tmpfs",
                       "options": ["nosuid", "nodev", f"size={size}"]})
    for target, readonly in binds:   # the host tree the daemon attached at root+target (runtime.mount_binds)
        mounts.append({"destination": target, "type": "bind", "source": root + target.rstrip("/"),
                       "options": ["rbind", "nosuid", "nodev", "ro" if readonly else "rw"]})
    linux: dict = {
        "namespaces": [{"type": t} for t in ("pid", "ipc", "uts", "mount")] + [{"type": "network", "path": netns}],
        "cgroupsPath": cgroups_path,
        "resources": {"memory": {"limit": memory}, "cpu": {"quota": int(cpu * 100_000), "period": 100_000},
                      "pids": {"limit": host_pids(pids)}},
    }
    if uid_base:   # the sentry and the gofer run as the sandbox's own unprivileged host uid
        linux["namespaces"].append({"type": "user"})
        linux["uidMappings"] = [{"containerID": 0, "hostID": uid_base, "size": 65536}]
        linux["gidMappings"] = [{"containerID": 0, "hostID": uid_base, "size": 65536}]
    return {
        "ociVersion": "1.0.0",
        "process": {"user": {"uid": 0, "gid": 0}, "args": list(args), "cwd": cwd,
                    "env": [f"{k}={v}" for k, v in env.items()], "noNewPrivileges": True,
                    "capabilities": {k: capabilities for k in ("bounding", "effective", "inheritable", "permitted")}},
        "root": {"path": root, "readonly": False},
        "hostname": hostname,
        "mounts": mounts,
        "linux": linux,
    }
