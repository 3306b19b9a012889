"""Run a command where the kernel refuses new user namespaces, as a container runtime's default seccomp
profile does: unshare() and clone() with CLONE_NEWUSER fail with EPERM, clone3() with ENOSYS (so that libc
falls back to clone(), whose flags a filter can read). Nothing host-wide changes: the filter binds this
process and its descendants only.

    python no_userns.py COMMAND ARGS...
"""

from __future__ import annotations

import ctypes
import errno
import os
import struct
import sys

PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 22, 2
AUDIT_ARCH_X86_64 = 0xC000003E
NR_CLONE, NR_UNSHARE, NR_CLONE3 = 56, 272, 435
CLONE_NEWUSER = 0x10000000
RET_ALLOW, RET_ERRNO = 0x7FFF0000, 0x00050000
LD, JEQ, JSET, RET = 0x20, 0x15, 0x45, 0x06


def _filter() -> bytes:
    prog = [
        (LD, 0, 0, 4), (JEQ, 1, 0, AUDIT_ARCH_X86_64), (RET, 0, 0, RET_ALLOW),   # 0-2: only x86_64 is judged
        (LD, 0, 0, 0),                                                          # 3: the syscall number
        (JEQ, 3, 0, NR_CLONE), (JEQ, 2, 0, NR_UNSHARE), (JEQ, 5, 0, NR_CLONE3),  # 4-6
        (RET, 0, 0, RET_ALLOW),                                                 # 7
        (LD, 0, 0, 16), (JSET, 0, 1, CLONE_NEWUSER),                            # 8-9: flags (args[0], low half)
        (RET, 0, 0, RET_ERRNO | errno.EPERM), (RET, 0, 0, RET_ALLOW),            # 10-11
        (RET, 0, 0, RET_ERRNO | errno.ENOSYS),                                  # 12: clone3
    ]
    return b"".join(struct.pack("HBBI", *ins) for ins in prog)


def main() -> None:
    code = _filter()
    buf = ctypes.create_string_buffer(code, len(code))
    fprog = struct.pack("HxxxxxxQ", len(code) // 8, ctypes.addressof(buf))
    fbuf = ctypes.create_string_buffer(fprog, len(fprog))
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl.argtypes = (ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong)
    if libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.addressof(fbuf), 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_SECCOMP)")
    os.execvp(sys.argv[1], sys.argv[1:])


if __name__ == "__main__":
    main()
