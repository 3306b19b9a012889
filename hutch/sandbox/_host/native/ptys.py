"""A sandbox's terminals, as its init makes and ends them: a pty of the sandbox's own devpts, and the
processes of a terminal's session. Standard library only: the init runs it (python -I -S).
"""

from __future__ import annotations

import fcntl
import os
import struct

from hutch.sandbox._host.native import linux as L


def open_pty(uid: int, rows: int, cols: int) -> tuple[int, int]:
    """A new pty of the sandbox's devpts: (master, slave), the slave owned by `uid` (as which the init opens
    its master: devpts gives the slave the opener's ids) and sized rows x cols. /dev/pts/ptmx, not /dev/ptmx:
    root inside may replace that symlink, not the devpts mount. The slave comes from its master (TIOCGPTPEER),
    never through a path a process of the sandbox could swap."""
    if uid:   # the init's saved ids (init._keep_user): the effective ones may be set to them and back
        os.setresgid(-1, uid, -1)
        os.setresuid(-1, uid, -1)
    try:
        master = os.open("/dev/pts/ptmx", os.O_RDWR | os.O_NOCTTY | os.O_CLOEXEC)
    finally:
        if uid:
            os.setresuid(-1, 0, -1)
            os.setresgid(-1, 0, -1)
    return pty_pair(master, rows, cols)


def pty_pair(master: int, rows: int, cols: int) -> tuple[int, int]:
    """(master, slave) of the just opened ptmx `master`: unlocked, sized rows x cols, the slave from its master
    (TIOCGPTPEER, never through a path); `master` is closed if that fails. The gVisor runtime's terminals too."""
    try:
        fcntl.ioctl(master, L.TIOCSPTLCK, struct.pack("i", 0))
        fcntl.ioctl(master, L.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
        slave = fcntl.ioctl(master, L.TIOCGPTPEER, os.O_RDWR | os.O_NOCTTY | os.O_CLOEXEC)
    except BaseException:
        os.close(master)
        raise
    return master, slave


def session_members(sid: int) -> list[int]:
    """The sandbox's processes in session `sid` (its /proc is the sandbox's pid namespace)."""
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid:   # state, ppid, pgrp, session
            out.append(int(name))
    return out
