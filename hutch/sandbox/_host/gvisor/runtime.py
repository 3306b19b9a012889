"""The daemon's side of the gVisor runtime: a sandbox under runsc, from its root to the last resource gone.

Per sandbox (docs/architecture.md, "The gVisor runtime"):

    daemon --SEQPACKET--> keeper (python -I -S, subreaper, the sandbox's netns, in its cgroups)
       keeper --fork/exec--> runsc run/restore --detach  -> runsc-sandbox (the sentry) + runsc-gofer, the keeper's
       keeper --fork--> files server (chrooted into the sandbox's root as its root's host uid; init.Init's calls)
    daemon --exec--> runsc exec / kill / checkpoint / delete (each a short Go process; exec waits for its command)

Its root is the daemon's: a tmpfs of `disk` bytes (upper and work, owned by the sandbox root's host uid) and an
overlay of the image's layers, idmapped through a user namespace of the sandbox's id map, mounted under the run
directory; runsc is told `--overlay2=none`, so what the sandbox writes is in that upper, where the files API
and filesystem snapshots find it. The channel (GvisorChannel) answers the calls the Manager's Execs make of a
native init: exec and kill through runsc, file calls through the files server, `upper` from the host.
"""

from __future__ import annotations

import asyncio
import errno
import itertools
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from hutch._core import paths
from hutch._core.errors import InvalidSpecError, SandboxError, StateError
from hutch.sandbox._host.gvisor import runsc
from hutch.sandbox._host.native import linux, ptys
from hutch.sandbox._host.native.runtime import Channel

START_TIMEOUT = 20.0   # seconds for a keeper to report ready and runsc to start the sandbox
ROOTS = "/run/hutch-gvisor"
MOUNT_DATA_MAX = 4096   # bytes of mount(2) options the kernel reads (a page), its NUL included
#: runsc exec's PATH for a command whose env has none (its error names this list)
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
#: Terminals one sandbox may hold at once, as a native one (native/init.MAX_PTYS): its devpts instance's max=
MAX_PTYS = 64
#: util-linux's setsid: `setsid -c` makes a terminal exec's runsc the leader of a session whose controlling
#: terminal is the pty (its stdin), so the signals the kernel sends for that terminal (^C, ^Z, SIGWINCH, hang-up)
#: reach runsc, which forwards them to the foreground process group inside
SETSID = "setsid"


@dataclass
class GvSandbox:
    """What the daemon holds for one gVisor sandbox (LiveSandbox.gv)."""

    id: str
    dir: Path                        # run_dir/gvisor/<id>: bundle, root mounts, logs, exec pid files
    network: bool                    # started with a link (--network=sandbox) or without (--network=none)
    keeper: subprocess.Popen | None = None
    ctl: Channel | None = None
    files: Channel | None = None
    files_pid: int = 0
    sentry_pid: int = 0
    sentry_fd: int = -1              # a pidfd of the sentry (sentry_ending), from runsc run until the teardown
    mounts: list[str] = field(default_factory=list)   # what the daemon mounted for it, innermost last
    root_tmp: bool = False           # /tmp is its root's (bound to itself in config.json: runtime.root_tmp)
    runs: dict[int, asyncio.Future] = field(default_factory=dict)
    reaped: dict[int, int] = field(default_factory=dict)   # exits the keeper reported: the sentry's may come first
    #: held while a memory snapshot is taken; a pause, an exec's start or a file call waits for it
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    rids: itertools.count = field(default_factory=lambda: itertools.count(1))
    tty: Path | None = None          # its devpts instance (Runsc.ttys/<id>), mounted at its first terminal exec

    @property
    def merged(self) -> Path:
        return self.dir / "root"

    @property
    def upper(self) -> Path:
        return self.dir / "disk" / "upper"


class Runsc:
    """The runsc command lines of one daemon: its state directory and the flags of each sandbox."""

    def __init__(self, run_dir: Path, name: str):
        self.root = run_dir / "gvisor"
        # The sentry and the gofer (the sandbox root's host uid) must reach the sandbox's root by its path, which a
        # 0700 run directory would forbid: each sandbox's directory is here, 0700 and its root's own, under a
        # root-owned 0711 parent named after the daemon's cgroup parent (its instance).
        self.dirs = Path(ROOTS) / name
        # The ptys of terminal execs: a devpts instance per sandbox under here, root's and 0700 all the way (the
        # sandbox's own directory is its root's host uid's, the sentry's and the gofer's)
        self.ttys = run_dir / "gvisor-tty"

    def argv(self, gv: GvSandbox, *args: str) -> list[str]:
        return [runsc.probe().path or runsc.RUNSC, *runsc.global_flags(str(self.root), gv.network), *args]

    async def call(self, gv: GvSandbox, *args: str, timeout: float = 30.0, check: bool = True) -> tuple[int, str]:
        """Run a short runsc command from the daemon; (returncode, its output)."""
        proc = await asyncio.create_subprocess_exec(*self.argv(gv, *args), stdin=subprocess.DEVNULL,
                                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        try:
            out, _ = await asyncio.wait_for(proc.communicate(), timeout)
        except asyncio.TimeoutError:
            proc.kill()
            await proc.wait()
            raise SandboxError(f"`runsc {args[0]}` of sandbox {gv.id} did not finish within {timeout:.0f} s.") from None
        text = out.decode(errors="replace").strip()
        if check and proc.returncode:
            i = text.find("panic:")   # a Go panic: its first lines say why, the stack after them does not
            why = text[i:i + 800] if i >= 0 else text[:800]
            raise SandboxError(f"`runsc {args[0]}` of sandbox {gv.id} failed ({proc.returncode}): {why}")
        return proc.returncode, text

    def reap(self) -> None:
        """A crashed predecessor's sandboxes died with it (their keepers' PDEATHSIG): only state files are left."""
        for d in (self.root, self.dirs, self.ttys):
            if d.is_dir():
                _unmount_all(d)
                remove_unmounted(d)
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.ttys.mkdir(exist_ok=True, mode=0o700)
        os.chown(self.ttys, 0, 0)
        os.chmod(self.ttys, 0o700)
        for d in (self.dirs.parent, self.dirs):
            d.mkdir(exist_ok=True, mode=0o711)
            os.chown(d, 0, 0)
            os.chmod(d, 0o711)

    def remove_dirs(self) -> None:
        """At daemon stop: its sandboxes are gone, so is their parent directory."""
        for d in (self.dirs, self.ttys):
            try:
                d.rmdir()
            except OSError:
                pass

    def open_pty(self, gv: GvSandbox, rows: int, cols: int) -> tuple[int, int]:
        """A new pty of the sandbox's devpts instance on the host (mounted at its first one, `max=MAX_PTYS`), not
        the host's /dev/pts: (master, slave), sized rows x cols, both root's; OSError ENOSPC when it holds
        MAX_PTYS. The slave comes from its master (TIOCGPTPEER), never through a path."""
        if gv.tty is None:
            at = self.ttys / gv.id
            at.mkdir(mode=0o700)
            try:
                linux.mount("hutch-gvisor-pts", str(at), "devpts", linux.MS_NOSUID | linux.MS_NOEXEC,
                            f"newinstance,ptmxmode=0600,mode=0600,gid=0,max={MAX_PTYS}")
            except BaseException:
                at.rmdir()
                raise
            gv.tty = at
        return ptys.pty_pair(os.open(gv.tty / "ptmx", os.O_RDWR | os.O_NOCTTY | os.O_CLOEXEC), rows, cols)


def _unmount_all(d: Path) -> None:
    """Unmount whatever is mounted under `d` (a leftover of a crashed daemon), deepest first."""
    prefix = str(d) + "/"
    found = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        target = line.split()[4].replace("\\040", " ")
        if target.startswith(prefix) or target == str(d):
            found.append(target)
    for target in sorted(found, key=len, reverse=True):
        try:
            linux.umount2(target, linux.MNT_DETACH)
        except OSError:
            pass


def mount_root(gv: GvSandbox, lowerdirs, disk: int, uid_base: int, userns_fd: int) -> None:
    """The sandbox's root: a tmpfs of `disk` bytes for upper and work, the layers idmapped through `userns_fd`
    (host root's files are root's inside; -1: plain), an overlay of both at gv.merged."""
    lowerdirs = list(lowerdirs)
    disk_dir = gv.dir / "disk"
    lowers = [str(gv.dir / f"lower{i}") for i in range(len(lowerdirs))]
    data = f"lowerdir={':'.join(lowers)},upperdir={disk_dir}/upper,workdir={disk_dir}/work"
    if len(data.encode()) >= MOUNT_DATA_MAX:
        fits = (MOUNT_DATA_MAX - 1 - len(data.encode()) + len(":".join(lowers).encode())) // (len(lowers[-1]) + 1)
        # mount(2) reads one page of options: the kernel cut the list short, and overlayfs answered ELOOP (a
        # lowerdir the cut made a prefix of another: "lower6" of "lower65") or ENOENT, a 500 of a fork of a fork
        raise StateError(f"the image of sandbox {gv.id} is a chain of {len(lowerdirs)} layers (a snapshot of a "
                         "restore or fork adds one each time), more than one overlay mount takes here (about "
                         f"{fits}); restore or fork from a sandbox "
                         "with fewer snapshots under it, or start a new one from a shorter image.")
    gv.dir.mkdir(mode=0o700)
    os.chown(gv.dir, uid_base, uid_base)
    disk_dir.mkdir(mode=0o700)
    linux.mount("hutch-gvisor-disk", str(disk_dir), "tmpfs", linux.MS_NOSUID | linux.MS_NODEV,
                f"size={disk},mode=0700")
    gv.mounts.append(str(disk_dir))
    for name in ("upper", "work"):
        (disk_dir / name).mkdir(mode=0o755)
        os.chown(disk_dir / name, uid_base, uid_base)
    for i, d in enumerate(lowerdirs):
        at = Path(lowers[i])
        at.mkdir(mode=0o700)
        if userns_fd >= 0:
            tree = linux.idmapped_tree(str(d), userns_fd, readonly=True)
            try:
                linux.move_mount_fd(tree, str(at))
            finally:
                os.close(tree)
        else:
            linux.mount(str(d), str(at), None, linux.MS_BIND)
            linux.mount(None, str(at), None, linux.MS_BIND | linux.MS_REMOUNT | linux.MS_RDONLY | linux.MS_NOSUID |
                        linux.MS_NODEV)
        gv.mounts.append(str(at))
    gv.merged.mkdir(mode=0o755)
    linux.mount("hutch-gvisor-root", str(gv.merged), "overlay", linux.MS_NOSUID | linux.MS_NODEV, data)
    gv.mounts.append(str(gv.merged))


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def mount_binds(gv: GvSandbox, binds, fds: list[int], uid_base: int) -> None:
    """Attach each bind's detached tree (native.runtime.bind_trees: idmapped as a native sandbox's) at its target
    inside the merged root, on the host: runsc's gofer serves the root with what is mounted in it, and the files
    server (chrooted there) sees the binds as the sandbox does. The target is made walking the image's tree from
    the root one component at a time, O_NOFOLLOW: a symlink on the way is refused (it would resolve on the host)."""
    for m in binds:
        fd = _target(gv, m.target, os.path.isdir(m.source), uid_base)
        try:
            linux.move_mount_at(fds[m.tree], fd)
        finally:
            os.close(fd)
        gv.mounts.append(str(gv.merged) + m.target.rstrip("/"))


def _target(gv: GvSandbox, target: str, is_dir: bool, uid_base: int, mode: int = 0o755) -> int:
    """An fd of `target` inside the merged root, made (as the sandbox root's) where missing, never through a link."""
    parts = [p for p in target.split("/") if p]
    fd = os.open(gv.merged, _DIR_FLAGS)
    try:
        for i, part in enumerate(parts):
            if i < len(parts) - 1 or is_dir:
                try:
                    os.mkdir(part, mode, dir_fd=fd)
                    os.chown(part, uid_base, uid_base, dir_fd=fd, follow_symlinks=False)
                    if mode != 0o755:   # past the umask
                        os.chmod(part, mode, dir_fd=fd)
                except FileExistsError:
                    pass
                try:
                    nfd = os.open(part, _DIR_FLAGS, dir_fd=fd)
                except OSError:
                    raise InvalidSpecError(f"the mount target {target!r} passes through a symlink or a file of the "
                                           f"image at {'/'.join(parts[:i + 1])!r}; mount it elsewhere.") from None
            else:
                try:
                    nfd = os.open(part, os.O_RDONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644, dir_fd=fd)
                except OSError:
                    raise InvalidSpecError(f"the bind target {target!r} of a file is a directory or a symlink in "
                                           "the image; bind it elsewhere.") from None
            os.close(fd)
            fd = nfd
        return fd
    except BaseException:
        os.close(fd)
        raise


def root_tmp(gv: GvSandbox, uid_base: int) -> bool:
    """Whether the sandbox's /tmp is a directory of its root (made 1777 if missing): then config.json binds it
    to itself, since runsc would otherwise mount a tmpfs of its own there, out of sight of the files API, the
    disk= limit and filesystem snapshots. False (runsc's default then) if the image has /tmp as a link or file."""
    try:
        os.close(_target(gv, "/tmp", True, uid_base, 0o1777))
        return True
    except InvalidSpecError:
        return False


def make_workdir(gv: GvSandbox, workdir: str, uid_base: int) -> None:
    """The spec's workdir made in the root where the image lacks it, as a native init makes it (runsc would
    fail every exec there); one through a symlink or a file of the image, or in a read-only root, is left to
    fail as runsc says."""
    if workdir and workdir.rstrip("/"):
        try:
            os.close(_target(gv, workdir, True, uid_base))
        except (InvalidSpecError, OSError):
            pass


def _still_mounted(d: Path) -> list[str]:
    prefix = str(d) + "/"
    return [t for t in (line.split()[4].replace("\\040", " ")
                        for line in Path("/proc/self/mountinfo").read_text().splitlines())
            if t.startswith(prefix) or t == str(d)]


def remove_unmounted(d: Path) -> None:
    """rmtree `d`, unless anything is still mounted under it: a bind of the host's, writable, may be among them."""
    left = _still_mounted(d)
    if left:
        print(f"hutch daemon: {d} is kept: {left[0]} is still mounted under it (unmount it, then remove it).",
              file=sys.stderr)
        return
    shutil.rmtree(d, ignore_errors=True)


def unmount_root(gv: GvSandbox) -> None:
    """Unmount the sandbox's root (and its terminals' devpts) and remove its directories."""
    for target in reversed(gv.mounts):
        try:
            linux.umount2(target, linux.MNT_DETACH)
        except OSError:
            pass
    gv.mounts.clear()
    remove_unmounted(gv.dir)
    if gv.tty is not None:
        try:
            linux.umount2(str(gv.tty), linux.MNT_DETACH)
        except OSError:
            pass
        try:
            gv.tty.rmdir()
        except OSError as e:
            print(f"hutch daemon: {gv.tty} is kept ({e}); unmount and remove it.", file=sys.stderr)
        gv.tty = None


@dataclass
class Spare:
    """A keeper started ahead of its sandbox (`spawn_keeper`): a Python process that has imported its code
    and waits for its config, in the daemon's cgroups, holding nothing of any sandbox yet."""

    proc: subprocess.Popen
    sock: socket.socket


def spawn_keeper() -> Spare:
    """Start a keeper process (keeper.py), not yet any sandbox's. Called on the event loop's thread: the
    keeper's PDEATHSIG is tied to the thread that forked it."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    pkg_parent = str(paths.PACKAGE_PARENT)
    code = (f"import sys; sys.path.insert(0, {pkg_parent!r}); "
            f"from hutch.sandbox._host.gvisor.keeper import main; main({theirs.fileno()}, {os.getpid()})")
    try:
        proc = subprocess.Popen([sys.executable, "-I", "-S", "-c", code], pass_fds=[theirs.fileno()],
                                stdin=subprocess.DEVNULL, close_fds=True, env={})
    except BaseException:
        ours.close()
        raise
    finally:
        theirs.close()
    return Spare(proc, ours)


class Spares:
    """Up to `size` keepers started ahead (a keeper's start is a Python interpreter's: ~60 ms of CPU, most of
    a gVisor sandbox's own set-up), so that a create or restore takes one that is ready and the next is started
    meanwhile. They end with the daemon (`close`; PDEATHSIG if it dies)."""

    def __init__(self, size: int = 2):
        self.size = size
        self.ready: list[Spare] = []
        self.closed = False

    def take(self) -> Spare:
        """A spare keeper that is still alive (else a new one), and the pool refilled."""
        spare = None
        while self.ready:
            s = self.ready.pop(0)
            if s.proc.poll() is None:
                spare = s
                break
            _end_spare(s)
        if spare is None:
            spare = spawn_keeper()
        self.fill()
        return spare

    def fill(self, at_least: int = 0) -> None:
        """Start spares up to the pool's size, or `at_least` of them (a fork about to restore that many)."""
        while not self.closed and len(self.ready) < max(self.size, at_least):
            try:
                self.ready.append(spawn_keeper())
            except OSError as e:   # out of processes or memory: the next take starts one itself
                print(f"hutch daemon: could not start a spare gVisor keeper: {e}", file=sys.stderr)
                return

    def close(self) -> None:
        self.closed = True
        while self.ready:
            _end_spare(self.ready.pop())


def _end_spare(s: Spare) -> None:
    s.sock.close()   # it reads EOF and exits
    try:
        s.proc.wait(2)
    except subprocess.TimeoutExpired:
        s.proc.kill()
        s.proc.wait()


async def start_keeper(gv: GvSandbox, cgroup_procs: list[str], uid_base: int,
                       on_event: Callable[[dict], None], spares: "Spares | None" = None, masks=()) -> None:
    """Give the sandbox a keeper (a spare one, or a new one) and start its files server; returns once both
    run. `masks`: the directories the sentry serves itself (keeper.Files refuses file calls there)."""
    spare = spares.take() if spares is not None else spawn_keeper()
    gv.keeper, ours = spare.proc, spare.sock
    loop = asyncio.get_running_loop()
    ready = loop.create_future()

    def event(msg, fds):
        if msg["op"] == "ready" and not ready.done():
            ready.set_result((msg, fds))
            return
        for fd in fds:
            os.close(fd)
        if msg["op"] == "ran":
            fut = gv.runs.pop(msg["rid"], None)
            if fut is not None and not fut.done():
                fut.set_result(msg["status"])
        elif msg["op"] == "eof" and not ready.done():
            ready.set_exception(SandboxError(f"the keeper of gVisor sandbox {gv.id} exited while starting; "
                                             "see the daemon's log."))
        else:
            if msg["op"] == "eof":
                for fut in gv.runs.values():
                    if not fut.done():
                        fut.set_result(-1)
            on_event(msg)

    gv.ctl = Channel(ours, event)
    await gv.ctl.notify({"op": "config", "cgroup_procs": cgroup_procs, "root": str(gv.merged), "uid_base": uid_base,
                         "masks": list(masks)})
    msg, fds = await asyncio.wait_for(ready, START_TIMEOUT)
    gv.files_pid = msg["files_pid"]
    gv.files = Channel(socket.socket(fileno=fds[0]), lambda m, f: [os.close(x) for x in f])


async def keeper_run(gv: GvSandbox, argv: list[str], stdio: tuple[int, int, int]) -> int:
    """Run `argv` (runsc create/run/restore) as the keeper's child, with `stdio`; its wait status."""
    rid = next(gv.rids)
    fut = asyncio.get_running_loop().create_future()
    gv.runs[rid] = fut
    await gv.ctl.notify({"op": "run", "rid": rid, "argv": argv}, list(stdio))
    return await asyncio.wait_for(fut, START_TIMEOUT)


async def stop_keeper(gv: GvSandbox) -> None:
    """Close the keeper's channel (it exits) and collect its exit status without blocking the loop."""
    for ch in (gv.files, gv.ctl):
        if ch is not None:
            ch.close()
    proc = gv.keeper
    if proc is None or proc.poll() is not None:
        return
    pidfd = os.pidfd_open(proc.pid)
    loop = asyncio.get_running_loop()
    gone = loop.create_future()
    loop.add_reader(pidfd, lambda: gone.done() or gone.set_result(None))
    try:
        try:
            await asyncio.wait_for(asyncio.shield(gone), 2.0)
        except asyncio.TimeoutError:
            proc.kill()
            await gone
    finally:
        loop.remove_reader(pidfd)
        os.close(pidfd)
    proc.wait()


def write_bundle(gv: GvSandbox, config: dict) -> Path:
    path = gv.dir / "config.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(config))
    os.replace(tmp, path)
    return gv.dir


def sentry_ending(gv: GvSandbox) -> bool:
    """Whether the sandbox's sentry has exited or is exiting: its pidfd readable (every thread gone), or the
    kernel's PF_EXITING on its leader, which a SIGKILL (the OOM killer's) sets on every thread before the last
    one closes the sentry's sockets; the pidfd not being readable says the pid is still the sentry's."""
    if not gv.sentry_pid:
        return False
    if gv.sentry_fd < 0:   # gone before runsc run had returned, or torn down
        return True
    try:
        flags = int(Path(f"/proc/{gv.sentry_pid}/stat").read_bytes().rsplit(b")", 1)[1].split()[6])
    except (OSError, IndexError, ValueError):
        flags = _PF_EXITING
    exited = select.poll()
    exited.register(gv.sentry_fd, select.POLLIN)
    return bool(exited.poll(0)) or bool(flags & _PF_EXITING)


#: include/linux/sched.h: the task is in do_exit()
_PF_EXITING = 0x4


def wait_status(code: int) -> int:
    """`runsc exec`'s exit code as a wait status: 128+N is a death by signal N (as a shell reports it)."""
    if 128 < code <= 128 + 64:
        return code - 128
    return (code & 0xFF) << 8


class GvisorChannel:
    """What Execs and the store routes call on a sandbox (the native init's Channel), for a gVisor sandbox:
    exec and kill through runsc, `upper` from the host, every file call to the files server."""

    def __init__(self, gv: GvSandbox, calls: Runsc, on_event: Callable[[dict, list[int]], None], join: Callable):
        self.gv = gv
        self.calls = calls
        self.on_event = on_event
        self.join = join                   # puts a host pid into the sandbox's memory and cpu cgroups
        self.closed = False
        self.procs: dict[str, asyncio.subprocess.Process] = {}
        self.starting: set[str] = set()          # execs on their way to runsc exec (a kill for one waits)
        self.pending: dict[str, list[tuple[int, bool]]] = {}  # signals for those (and whether to its session)
        self.terminals: set[str] = set()         # running execs on a terminal
        self.tasks: set[asyncio.Task] = set()

    def drain(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True
        for p in self.procs.values():
            if p.returncode is None:
                try:
                    p.kill()
                except ProcessLookupError:
                    pass

    async def request(self, msg: dict, fds=()) -> tuple[dict, list[int]]:
        if self.closed:
            raise StateError("the sandbox has ended; create a new sandbox.")
        op = msg["op"]
        if op == "exec":
            return await self._exec(msg, list(fds))
        if op == "upper":
            return {"ok": True}, [os.open(self.gv.upper, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)]
        if op == "kill":
            self._kill(msg)
            return {"ok": True}, []
        if self.gv.lock.locked():   # a memory snapshot is being taken: its files are being committed
            async with self.gv.lock:
                pass
        return await self.gv.files.request(msg, fds)

    async def notify(self, msg: dict, fds=()) -> None:
        if msg["op"] == "kill":
            self._kill(msg)

    async def _exec(self, msg: dict, fds: list[int]) -> tuple[dict, list[int]]:
        """`runsc exec` of the command. One arriving while a memory snapshot is taken waits for it (a runsc exec
        of a paused or checkpointing sandbox is not defined; and its pipes, the host's, must not be in it): it
        starts holding the lock, so a snapshot after it sees it running (Execs.busy) and refuses."""
        self.starting.add(msg["eid"])
        try:
            async with self.gv.lock:
                if self.closed:
                    return {"ok": False, "error": "StateError", "message": "the sandbox has ended; create a new "
                                                                          "sandbox."}, []
                return await self._start_exec(msg, fds)
        finally:
            self.starting.discard(msg["eid"])
            self.pending.pop(msg["eid"], None)

    async def _start_exec(self, msg: dict, fds: list[int]) -> tuple[dict, list[int]]:
        """runsc exec; (reply, [the terminal's master] for an exec with "pty": [rows, cols]). A terminal is a pty
        of the sandbox's devpts instance on the host (Runsc.open_pty): runsc exec gets its slave as stdin, stdout
        and stderr and as its controlling terminal (`setsid -c`), and gVisor gives the command that host terminal
        as its own (isatty, termios, window size and job control go to it; `tty` says "not a tty": gVisor names
        it host:[N], not /dev/pts/N)."""
        eid = msg["eid"]
        pidfile = self.gv.dir / f"exec-{eid}.pid"
        args = ["exec", f"--internal-pid-file={pidfile}", f"--cwd={msg['cwd']}", f"--user={msg.get('uid', 0)}:"
                f"{msg.get('uid', 0)}"]
        for k, v in msg["env"].items():
            args.append(f"--env={k}={v}")
        args += ["--", self.gv.id, *msg["argv"]]
        if any("\0" in a for a in args) or any(not k or "=" in k for k in msg["env"]):
            return {"ok": False, "error": "ConfigError", "message": "argv, env and workdir may not hold NUL bytes, "
                                                                    "nor an env name '=' or be empty; fix the command."}, []
        # the program and the workdir looked up in the root first (keeper.Files.op_which): runsc exec would start
        # and fail inside, a 200 with an exit code where a native init says NotFoundError
        reply, _ = await self.gv.files.request({"op": "which", "argv0": msg["argv"][0], "cwd": msg["cwd"],
                                                "path": msg["env"].get("PATH") or DEFAULT_PATH})
        if not reply["ok"]:
            return reply, []
        argv = self.calls.argv(self.gv, *args)
        master = slave = None
        if msg.get("pty"):
            if shutil.which(SETSID) is None:
                return {"ok": False, "error": "UnsupportedError", "message": "a terminal exec on gVisor needs "
                        "util-linux's setsid, which is not on the daemon's PATH; install util-linux."}, []
            try:
                master, slave = await asyncio.to_thread(self.calls.open_pty, self.gv, *msg["pty"])
            except OSError as e:
                if e.errno != errno.ENOSPC:
                    raise
                return {"ok": False, "error": "SandboxError", "message":
                        f"the sandbox holds all the {MAX_PTYS} terminals it may have open; end some of its "
                        "terminal sessions first."}, []
            stdio = [slave, slave, slave]
            argv = [SETSID, "-c", *argv]
        else:
            passed = iter(fds)
            stdio = [next(passed) if want else subprocess.DEVNULL for want in msg["streams"]]
        try:
            proc = await asyncio.create_subprocess_exec(*argv, stdin=stdio[0], stdout=stdio[1], stderr=stdio[2])
        except OSError as e:
            if master is not None:
                os.close(master)
            return {"ok": False, "error": "SandboxError", "message": f"runsc exec could not start: {e}"}, []
        finally:
            if slave is not None:
                os.close(slave)   # runsc has it, and gives it to the sentry
        self.join(proc.pid)
        self.procs[eid] = proc
        self._task(self._wait(eid, proc, pidfile))
        if master is not None:
            self.terminals.add(eid)
        for sig, session in self.pending.pop(eid, ()):   # kills that came while it started
            self._task(self._signal(eid, sig, session))
        return {"ok": True, "pid": proc.pid}, ([master] if master is not None else [])

    def _task(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _wait(self, eid: str, proc, pidfile: Path) -> None:
        code = await proc.wait()
        self.procs.pop(eid, None)
        try:
            pidfile.unlink()
        except FileNotFoundError:
            pass
        if sentry_ending(self.gv):
            # the sandbox died under the command (its sentry OOM-killed, say): runsc exec's status is runsc's own
            # error (128, 255), not the command's; the sandbox's end reports it (sandbox_ended), whichever of
            # runsc exec's exit and the keeper's word of the sentry's comes first
            return
        status = wait_status(code) if code >= 0 else -code
        self.terminals.discard(eid)
        self.on_event({"op": "exec_exit", "eid": eid, "status": status}, [])

    def _kill(self, msg: dict) -> None:
        eid, sig, session = msg["eid"], int(msg["signal"]), bool(msg.get("session"))
        if eid in self.procs:
            self._task(self._signal(eid, sig, session))
        elif eid in self.starting and len(self.pending.get(eid, ())) < 8:
            self.pending.setdefault(eid, []).append((sig, session))

    async def _signal(self, eid: str, sig: int, session: bool = False) -> None:
        """Signal exec `eid`'s process group inside, as a native init does (killpg): gVisor makes each exec'd
        command the leader of a session of its own, so `kill -SIG -PID` from a helper exec reaches what it started
        (`sleep 30 &` too); then `runsc kill --pid` for the command itself, should it have left its group or the
        helper could not start (the sandbox at its pids limit). Its pid is known once runsc exec has written it:
        a kill that comes sooner waits for it. `session` (a terminal's command ending): every process of its
        session too, the shell's jobs in process groups of their own, as a native init ends them."""
        pidfile = self.gv.dir / f"exec-{eid}.pid"
        while True:
            proc = self.procs.get(eid)
            if proc is None or proc.returncode is not None or self.closed:
                return
            try:
                pid = int(pidfile.read_text().strip())
                break
            except (OSError, ValueError):
                await asyncio.sleep(0.005)
        gv = self.gv
        bb = runsc.BUSYBOX_AT
        if session:   # the command is its session's leader (gVisor's exec makes it one): its sid is its pid
            helper = [bb, "sh", "-c", f'{bb} kill -{sig} -- -$1 $({bb} ps -o sid,pid | {bb} awk -v s=$1 '
                                      "'$1 == s && $2 != s {print $2}')", bb, str(pid)]
        else:
            helper = [bb, "kill", f"-{sig}", "--", f"-{pid}"]
        try:
            code, _ = await self.calls.call(gv, "exec", "--cap=CAP_KILL", "--", gv.id, *helper, check=False)
            if code:
                await self.calls.call(gv, "kill", f"--pid={pid}", gv.id, str(sig), check=False)
        except SandboxError:   # runsc did not answer (the sandbox is ending): its teardown kills everything
            pass


def kill_all(cgroups, sid: str, keep: int) -> None:
    """SIGKILL every process of the sandbox's cgroups but its keeper (which reaps them), thawed first."""
    cgroups.thaw(sid)
    for pid in cgroups.pids(sid):
        if pid != keep:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


__all__ = ["GvSandbox", "GvisorChannel", "Runsc", "Spare", "Spares", "spawn_keeper", "kill_all", "keeper_run", "make_workdir", "mount_binds", "mount_root", "remove_unmounted", "root_tmp", "sentry_ending", "start_keeper",
           "stop_keeper", "unmount_root", "wait_status", "write_bundle"]
