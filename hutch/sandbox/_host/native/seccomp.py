"""The sandbox's seccomp filter: classic BPF, assembled here once per daemon.

Modelled on Docker's default profile, written as a deny list over x86_64:
syscalls a container never needs and that widen the kernel's attack surface
return EPERM; clone() with any namespace flag returns EPERM; clone3() returns
ENOSYS so that libc falls back to clone(), whose flags we can inspect; io_setup()
returns ENOSYS, as on a kernel without AIO (fs.aio-max-nr counts contexts
host-wide: one sandbox could take them all from the host and the others);
socket() of AF_VSOCK returns EAFNOSUPPORT (vsock is not network-namespaced: it
would reach the VM's host whatever the sandbox's network; Docker refuses it too);
modify_ldt() returns EPERM (16-bit segments: old exploits' favourite, nothing a
64-bit program needs); personality() is allowed only for the values Docker allows
(PER_LINUX, PER_LINUX32, either with UNAME26, and the query 0xffffffff), so no
READ_IMPLIES_EXEC (every readable mapping executable) or ADDR_NO_RANDOMIZE;
any other architecture or the x32 ABI kills the process. Docker's profile is an
allow list; a deny list admits syscalls that future kernels add (see
docs/architecture.md).
Standard library only: the zygote imports this module.
"""

from __future__ import annotations

import errno
import struct

AUDIT_ARCH_X86_64 = 0xC000003E
RET_KILL_PROCESS = 0x80000000
RET_ERRNO = 0x00050000
RET_ALLOW = 0x7FFF0000

NR_IOCTL = 16
NR_CLONE = 56
NR_CLONE3 = 435
NR_IO_SETUP = 206
NR_SOCKET = 41
NR_PERSONALITY = 135
# personality(2) values Docker's profile allows: PER_LINUX, UNAME26, PER_LINUX32, PER_LINUX32|UNAME26, query.
PERSONALITIES = (0x0, 0x8, 0x20000, 0x20008, 0xFFFFFFFF)
AF_VSOCK = 40
TIOCSTI = 0x5412
TIOCLINUX = 0x541C
NS_FLAGS = 0x7E020000  # every CLONE_NEW* flag: NS, CGROUP, UTS, IPC, USER, PID, NET

# name -> x86_64 number; each returns EPERM.
DENIED = {
    "acct": 163, "add_key": 248, "bpf": 321, "chroot": 161, "clock_adjtime": 305, "clock_settime": 227,
    "create_module": 174, "delete_module": 176, "fanotify_init": 300, "finit_module": 313, "fsconfig": 431,
    "fsmount": 432, "fsopen": 430, "fspick": 433, "get_kernel_syms": 177, "init_module": 175, "ioperm": 173,
    "iopl": 172, "io_uring_enter": 426, "io_uring_register": 427, "io_uring_setup": 425, "kcmp": 312,
    "kexec_file_load": 320, "kexec_load": 246, "keyctl": 250, "lookup_dcookie": 212, "mount": 165,
    "modify_ldt": 154, "mount_setattr": 442, "move_mount": 429, "move_pages": 279, "name_to_handle_at": 303, "nfsservctl": 180,
    "open_by_handle_at": 304, "open_tree": 428, "open_tree_attr": 467, "perf_event_open": 298, "pivot_root": 155,
    "process_vm_readv": 310, "process_vm_writev": 311, "ptrace": 101, "query_module": 178, "quotactl": 179,
    "quotactl_fd": 443, "reboot": 169, "request_key": 249, "setns": 308, "settimeofday": 164, "swapoff": 168,
    "swapon": 167, "syslog": 103, "sysfs": 139, "_sysctl": 156, "umount2": 166, "unshare": 272, "uselib": 134,
    "userfaultfd": 323, "ustat": 136, "vhangup": 153,
}

_LD_W_ABS = 0x20
_JEQ = 0x15
_JGE = 0x35
_JSET = 0x45
_RET = 0x06


def build_filter() -> bytes:
    """Assemble the filter: a list of sock_filter structs, as bytes ready for seccomp(2)."""
    prog: list[tuple] = []  # (code, jt-label-or-0, jf-label-or-0, k) ; labels resolved below
    labels: dict[str, int] = {}

    def op(code, k, jt=0, jf=0):
        prog.append((code, jt, jf, k))

    def label(name):
        labels[name] = len(prog)

    op(_LD_W_ABS, 4)                                   # seccomp_data.arch
    op(_JEQ, AUDIT_ARCH_X86_64, 0, "kill")
    op(_LD_W_ABS, 0)                                   # seccomp_data.nr
    op(_JGE, 0x40000000, "kill", 0)                    # the x32 ABI
    op(_JEQ, NR_CLONE, "clone", 0)
    op(_JEQ, NR_CLONE3, "enosys", 0)
    op(_JEQ, NR_IO_SETUP, "enosys", 0)
    op(_JEQ, NR_IOCTL, "ioctl", 0)
    op(_JEQ, NR_SOCKET, "socket", 0)
    op(_JEQ, NR_PERSONALITY, "personality", 0)
    for nr in sorted(DENIED.values()):
        op(_JEQ, nr, "eperm", 0)
    op(_RET, RET_ALLOW)
    label("clone")
    op(_LD_W_ABS, 16)                                  # args[0] (flags), low 32 bits
    op(_JSET, NS_FLAGS, "eperm", 0)
    op(_RET, RET_ALLOW)
    label("ioctl")
    op(_LD_W_ABS, 24)                                  # args[1] (request), low 32 bits
    op(_JEQ, TIOCSTI, "eperm", 0)                      # typing into another terminal's input
    op(_JEQ, TIOCLINUX, "eperm", 0)
    op(_RET, RET_ALLOW)
    label("socket")
    op(_LD_W_ABS, 16)                                  # args[0] (domain)
    op(_JEQ, AF_VSOCK, "eafnosupport", 0)
    op(_RET, RET_ALLOW)
    label("personality")
    op(_LD_W_ABS, 16)                                  # args[0] (persona: an unsigned int, low 32 bits)
    for value in PERSONALITIES:
        op(_JEQ, value, "allow", 0)
    op(_RET, RET_ERRNO | errno.EPERM)
    label("allow")
    op(_RET, RET_ALLOW)
    label("eafnosupport")
    op(_RET, RET_ERRNO | errno.EAFNOSUPPORT)
    label("eperm")
    op(_RET, RET_ERRNO | errno.EPERM)
    label("enosys")
    op(_RET, RET_ERRNO | errno.ENOSYS)
    label("kill")
    op(_RET, RET_KILL_PROCESS)

    out = bytearray()
    for i, (code, jt, jf, k) in enumerate(prog):
        def rel(t):
            if isinstance(t, str):
                d = labels[t] - i - 1
                if not 0 <= d <= 255:
                    raise ValueError("seccomp jump out of range")
                return d
            return t
        out += struct.pack("HBBI", code, rel(jt), rel(jf), k)
    return bytes(out)
