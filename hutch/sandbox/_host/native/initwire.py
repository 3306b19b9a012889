"""Messages between the daemon, the zygote and each sandbox's init.

One JSON object per SOCK_SEQPACKET message, file descriptors riding along as
SCM_RIGHTS. A message too big for one packet travels in a memfd instead.
Standard library only: the zygote imports this module.
"""

from __future__ import annotations

import array
import json
import os
import socket

MAX_PACKET = 60000
MAX_FDS = 8


def pack(obj: dict, fds=()) -> tuple[bytes, list[int], int | None]:
    """Encode a message; returns (bytes, fds, memfd-to-close-after-send)."""
    data = json.dumps(obj, separators=(",", ":")).encode()
    if len(data) <= MAX_PACKET:
        return data, list(fds), None
    mfd = os.memfd_create("hutch-msg", os.MFD_CLOEXEC)
    view = memoryview(data)
    while view:
        view = view[os.write(mfd, view):]
    os.lseek(mfd, 0, os.SEEK_SET)
    return b'{"_memfd":1}', [mfd, *fds], mfd


def send(sock: socket.socket, obj: dict, fds=()) -> None:
    """Blocking send (the zygote and init use blocking sockets)."""
    data, fdl, mfd = pack(obj, fds)
    try:
        if fdl:
            socket.send_fds(sock, [data], fdl)
        else:
            sock.send(data)
    finally:
        if mfd is not None:
            os.close(mfd)


def unpack(data: bytes, fds: list[int]) -> tuple[dict, list[int]]:
    obj = json.loads(data)
    if obj.get("_memfd"):
        mfd = fds.pop(0)
        try:
            chunks = []
            while chunk := os.read(mfd, 1 << 20):
                chunks.append(chunk)
        finally:
            os.close(mfd)
        obj = json.loads(b"".join(chunks))
    return obj, fds


def recv_fds(sock: socket.socket) -> tuple[bytes, list[int]]:
    """One packet and the descriptors riding on it, which arrive close-on-exec: the init dup2()s an
    exec's pipes onto its 0-2, and the originals must not stay open in the command as well (they would
    keep its output open after it closed it). socket.recv_fds drops its flags before Python 3.12."""
    data, anc, _flags, _addr = sock.recvmsg(MAX_PACKET + 1024, socket.CMSG_SPACE(MAX_FDS * 4),
                                            socket.MSG_CMSG_CLOEXEC)
    fds = array.array("i")
    for level, kind, payload in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[:len(payload) - len(payload) % fds.itemsize])
    return data, list(fds)


def recv(sock: socket.socket) -> tuple[dict | None, list[int]]:
    """Receive one message; (None, []) at end of file."""
    data, fds = recv_fds(sock)
    if not data:
        for fd in fds:
            os.close(fd)
        return None, []
    return unpack(data, list(fds))


def drain(fd: int) -> None:
    """Empty a non-blocking wake-up pipe (signal.set_wakeup_fd): its bytes only say 'look again'."""
    try:
        while os.read(fd, 512):
            pass
    except BlockingIOError:
        pass


def reaped():
    """(pid, wait status) of every child that has exited, without blocking (a SIGCHLD handler's loop)."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        yield pid, status
