"""User namespaces: root in a sandbox is an unprivileged host uid, never host root (the default).

Each sandbox gets its own range of 65536 host ids (HOST_ID_BASE + k * 65536 ..), so a process that
escaped one sandbox's namespaces is a different nobody from every other sandbox's processes: it can
neither signal nor ptrace them. A range is taken when the sandbox's init is spawned and given back
once its cgroups are gone (its processes are dead). Ranges are shared by every daemon of the host
through byte-range locks, which the kernel drops when a daemon dies (its sandboxes die with it), so its
ranges are free again at once. Range k is a daemon's when it holds byte k of RANGE_LOCK and byte
CGROUP_LOCK_OFFSET + k of the root cgroup.procs of the cgroup tree its sandboxes live in: /run may be
another directory for a daemon in another mount namespace (a container's, a chroot's), but the cgroup
tree is the one thing every daemon that can start sandboxes shares (a new mount of it is the same
files). Only root can open that file for writing, and so take a write lock there: a byte that only
read locks cover (any local user can take those) is ignored rather than counted as another daemon's.

The image's layers and the bind sources, owned by host root, are attached to each sandbox as
idmapped mounts made with the sandbox's own user namespace (host 0 -> its root), as detached mount
fds handed to its init: nothing per sandbox is mounted on the host, nothing is left to reap. What
root inside writes to the overlay lands in the tmpfs upper as the sandbox's host ids; a snapshot
shifts them back (layers.commit_tree's uid_shift), so layers hold the sandbox's own ids (0 = root).
"""

from __future__ import annotations

import fcntl
import os
import select
import sys
from pathlib import Path

from hutch._core.errors import SandboxError
from hutch.sandbox._host.native import linux as L

HOST_ID_BASE = 1_000_000_000   # far above /etc/subuid's usual 100000-based ranges
ID_COUNT = 65536
RANGES = 32768                 # up to HOST_ID_BASE + 2**31: below the 32-bit end (4294967295 is "no id")
RANGE_LOCK = "/run/hutch-uid-ranges.lock"
CGROUP_LOCK_OFFSET = 1 << 40   # far from any offset another program might lock in a cgroup file
# The host ids of what sandboxes write to volumes (root inside -> VOLUME_ID_BASE, uid k -> + k): one range
# for every sandbox, since a volume is shared by many; just below the per-sandbox ranges, fixed across restarts.
VOLUME_ID_BASE = HOST_ID_BASE - ID_COUNT
# Every host id hutch maps sandboxes to: an operator's Mount.bind(owner=) may not name one.
SANDBOX_HOST_IDS = range(VOLUME_ID_BASE, HOST_ID_BASE + RANGES * ID_COUNT)


def write_maps(pid: int, base: int = HOST_ID_BASE) -> None:
    """Map ids 0..65535 of `pid`'s (new, still empty) user namespace to base..; done from the host by the daemon."""
    line = f"0 {base} {ID_COUNT}\n".encode()
    for f in ("uid_map", "gid_map"):
        fd = os.open(f"/proc/{pid}/{f}", os.O_WRONLY)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)


class UidRanges:
    """The host id ranges this daemon holds (see the module docstring for the two locks of each)."""

    def __init__(self, path: str = RANGE_LOCK, cgroup_lock: str | None = None):
        self.paths = [path] + ([cgroup_lock] if cgroup_lock else [])
        self.fds: list[int] = []
        self.held: set[int] = set()
        self.next = 0

    def take(self) -> int:
        """Lock a free range; returns its first host id."""
        if not self.fds:
            self.fds = [os.open(self.paths[0], os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)]
            self.fds += [os.open(p, os.O_RDWR | os.O_CLOEXEC) for p in self.paths[1:]]
        for i in range(RANGES):
            k = (self.next + i) % RANGES
            if k in self.held:
                continue   # fcntl locks are per process: our own lock would not refuse us
            if not _lock(self.fds[0], k):
                continue   # another daemon's
            if len(self.fds) > 1 and not _lock(self.fds[1], CGROUP_LOCK_OFFSET + k) \
                    and _written(self.fds[1], CGROUP_LOCK_OFFSET + k):
                _unlock(self.fds[0], k)
                continue   # a daemon's that sees another /run
            self.held.add(k)
            self.next = k + 1
            return HOST_ID_BASE + k * ID_COUNT
        raise SandboxError(f"all {RANGES} user id ranges of this host are in use; end some sandboxes.")

    def give(self, base: int) -> None:
        k = (base - HOST_ID_BASE) // ID_COUNT
        if k in self.held:
            self.held.discard(k)
            _unlock(self.fds[0], k)
            if len(self.fds) > 1:
                _unlock(self.fds[1], CGROUP_LOCK_OFFSET + k)

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)   # drops every lock
        self.fds = []
        self.held.clear()


def _lock(fd: int, offset: int) -> bool:
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, offset)
        return True
    except OSError:
        return False


def _unlock(fd: int, offset: int) -> None:
    fcntl.lockf(fd, fcntl.LOCK_UN, 1, offset)


def _written(fd: int, offset: int) -> bool:
    """Whether a write lock covers the byte (and not only read locks): only a writer blocks a reader."""
    try:
        fcntl.lockf(fd, fcntl.LOCK_SH | fcntl.LOCK_NB, 1, offset)
    except OSError:
        return True
    _unlock(fd, offset)
    return False


def mounts_under(path: Path) -> list[str]:
    prefix = str(path).rstrip("/") + "/"
    out = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        mp = line.split()[4].encode().decode("unicode_escape")
        if mp.startswith(prefix):
            out.append(mp)
    return sorted(out, key=len, reverse=True)


class IdMapper:
    """Whether this kernel and each layer's filesystem can idmap, probed with one helper user namespace."""

    def __init__(self, run_dir: Path):
        self.dir = run_dir / "layers"   # where earlier versions mounted shared layer views
        self.userns_fd = -1
        self.can: dict[str, bool] = {}
        self.why = ""   # why start() failed

    def reap(self) -> None:
        """Unmount layer views an earlier version's crashed daemon left."""
        for mp in mounts_under(self.dir):
            try:
                L.umount2(mp, L.MNT_DETACH)
            except OSError:
                pass
        if self.dir.is_dir():
            for p in self.dir.iterdir():
                try:
                    os.rmdir(p) if p.is_dir() else p.unlink()
                except OSError:
                    pass

    def start(self) -> bool:
        """Make the probing namespace; False (and `why`) if this kernel refuses a new user namespace (a chroot,
        user.max_user_namespaces=0, a container runtime's seccomp profile) or cannot idmap mounts: then
        sandboxes run without one."""
        r, w = os.pipe()        # parent -> child: done, exit
        r2, w2 = os.pipe()      # child -> parent: "u" unshared, or "e" and why not
        pid = os.fork()  # at start-up, before the daemon has threads
        if pid == 0:
            try:
                os.close(w)
                os.close(r2)
                try:
                    L.unshare(L.CLONE_NEWUSER)
                except OSError as e:
                    os.write(w2, b"e" + str(e).encode()[:400])
                else:
                    os.write(w2, b"u")
                    os.read(r, 1)
            finally:
                os._exit(0)
        os.close(r)
        os.close(w2)
        try:
            # a blocking handshake, not a poll of /proc: on a loaded machine the child may take a while
            said = os.read(r2, 512) if select.select([r2], [], [], 10)[0] else b""
            if said != b"u":
                why = said[1:].decode(errors="replace") if said[:1] == b"e" else "its helper did not answer"
                raise OSError(f"the kernel refused a new user namespace: {why}")
            write_maps(pid)
            self.userns_fd = os.open(f"/proc/{pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC)
            try:
                os.close(L.idmapped_tree(str(self.dir.parent), self.userns_fd))
            except OSError as e:
                raise OSError(f"this kernel cannot idmap mounts ({e})") from e
            return True
        except OSError as e:
            self.why = str(e)
            if self.userns_fd >= 0:
                os.close(self.userns_fd)
                self.userns_fd = -1
            return False
        finally:
            os.close(r2)
            try:
                os.write(w, b"x")
            except BrokenPipeError:
                pass   # the helper has exited already (it could not unshare)
            os.close(w)
            os.waitpid(pid, 0)

    def can_idmap(self, path: str) -> bool:
        """Whether the filesystem of layer directory `path` can be idmapped (probed once per path)."""
        ok = self.can.get(path)
        if ok is None:
            try:
                os.close(L.idmapped_tree(path, self.userns_fd))
                ok = True
            except OSError as e:
                ok = False
                print(f"hutch daemon: image layer {path} cannot be idmapped ({e}); sandboxes of images with it "
                      "run without a user namespace (root inside is host root without capabilities).",
                      file=sys.stderr)
            self.can[path] = ok
        return ok

    def stop(self) -> None:
        self.reap()
        if self.userns_fd >= 0:
            os.close(self.userns_fd)
            self.userns_fd = -1


def _overlaps(start: int, count: int) -> bool:
    return start < SANDBOX_HOST_IDS.stop and start + count > SANDBOX_HOST_IDS.start


def check_host_accounts(passwd=None, group=None, subid_files=("/etc/subuid", "/etc/subgid")) -> None:
    """Refuse (ConfigError) a host where another account may act as a sandbox's ids: a local user or group
    whose id is in SANDBOX_HOST_IDS would own the files sandboxes write (their layers, volumes) and could signal their
    processes, and an /etc/subuid or /etc/subgid range overlapping SANDBOX_HOST_IDS lets its user make a user
    namespace that maps those very host ids (newuidmap). `passwd`/`group`: the entries to look at (default:
    the host's, pwd.getpwall()/grp.getgrall())."""
    import grp
    import pwd

    from hutch._core.errors import ConfigError

    span = f"{SANDBOX_HOST_IDS.start}-{SANDBOX_HOST_IDS.stop - 1}"
    for kind, entries in (("user", pwd.getpwall() if passwd is None else passwd),
                          ("group", grp.getgrall() if group is None else group)):
        for e in entries:
            xid = e.pw_uid if kind == "user" else e.gr_gid
            name = e.pw_name if kind == "user" else e.gr_name
            if xid in SANDBOX_HOST_IDS:
                raise ConfigError(f"host {kind} {name!r} has id {xid}, among the ids hutch gives sandboxes ({span}): "
                                  f"it would own what sandboxes write and could signal their processes; give it "
                                  f"another id (`{kind}mod -{'u' if kind == 'user' else 'g'} NEW {name}`) before "
                                  "starting the daemon.")
    for path in subid_files:
        try:
            text = Path(path).read_text(errors="replace")
        except FileNotFoundError:
            continue
        for n, line in enumerate(text.splitlines(), 1):
            parts = line.strip().split(":")
            if len(parts) != 3 or not parts[1].isdigit() or not parts[2].isdigit():
                continue
            start, count = int(parts[1]), int(parts[2])
            if _overlaps(start, count):
                raise ConfigError(f"{path} line {n} gives {parts[0]!r} the ids {start}-{start + count - 1}, which "
                                  f"overlap those hutch gives sandboxes ({span}): that user could map a sandbox's "
                                  f"host ids into a user namespace of theirs and own its files; give them a range "
                                  f"below {SANDBOX_HOST_IDS.start} (`usermod --del-subuids/--del-subgids`, then "
                                  "--add-subuids/--add-subgids) before starting the daemon.")
