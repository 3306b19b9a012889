"""The keeper of one gVisor sandbox: the process runsc runs under, and its files server.

Run by the daemon as `python -I -S` (standard library only, like the zygote), one per gVisor sandbox,
in the sandbox's cgroups (so what it holds is the sandbox's). It

- is a child subreaper: `runsc create`/`restore` exit once the sandbox runs and leave the sentry and the
  gofer orphaned; they become the keeper's children, which reaps them at once and reports each exit (pid 1
  on this kind of host reaps ~1.5 s late, and `runsc delete` waits for that);
- holds the sandbox's network namespace (new, empty: the egress gateway plumbs it before runsc starts);
- runs runsc in a private mount namespace with an empty tmpfs over /proc/sys/net: runsc 20240729 takes
  /proc/sys/net/core/rmem_default, which kernels >= 6.11 show in every netns, for "still in the root
  netns" and refuses netstack (gVisor issue 10704; drop this once a fixed runsc is in backports);
- forks the files server: chrooted into the sandbox's merged root, as the sandbox root's host uid (no
  capability left), serving the same file calls as a native init (init.Init), so `..` and absolute
  symlinks resolve inside the sandbox's root and nothing is written as host root.

Protocol (initwire over SEQPACKET): the daemon sends {"op": "config", "cgroup_procs", "root", "uid_base",
"masks"};
the keeper answers {"op": "ready", "files_pid"} with the files server's socket; then {"op": "run", "argv",
"rid"} with three fds (stdin, stdout, stderr) runs a runsc command and answers {"op": "ran", "rid",
"status"} when it exits; every other child's exit is an event {"op": "reaped", "pid", "status"}. EOF on
the socket (the daemon closed it, or died): the keeper exits.
"""

from __future__ import annotations

import os
import select
import signal
import socket
import stat

from hutch.sandbox._host.native import init, initwire
from hutch.sandbox._host.native import linux as L


class Keeper:
    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.runs: dict[int, int] = {}    # pid of a runsc command -> rid of its request
        self.files_pid = 0
        self.procs: list[str] = []
        self.wake_r, self.wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)

    def run(self) -> None:
        msg, _ = initwire.recv(self.sock)
        if msg is None or msg.get("op") != "config":
            os._exit(2)
        self.procs = list(msg["cgroup_procs"])
        init.join_cgroups(self.procs)
        L.prctl(L.PR_SET_CHILD_SUBREAPER, 1)
        L.unshare(L.CLONE_NEWNS | L.CLONE_NEWNET)
        L.mount(None, "/", None, L.MS_REC | L.MS_PRIVATE)   # nothing mounted here reaches the host
        L.mount("hutch-gvisor-netfix", "/proc/sys/net", "tmpfs", L.MS_NOSUID | L.MS_NODEV | L.MS_NOEXEC,
                "size=4k,mode=0555")
        signal.signal(signal.SIGCHLD, lambda *_: None)
        signal.set_wakeup_fd(self.wake_w)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        pid = os.fork()
        if pid == 0:
            self._files(theirs, msg["root"], int(msg["uid_base"]), [str(m) for m in msg.get("masks", ())])
        theirs.close()
        self.files_pid = pid
        initwire.send(self.sock, {"op": "ready", "files_pid": pid}, [ours.fileno()])
        ours.close()
        try:
            self.serve()
        except (ConnectionError, BrokenPipeError):
            # the daemon hung up (the sandbox ends) while an answer was on its way: the same as its EOF, not a
            # traceback in the daemon's log
            os._exit(0)

    def serve(self) -> None:
        while True:
            ready, _, _ = select.select([self.sock, self.wake_r], [], [])
            if self.wake_r in ready:
                initwire.drain(self.wake_r)
                self.reap()
            if self.sock in ready:
                msg, fds = initwire.recv(self.sock)
                if msg is None:
                    os._exit(0)
                if msg.get("op") == "run":
                    self.start(msg, fds)
                for fd in fds:
                    os.close(fd)

    def start(self, msg: dict, fds: list[int]) -> None:
        try:
            pid = os.fork()
        except OSError as e:
            initwire.send(self.sock, {"op": "ran", "rid": msg["rid"], "status": -1, "message": str(e)})
            return
        if pid == 0:
            try:
                for target, fd in enumerate(fds[:3]):
                    os.dup2(fd, target)
                os.closerange(3, 65536)
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                os.execv(msg["argv"][0], msg["argv"])
            finally:
                os._exit(127)
        self.runs[pid] = msg["rid"]

    def reap(self) -> None:
        for pid, status in initwire.reaped():
            rid = self.runs.pop(pid, None)
            if rid is not None:
                initwire.send(self.sock, {"op": "ran", "rid": rid, "status": status})
            else:
                initwire.send(self.sock, {"op": "reaped", "pid": pid, "status": status})

    def _files(self, sock: socket.socket, root: str, uid: int, masks: list[str]) -> None:
        """The files server: chroot into the sandbox's root, become its root's host id, serve init's file calls."""
        code = 1
        try:
            keep = sock.fileno()
            os.closerange(3, keep)
            os.closerange(keep + 1, 65536)
            signal.set_wakeup_fd(-1)
            L.prctl(L.PR_SET_PDEATHSIG, signal.SIGKILL)
            os.chroot(root)
            os.chdir("/")
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)   # a non-zero uid: every capability is gone (chroot cannot be left)
            L.prctl(L.PR_SET_NO_NEW_PRIVS, 1)
            L.prctl(L.PR_SET_DUMPABLE, 0)
            Files(sock, masks).serve()
            code = 0
        finally:
            os._exit(code)


def _under(path: str, masks) -> str | None:
    """The mask (a directory the sentry serves: /dev, /proc, /sys, a tmpfs) `path` is in, else None."""
    for m in masks:
        if path == m or path.startswith(m.rstrip("/") + "/"):
            return m
    return None


def _real(path: str, follow: bool) -> str:
    """Where `path` leads in this chroot (the sandbox's root: `..` and absolute links stay inside it), its last
    name followed or not; a missing tail is kept as written."""
    head, name = os.path.split(path.rstrip("/") or "/")
    if follow or not name:
        return os.path.realpath(path)
    return os.path.join(os.path.realpath(head or "/"), name)


#: the file calls of init.Init, and whether each follows the last name of its path
_FOLLOWS = {"read": True, "list": True, "mkdir": True, "write_open": False, "write_commit": False, "stat": False,
            "remove": False}


class Files(init.Init):
    """init.Init's file calls on the sandbox's root as the host holds it, where a gVisor sandbox's /dev, /proc,
    /sys and tmpfs mounts are not (the sentry serves them from its own memory): a call on one of those is
    refused as a native sandbox refuses a device or a /proc file (ConfigError), never answered from the hidden
    directory below. And `which`: whether an exec's program and working directory exist, looked up here (links
    resolve inside the root) before `runsc exec` starts it, so a missing one is the caller's NotFoundError."""

    def __init__(self, sock: socket.socket, masks: list[str]):
        super().__init__(sock, {})
        self.masks = masks

    def refusal(self, msg: dict, follow: bool) -> dict | None:
        m = _under(_real(msg["path"], follow), self.masks)
        if m is None:
            return None
        return {"rid": msg.get("rid"), "ok": False, "error": "ConfigError", "message":
                f"{msg['path']}: it is under {m}, which the sandbox's gVisor kernel keeps in its own memory, out "
                "of the files API's reach; run('cat', path) reads it (and a command writes it)."}

    def op_which(self, msg, fds):
        """{"argv0", "cwd", "path" (the command's PATH)}: ok, or NotFoundError as a native init says it. What
        is under a mask (not seen from here) is left to runsc."""
        rid, argv0, cwd = msg["rid"], msg["argv0"], msg["cwd"]
        if _under(_real(cwd, True), self.masks) is None:
            try:
                os.close(init.open_no_magic(cwd, os.O_PATH | os.O_DIRECTORY))
            except OSError as e:
                return {"rid": rid, "ok": False, "error": "NotFoundError", "message":
                        f"working directory {cwd!r}: {os.strerror(e.errno or 0)}; create it or pass another workdir."}
        cands = [argv0] if "/" in argv0 else [os.path.join(d or ".", argv0) for d in msg["path"].split(":")]
        for cand in cands:
            real = _real(os.path.join(cwd, cand), True)
            if _under(real, self.masks) is not None:
                return {"rid": rid, "ok": True}
            try:
                fd = init.open_no_magic(os.path.join(cwd, cand), os.O_PATH)
            except OSError:
                continue
            try:
                st = os.fstat(fd)
            finally:
                os.close(fd)
            if stat.S_ISREG(st.st_mode) and st.st_mode & 0o111:
                return {"rid": rid, "ok": True}
        return {"rid": rid, "ok": False, "error": "NotFoundError", "message":
                f"program {argv0!r} was not found in the sandbox; check the name or install it in the image."}


def _checked(op: str, follow: bool):
    base = getattr(init.Init, "op_" + op)

    def call(self: Files, msg, fds):
        refused = self.refusal(msg, follow)
        return refused if refused is not None else base(self, msg, fds)
    call.__name__ = "op_" + op
    return call


for _op, _follow in _FOLLOWS.items():
    setattr(Files, "op_" + _op, _checked(_op, _follow))


def main(fd: int, parent_pid: int) -> None:
    """Entry point: `python -I -S -c '... main(fd, daemon_pid)'` with the daemon's socket as `fd`."""
    # The daemon's death ends the sandbox: SIGTERM here, which kills everything in the sandbox's cgroups.
    signal.signal(signal.SIGTERM, _kill_all)
    L.prctl(L.PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent_pid:
        os._exit(0)
    sock = socket.socket(fileno=fd)
    sock.setblocking(True)
    keeper = Keeper(sock)
    _KEEPER.append(keeper)
    keeper.run()


_KEEPER: list[Keeper] = []


def _kill_all(*_) -> None:
    me = os.getpid()
    procs = _KEEPER[0].procs if _KEEPER else ()
    for path in procs:   # a frozen process does not die of SIGKILL until it is thawed (cgroup v1)
        if "/freezer/" in path:
            try:
                with open(os.path.join(os.path.dirname(path), "freezer.state"), "w") as f:
                    f.write("THAWED")
            except OSError:
                pass
    for path in procs:
        try:
            with open(path) as f:
                pids = [int(p) for p in f.read().split()]
        except (OSError, ValueError):
            continue
        for pid in pids:
            if pid != me:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
    os._exit(0)
