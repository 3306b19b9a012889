"""gVisor sandboxes in the daemon: `Gvisor`, the part of the Manager that starts, ends, checkpoints and restores
sandboxes of `runtime="gvisor"` (the runtime itself: _host/gvisor/).

A gVisor sandbox is a LiveSandbox like any other (same record, cgroups, uid range, egress attachment, timers,
Execs); what differs is held in `LiveSandbox.gv` and its channel (gvisor.runtime.GvisorChannel).
"""

from __future__ import annotations

import asyncio
import os
import secrets
import time
from typing import TYPE_CHECKING

from hutch._core.errors import SandboxError, StateError, UnsupportedError
from hutch.sandbox._host.gvisor import runsc
from hutch.sandbox._host.gvisor.runtime import (
    GvisorChannel, GvSandbox, Runsc, keeper_run, kill_all, mount_root, start_keeper, stop_keeper, unmount_root,
    write_bundle,
)
from hutch.sandbox._host.native.runtime import exec_env

if TYPE_CHECKING:  # pragma: no cover
    from hutch.sandbox._host.daemon.manager import LiveSandbox, Manager

SLEEP_FOREVER = [runsc.BUSYBOX_AT, "sleep", "2147483647"]   # pid 1 of a sandbox without a command
DELETE_TIMEOUT = 10.0


def check_supported(spec) -> None:
    """Refuse what the gVisor runtime does not do (yet), naming the fix; UnsupportedError."""
    p = runsc.probe()
    if not p.ok:
        raise UnsupportedError(f'runtime="gvisor" is not available on this host: {p.why}.')
    if not runsc.host_busybox():
        raise UnsupportedError('runtime="gvisor" needs the host\'s static busybox (busybox-static); run scripts/setup.sh.')
    for m in spec.mounts:
        if m.kind != "tmpfs":
            raise UnsupportedError(f"a gVisor sandbox takes Mount.tmpfs only so far, not the {m.kind} at {m.target}; "
                                   'use runtime="native" for binds, volumes and memory mounts.')


class Gvisor:
    """Sandboxes of runtime="gvisor" in one daemon (the Manager holds one)."""

    def __init__(self, mgr: "Manager"):
        self.mgr = mgr
        self.calls = Runsc(mgr.run_dir, mgr.cgroups.parent)

    def prepare(self) -> None:
        """At daemon start: clear what a crashed predecessor's gVisor sandboxes left (state files, mounts)."""
        self.calls.reap()

    # --- start --------------------------------------------------------------------------

    async def create(self, spec, image) -> "LiveSandbox":
        from hutch.sandbox._host.daemon.manager import LiveSandbox

        check_supported(spec)
        mgr = self.mgr
        sb = LiveSandbox(id=secrets.token_hex(6), spec=spec, image=image, status="starting")
        sb.hostname = spec.name or f"hutch-{sb.id}"
        sb.cgroups = mgr.cgroups.paths(sb.id)
        sb.userns = mgr.idmap.userns_fd >= 0
        mgr._write_record(sb)
        mgr.sandboxes[sb.id] = sb
        mgr._prune()
        try:
            gv = await self._prepare(sb, spec, image)
            config = runsc.bundle_config(
                args=list(spec.command) or SLEEP_FOREVER, env=exec_env(spec, image, sb.hostname),
                cwd=spec.workdir if spec.command else "/", root=str(gv.merged), hostname=sb.hostname,
                netns=f"/proc/{gv.keeper.pid}/ns/net", cgroups_path=f"/{mgr.cgroups.parent}/{sb.id}",
                memory=spec.limits.memory, cpu=spec.limits.cpu, pids=spec.limits.pids, uid_base=sb.uid_base,
                caps=spec.capabilities, tmpfs=[(m.target, m.size or 64 * 1024**2) for m in spec.mounts])
            write_bundle(gv, config)
            await self._run(gv, "run", "--detach", f"--bundle={gv.dir}", f"--pid-file={gv.dir}/pid", sb.id)
            self._running(sb, gv)
        except BaseException as e:
            await mgr.end(sb, "failed")
            if isinstance(e, (SandboxError, StateError, UnsupportedError)):
                raise
            raise SandboxError(f"gVisor sandbox {sb.id} could not be started: {e}") from e
        return sb

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
        finally:
            if ns >= 0:
                os.close(ns)
        await start_keeper(gv, mgr.cgroups.procs_files(sb.id), sb.uid_base, lambda msg: self._keeper_event(sb, msg))
        sb.init_pid = gv.files_pid   # its netns is the sandbox's, its root (/proc/<pid>/root) the sandbox's root
        if mgr.network is not None:
            await mgr.network.attach(sb.id, gv.files_pid, spec.network, plain=True)
        return gv

    async def _run(self, gv: GvSandbox, *args: str) -> None:
        """`runsc run/restore` under the keeper, the container's stdio /dev/null (it never reads a pipe of it)."""
        log = gv.dir / "runsc.log"
        null = os.open("/dev/null", os.O_RDWR | os.O_CLOEXEC)
        try:
            status = await keeper_run(gv, self.calls.argv(gv, f"--log={log}", *args), (null, null, null))
        finally:
            os.close(null)
        if status != 0:
            tail = log.read_text(errors="replace")[-1500:] if log.exists() else ""
            raise SandboxError(f"runsc {args[0]} of sandbox {gv.id} failed (wait status {status}): {tail}")
        gv.sentry_pid = int((gv.dir / "pid").read_text().strip())

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

    # --- end ----------------------------------------------------------------------------

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
        unmount_root(gv)


__all__ = ["Gvisor", "check_supported"]
