"""Per-sandbox cgroups: memory, pids and cpu limits; OOM counts; kill and removal.

cgroup v1 (this host runs hybrid: v1 controllers, an empty v2 tree) puts each
sandbox at /sys/fs/cgroup/<controller>/<parent>/<id>; pure cgroup v2 at
/sys/fs/cgroup/<parent>/<id>. `parent` is `hutch` for the default daemon and
`hutch-<hash>` for a daemon with its own run directory, so daemons never
reap each other's sandboxes.
"""

from __future__ import annotations

import errno
import os
import signal
import time
from pathlib import Path

from hutch._core.errors import SandboxError

CGROUP_ROOT = Path("/sys/fs/cgroup")
V1_CONTROLLERS = ("memory", "pids", "cpu")
CPU_PERIOD_US = 100_000
ZYGOTE_LEAF = "_zygote"


def _write(path: Path, value) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, str(value).encode())
    finally:
        os.close(fd)


class Cgroups:
    """The cgroup subtree of one daemon."""

    def __init__(self, parent: str, root: Path = CGROUP_ROOT):
        self.parent = parent
        self.v2 = (root / "cgroup.controllers").exists()
        if self.v2:
            self.bases = [root / parent]
        else:
            missing = [c for c in V1_CONTROLLERS if not (root / c / "cgroup.procs").exists()]
            if missing:
                raise SandboxError(
                    f"cgroup controllers {missing} are not mounted under {root}; mount the v1 memory, pids and cpu "
                    "controllers, or boot with cgroup v2."
                )
            self.bases = [root / c / parent for c in V1_CONTROLLERS]

    def setup(self) -> None:
        for b in self.bases:
            b.mkdir(exist_ok=True)
        if self.v2:
            # Controllers must be enabled on the way down; a v2 parent with controllers holds no processes.
            _write(self.bases[0].parent / "cgroup.subtree_control", "+memory +pids +cpu")
            _write(self.bases[0] / "cgroup.subtree_control", "+memory +pids +cpu")
        self.create(ZYGOTE_LEAF)

    def dirs(self, sid: str) -> list[Path]:
        return [b / sid for b in self.bases]

    def procs_files(self, sid: str) -> list[str]:
        return [str(d / "cgroup.procs") for d in self.dirs(sid)]

    def create(self, sid: str, memory: int | None = None, pids: int | None = None, cpu: float | None = None) -> None:
        for d in self.dirs(sid):
            d.mkdir()
        self.set_limits(sid, memory, pids, cpu)

    def set_limits(self, sid: str, memory: int | None = None, pids: int | None = None, cpu: float | None = None) -> None:
        if self.v2:
            d = self.dirs(sid)[0]
            if memory:
                _write(d / "memory.max", memory)
                _write(d / "memory.swap.max", 0) if (d / "memory.swap.max").exists() else None
            if pids:
                _write(d / "pids.max", pids)
            if cpu:
                _write(d / "cpu.max", f"{int(cpu * CPU_PERIOD_US)} {CPU_PERIOD_US}")
            return
        mem, pid, cpud = self.dirs(sid)
        if memory:
            _write(mem / "memory.limit_in_bytes", memory)
            if (mem / "memory.memsw.limit_in_bytes").exists():  # no swap beyond the limit
                _write(mem / "memory.memsw.limit_in_bytes", memory)
        if pids:
            _write(pid / "pids.max", pids)
        if cpu:
            _write(cpud / "cpu.cfs_period_us", CPU_PERIOD_US)
            _write(cpud / "cpu.cfs_quota_us", int(cpu * CPU_PERIOD_US))

    def oom_kills(self, sid: str) -> int:
        d = self.dirs(sid)[0]
        try:
            text = (d / ("memory.events" if self.v2 else "memory.oom_control")).read_text()
        except OSError:
            return 0
        for line in text.splitlines():
            k, _, v = line.partition(" ")
            if k == "oom_kill":
                return int(v)
        return 0

    def pids(self, sid: str) -> set[int]:
        out: set[int] = set()
        for d in self.dirs(sid):
            try:
                out.update(int(x) for x in (d / "cgroup.procs").read_text().split())
            except FileNotFoundError:
                pass
        return out

    def remove(self, sid: str, deadline: float = 2.0) -> bool:
        """Kill whatever is left in the sandbox's cgroups and remove them; True when all are gone."""
        end = time.monotonic() + deadline
        pending = [d for d in self.dirs(sid) if d.exists()]
        delay = 0.0005
        while pending:
            for d in list(pending):
                try:
                    d.rmdir()
                    pending.remove(d)
                except FileNotFoundError:
                    pending.remove(d)
                except OSError as e:
                    if e.errno != errno.EBUSY:
                        raise
                    for pid in self.pids(sid):  # only processes of this sandbox's own cgroup
                        try:
                            os.kill(pid, signal.SIGKILL)
                        except ProcessLookupError:
                            pass
            if pending:
                if time.monotonic() > end:
                    return False
                time.sleep(delay)
                delay = min(delay * 2, 0.02)
        return True

    def children(self) -> list[str]:
        names: set[str] = set()
        for b in self.bases:
            if b.is_dir():
                names.update(p.name for p in b.iterdir() if p.is_dir())
        return sorted(names)
