"""ctypes wrappers for the Linux syscalls the sandbox needs and Python lacks (x86_64 only).

Standard library only: the zygote imports this module.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import socket
import struct

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
# Declared once: ctypes then converts plain ints in C (an init makes ~45 prctl calls while it starts).
_libc.prctl.argtypes = (ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong)

ARCH_OK = os.uname().machine == "x86_64"

# x86_64 syscall numbers (stable ABI; from asm/unistd_64.h)
NR_CLONE = 56
NR_CAPSET = 126
NR_PIVOT_ROOT = 155
NR_SECCOMP = 317
NR_OPEN_TREE = 428
NR_MOVE_MOUNT = 429

CLONE_NEWNS = 0x00020000
CLONE_NEWCGROUP = 0x02000000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
# The init is clone()d into a new pid (and maybe user) namespace, joins its cgroups, then unshares
# these, so that they (a network namespace is ~0.3 MiB of kernel memory) are charged to it. The
# mount namespace comes last, when the plan arrives: its copy of the host's mounts is then current.
UNSHARE_NS_FLAGS = CLONE_NEWCGROUP | CLONE_NEWUTS | CLONE_NEWIPC | CLONE_NEWNET

# tty ioctls (asm-generic/ioctls.h) termios does not name
TIOCSCTTY = 0x540E
TIOCSWINSZ = 0x5414
TIOCSPTLCK = 0x40045431
TIOCGPTPEER = 0x5441

MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_REMOUNT = 32
MS_BIND = 4096
MS_REC = 16384
MS_PRIVATE = 1 << 18
MS_SLAVE = 1 << 19
MNT_DETACH = 2

PR_SET_PDEATHSIG = 1
PR_SET_DUMPABLE = 4
PR_SET_SECUREBITS = 28
PR_CAPBSET_DROP = 24
PR_SET_NO_NEW_PRIVS = 38
PR_SET_CHILD_SUBREAPER = 36
PR_CAP_AMBIENT = 47
PR_CAP_AMBIENT_CLEAR_ALL = 4
# SECBIT_NOROOT | _LOCKED, SECBIT_NO_SETUID_FIXUP | _LOCKED, SECBIT_KEEP_CAPS_LOCKED,
# SECBIT_NO_CAP_AMBIENT_RAISE | _LOCKED: uid 0 never regains capabilities on execve.
SECUREBITS_LOCKED_DOWN = 0x01 | 0x02 | 0x04 | 0x08 | 0x20 | 0x40 | 0x80
# With kept capabilities (image build steps): NOROOT and NO_SETUID_FIXUP locked *off* (uid 0 gets the
# kept set on execve, a change to another uid drops it), KEEP_CAPS and ambient raising locked off.
SECUREBITS_KEPT = 0x02 | 0x08 | 0x20 | 0x40 | 0x80

SECCOMP_SET_MODE_FILTER = 1


def _check(ret: int, what: str) -> int:
    if ret < 0:
        e = ctypes.get_errno()
        raise OSError(e, f"{what}: {os.strerror(e)}")
    return ret


def _b(s) -> bytes | None:
    return None if s is None else os.fsencode(s)


def mount(source, target, fstype, flags: int = 0, data: str | None = None) -> None:
    _check(_libc.mount(_b(source), _b(target), _b(fstype), ctypes.c_ulong(flags), _b(data)), f"mount {target}")


def umount2(target, flags: int = 0) -> None:
    _check(_libc.umount2(_b(target), flags), f"umount {target}")


OPEN_TREE_CLONE = 1
OPEN_TREE_CLOEXEC = 0o2000000
MOVE_MOUNT_F_EMPTY_PATH = 0x4
AT_FDCWD = -100


def open_tree(path) -> int:
    """A detached bind of `path` as a mount fd (open_tree(2) with OPEN_TREE_CLONE), taken in the caller's
    mount namespace: a process in another namespace can attach it with move_mount_fd."""
    return _check(_libc.syscall(NR_OPEN_TREE, AT_FDCWD, _b(path), OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC),
                  f"open_tree {path}")


def move_mount_fd(fd: int, target) -> None:
    """Attach the detached mount `fd` (from open_tree) at `target` in this mount namespace."""
    _check(_libc.syscall(NR_MOVE_MOUNT, fd, b"", AT_FDCWD, _b(target), MOVE_MOUNT_F_EMPTY_PATH),
           f"move_mount {target}")


def move_mount_at(fd: int, dir_fd: int) -> None:
    """Attach the detached mount `fd` on what `dir_fd` is open on (MOVE_MOUNT_T_EMPTY_PATH: no path is resolved
    again, so nothing can be swapped for a symlink meanwhile)."""
    _check(_libc.syscall(NR_MOVE_MOUNT, fd, b"", dir_fd, b"", MOVE_MOUNT_F_EMPTY_PATH | MOVE_MOUNT_T_EMPTY_PATH),
           "move_mount")


MOVE_MOUNT_T_EMPTY_PATH = 0x40
FUSE_SUPER_MAGIC = 0x65735546
PROC_SUPER_MAGIC = 0x9FA0
SYSFS_MAGIC = 0x62656572


def fs_type(path) -> int:
    """statfs(2)'s f_type of the filesystem `path` is on (FUSE_SUPER_MAGIC for a FUSE mount)."""
    buf = ctypes.create_string_buffer(256)   # struct statfs is 120 bytes on x86-64 and arm64; f_type first
    _check(_libc.statfs(_b(str(path)), buf), f"statfs {path}")
    return struct.unpack_from("l", buf.raw)[0]


def fd_fs_type(fd: int) -> int:
    """fstatfs(2)'s f_type of the filesystem the open file `fd` (O_PATH too) is on."""
    buf = ctypes.create_string_buffer(256)
    _check(_libc.fstatfs(ctypes.c_int(fd), buf), "fstatfs")
    return struct.unpack_from("l", buf.raw)[0]
NR_OPENAT2 = 437
RESOLVE_NO_MAGICLINKS = 0x02


def openat2(path, flags: int, resolve: int, dir_fd: int = AT_FDCWD) -> int:
    """openat2(2): open `path` with `flags` (mode 0: never O_CREAT) under the RESOLVE_* flags `resolve`."""
    how = struct.pack("QQQ", flags, 0, resolve)
    return _check(_libc.syscall(NR_OPENAT2, ctypes.c_int(dir_fd), _b(path), how, ctypes.c_size_t(len(how))),
                  f"open {path}")


def pivot_root(new_root, put_old) -> None:
    _check(_libc.syscall(NR_PIVOT_ROOT, _b(new_root), _b(put_old)), "pivot_root")


def prctl(option: int, arg2: int = 0, arg3: int = 0, arg4: int = 0, arg5: int = 0) -> int:
    ret = _libc.prctl(option, arg2, arg3, arg4, arg5)
    return ret if ret >= 0 else _check(ret, f"prctl {option}")


_cap_last: int | None = None


def cap_last_cap() -> int:
    """The highest capability number of this kernel (read once: the zygote reads it, its inits inherit it)."""
    global _cap_last
    if _cap_last is None:
        with open("/proc/sys/kernel/cap_last_cap", "rb") as f:
            _cap_last = int(f.read())
    return _cap_last


def clone(flags: int) -> int:
    """fork() into new namespaces: returns the child's pid in the parent and 0 in the child.

    A raw clone with no new stack behaves like fork; Python's at-fork hooks do not
    run, which is fine for the single-threaded zygote that calls it.
    """
    return _check(_libc.syscall(NR_CLONE, ctypes.c_ulong(flags | 17), None, None, None, None), "clone")  # 17 = SIGCHLD


NR_MOUNT_SETATTR = 442
AT_RECURSIVE = 0x8000
AT_EMPTY_PATH = 0x1000
MOUNT_ATTR_RDONLY = 0x00000001
MOUNT_ATTR_IDMAP = 0x00100000


MOUNT_ATTR_NOSUID = 0x00000002
MOUNT_ATTR_NODEV = 0x00000004


def detached_tree(source: str, userns_fd: int = -1, readonly: bool = False) -> int:
    """A detached copy of the mount at `source` (not of those below it, as with a plain bind), nosuid and
    nodev, as a mount fd: attach it with move_mount_fd; closed unattached, it is gone. With `userns_fd` its
    ids go through that user namespace's mapping (an idmapped mount; OSError if the filesystem cannot
    idmap: FUSE, for one). `readonly` makes the copy read-only (an image layer: through it, root inside
    would own the host's layer)."""
    tree = _check(_libc.syscall(NR_OPEN_TREE, -100, _b(source), OPEN_TREE_CLONE | os.O_CLOEXEC),
                  f"open_tree {source}")
    try:
        flags = MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV | (MOUNT_ATTR_RDONLY if readonly else 0)
        if userns_fd >= 0:
            flags |= MOUNT_ATTR_IDMAP
        attr = struct.pack("QQQQ", flags, 0, 0, max(userns_fd, 0))
        _check(_libc.syscall(NR_MOUNT_SETATTR, tree, b"", AT_EMPTY_PATH | AT_RECURSIVE, attr, len(attr)),
               f"idmapping {source}" if userns_fd >= 0 else f"mount_setattr {source}")
    except BaseException:
        os.close(tree)
        raise
    return tree


def idmapped_tree(source: str, userns_fd: int, readonly: bool = False) -> int:
    """detached_tree(source) with its ids mapped through `userns_fd`."""
    return detached_tree(source, userns_fd, readonly)


def unshare(flags: int) -> None:
    _check(_libc.unshare(flags), "unshare")


def sethostname(name: str) -> None:
    b = name.encode()
    _check(_libc.sethostname(b, len(b)), "sethostname")


def drop_all_capabilities() -> None:
    """Empty every capability set of this process and lock uid 0 out of regaining them."""
    for cap in range(cap_last_cap() + 1):
        prctl(PR_CAPBSET_DROP, cap)
    prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL)
    prctl(PR_SET_SECUREBITS, SECUREBITS_LOCKED_DOWN)
    hdr = struct.pack("II", 0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
    data = bytes(24)  # two {effective, permitted, inheritable} u32 triples, all zero
    _check(_libc.syscall(NR_CAPSET, hdr, data), "capset")


def limit_capabilities(keep) -> None:
    """Keep only the capabilities numbered in `keep` (bounding, permitted, effective); no ambient or
    inheritable ones. Under no_new_privs, uid 0 gets exactly these on execve, never more."""
    keep = set(keep)
    for cap in range(cap_last_cap() + 1):
        if cap not in keep:
            prctl(PR_CAPBSET_DROP, cap)
    prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL)
    prctl(PR_SET_SECUREBITS, SECUREBITS_KEPT)
    mask = sum(1 << c for c in keep)
    lo, hi = mask & 0xFFFFFFFF, mask >> 32
    hdr = struct.pack("II", 0x20080522, 0)
    data = struct.pack("IIIIII", lo, lo, 0, hi, hi, 0)  # {effective, permitted, inheritable} x 2
    _check(_libc.syscall(NR_CAPSET, hdr, data), "capset")


def load_seccomp(bpf: bytes) -> None:
    """Install a classic-BPF seccomp filter (needs no_new_privs first)."""
    n = len(bpf) // 8
    buf = ctypes.create_string_buffer(bpf, len(bpf))
    prog = struct.pack("HxxxxxxQ", n, ctypes.addressof(buf))
    _check(_libc.syscall(NR_SECCOMP, SECCOMP_SET_MODE_FILTER, 0, prog), "seccomp")


def loopback_up() -> None:
    """Bring `lo` up in the current network namespace (SIOCSIFFLAGS, no netlink needed)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        ifr = struct.pack("16sH14x", b"lo", 0)
        flags = struct.unpack("16sH14x", fcntl.ioctl(s, 0x8913, ifr))[1]  # SIOCGIFFLAGS
        fcntl.ioctl(s, 0x8914, struct.pack("16sH14x", b"lo", flags | 0x1 | 0x40))  # SIOCSIFFLAGS: UP|RUNNING
    finally:
        s.close()


def memfd(name: str, data: bytes) -> int:
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    os.write(fd, data)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


__all__ = ["ARCH_OK", "UNSHARE_NS_FLAGS", "clone", "errno", "mount", "pivot_root", "prctl", "umount2"]
