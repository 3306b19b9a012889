"""gVisor sandboxes in the daemon: `Gvisor`, the part of the Manager that starts, ends, checkpoints and restores
sandboxes of `runtime="gvisor"` (the runtime itself: _host/gvisor/).

A gVisor sandbox is a LiveSandbox like any other (same record, cgroups, uid range, egress attachment, timers,
Execs); what differs is held in `LiveSandbox.gv` and its channel (gvisor.runtime.GvisorChannel).
"""

from __future__ import annotations

import asyncio
import errno
import dataclasses
import os
import re
import shutil
import sys
import time
from typing import TYPE_CHECKING

from hutch._core.errors import ConfigError, SandboxError, StateError, UnsupportedError
from hutch.sandbox._host import images, layers
from hutch.sandbox._host.gvisor import runsc, snapshots, transfer
from hutch.sandbox._host.gvisor.runtime import (
    GvisorChannel, GvSandbox, Runsc, Spares, keeper_run, kill_all, make_workdir, mount_binds, mount_root, root_tmp,
    start_keeper,
    stop_keeper, unmount_root, write_bundle,
)
from hutch.sandbox._host.native import linux
from hutch.sandbox._host.native.plan import build_plan
from hutch.sandbox._host.native.runtime import bind_trees, exec_env
from hutch.sandbox._spec import SandboxSpec

if TYPE_CHECKING:  # pragma: no cover
    from hutch.sandbox._host.daemon.manager import LiveSandbox, Manager

#: pid 1 of a sandbox without a command: a shell waiting on a sleep that never ends, so that every orphan the
#: sandbox's commands leave (reparented to pid 1) is reaped, as a native init reaps them: ash's `wait` takes
#: any child (waitpid(-1)) while its own job runs
PID1 = [runsc.BUSYBOX_AT, "sh", "-c", f"while :; do {runsc.BUSYBOX_AT} sleep 2147483647 & wait; done"]
DELETE_TIMEOUT = 10.0
MAX_FORK = 16   # copies one fork call may make


def check_supported(spec) -> None:
    """Refuse what the gVisor runtime does not do (yet), naming the fix; UnsupportedError."""
    p = runsc.probe()
    if not p.ok:
        raise UnsupportedError(f'runtime="gvisor" is not available on this host: {p.why}.')
    if not runsc.host_busybox():
        raise UnsupportedError('runtime="gvisor" needs the host\'s static busybox (busybox-static); run scripts/setup.sh.')
    for m in spec.mounts:
        if m.kind not in ("tmpfs", "bind", "volume"):
            raise UnsupportedError(f"a gVisor sandbox takes Mount.tmpfs, Mount.bind and Mount.volume, not the {m.kind} "
                                   f"at {m.target} (a memory view is a FUSE mount of the host's, which gVisor's gofer "
                                   'does not serve); use runtime="native" for memory mounts.')


def sentry_dirs(spec, root_tmp: bool) -> list[str]:
    """What a gVisor sandbox's kernel serves from its own memory, unseen in its root on the host: /dev (/dev/shm
    with it), /proc, /sys, its tmpfs mounts, and /tmp where runsc mounts one (the image's /tmp not a directory)."""
    dirs = ["/dev", "/proc", "/sys"] + [m.target.rstrip("/") for m in spec.mounts if m.kind == "tmpfs"]
    if not root_tmp and not any(m.target.rstrip("/") == "/tmp" for m in spec.mounts):
        dirs.append("/tmp")
    return dirs


class Gvisor:
    """Sandboxes of runtime="gvisor" in one daemon (the Manager holds one)."""

    def __init__(self, mgr: "Manager"):
        self.mgr = mgr
        self.calls = Runsc(mgr.run_dir, mgr.cgroups.parent)
        self.spares = Spares()   # keepers started ahead; the first create or restore starts them

    def prepare(self) -> None:
        """At daemon start: clear what a crashed predecessor's gVisor sandboxes left (state files, mounts, a
        half-taken snapshot)."""
        self.calls.reap()
        snapshots.remove_partial()

    # --- start --------------------------------------------------------------------------

    async def create(self, spec, image) -> "LiveSandbox":
        from hutch.sandbox._host.daemon.manager import LiveSandbox

        check_supported(spec)
        mgr = self.mgr
        sb = LiveSandbox(id=self.mgr.new_id(), spec=spec, image=image, status="starting")
        sb.hostname = spec.name or f"hutch-{sb.id}"
        sb.cgroups = mgr.cgroups.paths(sb.id)
        sb.userns = mgr.idmap.userns_fd >= 0
        mgr._write_record(sb)
        mgr.register(sb)
        mgr._prune()
        try:
            gv = await self._prepare(sb, spec, image)
            write_bundle(gv, self._config(sb, gv))
            await self._run(gv, "run", "--detach", f"--bundle={gv.dir}", f"--pid-file={gv.dir}/pid", sb.id)
            self._running(sb, gv)
        except BaseException as e:
            await mgr.end(sb, "failed")
            if isinstance(e, (SandboxError, StateError, ConfigError)):
                raise
            if isinstance(e, OSError) and e.errno == errno.EROFS:   # the spec's read-only root lacks what runsc needs
                raise ConfigError(f"gVisor sandbox {sb.id} could not be started: its root is read-only and lacks "
                                  f"{e.filename!r}, which a gVisor sandbox needs; add it to the image or drop "
                                  "read_only.") from e
            raise SandboxError(f"gVisor sandbox {sb.id} could not be started: {e}") from e
        return sb

    def _config(self, sb: "LiveSandbox", gv: GvSandbox) -> dict:
        """The sandbox's config.json: a restore's must list the same mounts as its source's, so both come from
        here, from the same spec."""
        spec, image = sb.spec, sb.image
        return runsc.bundle_config(
            args=list(spec.command) or PID1, env=exec_env(spec, image, sb.hostname, sb.egress_env),
            cwd=spec.workdir if spec.command else "/", root=str(gv.merged), hostname=sb.hostname,
            netns=f"/proc/{gv.keeper.pid}/ns/net", cgroups_path=f"/{self.mgr.cgroups.parent}/{sb.id}",
            memory=spec.limits.memory, cpu=spec.limits.cpu, pids=spec.limits.pids, uid_base=sb.uid_base,
            caps=spec.capabilities, tmpfs=[(m.target, m.size or 64 * 1024**2) for m in spec.mounts if m.kind == "tmpfs"],
            binds=[(m.target, m.readonly) for m in spec.mounts if m.kind in ("bind", "volume")]
            + ([("/tmp", False)] if gv.root_tmp and not any(m.target.rstrip("/") == "/tmp" for m in spec.mounts)
               else []))

    async def _prepare(self, sb: "LiveSandbox", spec, image, lowerdirs=None) -> GvSandbox:
        """Everything before runsc: uid range, cgroups, root, keeper and files server, network."""
        mgr = self.mgr
        if sb.userns:
            sb.uid_base = mgr.ranges.take()
        mgr.cgroups.create(sb.id)
        mgr.cgroups.set_limits(sb.id, spec.limits.memory, runsc.host_pids(spec.limits.pids), spec.limits.cpu)
        gv = sb.gv = GvSandbox(sb.id, self.calls.dirs / sb.id, network=spec.network.mode != "none")
        ns = -1
        if sb.userns:
            if mgr.zygote is None:
                raise SandboxError(mgr.unavailable() or "the daemon is starting; retry in a moment.")
            m = f"0 {sb.uid_base} 65536"
            ns = await mgr.zygote.userns(m, m)
        try:
            mount_root(gv, lowerdirs if lowerdirs is not None else image.lowerdirs, spec.limits.disk, sb.uid_base, ns)
            if any(m.kind in ("bind", "volume") for m in spec.mounts):   # before the keeper: it copies the mounts
                await self._binds(sb, gv, spec, image, ns)
            gv.root_tmp = root_tmp(gv, sb.uid_base)
            make_workdir(gv, spec.workdir, sb.uid_base)
        finally:
            if ns >= 0:
                os.close(ns)
        await start_keeper(gv, mgr.cgroups.procs_files(sb.id), sb.uid_base, lambda msg: self._keeper_event(sb, msg),
                           self.spares, masks=sentry_dirs(spec, gv.root_tmp))
        sb.init_pid = gv.files_pid   # its netns is the sandbox's, its root (/proc/<pid>/root) the sandbox's root
        if mgr.network is not None:
            await mgr.network.attach(sb.id, gv.files_pid, spec.network, plain=True)
            # credentials: the gateway's CA into the root's trust store before runsc starts (trust.py's file
            # calls go to the files server, which is all the channel there is yet)
            sb.channel = gv.files
            try:
                await mgr.trust_egress_ca(sb)
            finally:
                sb.channel = None
        return gv

    async def _binds(self, sb: "LiveSandbox", gv: GvSandbox, spec, image, ns: int) -> None:
        """Binds and volumes, idmapped as a native sandbox's (plan.bind_map: what root inside writes never lands
        as host root), attached inside the sandbox's root (runtime.mount_binds)."""
        plan = dataclasses.replace(build_plan(spec, image, scratch=""), lowerdirs=())
        for m in plan.mounts:
            if m.kind == "bind" and linux.fs_type(m.source) == linux.FUSE_SUPER_MAGIC:
                raise UnsupportedError(f"the mount at {m.target} is a FUSE filesystem (a memory view, "
                                       "hutch.MemoryMount), which a gVisor sandbox does not take yet: its gofer's "
                                       'file calls are not the ones the view allows; use runtime="native".')
        plan, helpers = await self.mgr._bind_helpers(sb, plan)
        try:
            plan, fds = bind_trees(plan, ns, helpers)
        finally:
            for fd in helpers.values():
                os.close(fd)
        try:
            mount_binds(gv, [m for m in plan.mounts if m.kind == "bind"], fds, sb.uid_base)
        finally:
            for fd in fds:
                os.close(fd)

    async def _run(self, gv: GvSandbox, *args: str) -> None:
        """`runsc run/restore` under the keeper, the container's stdio /dev/null (it never reads a pipe of it)."""
        log = gv.dir / "runsc.log"
        null = os.open("/dev/null", os.O_RDWR | os.O_CLOEXEC)
        try:
            status = await keeper_run(gv, self.calls.argv(gv, f"--log={log}", *args), (null, null, null))
        finally:
            os.close(null)
        if status != 0:
            why = _why(log)
            if "error finding executable" in why:   # the spec's program is not in the image: the caller's to fix
                raise ConfigError(f"the sandbox's program is not in its image ({why}); name a program the image "
                                  "has (a path, or a name on its PATH), or add it to the image.")
            raise SandboxError(f"runsc {args[0]} of sandbox {gv.id} failed (wait status {status}): {why}")
        gv.sentry_pid = int((gv.dir / "pid").read_text().strip())
        try:
            gv.sentry_fd = os.pidfd_open(gv.sentry_pid)
        except ProcessLookupError:   # it ended already (the keeper's reaped event says how)
            pass

    def _running(self, sb: "LiveSandbox", gv: GvSandbox) -> None:
        mgr = self.mgr
        sb.channel = GvisorChannel(gv, self.calls, lambda m, f: mgr._on_init_event(sb, m, f),
                                   join=lambda pid: self._join(sb, pid))
        if sb.status == "starting":
            sb.status = "running"
        sb.created_at = time.time()
        mgr.arm_timers(sb)
        if gv.sentry_pid in gv.reaped:   # it ended before runsc had said it runs
            self._sentry_exit(sb, gv.reaped.pop(gv.sentry_pid))

    def _join(self, sb: "LiveSandbox", pid: int) -> None:
        """A runsc exec (a Go process of ~20 MB while its command runs) is charged to the sandbox's memory and
        cpu; not its pids (its threads would eat the sandbox's tasks) nor its freezer."""
        for path in self.mgr.cgroups.procs_files(sb.id)[:3]:
            if "/pids/" in path:
                continue
            try:
                with open(path, "w") as f:
                    f.write(str(pid))
            except OSError:
                pass   # it ended already

    def _keeper_event(self, sb: "LiveSandbox", msg: dict) -> None:
        gv = sb.gv
        if msg["op"] == "reaped" and not gv.sentry_pid:   # a quick command: before runsc run has returned
            if len(gv.reaped) < 64:
                gv.reaped[msg["pid"]] = msg["status"]
        elif msg["op"] == "reaped" and msg["pid"] == gv.sentry_pid:
            self._sentry_exit(sb, msg["status"])
        elif msg["op"] == "eof":
            self.mgr._on_init_exit(sb)

    def _sentry_exit(self, sb: "LiveSandbox", status: int) -> None:
        if sb.active and sb.spec.command:
            killed = os.WIFSIGNALED(status)
            sb.status = "oom" if killed and self.mgr.cgroups.oom_kills(sb.id) else "exited"
            sb.returncode = os.waitstatus_to_exitcode(status)
        self.mgr._on_init_exit(sb)

    # --- memory snapshots, restore, fork ----------------------------------------------------

    def flags(self) -> list[str]:
        """The runsc flags a snapshot records and a restore must match (the state directory aside)."""
        return runsc.global_flags("", True)[1:]

    async def snapshot_memory(self, sb: "LiveSandbox", *, pinned: bool = True) -> dict:
        """Processes, memory and filesystem of `sb` into a new memory snapshot; `sb` runs on (it is stopped
        meanwhile: `runsc pause`, checkpoint, its writes committed as a layer, `runsc resume`)."""
        if sb.gv is None:
            raise UnsupportedError(f"sandbox {sb.id} runs on the native runtime, which has no memory snapshots on this "
                                   "host (Debian 12's CRIU fails on this kernel); create it with runtime=\"gvisor\".")
        if sb.status not in ("running", "paused"):
            raise StateError(f"sandbox {sb.id} is {sb.status}, so it cannot be snapshotted; only a running one can.")
        if snapshots.total_bytes() + sb.spec.limits.memory > (total_max := snapshots.total_max()):
            raise SandboxError(f"the memory snapshots of this host hold {snapshots.total_bytes()} bytes, and another of "
                               f"up to {sb.spec.limits.memory} would pass HUTCH_MEMORY_SNAPSHOTS_MAX "
                               f"({total_max}); delete some (hutch.Snapshot.list()).")
        gv, mgr = sb.gv, self.mgr
        snap_id = snapshots.new_id(self.mgr.id_prefix[:-1])   # a fleet node's: its key first
        async with gv.lock:   # an exec or file call arriving from here on waits for the snapshot (GvisorChannel)
            if not sb.active:
                raise StateError(f"sandbox {sb.id} ended while its snapshot waited; only a running one can be "
                                 "snapshotted.")
            if any(ex.pty is not None for ex in sb.exec_records.values()):
                raise StateError(f"sandbox {sb.id} has a terminal open (an exec with pty=True), a pty of the host "
                                 "that gVisor cannot checkpoint; end that session first (exit its shell, or close "
                                 "or kill it), then snapshot or fork.")
            if mgr.execs.busy(sb):
                raise StateError(f"sandbox {sb.id} runs a command started by exec, whose pipes are the host's "
                                 "(gVisor cannot restore those); wait for it or kill it first, and start long-lived "
                                 "processes as the sandbox's command= or detached from the exec's output "
                                 "(`cmd </dev/null >/dev/null 2>&1 &`).")
            was_paused = sb.status == "paused"
            tmp = snapshots.make_dir(snap_id)
            try:
                if was_paused:   # every runsc call hangs on a frozen sentry
                    await asyncio.to_thread(mgr.cgroups.thaw, sb.id)
                await self.calls.call(gv, "pause", sb.id)
                try:
                    # the image through the page cache, so that a restore reads it from memory, not from the disk
                    # (an O_DIRECT image of 256 MiB: 0.4-0.6 s more), charged to a memory cgroup beside the
                    # sandbox's, at full speed (the copy is the paused sentry's CPU: 0.8-2.5 s at cpu=1 under load);
                    # O_DIRECT where the host cannot do that (cgroup v2)
                    try:
                        cached = mgr.cgroups.set_aside(sb.id, gv.sentry_pid,
                                                       sb.spec.limits.memory + snapshots.IMAGE_SLACK, sb.spec.limits.cpu)
                    except OSError as e:
                        print(f"hutch daemon: the checkpoint of sandbox {sb.id} writes O_DIRECT: its memory cgroup "
                              f"aside could not be made ({e}).", file=sys.stderr)
                        cached = False
                    try:
                        await self.calls.call(gv, "checkpoint", f"--image-path={tmp / 'mem'}", "--leave-running",
                                              "--compression=none", *([] if cached else ["--direct"]), sb.id,
                                              timeout=600)
                    except SandboxError as e:
                        if "unsupported networking state" in str(e):   # gVisor saves no open TCP connection
                            raise StateError(f"sandbox {sb.id} has an open network connection, which gVisor cannot "
                                             "snapshot; close its connections (or wait for them to end) and "
                                             "retry.") from None
                        raise
                    finally:
                        if cached:
                            mgr.cgroups.put_back(sb.id, gv.sentry_pid, sb.spec.limits.cpu)
                    node = await asyncio.to_thread(self._commit_fs, sb, pinned)
                    base = await asyncio.to_thread(transfer.base_id, node["ref"])
                finally:
                    if sb.active:
                        await self.calls.call(gv, "resume", sb.id, check=False)
                    if was_paused and sb.status == "paused":
                        await asyncio.to_thread(mgr.cgroups.freeze, sb.id)
                size = snapshots.image_bytes(tmp / "mem")
                if size > sb.spec.limits.memory + snapshots.IMAGE_SLACK:
                    raise SandboxError(f"the memory image of sandbox {sb.id} came out at {size} bytes, more than its "
                                       "memory limit allows; it was not kept.")
                spec = dataclasses.replace(sb.spec, image=node["ref"])
                meta = snapshots.Meta(snap_id, time.time(), runsc.probe().version, tuple(self.flags()),
                                      spec.to_dict(), sb.id, size, runsc.bundle_id(), base)
                snapshots.write_meta(tmp, meta)
                snapshots.complete(tmp, snap_id)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
        sb.touch()
        return {**meta.to_dict(), "image": node["ref"]}

    @staticmethod
    def _commit_fs(sb: "LiveSandbox", pinned: bool) -> dict:
        """The sandbox's writes as a layer over its image (an image node), its ids shifted back to its own."""
        upper = os.open(sb.gv.upper, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            digest, _ = layers.commit_tree(upper, sb.uid_base, sb.spec.limits.disk)
        finally:
            os.close(upper)
        parent = sb.spec.image
        return layers.put_node(layers.snapshot_id(parent, digest), parent, layer=digest, kind="snapshot",
                               pinned=pinned, description=f"the filesystem of a memory snapshot of sandbox {sb.id}")

    async def restore(self, snap_id: str, *, detach: bool = False, tags=None, memory_snapshot=True) -> "LiveSandbox":
        """A new sandbox carrying on from the snapshot: its own id, hostname, root, uid range, cgroups, netns."""
        from hutch.sandbox._host.daemon.manager import LiveSandbox

        p = runsc.probe()
        if not p.ok:
            raise UnsupportedError(f'runtime="gvisor" is not available on this host: {p.why}.')
        meta = await asyncio.to_thread(snapshots.load, snap_id, runsc_version=p.version, flags=self.flags(),
                                      bundle=runsc.bundle_id())
        spec = SandboxSpec.from_dict(meta.spec)
        spec = dataclasses.replace(spec, name=None, detach=bool(detach), tags=tuple(sorted((tags or {}).items())))
        check_supported(spec)
        image = images.resolve_image(spec.image)
        mgr = self.mgr
        sb = LiveSandbox(id=self.mgr.new_id(), spec=spec, image=image, status="starting")
        sb.hostname = f"hutch-{sb.id}"
        sb.cgroups = mgr.cgroups.paths(sb.id)
        sb.userns = mgr.idmap.userns_fd >= 0
        mgr._write_record(sb)
        mgr.register(sb)
        mgr._prune()
        mem = snapshots.path_of(snap_id) / "mem"
        try:
            await asyncio.to_thread(snapshots.prefetch, mem)
            gv = await self._prepare(sb, spec, image)
            write_bundle(gv, self._config(sb, gv))
            await self._run(gv, "restore", "--detach", f"--image-path={mem}", f"--bundle={gv.dir}",
                            f"--pid-file={gv.dir}/pid", sb.id)
            await self._own_hostname(gv, sb)
            self._running(sb, gv)
        except BaseException as e:
            await mgr.end(sb, "failed")
            if isinstance(e, (SandboxError, StateError, ConfigError)):
                raise
            raise SandboxError(f"memory snapshot {snap_id} could not be restored: {e}") from e
        return sb

    async def _own_hostname(self, gv, sb: "LiveSandbox") -> None:
        """Identity: the image carries the source's hostname; give the copy its own. A copy is never handed out
        with the source's: an exec that fails (seen once on a loaded machine, the copy then answering with its
        source's name) is tried again, and a third failure fails the restore, with runsc's words."""
        for attempt in range(3):
            code, text = await self.calls.call(gv, "exec", "--cap=CAP_SYS_ADMIN", "--", sb.id, runsc.BUSYBOX_AT,
                                               "hostname", sb.hostname, check=False)
            if code == 0:
                return
            await asyncio.sleep(0.05 * (attempt + 1))
        raise SandboxError(f"the restored copy {sb.id} could not be given its own hostname (`runsc exec hostname` "
                           f"failed {code}): {text[:400]}")

    async def fork(self, sb: "LiveSandbox", n: int, *, detach: bool = False) -> list["LiveSandbox"]:
        """`n` running copies of `sb` (a memory snapshot, restored n times at once, then deleted)."""
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_FORK:
            raise ConfigError(f"n={n!r} must be a number of copies from 1 to {MAX_FORK}.")
        # a keeper for each copy, started now so that their interpreters start while the checkpoint runs (with
        # the pool's 2, the third and fourth restore of a fork(4) started their own: ~1 s each at load 40)
        self.spares.fill(n)
        snap = await self.snapshot_memory(sb, pinned=False)
        try:
            results = await asyncio.gather(*(self.restore(snap["id"], detach=detach, tags=dict(sb.spec.tags))
                                             for _ in range(n)), return_exceptions=True)
        finally:
            await asyncio.to_thread(snapshots.remove, snap["id"])
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            await asyncio.gather(*(self.mgr.end(r, "terminated") for r in results if not isinstance(r, BaseException)))
            raise failed[0]
        return list(results)

    async def export(self, snap_id: str, fileobj) -> dict:
        """Memory snapshot `snap_id` as a tar (transfer.py) to `fileobj`."""
        p = runsc.probe()
        return await asyncio.to_thread(transfer.export, snap_id, fileobj, runsc_version=p.version, flags=self.flags())

    async def digest(self, snap_id: str) -> dict:
        """{"id", "digest"} of memory snapshot `snap_id` (transfer.digest: an import's `digest=` checks it)."""
        p = runsc.probe()
        return await asyncio.to_thread(transfer.digest, snap_id, runsc_version=p.version, flags=self.flags())

    async def import_(self, fileobj, limits, *, digest: str | None = None, base: str | None = None) -> dict:
        """A snapshot archive read as hostile input (transfer.py): a new snapshot of this host, or a refusal;
        given `digest`, only the snapshot of that digest, under its source's id."""
        p = runsc.probe()
        if not p.ok:
            raise UnsupportedError(f'runtime="gvisor" is not available on this host: {p.why}.')
        return await asyncio.to_thread(transfer.import_, fileobj, runsc_version=p.version, flags=self.flags(),
                                       limits=limits, check_spec=check_supported, digest=digest, base=base)

    # --- end ----------------------------------------------------------------------------

    def stop(self) -> None:
        """At daemon stop: end the spare keepers (its sandboxes have ended), remove the sandboxes' parent."""
        self.spares.close()
        self.calls.remove_dirs()

    async def teardown(self, sb: "LiveSandbox") -> None:
        """Kill what runs, let the keeper reap it, delete runsc's state, stop the keeper, unmount the root."""
        gv = sb.gv
        keeper = gv.keeper.pid if gv.keeper is not None else 0
        kill_all(self.mgr.cgroups, sb.id, keeper)
        deadline = time.monotonic() + 5
        while self.mgr.cgroups.pids(sb.id) - {keeper} and time.monotonic() < deadline:
            await asyncio.sleep(0.005)
        if gv.sentry_pid or (self.calls.root / sb.id).exists() or any(self.calls.root.glob(f"*{sb.id}*")):
            try:
                await self.calls.call(gv, "delete", "--force", sb.id, timeout=DELETE_TIMEOUT, check=False)
            except SandboxError:
                pass
        await stop_keeper(gv)
        if gv.sentry_fd >= 0:
            os.close(gv.sentry_fd)
            gv.sentry_fd = -1
        unmount_root(gv)


def _why(log) -> str:
    """runsc's reason from its log: a panic's first line, else its last error message."""
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return "(runsc wrote no log)"
    if "no host FD available" in text:
        return ("the snapshot holds a process that an exec left running with the exec's own output pipes, which "
                "are the host's and cannot be restored; start long-lived processes as the sandbox's command= or "
                "detached from the exec's output (`cmd </dev/null >/dev/null 2>&1 &`), then snapshot again")
    i = text.find("panic:")
    if i >= 0:
        return text[i:i + 600].replace("\\n", " | ")
    msgs = re.findall(r'"msg":"((?:[^"\\]|\\.)*)"', text)
    return msgs[-1][:800] if msgs else text[-800:]


__all__ = ["Gvisor", "check_supported"]
