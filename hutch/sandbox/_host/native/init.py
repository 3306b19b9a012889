"""A sandbox's init (pid 1): builds the root, locks itself down, then serves the daemon.

Runs in the clone()d child of the zygote, already inside the sandbox's
cgroups and new namespaces. Standard library only.
"""

from __future__ import annotations

import errno
import fcntl
import os
import select
import signal
import socket
import stat

from hutch.sandbox._host.native import linux as L
from hutch.sandbox._host.native import initwire, ptys

# Standard library only, and little of it: every module the zygote imports is memory each init may
# copy on write, and mappings each clone() copies (secrets would bring OpenSSL, shutil zlib/bz2/lzma).

# Paths under /proc that leak host information or reach host-wide knobs: Docker's list (kcore ... scsi,
# interrupts), and what else shows host-wide figures: the kernel's command line and config, the host's disks
# (diskstats, partitions, swaps, mdstat), interrupt counts (softirqs), pressure (PSI: its files also take
# host-wide triggers). Files are covered by /dev/null, directories by an empty read-only tmpfs.
PROC_MASK_FILES = ("cmdline", "config.gz", "diskstats", "interrupts", "kcore", "keys", "latency_stats", "mdstat",
                   "partitions", "sched_debug", "softirqs", "swaps", "sysrq-trigger", "timer_list", "timer_stats")
PROC_MASK_DIRS = ("acpi", "asound", "pressure", "scsi")
# Root-only files that show physical memory and the kernel heap's layout (what rowhammer and heap exploits
# want): unreadable to root in a user namespace, so masked only without one (HUTCH_USERNS=0: host root).
PROC_ROOT_ONLY = ("kpagecgroup", "kpagecount", "kpageflags", "pagetypeinfo", "slabinfo", "vmallocinfo")
PROC_READONLY = ("bus", "fs", "irq", "sys")
# /sys: firmware tables, power capping (Docker's list); the host's filesystems' statistics (fs: ext4, xfs,
# btrfs ...) and block devices (their I/O counters, as in /proc/diskstats) where sysfs keeps them: the virtual
# ones' directory and each disk's (_block_device_dirs); /sys/block, class/block and dev/block only link there.
SYS_MASK_DIRS = ("devices/virtual/block", "devices/virtual/powercap", "firmware", "fs")
DEVICES = {"null": (1, 3), "zero": (1, 5), "full": (1, 7), "random": (1, 8), "urandom": (1, 9), "tty": (5, 0)}
# Ptys one sandbox may hold: kernel.pty.max (4096, 1024 of them kept for the host's own /dev/pts) is shared
# by every devpts instance, so without a bound one sandbox could take them all from the others.
MAX_PTYS = 64
#: The sandbox's unprivileged user (uid and gid) an exec may run as: hutch.sandbox._spec.SANDBOX_USER_ID.
USER_ID = 1000
NODEV = L.MS_NOSUID | L.MS_NODEV | L.MS_NOEXEC
_MASKS: tuple | None = None   # (proc files, root-only ones, proc dirs, proc read-only, sys dirs) this kernel has


def _block_device_dirs() -> tuple[str, ...]:
    """The `block` directories of the host's disks under /sys/devices (outside devices/virtual), relative."""
    out = set()
    try:
        names = os.listdir("/sys/class/block")
    except OSError:
        return ()
    for name in names:
        path = os.path.realpath(f"/sys/class/block/{name}")
        while path.startswith("/sys/devices/") and os.path.basename(path) != "block":
            path = os.path.dirname(path)
        if path.startswith("/sys/devices/") and not path.startswith("/sys/devices/virtual/"):
            out.add(path[len("/sys/"):])
    return tuple(sorted(out))


def precompute() -> None:
    """Once, in the zygote: what every init would otherwise look up again (its inits inherit the result).

    A fresh /proc or /sys shows the same kernel-wide entries as the host's, so which of the masked
    paths exist is known before any sandbox starts.
    """
    global _MASKS
    _MASKS = (tuple(n for n in PROC_MASK_FILES if os.path.exists(f"/proc/{n}")),
              tuple(n for n in PROC_ROOT_ONLY if os.path.exists(f"/proc/{n}")),
              tuple(n for n in PROC_MASK_DIRS if os.path.isdir(f"/proc/{n}")),
              tuple(n for n in PROC_READONLY if os.path.exists(f"/proc/{n}")),
              tuple(n for n in SYS_MASK_DIRS if os.path.isdir(f"/sys/{n}")) + _block_device_dirs())
    L.cap_last_cap()
_UPPER = -1   # O_PATH fd of the overlay's writable layer


def main(ctl: socket.socket, plan: dict, seccomp: bytes, keep=(), go: int = -1, native: int = -1) -> int:
    """Become the sandbox's init; returns only on a failure before it was ready.

    In two steps: join the cgroups and unshare the namespaces, report "warm" and
    wait for the root's plan (a warm pool keeps inits parked here); then build
    the root, lock down, and serve: with `native` (an fd of the C init, initd.c,
    which the zygote opened) by exec'ing that in place of this interpreter, else here.
    """
    if go >= 0:   # a helper cloned this init (zygote.clone_init): on once it is in its cgroups
        ready = os.read(go, 1) == b"g"
        os.close(go)
        if not ready:
            return 1
    else:         # (the helper's death would fire PDEATHSIG: the daemon kills such an init instead)
        L.prctl(L.PR_SET_PDEATHSIG, signal.SIGKILL)
    low = 3
    for fd in sorted(set(keep) | ({native} if native >= 0 else set())):
        os.closerange(low, fd)
        low = fd + 1
    os.closerange(low, 65536)
    try:
        if go < 0:
            join_cgroups(plan["cgroup_procs"])
        L.unshare(L.UNSHARE_NS_FLAGS)
        initwire.send(ctl, {"op": "warm"})
        msg, trees = initwire.recv(ctl)
        if msg is None:  # the daemon is gone, or did not need this warm init
            return 0
        plan = msg["plan"]
        L.unshare(L.CLONE_NEWNS)
        _setup_root(plan, trees)
        for fd in trees:
            os.close(fd)
        if plan.get("userns"):   # (without one, uid 1000 inside would be host uid 1000, a real account)
            _keep_user(USER_ID)
        _lockdown(seccomp, plan.get("caps") or ())
        if native >= 0 and not plan.get("caps"):
            _exec_native(ctl, native)
    except Exception as e:  # report why, then die: the daemon tears the rest down
        try:
            initwire.send(ctl, {"op": "failed", "message": f"{type(e).__name__}: {e}"})
        except OSError:
            pass
        return 1
    Init(ctl, plan).serve()
    return 0


def _exec_native(ctl: socket.socket, native: int) -> None:
    """Serve as the C init from here (initd.c: the same protocol as Init, a few pages where this interpreter
    keeps its copy-on-write heap): exec it in place of this process, already locked down (no_new_privs,
    capabilities, seccomp all survive the execve). The sandbox's user rides in as the effective and saved ids:
    an execve makes the saved ids the effective ones, which would lose the user _keep_user kept (the C init
    sets its effective ids back to 0 first thing). An image build step's capabilities (plan["caps"]) would not
    survive that, so such an init stays this one. Nothing of the sandbox runs before the C init's "ready", so
    nothing can reach it before it makes itself not dumpable again."""
    os.set_inheritable(ctl.fileno(), True)
    if _UPPER >= 0:
        os.set_inheritable(_UPPER, True)
    if _USER_KEPT:
        os.setresgid(-1, USER_ID, -1)
        os.setresuid(-1, USER_ID, -1)
    os.execve(native, ["hutch-init", str(ctl.fileno()), str(_UPPER), "1" if _USER_KEPT else "0"], {})


def join_cgroups(procs_files, pid: int = 0) -> None:
    for path in procs_files:  # pid 0: this process; before any namespace exists
        fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
        try:
            os.write(fd, str(pid).encode())
        finally:
            os.close(fd)


# --- building the root -----------------------------------------------------------------

def _safe_target(root: str, target: str, is_file: bool) -> str:
    """Create a mount point at root+target without following symlinks (the image could plant them)."""
    path = root
    parts = [p for p in target.split("/") if p]
    if any(p in (".", "..") for p in parts):
        raise OSError(errno.EINVAL, f"mount target {target} must not contain '.' or '..'")
    for i, part in enumerate(parts):
        path = os.path.join(path, part)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            if is_file and i == len(parts) - 1:
                os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o644))
            else:
                os.mkdir(path, 0o755)
            continue
        if stat.S_ISLNK(st.st_mode):
            raise OSError(errno.ELOOP, f"mount target {target} crosses a symlink in the image")
    return path


def _locked_flags(path: str) -> int:
    """The mount flags a remount must keep: in a user namespace, clearing one the host set is refused."""
    f = os.statvfs(path).f_flag
    flags = f & (L.MS_RDONLY | L.MS_NOSUID | L.MS_NODEV | L.MS_NOEXEC | 1024 | 2048)  # + NOATIME, NODIRATIME
    return flags | (1 << 21 if f & 4096 else 0)  # ST_RELATIME -> MS_RELATIME


def _ro_bind(path: str, extra: int = 0) -> None:
    L.mount(path, path, None, L.MS_BIND | L.MS_REC)
    L.mount(None, path, None, L.MS_BIND | L.MS_REMOUNT | L.MS_RDONLY | extra)


def _setup_root(plan: dict, trees=()) -> None:
    """Build the sandbox's root under the scratch mount point, then pivot into it.

    Paths below are relative to the scratch tmpfs (the working directory): with a
    user namespace the init is its root (an unprivileged host uid, from its clone on),
    and that uid may not traverse the host directories on the way; the image's layers
    and the bind sources therefore come from the daemon as detached, idmapped mount
    fds (`trees`), attached here.
    """
    os.umask(0)
    # Nothing we mount from here on may propagate back to the host.
    L.mount(None, "/", None, L.MS_REC | L.MS_PRIVATE)
    userns = bool(plan.get("userns"))
    lowers = list(plan["lowerdirs"])
    # a bind's tree (from the daemon, runtime.bind_trees) stands for its source from here on
    sources = {i: f"/proc/self/fd/{trees[m['tree']]}" if m.get("tree") is not None else m["source"]
               for i, m in enumerate(plan["mounts"]) if m["kind"] == "bind"}
    # The writable layer: a subvolume of the disk store (disk.py), relative to the working directory, which is
    # the store's root in this mount namespace (inherited from the zygote); else the scratch tmpfs (memory).
    layer = os.open(plan["layer"], os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC) \
        if plan.get("layer") else -1
    # With a user namespace the init is the sandbox's host uid from the start, which may not traverse
    # the run directory's parents: its scratch covers /tmp of its own mount namespace instead.
    scratch = "/tmp" if userns else plan["scratch"]
    L.mount("hutch", scratch, "tmpfs", L.MS_NOSUID | L.MS_NODEV,
            f"size={plan['disk'] if layer < 0 else 1 << 20},mode=0755" + (",uid=0,gid=0" if userns else ""))
    os.chdir(scratch)
    if userns:  # root of the sandbox's user namespace (its host uid already: the ids map to it)
        os.setgroups([])
        os.setresgid(0, 0, 0)
        os.setresuid(0, 0, 0)
    if layer >= 0:
        upper, work = f"/proc/self/fd/{layer}/upper", f"/proc/self/fd/{layer}/work"
    else:
        upper, work = "upper", "work"
        for d in ("upper", "work"):
            os.mkdir(d, 0o755)
    os.mkdir("root", 0o755)
    if plan.get("lower_trees") is not None:   # the image's layers, idmapped for this sandbox
        lowers = []
        for i, t in enumerate(plan["lower_trees"]):
            os.mkdir(f"l{i}", 0o755)
            L.move_mount_fd(trees[t], f"l{i}")
            lowers.append(f"l{i}")
    global _UPPER  # kept for snapshots (op_upper): after pivot_root no path reaches it
    _UPPER = os.open(upper, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    root = "root"
    # userxattr: in a user namespace overlay may not write trusted.* xattrs, and without its opaque
    # markers removing a directory of the image and making it again fails with EIO.
    # volatile (a disk layer): no sync of the upper, ever; it dies with the sandbox, and a sync at unmount would
    # commit the store's transaction on every sandbox's end
    L.mount("overlay", root, "overlay", L.MS_NOSUID | L.MS_NODEV,
            f"lowerdir={':'.join(lowers)},upperdir={upper},workdir={work}" + (",userxattr" if userns else "")
            + (",volatile" if layer >= 0 else ""))
    if layer >= 0:
        os.close(layer)

    proc = _safe_target(root, "/proc", False)
    L.mount("proc", proc, "proc", NODEV)
    if _MASKS is None:
        precompute()
    proc_files, root_only, proc_dirs, proc_ro, sys_dirs = _MASKS
    for name in proc_files + (() if userns else root_only):
        L.mount("/dev/null", f"{proc}/{name}", None, L.MS_BIND)
    # one empty read-only tmpfs, bound over every masked directory (a bind is cheaper than a superblock each)
    os.mkdir("empty", 0o555)
    L.mount("hutch", "empty", "tmpfs", NODEV | L.MS_RDONLY, "size=4k,nr_inodes=1,mode=0555")
    for name in proc_dirs:
        L.mount("empty", f"{proc}/{name}", None, L.MS_BIND)
    for name in proc_ro:
        _ro_bind(f"{proc}/{name}", NODEV)

    sysfs = _safe_target(root, "/sys", False)
    L.mount("sysfs", sysfs, "sysfs", NODEV | L.MS_RDONLY)
    for name in sys_dirs:
        L.mount("empty", f"{sysfs}/{name}", None, L.MS_BIND)

    dev = _safe_target(root, "/dev", False)
    L.mount("hutch", dev, "tmpfs", L.MS_NOSUID | L.MS_NOEXEC, "mode=0755,size=64k")
    for name in DEVICES:  # bound from the host's: a user namespace may not mknod
        os.close(os.open(os.path.join(dev, name), os.O_WRONLY | os.O_CREAT, 0o666))
        L.mount(f"/dev/{name}", os.path.join(dev, name), None, L.MS_BIND)
    os.mkdir(os.path.join(dev, "pts"), 0o755)
    L.mount("devpts", os.path.join(dev, "pts"), "devpts", L.MS_NOSUID | L.MS_NOEXEC,
            f"newinstance,ptmxmode=0666,mode=0620,max={MAX_PTYS}")
    os.symlink("pts/ptmx", os.path.join(dev, "ptmx"))
    os.mkdir(os.path.join(dev, "shm"), 0o1777)
    L.mount("hutch", os.path.join(dev, "shm"), "tmpfs", NODEV, f"mode=1777,size={plan['shm']}")
    for name, to in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"),
                     ("stdout", "/proc/self/fd/1"), ("stderr", "/proc/self/fd/2")):
        os.symlink(to, os.path.join(dev, name))

    for i, m in enumerate(plan["mounts"]):
        if m["kind"] == "bind":
            target = _safe_target(root, m["target"], not os.path.isdir(sources[i]))
            if m.get("tree") is not None:  # the source as the daemon sees it (runtime.bind_trees)
                L.move_mount_fd(trees[m["tree"]], target)
            else:
                L.mount(sources[i], target, None, L.MS_BIND)
            flags = L.MS_BIND | L.MS_REMOUNT | L.MS_NOSUID | L.MS_NODEV | (L.MS_RDONLY if m["readonly"] else 0)
            L.mount(None, target, None, flags | _locked_flags(target))
        elif m["kind"] == "tmpfs":
            target = _safe_target(root, m["target"], False)
            L.mount("hutch", target, "tmpfs", L.MS_NOSUID | L.MS_NODEV, f"size={m['size']},mode=1777")

    os.chdir(root)
    L.pivot_root(".", ".")          # the old root now sits on top of the new one ...
    L.umount2(".", L.MNT_DETACH)    # ... and this detaches it: the host is unreachable
    os.chdir("/")
    os.umask(0o022)
    L.sethostname(plan["hostname"])
    L.loopback_up()
    os.close(_makedirs(plan["workdir"]))   # not through /proc/self/fd/<a layer's tree> an image planted


_USER_KEPT = False


def _keep_user(uid: int) -> None:
    # The sandbox's unprivileged user, as the saved set-user and set-group ids of the init: without any
    # capability, a process may still set its ids to its real, effective or saved ones, so the init's own
    # children (forked for an exec with "uid") can become that user and nothing else. An execve makes the
    # saved ids the effective ones (0), so no command the init starts as root inherits even that.
    global _USER_KEPT
    os.setresgid(0, 0, uid)
    os.setresuid(0, 0, uid)
    _USER_KEPT = True


def _lockdown(seccomp: bytes, caps=()) -> None:
    # no_new_privs first: no later execve (setuid, file capabilities) can gain privileges,
    # and it lets the seccomp filter load without CAP_SYS_ADMIN.
    L.prctl(L.PR_SET_NO_NEW_PRIVS, 1)
    # Not dumpable: processes of the sandbox (same uid, no capabilities, like the init) may not
    # ptrace it, read its memory or take its descriptors (its socket to the daemon) via /proc/1/fd
    # or pidfd_getfd. The commands it starts are dumpable again after their execve.
    L.prctl(L.PR_SET_DUMPABLE, 0)
    if caps:   # an image build step (SandboxSpec.capabilities): a Docker-like subset, never admin ones
        L.limit_capabilities(caps)
    else:
        L.drop_all_capabilities()
    L.load_seccomp(seccomp)


# --- serving the daemon -----------------------------------------------------------------

_ERRNO_CLASS = {
    errno.ENOENT: "NotFoundError", errno.ENOTDIR: "NotFoundError", errno.EISDIR: "ConfigError",
    errno.EEXIST: "ConfigError", errno.ENOTEMPTY: "ConfigError", errno.ENOSPC: "StateError",
    errno.EDQUOT: "StateError", errno.EACCES: "ConfigError", errno.EPERM: "ConfigError",
    errno.EROFS: "ConfigError", errno.ELOOP: "ConfigError", errno.ENAMETOOLONG: "ConfigError",
    errno.ENOEXEC: "ConfigError", errno.EINVAL: "ConfigError", errno.EBUSY: "StateError",
    errno.ETXTBSY: "StateError", errno.EXDEV: "ConfigError", errno.ENXIO: "ConfigError", errno.ENODEV: "ConfigError",
    errno.EFBIG: "ConfigError", errno.EMLINK: "ConfigError", errno.EOVERFLOW: "ConfigError",
}


def _error(rid, e: OSError, what: str) -> dict:
    fix = {
        errno.ENOENT: "check the path (it is inside the sandbox) or create it first",
        errno.ENOTDIR: "a parent of the path is not a directory",
        errno.EISDIR: "it is a directory; use files.list, or give a file path",
        errno.ENOTEMPTY: "the directory is not empty; pass recursive=True to remove it with its contents",
        errno.ENOSPC: "the sandbox's disk limit is reached; create it with a larger disk= or remove files",
        errno.EDQUOT: "the sandbox's disk limit is reached; create it with a larger disk= or remove files",
        errno.EACCES: "the sandbox's root has no capabilities, so only files it owns or may access are reachable",
        errno.EROFS: "that path is on a read-only mount",
        errno.EINVAL: "only regular files can be read this way (a file of /proc or /sys is made as it is read: "
                      "run('cat', path) reads it)",
        errno.ELOOP: "the path leads through a /proc link of a process or too many symlinks; give a plain path",
        errno.EBUSY: "it is a mount point or in use; what the sandbox was created with stays until it ends",
        errno.ETXTBSY: "a running program is that file; end the command first",
        errno.ENXIO: "it is a device or socket, not a file",
        errno.ENODEV: "it is a device or socket, not a file",
    }.get(e.errno, "check the path and try again")
    return {"rid": rid, "ok": False, "error": _ERRNO_CLASS.get(e.errno, "SandboxError"),
            "message": f"{what}: {os.strerror(e.errno or 0)}; {fix}.", "errno": e.errno}


def _entry(path: str, st: os.stat_result) -> dict:
    m = st.st_mode
    kind = "dir" if stat.S_ISDIR(m) else "file" if stat.S_ISREG(m) else "symlink" if stat.S_ISLNK(m) else "other"
    return {"name": os.path.basename(path.rstrip("/")) or "/", "path": path, "type": kind,
            "size": st.st_size, "mode": stat.S_IMODE(m), "mtime": st.st_mtime, "uid": st.st_uid, "gid": st.st_gid}


class _SpawnError(Exception):
    def __init__(self, cls: str, message: str):
        self.cls, self.message = cls, message


# --- paths of the files API -----------------------------------------------------------------
# The init resolves every path of a file call, and to the init /proc/self and /proc/1 are itself: a
# symlink the sandbox planted at /proc/self/fd/2 (the daemon's log) or /proc/self/fd/<n>/.. (its scratch
# mount, outside the root) must not lead there. So no path is followed through a /proc "magic link"
# (openat2's RESOLVE_NO_MAGICLINKS, ELOOP); every other symlink resolves inside the sandbox as before.

#: Filesystems whose files the files API does not read (Init.op_read).
_PSEUDO_FS = (L.PROC_SUPER_MAGIC, L.SYSFS_MAGIC)


def open_no_magic(path: str, flags: int, dir_fd: int = L.AT_FDCWD) -> int:
    """openat2 of `path`, close-on-exec, never through a /proc magic link (the files server's and the keeper's open)."""
    return L.openat2(path, flags | os.O_CLOEXEC, L.RESOLVE_NO_MAGICLINKS, dir_fd)


def _parent(path: str) -> tuple[int, str]:
    """An O_PATH fd of the directory holding `path`'s last name, and that name."""
    head, name = os.path.split(path.rstrip("/") or "/")
    return open_no_magic(head or "/", os.O_PATH | os.O_DIRECTORY), name


def _makedirs(path: str) -> int:
    """os.makedirs(path, exist_ok=True), one directory fd at a time; returns an O_PATH fd of `path`."""
    fd = open_no_magic("/", os.O_PATH | os.O_DIRECTORY)
    try:
        for part in [p for p in path.split("/") if p]:
            try:
                nfd = open_no_magic(part, os.O_PATH | os.O_DIRECTORY, fd)
            except FileNotFoundError:
                try:
                    os.mkdir(part, 0o777, dir_fd=fd)
                except FileExistsError:
                    pass
                nfd = open_no_magic(part, os.O_PATH | os.O_DIRECTORY, fd)
            os.close(fd)
            fd = nfd
    except BaseException:
        os.close(fd)
        raise
    return fd


def _rmtree(name: str, parent: int) -> None:
    """shutil.rmtree's walk by directory fds, which never follows a symlink. Written out because the init
    cannot import shutil late (after pivot_root no module path is reachable) and does not import it early
    (see the imports)."""
    fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent)
    try:
        _rm_contents(fd)
    finally:
        os.close(fd)
    os.rmdir(name, dir_fd=parent)


def _rm_contents(dfd: int) -> None:
    with os.scandir(dfd) as it:
        entries = [(de.name, de.is_dir(follow_symlinks=False)) for de in it]
    for name, is_dir in entries:
        if is_dir:
            fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
            try:
                _rm_contents(fd)
            finally:
                os.close(fd)
            os.rmdir(name, dir_fd=dfd)
        else:
            os.unlink(name, dir_fd=dfd)


def _which(name: str, path: str) -> str | None:
    """execvp's search: a name with a slash as is, else the first executable file on PATH."""
    if "/" in name:
        return name
    for d in path.split(":"):
        cand = os.path.join(d or ".", name)
        try:
            if stat.S_ISREG(os.stat(cand).st_mode) and os.access(cand, os.X_OK):
                return cand
        except OSError:
            continue
    return None


class Init:
    def __init__(self, ctl: socket.socket, plan: dict):
        self.ctl = ctl
        self.plan = plan
        self.procs: dict[int, str] = {}   # pid -> exec id
        self.main_pid: int | None = None
        self.wake_r, self.wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        # From inside its namespace pid 1 gets only the signals it handles, and Python's SIGINT handler raises
        # KeyboardInterrupt: `kill -INT 1` in the sandbox would end it. Handled, it does nothing (an exec'd
        # command starts with the default again).
        signal.signal(signal.SIGINT, lambda *_: None)
        signal.set_wakeup_fd(self.wake_w)

    def serve(self) -> None:
        initwire.send(self.ctl, {"op": "ready"})
        while True:
            ready, _, _ = select.select([self.ctl, self.wake_r], [], [])
            if self.wake_r in ready:
                initwire.drain(self.wake_r)
                self.reap()
            if self.ctl in ready:
                msg, fds = initwire.recv(self.ctl)
                if msg is None:  # the daemon is gone: ending pid 1 ends the sandbox
                    os._exit(0)
                try:
                    reply = getattr(self, "op_" + msg["op"])(msg, fds)
                except OSError as e:
                    reply = _error(msg.get("rid"), e, msg.get("path") or msg["op"])
                finally:
                    for fd in fds:
                        try:
                            os.close(fd)
                        except OSError:
                            pass
                if reply is not None:
                    rfds = reply.pop("_fds", ())
                    try:
                        initwire.send(self.ctl, reply, rfds)
                    finally:
                        for fd in rfds:
                            os.close(fd)

    def reap(self) -> None:
        for pid, status in initwire.reaped():
            eid = self.procs.pop(pid, None)
            if pid == self.main_pid:
                initwire.send(self.ctl, {"op": "main_exit", "status": status})
                os._exit(0)
            if eid is not None:
                initwire.send(self.ctl, {"op": "exec_exit", "eid": eid, "status": status})

    def _spawn(self, msg: dict, fds: list[int]) -> int:
        """posix_spawn (vfork + exec) the command in its own session; raises _SpawnError."""
        argv, cwd, env = msg["argv"], msg["cwd"], msg["env"]
        # posix_spawn would raise ValueError (and so end the init, the sandbox with it) where C strings cannot be
        if "\0" in cwd or any("\0" in a for a in argv) or any(
                not k or "=" in k or "\0" in k or "\0" in v for k, v in env.items()):
            raise _SpawnError("ConfigError", "argv, env and workdir may not hold NUL bytes, nor an env name '=' "
                                             "or be empty; fix the command.")
        prog = _which(argv[0], env.get("PATH", ""))
        if prog is None:
            raise _SpawnError("NotFoundError", f"program {argv[0]!r} was not found in the sandbox; "
                                               "check the name or install it in the image.")
        actions, passed = [], iter(fds)
        for target, want in enumerate(msg["streams"]):  # stdin, stdout, stderr: a passed fd or /dev/null
            if want:
                actions.append((os.POSIX_SPAWN_DUP2, next(passed), target))
            else:
                actions.append((os.POSIX_SPAWN_OPEN, target, "/dev/null", os.O_RDWR, 0))
        try:  # posix_spawn has no chdir action in Python: the init is single-threaded
            fd = open_no_magic(cwd, os.O_PATH | os.O_DIRECTORY)
            try:
                os.fchdir(fd)
            finally:
                os.close(fd)
        except OSError as e:
            raise _SpawnError("NotFoundError" if e.errno in (errno.ENOENT, errno.ENOTDIR) else "ConfigError",
                              f"working directory {cwd!r}: {os.strerror(e.errno or 0)}; create it or pass another workdir.")
        try:
            if msg.get("pty"):
                return self._spawn_as(int(msg.get("uid") or 0), prog, argv, env, msg["streams"], fds, tty=fds[0])
            if msg.get("uid"):
                return self._spawn_as(int(msg["uid"]), prog, argv, env, msg["streams"], fds)
            return os.posix_spawn(prog, argv, env, file_actions=actions, setsid=True,
                                  setsigdef=(signal.SIGPIPE, signal.SIGXFSZ, signal.SIGCHLD))
        except OSError as e:
            if e.errno in (errno.EAGAIN, errno.ENOMEM):
                raise _SpawnError("SandboxError", f"program {argv[0]!r} could not be started: the sandbox is at "
                                                  "its pids or memory limit; end some of its processes or create it "
                                                  "with larger limits.") from None
            cls = "NotFoundError" if e.errno == errno.ENOENT else "ConfigError"
            raise _SpawnError(cls, f"program {argv[0]!r} could not be started: {os.strerror(e.errno or 0)}; "
                                   "check it is an executable for this machine.") from None
        finally:
            os.chdir("/")

    @staticmethod
    def _spawn_as(uid: int, prog: str, argv, env, streams, fds, tty: "int | None" = None) -> int:
        """fork + setresgid/setresuid + execve: posix_spawn cannot change ids, nor take a controlling terminal.
        `tty`: a pty's slave, made the child's controlling terminal and its stdin, stdout and stderr. The child
        reports a failed execve's errno on a close-on-exec pipe (nothing read: it runs)."""
        r, w = os.pipe2(os.O_CLOEXEC)
        pid = os.fork()
        if pid == 0:   # the child: only async-signal-safe-ish calls, then exec or _exit
            try:
                os.setsid()
                if tty is not None:
                    fcntl.ioctl(tty, L.TIOCSCTTY, 0)
                    for target in (0, 1, 2):
                        os.dup2(tty, target)
                else:
                    passed = iter(fds)
                    for target, want in enumerate(streams):
                        src = next(passed) if want else os.open("/dev/null", os.O_RDWR)
                        os.dup2(src, target)
                for sig in (signal.SIGPIPE, signal.SIGXFSZ, signal.SIGCHLD, signal.SIGINT):
                    signal.signal(sig, signal.SIG_DFL)
                if uid:
                    os.setresgid(uid, uid, uid)
                    os.setresuid(uid, uid, uid)
                os.execve(prog, argv, env)
            except OSError as e:
                os.write(w, str(e.errno or 0).encode())
            finally:
                os._exit(127)
        os.close(w)
        try:
            err = os.read(r, 16)
        finally:
            os.close(r)
        if err:
            os.waitpid(pid, 0)
            raise OSError(int(err), os.strerror(int(err)))
        return pid

    def op_exec(self, msg, fds):
        master = None
        if msg.get("pty"):   # its terminal: a pty of the sandbox's own devpts, its master for the daemon
            try:
                master, slave = ptys.open_pty(int(msg.get("uid") or 0) if _USER_KEPT else 0, *msg["pty"])
            except OSError as e:
                if e.errno != errno.ENOSPC:
                    raise
                return {"rid": msg["rid"], "ok": False, "error": "SandboxError", "message":
                        f"the sandbox holds all the {MAX_PTYS} terminals it may have open; end some of its "
                        "terminal sessions first."}
            fds.insert(0, slave)   # closed with the passed fds once the command has it
        try:
            pid = self._spawn(msg, fds)
        except _SpawnError as e:
            if master is not None:
                os.close(master)
            return {"rid": msg["rid"], "ok": False, "error": e.cls, "message": e.message}
        except BaseException:
            if master is not None:
                os.close(master)
            raise
        self.procs[pid] = msg["eid"]
        if msg.get("main"):
            self.main_pid = pid
        reply = {"rid": msg["rid"], "ok": True, "pid": pid}
        if master is not None:
            reply["_fds"] = [master]
        return reply

    def op_kill(self, msg, fds):
        # Signalled as the sandbox's user too: kill() needs the sender's real or effective uid to be the
        # target's real or saved one, and the init has no CAP_KILL; its real uid (0) still reaches root's.
        if _USER_KEPT:
            os.setresuid(-1, USER_ID, -1)
        try:
            for pid, eid in list(self.procs.items()):
                if eid == msg["eid"]:
                    for fn in (os.killpg, os.kill):  # its process group, then itself if it left the group
                        try:
                            fn(pid, msg["signal"])
                        except OSError:
                            pass
                    if msg.get("session"):   # a terminal's session: every job of its shell has a group of its own
                        for other in ptys.session_members(pid):
                            try:
                                os.kill(other, msg["signal"])
                            except OSError:
                                pass
        finally:
            if _USER_KEPT:
                os.setresuid(-1, 0, -1)
        return {"rid": msg["rid"], "ok": True} if "rid" in msg else None

    def op_read(self, msg, fds):
        # A file of /proc or /sys first (looked at through an O_PATH fd, before its own permissions count): such a
        # file's content is made as it is read, its size is 0 or a page, and in /proc/self it would be this init's.
        fd = open_no_magic(msg["path"], os.O_PATH)
        try:
            if stat.S_ISREG(os.fstat(fd).st_mode) and L.fd_fs_type(fd) in _PSEUDO_FS:
                raise OSError(errno.EINVAL, "not a regular file")
        finally:
            os.close(fd)
        fd = open_no_magic(msg["path"], os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY)
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or L.fd_fs_type(fd) in _PSEUDO_FS:   # again: the path may have changed
            os.close(fd)
            raise OSError(errno.EISDIR if stat.S_ISDIR(st.st_mode) else errno.EINVAL, "not a regular file")
        return {"rid": msg["rid"], "ok": True, "size": st.st_size, "_fds": [fd]}

    def op_write_open(self, msg, fds):
        path = msg["path"]
        parent = os.path.dirname(path) or "/"
        dfd = _makedirs(parent)
        try:
            try:
                if stat.S_ISDIR(os.stat(os.path.basename(path), dir_fd=dfd).st_mode):
                    raise OSError(errno.EISDIR, "is a directory")
            except FileNotFoundError:
                pass
            name = f".hutch-write-{os.urandom(6).hex()}"
            fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600, dir_fd=dfd)
        finally:
            os.close(dfd)
        os.fchmod(fd, msg["mode"])
        return {"rid": msg["rid"], "ok": True, "tmp": os.path.join(parent, name), "_fds": [fd]}

    def op_write_commit(self, msg, fds):
        src, name = _parent(msg["tmp"])
        try:
            dst, new = _parent(msg["path"])
            try:
                os.rename(name, new, src_dir_fd=src, dst_dir_fd=dst)
            finally:
                os.close(dst)
        finally:
            os.close(src)
        return {"rid": msg["rid"], "ok": True}

    def op_write_abort(self, msg, fds):
        dfd, name = _parent(msg["tmp"])
        try:
            os.unlink(name, dir_fd=dfd)
        except FileNotFoundError:
            pass
        finally:
            os.close(dfd)
        return {"rid": msg["rid"], "ok": True}

    def op_upper(self, msg, fds):
        """An fd of the writable layer, for the daemon to copy into a snapshot layer."""
        return {"rid": msg["rid"], "ok": True, "_fds": [os.dup(_UPPER)]}

    def op_stat(self, msg, fds):
        fd = open_no_magic(msg["path"], os.O_PATH | os.O_NOFOLLOW)   # the link itself if it is one, as lstat
        try:
            return {"rid": msg["rid"], "ok": True, "entry": _entry(msg["path"], os.fstat(fd))}
        finally:
            os.close(fd)

    def op_list(self, msg, fds):
        path = msg["path"]
        out = []
        fd = open_no_magic(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            with os.scandir(fd) as it:
                for de in it:
                    try:
                        out.append(_entry(os.path.join(path, de.name), de.stat(follow_symlinks=False)))
                    except FileNotFoundError:
                        continue
        finally:
            os.close(fd)
        out.sort(key=lambda e: e["name"])
        return {"rid": msg["rid"], "ok": True, "entries": out}

    def op_remove(self, msg, fds):
        path = msg["path"]
        if path.rstrip("/") in ("", "/"):
            raise OSError(errno.EPERM, "refusing to remove /")
        dfd, name = _parent(path)
        try:
            if stat.S_ISDIR(os.stat(name, dir_fd=dfd, follow_symlinks=False).st_mode):
                if msg.get("recursive"):
                    _rmtree(name, dfd)
                else:
                    os.rmdir(name, dir_fd=dfd)
            else:
                os.unlink(name, dir_fd=dfd)
        finally:
            os.close(dfd)
        return {"rid": msg["rid"], "ok": True}

    def op_mkdir(self, msg, fds):
        if msg.get("parents"):
            os.close(_makedirs(msg["path"]))
        else:
            dfd, name = _parent(msg["path"])
            try:
                os.mkdir(name, 0o777, dir_fd=dfd)
            finally:
                os.close(dfd)
        return {"rid": msg["rid"], "ok": True}
