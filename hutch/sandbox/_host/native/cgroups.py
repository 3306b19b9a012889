"""Per-sandbox cgroups: memory, pids and cpu limits; OOM counts; freeze and thaw (pause); kill and removal.

cgroup v1 (this host runs hybrid: v1 controllers, an empty v2 tree) puts each
sandbox at /sys/fs/cgroup/<controller>/<parent>/<id>; pure cgroup v2 at
/sys/fs/cgroup/<parent>/<id>. `parent` is `hutch` for the default daemon and
`hutch-<hash>` for a daemon with its own run directory, so daemons never
reap each other's sandboxes.

Each daemon holds its instance's lock (an open-file-description lock on one byte, at an offset
derived from its instance id, of a file of the cgroup tree's root: the same file for every daemon
whatever its mount namespace) from before it makes anything until it has removed its parents. A
daemon killed outright leaves its parents (and its sandboxes' cgroups, whose processes die with
its zygote): any daemon that starts reaps such leftovers of every instance whose lock is free and
whose cgroups hold no process (a live daemon always has its zygote in `_zygote`), under every
controller the host mounts (gVisor's runsc makes its cgroups in all of them).
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import signal
import struct
import time
from pathlib import Path

from hutch._core.errors import SandboxError

CGROUP_ROOT = Path("/sys/fs/cgroup")
V1_CONTROLLERS = ("memory", "pids", "cpu")
#: v1 only: the freezer, joined too when the host mounts it (pause/resume; v2 has cgroup.freeze in every cgroup).
V1_FREEZER = "freezer"
FREEZE_TIMEOUT = 5.0   # seconds a freeze may stay FREEZING (a task in an uninterruptible sleep) before it fails
CPU_PERIOD_US = 100_000
#: The suffix of a checkpoint's memory cgroup beside its sandbox's (Cgroups.set_aside)
ASIDE = ".image"
ZYGOTE_LEAF = "_zygote"
#: A daemon's sandboxes together hold at most 1 / HOST_PIDS_DIVISOR of the host's process ids.
HOST_PIDS_DIVISOR = 2
#: The parent directories of daemon instances (instance.InstanceNames.cgroup_parent).
INSTANCE_PARENT = re.compile(r"hutch-[0-9a-f]{8}")
#: Where an instance's lock byte sits in the lock file: past idmap's range locks (which use POSIX locks on
#: another file), at this base plus the instance id as a number.
INSTANCE_LOCK_OFFSET = 1 << 40
INSTANCE_LOCK_WAIT = 10.0   # seconds a starting daemon waits for its lock (a reaper holds it while it checks)
#: Seconds an instance's cgroups must have been unchanged before another daemon reaps them: a daemon of a hutch
#: older than the instance lock has none, and holds no process until its zygote starts.
REAP_QUIET = 10.0


def _write(path, value) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, str(value).encode())
    finally:
        os.close(fd)


def host_pids_share() -> int:
    """How many processes and threads a daemon's sandboxes may hold together: half of what the host has."""
    limits = []
    for f in ("/proc/sys/kernel/pid_max", "/proc/sys/kernel/threads-max"):
        try:
            limits.append(int(Path(f).read_text()))
        except (OSError, ValueError):
            continue
    return max(1024, min(limits, default=32768) // HOST_PIDS_DIVISOR)


class Cgroups:
    """The cgroup subtree of one daemon."""

    def __init__(self, parent: str, root: Path = CGROUP_ROOT):
        self.parent = parent
        self.root = root
        self._lock_fd = -1   # this instance's lock (hold_instance)
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
            controllers = V1_CONTROLLERS + ((V1_FREEZER,) if (root / V1_FREEZER / "cgroup.procs").exists() else ())
            self.bases = [root / c / parent for c in controllers]
        self.can_freeze = self.v2 or len(self.bases) > len(V1_CONTROLLERS)
        # plain strings: these paths are built on every create and teardown, pathlib costs more there
        self._bases = [str(b) for b in self.bases]
        self._memsw: bool | None = None   # the v1 memory controller accounts swap (looked up once)

    def instance_lock_file(self) -> Path:
        """The file of the tree's root whose bytes lock instances (not lock_file(): idmap holds POSIX locks there,
        which any close of another descriptor of that file by this process would drop)."""
        return self.root / "cgroup.threads" if self.v2 else self.pids_dir().parent / "tasks"

    def _lock_at(self, fd: int, offset: int, kind: int, wait: bool = False) -> bool:
        cmd = fcntl.F_OFD_SETLKW if wait else fcntl.F_OFD_SETLK
        try:
            fcntl.fcntl(fd, cmd, struct.pack("hhqqi4x", kind, os.SEEK_SET, offset, 1, 0))
            return True
        except OSError as e:
            if e.errno in (errno.EAGAIN, errno.EACCES):
                return False
            raise

    @staticmethod
    def _offset(parent: str) -> int:
        return INSTANCE_LOCK_OFFSET + int(parent.rsplit("-", 1)[1], 16)

    def hold_instance(self) -> None:
        """Take this instance's lock for the daemon's life (until release_instance); waits a little for a reaper
        that is checking it, and fails if another live daemon holds it (the same instance id in another mount
        namespace: a copied run directory)."""
        if self._lock_fd >= 0 or not INSTANCE_PARENT.fullmatch(self.parent):
            return
        fd = os.open(self.instance_lock_file(), os.O_WRONLY | os.O_CLOEXEC)   # (a write lock needs a writer)
        end = time.monotonic() + INSTANCE_LOCK_WAIT
        while not self._lock_at(fd, self._offset(self.parent), fcntl.F_WRLCK):
            if time.monotonic() > end:
                os.close(fd)
                raise SandboxError(f"another daemon holds the cgroup parent {self.parent} (its instance id); each "
                                   "daemon needs a run directory of its own, so do not copy one (remove its "
                                   "instance-id file while no daemon uses it).")
            time.sleep(0.05)
        self._lock_fd = fd

    def release_instance(self) -> None:
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1

    def controller_roots(self) -> list[Path]:
        """Every hierarchy the host mounts under the root (v1: one per controller; v2: the root)."""
        if self.v2:
            return [self.root]
        seen, out = set(), []
        for p in sorted(self.root.iterdir()):
            try:
                real = p.resolve()
                if not (real / "cgroup.procs").exists() or real in seen:
                    continue
            except OSError:
                continue
            seen.add(real)
            out.append(real)
        return out

    def remove_parents(self) -> None:
        """Remove this daemon's (empty) parent in every hierarchy: also in controllers only runsc used."""
        for ctrl in self.controller_roots():
            _remove_tree(ctrl / self.parent, deadline=0)

    def reap_dead_instances(self) -> list[str]:
        """Remove the parents (and everything under them) of every other instance whose daemon is gone: its lock is
        free and none of its cgroups holds a process. Returns the parents reaped."""
        if self._lock_fd < 0:
            return []
        found: dict[str, list[Path]] = {}
        for ctrl in self.controller_roots():
            try:
                names = [p.name for p in ctrl.iterdir() if INSTANCE_PARENT.fullmatch(p.name) and p.is_dir()]
            except OSError:
                continue
            for name in names:
                if name != self.parent:
                    found.setdefault(name, []).append(ctrl / name)
        reaped = []
        for name, dirs in sorted(found.items()):
            offset = self._offset(name)
            if not self._lock_at(self._lock_fd, offset, fcntl.F_WRLCK):
                continue   # its daemon is alive
            try:
                if any(_populated(d) for d in dirs) or time.time() - _newest_change(dirs) < REAP_QUIET:
                    continue   # a daemon of a hutch without this lock, or its last processes still exiting
                if all(_remove_tree(d, deadline=1.0) for d in dirs):
                    reaped.append(name)
            finally:
                self._lock_at(self._lock_fd, offset, fcntl.F_UNLCK)
        return reaped

    def setup(self) -> None:
        """Make (or remake: a restart after someone removed them) the parents and the zygote's leaf."""
        for b in self.bases:
            b.mkdir(exist_ok=True)
        if self.v2:
            # Controllers must be enabled on the way down; a v2 parent with controllers holds no processes.
            _write(self.bases[0].parent / "cgroup.subtree_control", "+memory +pids +cpu")
            _write(self.bases[0] / "cgroup.subtree_control", "+memory +pids +cpu")
        # Process ids are a host-wide pool (kernel.pid_max, 32768 by default): 64 sandboxes filling their own
        # pids limit (512) would leave the host none. All of this daemon's sandboxes together get at most a share.
        _write(self.pids_dir() / "pids.max", host_pids_share())
        for b in self.bases:
            (b / ZYGOTE_LEAF).mkdir(exist_ok=True)

    def lock_file(self) -> Path:
        """A file of this cgroup tree's root, the same for every daemon whatever its mount namespace (it locks
        byte ranges there: see idmap.UidRanges)."""
        return self.bases[0].parent / "cgroup.procs" if self.v2 else self.pids_dir().parent / "cgroup.procs"

    def pids_dir(self) -> Path:
        """The daemon's own cgroup of the pids controller (its sandboxes' parent)."""
        return self.bases[0] if self.v2 else self.bases[V1_CONTROLLERS.index("pids")]

    def dirs(self, sid: str) -> list[Path]:
        return [b / sid for b in self.bases]

    def paths(self, sid: str) -> tuple[str, ...]:
        """The sandbox's cgroup directories: a host process doing work for it (a memory view) joins them. Not the
        freezer's: a view frozen with the sandbox would hang every host process that looks at its mount."""
        return tuple(f"{b}/{sid}" for b in self._bases[:len(V1_CONTROLLERS)])

    def procs_files(self, sid: str) -> list[str]:
        return [f"{b}/{sid}/cgroup.procs" for b in self._bases]

    def create(self, sid: str, memory: int | None = None, pids: int | None = None, cpu: float | None = None) -> None:
        for b in self._bases:
            os.mkdir(f"{b}/{sid}")
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
        mem, pid, cpud = (f"{b}/{sid}" for b in self._bases[:3])
        if memory:
            _write(f"{mem}/memory.limit_in_bytes", memory)
            if self._memsw is None:
                self._memsw = os.path.exists(f"{mem}/memory.memsw.limit_in_bytes")
            if self._memsw:  # no swap beyond the limit
                _write(f"{mem}/memory.memsw.limit_in_bytes", memory)
        if pids:
            _write(f"{pid}/pids.max", pids)
        if cpu:
            # the period is the kernel's default (100 ms) in a new cgroup: only the quota needs writing
            if CPU_PERIOD_US != 100_000:
                _write(f"{cpud}/cpu.cfs_period_us", CPU_PERIOD_US)
            _write(f"{cpud}/cpu.cfs_quota_us", int(cpu * CPU_PERIOD_US))

    def set_aside(self, sid: str, pid: int, memory: int, cpu: float) -> bool:
        """For gVisor's checkpoint of a paused sandbox: process `pid` (its sentry) moved into a memory cgroup of its
        own beside the sandbox's (`<sid>.image`, of `memory` bytes) and the sandbox's cpu quota (`cpu`) lifted, so
        that the image it writes goes through the page cache, charged there and not to the sandbox's limit, at full
        speed (a restore then reads it from memory; see `put_back`). What it held stays charged to the sandbox. v1
        only: False (nothing done) on v2, where a move takes every controller with it."""
        if self.v2:
            return False
        mem, cpud = (self._bases[V1_CONTROLLERS.index(c)] for c in ("memory", "cpu"))
        aside = f"{mem}/{sid}{ASIDE}"
        os.mkdir(aside)
        try:
            _write(f"{aside}/memory.limit_in_bytes", memory)
            if os.path.exists(f"{aside}/memory.memsw.limit_in_bytes"):
                _write(f"{aside}/memory.memsw.limit_in_bytes", memory)
            _write(f"{cpud}/{sid}/cpu.cfs_quota_us", -1)
            _write(f"{aside}/cgroup.procs", pid)
        except BaseException:
            self.put_back(sid, pid, cpu)
            raise
        return True

    def put_back(self, sid: str, pid: int, cpu: float | None) -> None:
        """Undo `set_aside`: `pid` back in the sandbox's memory cgroup, its cpu quota `cpu` again, the aside
        removed (the image's page cache stays cached, charged to the removed cgroup, reclaimable). A sentry that
        cannot be moved back is killed (it would run outside its limit): its sandbox ends."""
        mem = self._bases[V1_CONTROLLERS.index("memory")]
        try:
            _write(f"{mem}/{sid}/cgroup.procs", pid)
        except ProcessLookupError:
            pass   # it has ended
        except OSError:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            raise
        finally:
            if cpu:
                self.set_limits(sid, cpu=cpu)
        try:
            os.rmdir(f"{mem}/{sid}{ASIDE}")
        except FileNotFoundError:
            pass
        except OSError as e:   # its process still ending: the sandbox's removal takes it (remove)
            if e.errno != errno.EBUSY:
                raise

    def start_freeze(self, sid: str) -> bool:
        """Ask the freezer to stop every process of the sandbox, and say whether all are stopped already (an idle
        sandbox's usually are, within the write: then no waiting, in a thread or otherwise, is needed)."""
        if not self.can_freeze:
            raise SandboxError("this host mounts no cgroup freezer (v1 `freezer` controller), so sandboxes cannot "
                               "be paused; mount it under /sys/fs/cgroup/freezer, or boot with cgroup v2.")
        path, value, want = self._freezer(sid, True)
        _write(path, value)
        return self._freezer_state(sid) == want

    def freeze(self, sid: str) -> None:
        """Stop every process of the sandbox where it is (memory kept); returns once all are stopped."""
        if self.start_freeze(sid):
            return
        _, _, want = self._freezer(sid, True)
        end = time.monotonic() + FREEZE_TIMEOUT
        delay = 0.0002
        while self._freezer_state(sid) != want:
            if time.monotonic() > end:
                self.thaw(sid)
                raise SandboxError(f"sandbox {sid} did not freeze within {FREEZE_TIMEOUT:.0f} s (a process in an "
                                   "uninterruptible wait); it runs on; retry the pause.")
            time.sleep(delay)
            delay = min(delay * 2, 0.01)

    def thaw(self, sid: str) -> None:
        """Let the sandbox's processes run again (a no-op if they were not frozen, or the cgroup is gone)."""
        if not self.can_freeze:
            return
        path, value, _ = self._freezer(sid, False)
        try:
            _write(path, value)
        except FileNotFoundError:
            pass

    def frozen(self, sid: str) -> bool:
        return self.can_freeze and self._freezer_state(sid) in ("FROZEN", "FREEZING", "1")

    def _freezer(self, sid: str, freeze: bool) -> tuple[str, str, str]:
        if self.v2:
            return f"{self._bases[0]}/{sid}/cgroup.freeze", "1" if freeze else "0", "frozen 1"
        return f"{self._bases[-1]}/{sid}/freezer.state", "FROZEN" if freeze else "THAWED", "FROZEN"

    def _freezer_state(self, sid: str) -> str:
        try:
            if self.v2:   # cgroup.events says "frozen 1" once every task is stopped
                text = Path(f"{self._bases[0]}/{sid}/cgroup.events").read_text()
                return "frozen 1" if "frozen 1" in text else "0"
            return Path(f"{self._bases[-1]}/{sid}/freezer.state").read_text().strip()
        except FileNotFoundError:
            return ""

    def oom_kills(self, sid: str) -> int:
        try:
            fd = os.open(f"{self._bases[0]}/{sid}/{'memory.events' if self.v2 else 'memory.oom_control'}",
                         os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return 0
        try:
            text = os.read(fd, 4096).decode()
        except OSError:
            return 0
        finally:
            os.close(fd)
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
        pending = [f"{b}/{sid}" for b in self._bases]
        if not self.v2:   # a checkpoint's aside (set_aside), should one be left
            pending.append(f"{self._bases[V1_CONTROLLERS.index('memory')]}/{sid}{ASIDE}")
        delay = 0.0005
        while pending:
            for d in list(pending):
                try:
                    os.rmdir(d)
                    pending.remove(d)
                except FileNotFoundError:
                    pending.remove(d)
                except OSError as e:
                    if e.errno != errno.EBUSY:
                        raise
                    self.thaw(sid)   # a frozen process does not die of SIGKILL until it is thawed (v1)
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
        """The sandboxes' cgroups under this daemon's parent: of its own controllers and of any other (runsc's)."""
        names: set[str] = set()
        for ctrl in self.controller_roots():
            b = ctrl / self.parent
            if b.is_dir():
                names.update(p.name for p in b.iterdir() if p.is_dir())
        return sorted(names)

    def remove_everywhere(self, sid: str) -> bool:
        """remove(sid), and the sandbox's cgroups under controllers hutch does not join (runsc's)."""
        ok = self.remove(sid)
        own = {Path(b).parent for b in self._bases}
        for ctrl in self.controller_roots():
            if ctrl not in own:
                ok = _remove_tree(ctrl / self.parent / sid, deadline=1.0) and ok
        return ok


def _populated(path: Path) -> bool:
    """Whether any cgroup at or under `path` holds a process."""
    for dirpath, dirnames, _ in os.walk(path):
        try:
            with open(os.path.join(dirpath, "cgroup.procs"), "rb") as f:
                if f.read(16).strip():
                    return True
        except OSError:
            continue
    return False


def _newest_change(dirs) -> float:
    """When the newest of these cgroups (or of their children) was made or changed."""
    newest = 0.0
    for d in dirs:
        try:
            newest = max(newest, d.stat().st_mtime, *(c.stat().st_mtime for c in d.iterdir() if c.is_dir()))
        except OSError:
            newest = time.time()   # changing under us
    return newest


def _remove_tree(path: Path, deadline: float) -> bool:
    """rmdir a cgroup and every cgroup under it, deepest first, killing what is left in them (thawed first);
    True when all are gone. Never follows anything but directories of the cgroup filesystem."""
    end = time.monotonic() + deadline
    while True:
        dirs = []
        for dirpath, dirnames, _ in os.walk(path):
            dirs.append(dirpath)
        busy = False
        for d in reversed(dirs):   # children before their parents
            try:
                os.rmdir(d)
            except FileNotFoundError:
                pass
            except OSError as e:
                if e.errno != errno.EBUSY:
                    raise
                busy = True
                for name, value in (("freezer.state", "THAWED"), ("cgroup.freeze", "0")):
                    try:
                        _write(os.path.join(d, name), value)
                    except OSError:
                        pass
                try:
                    pids = open(os.path.join(d, "cgroup.procs")).read().split()
                except OSError:
                    pids = []
                for pid in pids:
                    try:
                        os.kill(int(pid), signal.SIGKILL)
                    except (ProcessLookupError, ValueError):
                        pass
        if not busy:
            return True
        if time.monotonic() > end:
            return False
        time.sleep(0.01)
