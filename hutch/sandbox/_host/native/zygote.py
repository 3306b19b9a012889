"""The start server ("zygote") and each sandbox's init.

The daemon spawns one zygote: a small, single-threaded Python process that
imports only the standard library. For each sandbox it clone()s a child into a
new pid namespace (with a user namespace, through a helper: see clone_init).
That child is the sandbox's init (pid 1): it joins the
sandbox's cgroups, unshares mount, net, ipc, uts and cgroup namespaces (so they
are charged to the sandbox), builds the root, drops every
privilege, and then serves the daemon over its own socket: it forks every exec
(so each inherits every restriction by construction) and does the file calls
inside the sandbox's root. The init never runs anything from the image itself.

Lifetimes: the zygote dies with the daemon (PDEATHSIG), each init dies with the
zygote (PDEATHSIG; one of a user namespace, whose parent was a helper, is killed
by the daemon) and also exits when the daemon's end of its socket closes;
an init's exit ends its pid namespace, which kills every process in it.
"""

from __future__ import annotations

import errno
import fcntl
import gc
import os
import select
import signal
import socket
import struct
import sys

from hutch.sandbox._host.native import init, linux, initwire

BTRFS_IOC_SNAP_DESTROY = 0x5000940F   # linux/btrfs.h (as in disk.py, which the zygote does not import)


def _write_pid(paths, pid: bytes) -> None:
    for p in paths:
        fd = os.open(p, os.O_WRONLY)
        try:
            os.write(fd, pid)
        finally:
            os.close(fd)


class Zygote:
    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.config: dict = {}
        self.native = -1   # the C init (initd.c), which each init execs once locked down; -1: inits stay Python
        self.wake_r, self.wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)

    def run(self) -> None:
        signal.signal(signal.SIGCHLD, lambda *_: None)
        signal.set_wakeup_fd(self.wake_w)
        msg, _ = initwire.recv(self.sock)
        if msg is None or msg.get("op") != "config":
            os._exit(2)
        self.config = msg
        self.seccomp = bytes.fromhex(msg["seccomp"])
        self.home = [p.encode() if isinstance(p, str) else p for p in msg["home_procs"]]
        if msg.get("native_init"):   # opened once here: after pivot_root no path reaches it
            self.native = os.open(msg["native_init"], os.O_RDONLY | os.O_CLOEXEC)
        linux.prctl(linux.PR_SET_CHILD_SUBREAPER, 1)   # inits whose helper exited (clone_init) come here
        init.precompute()
        _write_pid(self.home, str(os.getpid()).encode())
        self.store, error = self.mount_layers(msg.get("layers"))
        initwire.send(self.sock, {"op": "ready", "pid": os.getpid(), "layers_error": error},
                   [self.store] if self.store >= 0 else [])
        # Freeze what is imported now so that the inits' garbage collector never
        # touches (and so copies) the zygote's pages.
        gc.collect()
        gc.freeze()
        while True:
            ready, _, _ = select.select([self.sock, self.wake_r], [], [])
            if self.wake_r in ready:
                initwire.drain(self.wake_r)
                self.reap()
            if self.sock in ready:
                msg, fds = initwire.recv(self.sock)
                if msg is None:
                    os._exit(0)
                if msg.get("op") == "start":
                    self.start(msg)
                elif msg.get("op") == "userns":
                    self.userns(msg)
                elif msg.get("op") == "destroy":
                    for name in msg["layers"]:
                        self.destroy_layer(name)
                for fd in fds:
                    os.close(fd)

    def destroy_layer(self, name: str) -> None:
        """Destroy an ended sandbox's subvolume in the store (the daemon's disk.py made it), relative to the
        working directory, the store's root; btrfs frees its blocks in the background."""
        try:
            fcntl.ioctl(self.store, BTRFS_IOC_SNAP_DESTROY, bytearray(struct.pack("q4088s", 0, name.encode())))
        except OSError:
            pass   # gone already, or it goes with the store

    def mount_layers(self, layers: dict | None) -> tuple[int, str]:
        """Mount the store of writable layers (disk.py) in a mount namespace of the zygote's own and work from
        its root: each init's copy of the namespace then starts there, in its own copy of the store, where
        its layer is, whatever the directories above it. Returns (an fd of the root for the daemon, error)."""
        if not layers:
            return -1, ""
        try:
            linux.unshare(linux.CLONE_NEWNS)
            # the host's mounts still reach this namespace; none of its own reaches the host
            linux.mount(None, "/", None, linux.MS_REC | linux.MS_SLAVE)
            linux.mount(layers["dev"], layers["at"], "btrfs", linux.MS_NOSUID | linux.MS_NODEV)
            fd = os.open(layers["at"], os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            os.fchdir(fd)
            return fd, ""
        except OSError as e:
            return -1, str(e)

    def reap(self) -> None:
        for pid, status in initwire.reaped():
            initwire.send(self.sock, {"op": "reaped", "pid": pid, "status": status})

    def start(self, msg: dict) -> None:
        plan = msg["plan"]
        parent_end, child_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        gc.freeze()  # what the zygote made since: the child's collector must not touch (copy) it either
        try:
            pid = self.clone_init(plan, child_end)
        except OSError as e:
            parent_end.close()
            child_end.close()
            initwire.send(self.sock, {"op": "error", "rid": msg["rid"], "message": f"could not start the sandbox: {e}"})
            return
        child_end.close()
        try:
            initwire.send(self.sock, {"op": "started", "rid": msg["rid"], "pid": pid}, [parent_end.fileno()])
        finally:
            parent_end.close()

    def userns(self, msg: dict) -> None:
        """A user namespace with the daemon's id maps, as an fd: what an idmapped mount maps through.

        A child clone()d into it holds it while the maps are written and the fd is opened, then exits.
        """
        try:
            r, w = os.pipe2(os.O_CLOEXEC)
            pid = linux.clone(linux.CLONE_NEWUSER)
            if pid == 0:
                os.close(w)
                linux.prctl(linux.PR_SET_PDEATHSIG, signal.SIGKILL)
                os.read(r, 1)
                os._exit(0)
            os.close(r)
            try:
                for name in ("uid_map", "gid_map"):
                    fd = os.open(f"/proc/{pid}/{name}", os.O_WRONLY)
                    try:
                        os.write(fd, msg[name].encode())
                    finally:
                        os.close(fd)
                ns = os.open(f"/proc/{pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC)
            finally:
                os.close(w)   # the child exits: the fd keeps the namespace
        except OSError as e:
            initwire.send(self.sock, {"op": "error", "rid": msg["rid"], "message": f"could not make a user namespace: {e}"})
            return
        try:
            initwire.send(self.sock, {"op": "userns", "rid": msg["rid"]}, [ns])
        finally:
            os.close(ns)

    def clone_init(self, plan: dict, child_end: socket.socket) -> int:
        """clone() the sandbox's init into a new pid namespace; returns its pid.

        With a user namespace, a helper clones it with the sandbox's own host uid (plan["uid_base"])
        as its effective uid: the namespace's owner, whom the kernel also charges with what the
        sandbox counts against per-user limits (inotify instances, message queues, queued signals).
        Owned by root, every sandbox's would count against host root's. The helper, root again,
        then puts the init into its cgroups (the init waits for that) and exits; the zygote, a
        subreaper, becomes the init's parent. It waits only for the clone, not for the cgroups.
        """
        if not plan.get("userns"):
            pid = linux.clone(linux.CLONE_NEWPID)
            if pid == 0:
                self._become_init(plan, child_end)
            return pid
        r, w = os.pipe2(os.O_CLOEXEC)
        try:
            if linux.clone(0) == 0:
                self._helper(plan, child_end, w)
            os.close(w)
            w = -1
            data = os.read(r, 32)
        finally:
            os.close(r)
            if w >= 0:
                os.close(w)
        if not data:
            raise OSError(errno.EAGAIN, "its init could not be cloned; see the daemon log")
        return int(data)

    def _helper(self, plan: dict, child_end: socket.socket, report: int) -> None:
        code = 1
        try:
            go_r, go_w = os.pipe2(os.O_CLOEXEC)
            base = plan["uid_base"]
            os.setresgid(-1, base, -1)   # real and saved ids stay 0: root again below
            os.setresuid(-1, base, -1)
            pid = linux.clone(linux.CLONE_NEWPID | linux.CLONE_NEWUSER)
            if pid == 0:
                os.close(go_w)
                self._become_init(plan, child_end, go_r)
            os.setresuid(-1, 0, -1)
            os.setresgid(-1, 0, -1)
            os.write(report, str(pid).encode())
            init.join_cgroups(plan["cgroup_procs"], pid)
            os.write(go_w, b"g")
            code = 0
        finally:
            os._exit(code)

    def _become_init(self, plan: dict, child_end: socket.socket, go: int = -1) -> None:
        code = 1
        try:
            code = init.main(child_end, plan, self.seccomp, keep=(child_end.fileno(),), go=go, native=self.native)
        finally:
            os._exit(code)


def main(fd: int, parent_pid: int) -> None:
    """Entry point: `python -I -S -c '... main(fd, daemon_pid)'` with the daemon's socket as `fd`."""
    linux.prctl(linux.PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:  # the daemon died before PDEATHSIG was armed
        os._exit(0)
    sock = socket.socket(fileno=fd)
    sock.setblocking(True)
    sys.stdin = None
    Zygote(sock).run()
