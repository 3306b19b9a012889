"""The daemon's side of the native runtime: the zygote process and the channels to each init."""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Callable

from hutch._core import paths, settings
from hutch._core.errors import DaemonError, InvalidSpecError, SandboxError, StateError
from hutch.sandbox._host.native import initwire
from hutch.sandbox._host.native.disk import LayerStore
from hutch.sandbox._host.native.plan import Plan
from hutch.sandbox._host.native.seccomp import build_filter

DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# Where writable layers live: "disk" (the default: a btrfs store with a quota per sandbox, disk.py), or
# "tmpfs" (memory: what a sandbox writes counts against its memory=). HUTCH_LAYERS in the daemon's environment.
#: The C init (initd.c, built by scripts/setup.sh next to it): each sandbox's init execs it once its root is
#: built and it is locked down, and holds a few pages instead of a copy of the interpreter. HUTCH_NATIVE_INIT=0
#: (or no binary: a checkout setup.sh has not built) keeps every init the Python one (init.Init).
NATIVE_INIT_PATH = Path(__file__).with_name("hutch-init")


def native_init() -> str:
    """The C init's path, or "" when inits stay Python (turned off, or not built)."""
    return str(NATIVE_INIT_PATH) if settings.NATIVE_INIT.get() and os.access(NATIVE_INIT_PATH, os.X_OK) else ""


class Channel:
    """Request/reply and events over one SOCK_SEQPACKET socket, on the asyncio loop."""

    def __init__(self, sock: socket.socket, on_event: Callable[[dict, list[int]], None]):
        self.loop = asyncio.get_running_loop()
        self.sock = sock
        sock.setblocking(False)
        self.on_event = on_event
        self.pending: dict[int, asyncio.Future] = {}
        self.rids = itertools.count(1)
        self.closed = False
        self.outbox: collections.deque[tuple[bytes, list[int], asyncio.Future]] = collections.deque()
        self.loop.add_reader(sock.fileno(), self._readable)

    def _readable(self) -> None:
        while not self.closed:
            try:
                data, fds = initwire.recv_fds(self.sock)
            except BlockingIOError:
                return
            except OSError:
                data, fds = b"", []
            if not data:
                self._eof()
                return
            msg, fds = initwire.unpack(data, list(fds))
            fut = self.pending.pop(msg.get("rid"), None) if "rid" in msg else None
            if fut is not None and not fut.done():
                fut.set_result((msg, fds))
            elif fut is not None:
                _close_all(fds)
            else:
                self.on_event(msg, fds)

    def drain(self) -> None:
        """Handle every message already queued on the socket, now (the init's last words before it exited)."""
        self._readable()

    def _eof(self) -> None:
        self.close()
        self.on_event({"op": "eof"}, [])

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.loop.remove_reader(self.sock.fileno())
        if self.outbox:
            self.loop.remove_writer(self.sock.fileno())
        self.sock.close()
        for _, _, fut in self.outbox:
            if not fut.done():
                fut.set_exception(StateError("the sandbox ended before the call could be sent; create a new sandbox."))
        self.outbox.clear()
        for fut in self.pending.values():
            if not fut.done():
                fut.set_exception(StateError("the sandbox ended while the call was in flight; create a new sandbox."))
        self.pending.clear()

    async def _send(self, msg: dict, fds=()) -> None:
        if self.closed:
            raise StateError("the sandbox has ended; create a new sandbox.")
        data, fdl, mfd = initwire.pack(msg, fds)
        try:
            if not self.outbox and self._send_now(data, fdl):
                return
            # The socket is full (or others wait before us): queue in order. One writer callback per socket
            # serves the whole queue; add_writer replaces an earlier callback, so one per waiter would lose some.
            fut = self.loop.create_future()
            self.outbox.append((data, fdl, fut))
            if len(self.outbox) == 1:
                self.loop.add_writer(self.sock.fileno(), self._writable)
            await fut   # cancelled while queued: _writable skips it (its fds are closed by the caller)
        finally:
            if mfd is not None:
                os.close(mfd)

    def _send_now(self, data: bytes, fdl: list[int]) -> bool:
        """Send one message; False if the socket is full."""
        try:
            if fdl:
                socket.send_fds(self.sock, [data], fdl)
            else:
                self.sock.send(data)
            return True
        except BlockingIOError:
            return False
        except OSError as e:
            raise StateError("the sandbox has ended; create a new sandbox.") from e

    def _writable(self) -> None:
        while self.outbox:
            data, fdl, fut = self.outbox[0]
            if not fut.done():
                try:
                    if not self._send_now(data, fdl):
                        return   # still full: stay registered
                except StateError as e:
                    fut.set_exception(e)
                else:
                    fut.set_result(None)
            self.outbox.popleft()
        self.loop.remove_writer(self.sock.fileno())

    async def request(self, msg: dict, fds=()) -> tuple[dict, list[int]]:
        rid = next(self.rids)
        fut = self.loop.create_future()
        self.pending[rid] = fut
        try:
            await self._send({**msg, "rid": rid}, fds)
        except BaseException:
            self.pending.pop(rid, None)
            raise
        return await fut

    async def notify(self, msg: dict, fds=()) -> None:
        await self._send(msg, fds)


def _close_all(fds) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


class Zygote:
    """The start server process (see zygote.py), owned by the daemon."""

    def __init__(self, on_reaped: Callable[[int, int], None], on_death: Callable[["Zygote"], None]):
        self.on_reaped = on_reaped
        self.on_death = on_death
        self.proc: subprocess.Popen | None = None
        self.channel: Channel | None = None
        self.pid = 0
        self.layers: LayerStore | None = None   # its sandboxes' writable layers (None: tmpfs, see disk.py)
        self.layers_error = ""
        self._destroying: list[str] = []   # layers release_layer queued for the next "destroy" message

    async def _make_layers(self, mount_at: Path | None) -> dict | None:
        if mount_at is None or settings.LAYERS.get() == "tmpfs":
            return None
        try:
            self.layers = await asyncio.to_thread(LayerStore.make, paths.state_dir())
        except OSError as e:
            self.layers_error = str(e)
            return None
        mount_at.mkdir(mode=0o700, exist_ok=True)
        return {"dev": self.layers.dev, "at": str(mount_at)}

    async def start(self, home_procs: list[str], layers_at: Path | None = None) -> None:
        """Start the zygote; with `layers_at` (a directory it mounts its store of writable layers on, in a
        mount namespace of its own) sandboxes get disk-backed layers, else (or if the store cannot be
        made) tmpfs ones, with a warning."""
        layers = await self._make_layers(layers_at)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        pkg_parent = str(paths.PACKAGE_PARENT)
        code = (f"import sys; sys.path.insert(0, {pkg_parent!r}); "
                f"from hutch.sandbox._host.native.zygote import main; main({theirs.fileno()}, {os.getpid()})")
        # -I -S: no site-packages, no environment: the zygote imports only the standard library. Nor does it
        # get the daemon's environment (tokens, credentials): every init would hold a copy in its memory.
        self.proc = subprocess.Popen([sys.executable, "-I", "-S", "-c", code], pass_fds=[theirs.fileno()],
                                     stdin=subprocess.DEVNULL, close_fds=True, env={})
        theirs.close()
        ready = asyncio.get_running_loop().create_future()

        def on_event(msg, fds):
            if msg["op"] == "ready" and not ready.done():
                self.pid = msg["pid"]
                ready.set_result((msg, fds))
                return
            _close_all(fds)
            if msg["op"] == "reaped":
                self.on_reaped(msg["pid"], msg["status"])
            elif msg["op"] == "eof":
                self._drop_layers()   # its mount namespace, and with it the store, is gone
                if not ready.done():
                    ready.set_exception(DaemonError("the sandbox start server exited during start-up (its error is "
                                                    "in the daemon's log)"))
                elif self.pid:
                    self.on_death(self)

        self.channel = Channel(ours, on_event)
        try:
            await self.channel.notify({"op": "config", "seccomp": build_filter().hex(), "home_procs": home_procs,
                                       "layers": layers, "native_init": native_init()})
            msg, fds = await asyncio.wait_for(ready, 10)
        except BaseException:
            self._drop_layers()
            await self.reap()
            raise
        if self.layers is not None and fds:
            try:
                self.layers.attach(fds.pop())
            except OSError as e:   # quotas refused: no store is better than one without limits
                self.layers_error = f"quotas: {e}"
                self._drop_layers()
        elif self.layers is not None:
            self.layers_error = msg.get("layers_error") or "the zygote could not mount it"
            self._drop_layers()
        _close_all(fds)
        if self.layers is None and layers_at is not None and settings.LAYERS.get() != "tmpfs":
            print(f"hutch daemon: no disk for writable layers ({self.layers_error}); they are tmpfs, so what a "
                  "sandbox writes counts against its memory= and filling disk= may OOM-kill it "
                  "(docs/architecture.md, Root).", file=sys.stderr)

    def _drop_layers(self) -> None:
        if self.layers is not None:
            self.layers.close()
            self.layers = None

    async def spawn(self, plan: dict) -> tuple[int, socket.socket]:
        """Start a sandbox's init from a plan; returns its host pid and the socket to it."""
        if self.channel is None or self.channel.closed:
            raise DaemonError("the sandbox start server is not running; restart the daemon (hutch serve).")
        msg, fds = await self.channel.request({"op": "start", "plan": plan})
        if msg["op"] != "started":
            _close_all(fds)
            raise SandboxError(msg.get("message", "the sandbox could not be started."))
        return msg["pid"], socket.socket(fileno=fds[0])

    async def release_layer(self, name: str) -> None:
        """Have the zygote destroy an ended sandbox's layer (its subvolume) in the store, in its own time. The
        layers of sandboxes ending together go in one message (a mass teardown sent 2,000 otherwise)."""
        if self.layers is None or self.channel is None or self.channel.closed:
            return   # the store went with its zygote
        self._destroying.append(name)
        if len(self._destroying) > 1:
            return   # the first one's message takes it along
        await asyncio.sleep(0)   # the other endings the loop is running now queue theirs
        names, self._destroying = self._destroying, []
        try:
            await self.channel.notify({"op": "destroy", "layers": names})
        except StateError:
            pass

    async def userns(self, uid_map: str, gid_map: str) -> int:
        """An fd of a new user namespace with these id maps (lines of /proc/<pid>/uid_map)."""
        if self.channel is None or self.channel.closed:
            raise DaemonError("the sandbox start server is not running; restart the daemon (hutch serve).")
        msg, fds = await self.channel.request({"op": "userns", "uid_map": uid_map, "gid_map": gid_map})
        if msg["op"] != "userns" or len(fds) != 1:
            _close_all(fds)
            raise SandboxError(msg.get("message", "a user namespace for an idmapped mount could not be made."))
        return fds[0]

    def stop(self) -> None:
        self._drop_layers()
        if self.channel is not None:
            self.channel.close()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    async def reap(self) -> None:
        """Kill the process if it still runs and collect its exit status, without blocking the loop:
        a zygote that died (or failed to start) must not stay a zombie child of the daemon."""
        self._drop_layers()
        if self.channel is not None:
            self.channel.close()
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        proc.kill()
        pidfd = os.pidfd_open(proc.pid)
        loop = asyncio.get_running_loop()
        gone = loop.create_future()
        loop.add_reader(pidfd, lambda: gone.done() or gone.set_result(None))
        try:
            await gone
        finally:
            loop.remove_reader(pidfd)
            os.close(pidfd)
        proc.wait()


def bind_trees(plan: Plan, userns_fd: int = -1, helpers: dict | None = None) -> tuple[Plan, list[int]]:
    """Open each bind source of `plan` as a detached mount, nosuid and nodev (in the daemon's mount namespace);
    returns the plan with each bind's index among the fds ("tree"), and the fds: a warm init unshared its
    namespace before the plan existed, so a mount made on the host since then (a memory store's FUSE view)
    is not in its copy; the fd carries it there.

    With `userns_fd` (the sandbox's user namespace) the image's layers come as trees too ("lower_trees"),
    idmapped through it. Each bind goes through the mapping with_bind_maps chose: the sandbox's namespace, or
    `helpers[map]`, a user namespace fd with that map. A source whose filesystem cannot idmap (a FUSE
    view, served with allow_other) is passed plain, unless the operator named its `owner`."""
    from hutch.sandbox._host.native import linux

    helpers = helpers or {}
    fds: list[int] = []
    try:
        if userns_fd >= 0:
            for d in plan.lowerdirs:
                fds.append(linux.idmapped_tree(d, userns_fd, readonly=True))
            plan = dataclasses.replace(plan, lower_trees=tuple(range(len(fds))))
        mounts = []
        for m in plan.mounts:
            if m.kind != "bind":
                mounts.append(m)
                continue
            ns = userns_fd if m.map == "sandbox" else helpers[m.map] if m.map else -1
            tree = -1
            if ns >= 0:
                try:
                    tree = linux.detached_tree(m.source, ns, m.readonly)
                except OSError as e:
                    if m.owner:
                        raise InvalidSpecError(
                            f"Mount.bind owner= needs an idmapped mount, which the filesystem of {m.source!r} "
                            f"does not allow ({e}); bind it without owner=.") from None
            fds.append(tree if tree >= 0 else linux.detached_tree(m.source, readonly=m.readonly))
            mounts.append(dataclasses.replace(m, tree=len(fds) - 1))
    except BaseException:
        _close_all(fds)
        raise
    return dataclasses.replace(plan, mounts=tuple(mounts)), fds


def exec_env(spec, image, hostname: str, extra: dict | None = None) -> dict:
    """The environment of a command: defaults, then the image's, then the sandbox's, then the exec's."""
    env = {"PATH": DEFAULT_PATH, "HOME": "/root", "HOSTNAME": hostname, "LANG": "C.UTF-8"}
    env.update(dict(image.env))
    env.update(dict(spec.env))
    env.update(extra or {})
    return env
