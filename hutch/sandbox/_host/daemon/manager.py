"""The sandbox manager: every sandbox of this host, from create to the last resource gone.

Owns the zygote, the per-sandbox cgroups and records, the timers (timeout,
idle timeout, lease grace), and the reaping of what a crashed predecessor left.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import dataclasses
import json
import os
import secrets
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from hutch._core import settings
from hutch._core.atomic import atomic_write
from hutch._core.errors import (
    ConfigError,
    DaemonError,
    InvalidSpecError,
    NetworkPolicyError,
    NotFoundError,
    QuotaExceededError,
    SandboxError,
    StateError,
)
from hutch.sandbox._host import images
from hutch.sandbox._host.daemon.execs import Exec, Execs, error_from_reply
from hutch.sandbox._host.daemon import trust
from hutch.sandbox._host.daemon.gvisor import Gvisor
from hutch.sandbox._host.daemon.network import NetworkAttacher
from hutch.sandbox._host.native.cgroups import ZYGOTE_LEAF, Cgroups
from hutch.sandbox._host.native.idmap import IdMapper, UidRanges, write_maps
from hutch.sandbox._host.native.plan import Plan, build_plan, needs_write_range, with_bind_maps
from hutch.sandbox._host.native.runtime import Channel, Zygote, bind_trees, exec_env
from hutch.sandbox._spec import DEFAULT_DISK, DEFAULT_WORKDIR, SandboxSpec

# The default: root in each sandbox is an unprivileged host uid of a range of its own (see _host/native/idmap.py).
# HUTCH_USERNS=0 opts out (root inside is then host root without capabilities); so does a kernel that cannot
# idmap mounts, with a warning in the daemon's log.
LEASE_GRACE = 5.0        # seconds a non-detached sandbox may wait for its creator's lease
START_TIMEOUT = 10.0     # seconds for an init to report ready
KEEP_ENDED = 1000        # ended sandboxes remembered for info/wait
RESTART_BACKOFF = (0.05, 5.0)   # seconds before the first retry of a failed zygote start, and the cap


def _why(e: BaseException) -> str:
    """An exception's text for a caller's error: never empty (a timeout's str() is '')."""
    if str(e):
        return str(e)
    if isinstance(e, TimeoutError):
        return "a step of its start did not finish in time (the host may be overloaded); try again."
    return f"{type(e).__name__} (see the daemon's log)."


class _Booking:
    """Sandboxes a create, restore or fork has counted against `--max-sandboxes` and not made yet."""

    __slots__ = ("left",)

    def __init__(self, n: int):
        self.left = n


#: the booking of the create, restore or fork this task runs (Manager.capped sets it, Manager.register uses it)
_BOOKING: contextvars.ContextVar[_Booking | None] = contextvars.ContextVar("hutch_booking", default=None)


@dataclass
class LiveSandbox:
    """The daemon's record of one sandbox it runs (or a warm init waiting for one); the caller's handle is
    hutch.Sandbox."""

    id: str
    spec: SandboxSpec | None = None     # None while a warm init waits in the pool
    image: object = None
    created_at: float = field(default_factory=time.time)
    status: str = "starting"
    returncode: int | None = None
    ended_at: float | None = None
    init_pid: int = 0
    pidfd: int = -1
    channel: Channel | None = None
    exec_records: dict[str, Exec] = field(default_factory=dict)   # its commands (Execs), kept after they end
    last_activity: float = field(default_factory=time.monotonic)
    leases: int = 0
    lease_seen: bool = False
    timers: list = field(default_factory=list)
    gone: asyncio.Event = field(default_factory=asyncio.Event)
    cleaning: bool = False
    ready: asyncio.Future | None = None
    warm: asyncio.Future | None = None
    userns: bool = False
    egress_env: dict = field(default_factory=dict)   # what its commands need to trust its egress CA (trust.py)
    uid_base: int = 0                   # the host id of root inside (0: no user namespace)
    write_base: int = 0                 # without one: the host ids its writable binds' writes land as
    layers: object = None               # the Zygote whose store holds its writable layer (None: tmpfs)
    hostname: str = ""
    cgroups: tuple[str, ...] = ()       # its cgroup directories, reported to the creator (see _provided)
    gv: object = None                   # a gVisor sandbox's runtime state (gvisor.runtime.GvSandbox); None: native
    tenant: str | None = None           # the tenant whose sandbox it is (None: the operator's; daemon/tenants.py)
    reserved: bool = False              # its create holds a quota reservation still (scope.Tenancy.admit)
    shown_spec: dict | None = None      # its spec as its tenant gave it (the daemon runs it with the tenant's
                                        # volumes' stored names and its image's id: scope.Tenancy.spec_for)
    spec_dict: tuple | None = None      # (spec, spec.to_dict()): info() is every reply's body, the spec is frozen

    @property
    def active(self) -> bool:
        return self.status in ("starting", "running", "paused")

    def info(self) -> dict:
        if self.spec_dict is None or self.spec_dict[0] is not self.spec:
            self.spec_dict = (self.spec, self.spec.to_dict())
        return {"id": self.id, "name": self.spec.name, "tags": dict(self.spec.tags), "status": self.status,
                "returncode": self.returncode, "created_at": self.created_at, "ended_at": self.ended_at,
                "detach": self.spec.detach, "spec": self.shown_spec or self.spec_dict[1],
                "cgroups": list(self.cgroups) if self.active else []}

    def touch(self) -> None:
        self.last_activity = time.monotonic()


#: Threads removing ended sandboxes' cgroups (Manager.teardown_pool).
TEARDOWN_THREADS = 8


class Manager:
    def __init__(self, run_dir: Path, cgroup_parent: str, network: NetworkAttacher | None = None):
        self.run_dir = run_dir
        self.records = run_dir / "sandboxes"
        self.scratch = run_dir / "mnt"
        self.layers_at = run_dir / "disk"   # where the zygote mounts its store of writable layers (_host/native/disk.py)
        self.cgroups = Cgroups(cgroup_parent)
        self.execs = Execs(self.cgroups, self.resume)   # commands and file calls in running sandboxes
        self.gvisor = Gvisor(self)                      # sandboxes of runtime="gvisor"
        self.network = network
        self.sandboxes: dict[str, LiveSandbox] = {}
        self.by_pid: dict[int, LiveSandbox] = {}
        self.zygote: Zygote | None = None
        self.closing = False
        self.pool: list[LiveSandbox] = []     # warm inits: cgroups joined, namespaces made, no root yet
        self.idmap = IdMapper(run_dir)
        self.ranges = UidRanges(cgroup_lock=str(self.cgroups.lock_file()))
        self.warming = 0
        self.warm_tasks: set[asyncio.Task] = set()
        self.creating = 0                 # creates in flight: the pool refills once none is
        self.streams: set[asyncio.Task] = set()   # exec output handlers: a client that stops reading holds one
        self.problem: str | None = None   # why no sandbox can start now (GET /v1/health reports it)
        self.restarting: asyncio.Task | None = None
        self.warned_plain_binds = False
        self.no_userns = ""               # why sandboxes run without a user namespace ("": they do not)
        self.warm_pool = settings.WARM_POOL.get()   # inits kept ready in their cgroups and namespaces
        self.tenancy = None               # scope.Tenancy with `hutch serve --tenants`, else None
        self.audit = None                 # tenants.AuditLog with `hutch serve --audit-log`, else None
        self.id_prefix = ""               # `hutch serve --id-prefix K`: a fleet node's ids start with "K-"
        self.max_sandboxes = 0            # `hutch serve --max-sandboxes N`: active ones at most (0: no cap)
        self.booked = 0                   # sandboxes of creates, restores and forks in flight, counted against it
        # An ended sandbox's cgroup removal and its pidfd's close run here, off the loop: each rmdir of a v1
        # cgroup and the close of a dead process's last reference are syscalls that can sleep, and on a busy
        # host the loop was the bottleneck of a mass teardown (2,000 sandboxes: 8,000 rmdirs one after another).
        self.teardown_pool = concurrent.futures.ThreadPoolExecutor(TEARDOWN_THREADS, thread_name_prefix="teardown")

    # --- daemon lifecycle ---------------------------------------------------------------

    def prepare(self) -> None:
        """Make the run directory's layout and reap what a crashed predecessor left."""
        self.records.mkdir(parents=True, exist_ok=True)
        self.scratch.mkdir(exist_ok=True)
        self.cgroups.hold_instance()   # before anything is made: a reaper never takes this instance for a dead one
        self.reap_predecessor()
        reaped = self.cgroups.reap_dead_instances()
        if reaped:
            print(f"hutch daemon: removed the cgroups of {len(reaped)} daemon(s) that were killed: {' '.join(reaped)}",
                  file=sys.stderr, flush=True)
        self.gvisor.prepare()
        self.idmap.reap()
        if not settings.USERNS.get():
            self.no_userns = "HUTCH_USERNS=0 in the daemon's environment"
        elif not self.idmap.start():
            self.no_userns = self.idmap.why
        print(f"hutch daemon: mode: {self.mode()}", file=sys.stderr, flush=True)
        self.prepared = True

    def mode(self) -> str:
        """One line: whether sandboxes run in user namespaces, and why not (the fallback of docs/architecture.md)."""
        if not self.no_userns:
            return "user namespaces (root inside is an unprivileged host uid range of its own sandbox)"
        return (f"no user namespace ({self.no_userns}): root inside is host root without capabilities, "
                "as with HUTCH_USERNS=0")

    async def start(self) -> None:
        if not getattr(self, "prepared", False):
            self.prepare()
        self.cgroups.setup()
        zygote = Zygote(self._on_reaped, self._on_zygote_death)
        await zygote.start(self.cgroups.procs_files(ZYGOTE_LEAF), layers_at=self.layers_at)
        self.zygote = zygote
        self._refill()
        if self.network is not None and hasattr(self.network, "start"):
            try:  # the egress gateway: host rules, resolver, proxy; also reaps a predecessor's veths
                await self.network.start()
            except Exception as e:  # noqa: BLE001 - sandboxes without network still work
                print(f"hutch daemon: the egress gateway did not start ({e}); only Network.none() is served.",
                      file=sys.stderr)
                self.network = None

    def reap_predecessor(self) -> list[str]:
        """Remove every cgroup and record a crashed daemon left (their processes died with its zygote)."""
        names = set(self.cgroups.children())
        for rec in self.records.glob("*.json"):
            names.add(rec.stem)
        reaped = []
        for name in sorted(names):
            if not self.cgroups.remove_everywhere(name):
                raise DaemonError(f"could not remove the leftover cgroup {name!r}; see `ls {self.cgroups.bases[0]}`.")
            (self.records / f"{name}.json").unlink(missing_ok=True)
            reaped.append(name)
        return reaped

    async def shutdown(self) -> None:
        self.closing = True
        self.problem = "it is shutting down"
        if self.restarting is not None:
            self.restarting.cancel()
            await asyncio.gather(self.restarting, return_exceptions=True)
        # Inits being warmed and creates in flight are in neither list below yet: let them land first
        # (a warm one then ends itself), or their cgroups would outlive the daemon with no reaper.
        loop = asyncio.get_running_loop()
        deadline = loop.time() + START_TIMEOUT
        if self.warm_tasks:
            await asyncio.wait(list(self.warm_tasks), timeout=START_TIMEOUT)
        while self.creating and loop.time() < deadline:
            await asyncio.sleep(0.01)
        everyone = list(self.sandboxes.values()) + self.pool
        await asyncio.gather(*(self.end(sb, "terminated") for sb in everyone if not sb.gone.is_set()))
        for task in list(self.streams):   # output a client never took would hold the shutdown back
            task.cancel()
        if self.zygote is not None:
            self.zygote.stop()
        if self.network is not None and hasattr(self.network, "stop"):
            try:
                await self.network.stop()
            except Exception:  # noqa: BLE001 - shutdown goes on
                pass
        self.idmap.stop()
        self.ranges.close()
        self.gvisor.stop()
        self.cgroups.remove(ZYGOTE_LEAF)
        self.cgroups.remove_parents()    # empty now, also under the controllers only runsc used
        self.cgroups.release_instance()

    def unavailable(self) -> str | None:
        """Why no sandbox can start now (None: they can), as GET /v1/health answers it."""
        if self.problem is None:
            return None
        return f"the daemon cannot start sandboxes now: {self.problem}; see its log."

    def _on_zygote_death(self, zygote: Zygote) -> None:
        if self.closing or zygote is not self.zygote:
            return
        self.zygote = None
        self.problem = "its sandbox start server died and is being restarted"
        # Every init dies with it (PDEATHSIG; one of a user namespace is killed here, see
        # zygote.clone_init); their pidfds clean up. Start a new zygote.
        for sb in list(self.sandboxes.values()):
            if sb.active:
                sb.status = "failed"
        dead, self.pool = self.pool, []   # none may serve a create while it dies
        # by_pid: also the inits still warming (one of a user namespace would survive, in the dead zygote's
        # mount namespace, with its store of writable layers, and be served to a create)
        for sb in dead + [sb for sb in self.sandboxes.values() if not sb.gone.is_set()] + list(self.by_pid.values()):
            if sb.pidfd >= 0:
                try:
                    signal.pidfd_send_signal(sb.pidfd, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        self.restarting = asyncio.get_running_loop().create_task(self._restart_zygote(zygote))

    async def _restart_zygote(self, dead: Zygote) -> None:
        """Start a new zygote until one runs, remaking what it needs first (someone may have removed the
        cgroups); retried with capped exponential backoff, the reason in GET /v1/health meanwhile."""
        await dead.reap()
        delay, attempt = RESTART_BACKOFF[0], 0
        while not self.closing:
            attempt += 1
            zygote = Zygote(self._on_reaped, self._on_zygote_death)
            try:
                self.records.mkdir(parents=True, exist_ok=True)
                self.scratch.mkdir(exist_ok=True)
                self.cgroups.setup()
                await zygote.start(self.cgroups.procs_files(ZYGOTE_LEAF), layers_at=self.layers_at)
            except Exception as e:  # noqa: BLE001 - anything that stops it is retried, and reported meanwhile
                await zygote.reap()
                self.problem = (f"its sandbox start server could not be restarted ({e}); it retries by itself "
                                f"(attempt {attempt}, the next in {delay:.2f} s)")
                print(f"hutch daemon: {self.problem}", file=sys.stderr, flush=True)
                await asyncio.sleep(delay)
                delay = min(delay * 2, RESTART_BACKOFF[1])
                continue
            if self.closing:
                zygote.stop()
                return
            self.zygote, self.problem, self.restarting = zygote, None, None
            if attempt > 1:
                print(f"hutch daemon: the sandbox start server runs again (attempt {attempt})", file=sys.stderr,
                      flush=True)
            self._refill()
            return

    def _on_reaped(self, pid: int, status: int) -> None:
        sb = self.by_pid.pop(pid, None)
        if sb is not None:
            self._on_init_exit(sb)

    def _on_init_exit(self, sb: LiveSandbox) -> None:
        if sb.pidfd >= 0:
            asyncio.get_running_loop().remove_reader(sb.pidfd)
        if sb.channel is not None:
            # The loop may see the pidfd before the socket: read what the init sent before it exited (a command's
            # `main_exit`), or a command quicker than create would be reported as a failed start.
            sb.channel.drain()
        if not sb.cleaning:
            sb.cleaning = True
            asyncio.get_running_loop().create_task(self._cleanup(sb))

    def new_id(self) -> str:
        """A new sandbox's id: 12 random hex digits, after the fleet node's key when it has one."""
        return self.id_prefix + secrets.token_hex(6)

    def active_count(self) -> int:
        return sum(1 for sb in self.sandboxes.values() if sb.active)

    def book(self, n: int) -> "_Booking":
        """Count `n` sandboxes about to be made against `--max-sandboxes`, or refuse them (QuotaExceededError,
        HTTP 429, quota "host_sandboxes": nothing made, retryable). The check and the count are one step of the
        event loop, so creates at once never overshoot. Each sandbox `register`ed under the booking (the task's
        context carries it) moves from booked to active; unbook() releases what was not made."""
        if self.max_sandboxes:
            used = self.active_count() + self.booked
            if used + n > self.max_sandboxes:
                where = f"fleet node {self.id_prefix[:-1]}" if self.id_prefix else "this host's daemon"
                raise QuotaExceededError(
                    f"{where} runs {used} of the {self.max_sandboxes} sandboxes it takes at most (`hutch serve "
                    f"--max-sandboxes`); nothing was made: retry once some end, or on another host.",
                    quota="host_sandboxes", limit=self.max_sandboxes, used=used)
        self.booked += n
        return _Booking(n)

    def unbook(self, b: "_Booking") -> None:
        self.booked -= b.left
        b.left = 0

    def register(self, sb: LiveSandbox) -> None:
        """A new sandbox is one of the daemon's: counted as active from now on, no longer as booked."""
        self.sandboxes[sb.id] = sb
        b = _BOOKING.get()
        if b is not None and b.left > 0:
            b.left -= 1
            self.booked -= 1

    async def capped(self, n, make):
        """`await make()` with `n` sandboxes booked against the cap while it runs (creates, restores, forks)."""
        n = n if isinstance(n, int) and not isinstance(n, bool) and n >= 1 else 1
        b = self.book(n)
        token = _BOOKING.set(b)
        try:
            return await make()
        finally:
            _BOOKING.reset(token)
            self.unbook(b)

    # --- lookup -------------------------------------------------------------------------

    def get(self, key: str, tenant=None) -> LiveSandbox:
        """The sandbox of id (or running sandbox of name) `key`; of `tenant`'s own only, if one is given
        (another's answers exactly as an unknown one)."""
        sb = self.sandboxes.get(key) if isinstance(key, str) else None
        if sb is not None and tenant is not None and sb.tenant != tenant.name:
            sb = None
        if sb is None:
            for s in self.sandboxes.values():
                if s.spec.name == key and s.active and (tenant is None or s.tenant == tenant.name):
                    return s
            raise NotFoundError(f"no sandbox {key!r} on this host; list them with hutch.Sandbox.list() or `hutch sandbox ls`.")
        return sb

    def list(self, tags: dict[str, str], tenant=None) -> list[LiveSandbox]:
        return [sb for sb in self.sandboxes.values()
                if sb.active and (tenant is None or sb.tenant == tenant.name)
                and all(dict(sb.spec.tags).get(k) == v for k, v in tags.items())]

    # --- create ---------------------------------------------------------------------------

    async def create(self, spec: SandboxSpec, tenant: str | None = None) -> LiveSandbox:
        """Start a sandbox from `spec` (a warm init if one fits) for `tenant` (None: the operator); returns once
        it runs."""
        self.creating += 1
        try:
            return await self.capped(1, lambda: self._create(spec, tenant))
        finally:
            self.creating -= 1
            # Refill once the create is done, so that a new init's start (clone, cgroup join, namespaces)
            # does not compete with it for the zygote and the CPU; while creates overlap, only when the
            # pool ran dry (the inits it warms then serve the creates still to come, nothing is wasted).
            if not self.creating or not self.pool:
                self._refill()

    async def _create(self, spec: SandboxSpec, tenant: str | None = None) -> LiveSandbox:
        if self.closing:
            raise DaemonError("the daemon is shutting down; retry once it is back.")
        if spec.network.mode != "none" and self.network is None:
            raise NetworkPolicyError(
                f"network mode {spec.network.mode!r} needs the egress gateway, which this daemon does not run; "
                "use hutch.Network.none()."
            )
        if spec.name and any(s.spec.name == spec.name and s.active and s.tenant == tenant
                             for s in self.sandboxes.values()):
            raise ConfigError(f"a running sandbox is already named {spec.name!r}; pick another name or terminate it.")
        if spec.limits.memory < 8 * 1024**2:
            raise InvalidSpecError(f"memory={spec.limits.memory} bytes is too small; give at least '8M'.")
        image = images.resolve_image(spec.image)
        if image.ref != spec.image:   # a name: the image it names now (a name may move to another image later)
            spec = dataclasses.replace(spec, image=image.ref)
        if spec.workdir == DEFAULT_WORKDIR and image.workdir and image.workdir != spec.workdir:
            spec = dataclasses.replace(spec, workdir=image.workdir)   # the image's workdir, unless one was given
        if spec.runtime == "gvisor":
            sb = await self.gvisor.create(spec, image)
            sb.tenant, sb.reserved = tenant, tenant is not None
            return sb
        plan = build_plan(spec, image, scratch=str(self.scratch))   # before an init is taken: bad mounts fail here
        # without one if idmapping is off, or a layer is on a filesystem that cannot idmap
        userns = self.idmap.userns_fd >= 0 and all(self.idmap.can_idmap(str(d)) for d in image.lowerdirs)
        sb = self.pool.pop(0) if self.pool and userns == self.pool[0].userns else None
        try:
            if sb is None:
                sb = await self._spawn(userns)
            sb.spec, sb.image, sb.hostname = spec, image, spec.name or f"hutch-{sb.id}"
            sb.tenant, sb.reserved = tenant, tenant is not None
            sb.cgroups = self.cgroups.paths(sb.id)
            sb.created_at, sb.status = time.time(), "starting"
        except BaseException as e:
            if sb is not None:
                await self.end(sb, "failed")
            if isinstance(e, (SandboxError, DaemonError)):
                raise
            raise SandboxError(f"a sandbox could not be started: {_why(e)}") from e
        self.register(sb)
        self._prune()
        try:
            self.cgroups.set_limits(sb.id, spec.limits.memory, spec.limits.pids, spec.limits.cpu)
            await self._start(sb, dataclasses.replace(plan, hostname=sb.hostname, userns=sb.userns))
        except BaseException as e:
            await self.end(sb, "failed")
            if isinstance(e, (SandboxError, ConfigError, NotFoundError, StateError, DaemonError)):
                raise
            raise SandboxError(f"sandbox {sb.id} could not be started: {_why(e)}") from e
        return sb

    async def _spawn(self, userns: bool | None = None) -> LiveSandbox:
        """A new init in its own cgroups and namespaces, parked until it is given a root's plan."""
        if userns is None:
            userns = self.idmap.userns_fd >= 0
        if self.zygote is None:
            raise DaemonError(self.unavailable() or "the daemon is starting; retry in a moment.")
        loop = asyncio.get_running_loop()
        sb = LiveSandbox(id=self.new_id(), status="warm", userns=userns)
        sb.warm, sb.ready = loop.create_future(), loop.create_future()
        self._write_record(sb)
        zygote = self.zygote
        try:
            if userns:
                sb.uid_base = self.ranges.take()
            self.cgroups.create(sb.id)
            pid, sock = await zygote.spawn({"cgroup_procs": self.cgroups.procs_files(sb.id), "userns": userns,
                                            "uid_base": sb.uid_base})
        except BaseException:
            sb.cleaning = True
            await self._cleanup(sb)
            raise
        sb.init_pid = pid
        self.by_pid[pid] = sb
        sb.pidfd = os.pidfd_open(pid)
        # The pidfd turns readable when pid 1 has exited, and with it every process of its namespace.
        loop.add_reader(sb.pidfd, self._on_init_exit, sb)
        sb.channel = Channel(sock, lambda m, f, sb=sb: self._on_init_event(sb, m, f))
        msg = await asyncio.wait_for(asyncio.shield(sb.warm), START_TIMEOUT)
        if msg["op"] != "warm":
            await self.end(sb, "failed")
            raise SandboxError(f"a sandbox init failed while starting: {msg.get('message')}.")
        if userns:
            write_maps(pid, sb.uid_base)  # before the init reads its plan and becomes root of its namespace
        if zygote.layers is not None:
            # its writable layer, owned by its root: a subvolume of the zygote's store, made while it warms (not
            # before: a refill's first steps run before the create that started it has answered)
            sb.layers = zygote
            try:
                zygote.layers.prepare(sb.id, sb.uid_base, DEFAULT_DISK)
            except BaseException:
                await self.end(sb, "failed")
                raise
        return sb

    def _refill(self) -> None:
        """Top the warm pool up in the background (a failure just leaves it short)."""
        if self.closing or self.zygote is None:
            return
        loop = asyncio.get_running_loop()
        while len(self.pool) + self.warming < self.warm_pool:
            self.warming += 1

            async def one():
                try:
                    sb = await self._spawn()
                    if self.closing:
                        await self.end(sb, "terminated")
                    else:
                        self.pool.append(sb)
                except Exception as e:  # noqa: BLE001 - a create spawns cold if the pool is empty
                    print(f"hutch daemon: could not warm an init: {e}", file=sys.stderr)
                finally:
                    self.warming -= 1

            task = loop.create_task(one())
            self.warm_tasks.add(task)
            task.add_done_callback(self.warm_tasks.discard)

    async def _bind_helpers(self, sb: LiveSandbox, plan: Plan) -> tuple[Plan, dict]:
        """`plan` with the id mapping of each bind decided (plan.bind_map), and the user namespaces (fds) of the
        helpers those maps go through."""
        if not sb.userns and needs_write_range(plan):
            sb.write_base = self.ranges.take()
        plan = with_bind_maps(plan, sb.uid_base, sb.userns, sb.write_base)
        helpers: dict = {}
        mounts = []
        try:
            for m in plan.mounts:
                mounts.append(m)
                key = m.map if isinstance(m.map, tuple) else None
                if key is None or key in helpers:
                    continue
                try:
                    helpers[key] = await self.zygote.userns(*key)
                except SandboxError:
                    if m.owner or sb.userns:
                        raise
                    # no user namespaces on this host: a plain bind, nosuid (docs/architecture.md, HUTCH_USERNS=0)
                    mounts[-1] = dataclasses.replace(m, map=None)
                    if not self.warned_plain_binds:
                        self.warned_plain_binds = True
                        print("hutch daemon: user namespaces are unavailable, so what sandboxes write through "
                              "writable binds and volumes is owned by host root (the mounts stay nosuid).",
                              file=sys.stderr)
        except BaseException:
            for fd in helpers.values():
                os.close(fd)
            raise
        return dataclasses.replace(plan, mounts=tuple(mounts)), helpers

    async def _start(self, sb: LiveSandbox, plan: Plan) -> None:
        if sb.layers is not None and sb.layers.layers is not None:   # its writable layer, made as it warmed
            await sb.layers.layers.ensure_room(plan.disk)
            if plan.disk != DEFAULT_DISK:
                sb.layers.layers.limit(sb.id, plan.disk)
            plan = dataclasses.replace(plan, layer=sb.id)
        plan, helpers = await self._bind_helpers(sb, plan)
        userns_fd = os.open(f"/proc/{sb.init_pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC) if sb.userns else -1
        try:   # layers and binds idmapped through the sandbox's own user namespace, or a helper
            plan, fds = bind_trees(plan, userns_fd, helpers)
        finally:
            for fd in list(helpers.values()) + ([userns_fd] if userns_fd >= 0 else []):
                os.close(fd)
        try:
            await sb.channel.notify({"op": "plan", "plan": plan.to_wire()}, fds)
        finally:
            for fd in fds:
                os.close(fd)
        msg = await asyncio.wait_for(asyncio.shield(sb.ready), START_TIMEOUT)
        if msg["op"] != "ready":
            raise SandboxError(f"sandbox {sb.id} could not be set up: {msg.get('message')}. "
                               "Check the image and the mounts of its spec.")
        if self.network is not None:  # also for none: a later PUT .../network can then give it one
            await self.network.attach(sb.id, sb.init_pid, sb.spec.network)
            await self.trust_egress_ca(sb)
        if sb.spec.command:
            eid = "main"
            reply, _ = await sb.channel.request({
                "op": "exec", "eid": eid, "main": True, "argv": list(sb.spec.command),
                "env": exec_env(sb.spec, sb.image, sb.hostname, sb.egress_env), "cwd": sb.spec.workdir,
                "streams": [False, False, False]})
            if not reply["ok"]:
                raise error_from_reply(reply)
        if sb.status == "starting":  # a command may have been quicker than this line
            sb.status = "running"
        self.arm_timers(sb)

    def arm_timers(self, sb: LiveSandbox) -> None:
        """Its timeout, idle check and lease grace, from now (a sandbox that just started running)."""
        loop = asyncio.get_running_loop()
        sb.touch()
        if sb.spec.timeout:
            sb.timers.append(loop.call_later(sb.spec.timeout, self._expire, sb, "timeout"))
        if sb.spec.idle_timeout:
            sb.timers.append(loop.call_later(sb.spec.idle_timeout, self._check_idle, sb))
        if not sb.spec.detach:
            sb.timers.append(loop.call_later(LEASE_GRACE, self._check_lease, sb))

    async def trust_egress_ca(self, sb: LiveSandbox) -> None:
        """Install a CA the gateway made for the sandbox's credentials and it does not trust yet (only then:
        a sandbox without credentials pays nothing for it)."""
        pending = getattr(self.network, "pending_ca", None)
        pem = pending(sb.id) if pending else None
        if pem:
            try:
                await trust.install_ca(sb, pem)
            except trust.InstallError as e:
                raise SandboxError(f"sandbox {sb.id}: its egress CA could not be put into its trust store "
                                   f"({e}); the image's /etc must be writable for credentials.") from None

    def _on_init_event(self, sb: LiveSandbox, msg: dict, fds: list[int]) -> None:
        for fd in fds:
            os.close(fd)
        op = msg["op"]
        if op == "warm":
            if sb.warm and not sb.warm.done():
                sb.warm.set_result(msg)
        elif op in ("ready", "failed"):
            for fut in (sb.warm, sb.ready):
                if fut and not fut.done():
                    fut.set_result(msg)
        elif op == "exec_exit":
            self.execs.exited(sb, msg["eid"], msg["status"])
        elif op == "main_exit":
            st = msg["status"]
            if sb.active:
                killed = os.WIFSIGNALED(st) and os.WTERMSIG(st) == signal.SIGKILL
                sb.status = "oom" if killed and self.cgroups.oom_kills(sb.id) else "exited"
                sb.returncode = os.waitstatus_to_exitcode(st)
        elif op == "eof":
            for fut in (sb.warm, sb.ready):
                if fut and not fut.done():
                    fut.set_result({"op": "failed", "message": "its init exited during set-up"})

    # --- ending ---------------------------------------------------------------------------

    def _expire(self, sb: LiveSandbox, status: str) -> None:
        if sb.active:
            asyncio.get_running_loop().create_task(self.end(sb, status))

    def _check_idle(self, sb: LiveSandbox) -> None:
        if sb.status != "running":   # ended, or paused (its resume arms the check again)
            return
        idle = sb.spec.idle_timeout
        busy = self.execs.busy(sb)
        left = idle - (time.monotonic() - sb.last_activity)
        if not busy and left <= 0 and sb.spec.on_idle == "pause":
            asyncio.get_running_loop().create_task(self._idle_pause(sb))
        elif not busy and left <= 0:
            self._expire(sb, "idle_timeout")
        else:
            sb.timers = [t for t in sb.timers if not t.cancelled() and t.when() > time.monotonic()]
            sb.timers.append(asyncio.get_running_loop().call_later(max(left, 0.05) if not busy else idle,
                                                                   self._check_idle, sb))

    async def _idle_pause(self, sb: LiveSandbox) -> None:
        try:
            await self.pause(sb)
        except Exception as e:  # noqa: BLE001 - it runs on, and the next idle check tries again
            print(f"hutch daemon: could not pause idle sandbox {sb.id}: {e}", file=sys.stderr)
            self._arm_idle(sb)

    def _arm_idle(self, sb: LiveSandbox) -> None:
        if sb.spec.idle_timeout:
            sb.timers = [t for t in sb.timers if not t.cancelled() and t.when() > time.monotonic()]
            sb.timers.append(asyncio.get_running_loop().call_later(sb.spec.idle_timeout, self._check_idle, sb))

    # --- pause and resume ------------------------------------------------------------------

    async def pause(self, sb: LiveSandbox) -> None:
        """Stop every process of `sb` where it is, memory kept (the cgroup freezer, for either runtime). Calls that
        run something in it (exec, files) resume it first; its timeout goes on counting."""
        if sb.status == "paused":
            return
        if sb.status != "running":
            raise StateError(f"sandbox {sb.id} is {sb.status}, so it cannot be paused; only a running sandbox can.")
        if sb.gv is not None and sb.gv.lock.locked():   # a memory snapshot is being taken: runsc must reach it
            async with sb.gv.lock:
                pass
            return await self.pause(sb)
        sb.status = "paused"   # before the wait: an exec arriving meanwhile resumes it (after the freeze)
        try:
            # one write and one read of the freezer's files (~0.5 ms) on the loop; only a freeze that is still
            # under way (a process in a system call) is waited for in a thread
            if not self.cgroups.start_freeze(sb.id):
                await asyncio.to_thread(self.cgroups.freeze, sb.id)
        except BaseException:
            if sb.status == "paused":
                sb.status = "running"
            raise
        if sb.status != "paused":   # it ended, or a resume came while it froze: undo
            self.cgroups.thaw(sb.id)

    async def resume(self, sb: LiveSandbox) -> None:
        """Let a paused sandbox run again (a no-op for a running one); StateError once it has ended."""
        if sb.status == "running":
            return
        if sb.status != "paused":
            raise StateError(f"sandbox {sb.id} is {sb.status}, so it runs nothing more; create a new sandbox.")
        sb.status = "running"
        self.cgroups.thaw(sb.id)   # one write to the freezer (~0.3 ms): not worth a thread's round trip
        sb.touch()
        self._arm_idle(sb)

    def _check_lease(self, sb: LiveSandbox) -> None:
        if sb.active and not sb.lease_seen and not sb.spec.detach:
            self._expire(sb, "terminated")

    def lease_opened(self, sb: LiveSandbox) -> None:
        sb.leases += 1
        sb.lease_seen = True

    def lease_closed(self, sb: LiveSandbox) -> None:
        sb.leases -= 1
        if sb.leases <= 0 and not sb.spec.detach:
            self._expire(sb, "terminated")

    async def end(self, sb: LiveSandbox, status: str) -> None:
        """End a sandbox (first reason wins) and return once every resource is gone."""
        paused = sb.status == "paused"
        if sb.active:
            sb.status = status
        if paused:   # a frozen process does not die of SIGKILL until it is thawed
            self.cgroups.thaw(sb.id)
        if sb.pidfd >= 0 and not sb.gone.is_set():
            try:
                signal.pidfd_send_signal(sb.pidfd, signal.SIGKILL)  # pid 1 dies, so does its pid namespace
            except ProcessLookupError:
                pass
        elif not sb.gone.is_set() and not sb.cleaning:
            sb.cleaning = True
            await self._cleanup(sb)  # never got an init
        await sb.gone.wait()

    async def _cleanup(self, sb: LiveSandbox) -> None:
        if sb.gone.is_set():
            return
        if sb.active:  # the init died on its own
            sb.status = "oom" if self.cgroups.oom_kills(sb.id) else "failed"
        if sb in self.pool:
            self.pool.remove(sb)
        for t in sb.timers:
            t.cancel()
        if sb.channel is not None:
            sb.channel.close()
        pidfd = sb.pidfd
        if sb.pidfd >= 0:
            asyncio.get_running_loop().remove_reader(sb.pidfd)
            sb.pidfd = -1
        self.by_pid.pop(sb.init_pid, None)
        self.execs.sandbox_ended(sb)
        if sb.gv is not None:
            await self.gvisor.teardown(sb)
        removed = await asyncio.get_running_loop().run_in_executor(self.teardown_pool, self._release_host, sb.id, pidfd)
        if sb.uid_base and removed:   # its processes are gone: the range may serve another sandbox
            self.ranges.give(sb.uid_base)
        if sb.write_base:             # no process ever had those ids
            self.ranges.give(sb.write_base)
            sb.write_base = 0
        if sb.layers is not None and removed:
            await sb.layers.release_layer(sb.id)
            sb.layers = None
        if self.tenancy is not None and sb.spec is not None:
            self.tenancy.charge_egress(self, sb)   # what it moved since the last charge, before the count goes
        if self.network is not None and sb.spec is not None:
            try:
                await self.network.detach(sb.id)
            except Exception:  # noqa: BLE001 - teardown goes on; the gateway logs its own failure
                pass
        sb.ended_at = time.time()
        sb.gone.set()

    def _release_host(self, sid: str, pidfd: int) -> bool:
        """In a teardown thread: close the init's pidfd, remove the sandbox's cgroups (killing stragglers, retrying
        EBUSY for up to 5 s) and its record; True when the cgroups are gone."""
        if pidfd >= 0:
            os.close(pidfd)
        removed = self.cgroups.remove(sid, deadline=5.0)
        (self.records / f"{sid}.json").unlink(missing_ok=True)
        return removed

    def _prune(self) -> None:
        if len(self.sandboxes) <= KEEP_ENDED:  # cannot hold too many ended ones: skip the scan (every create)
            return
        ended = [s for s in self.sandboxes.values() if s.gone.is_set()]
        for s in sorted(ended, key=lambda s: s.ended_at or 0)[:max(0, len(ended) - KEEP_ENDED)]:
            del self.sandboxes[s.id]

    def _write_record(self, sb: LiveSandbox) -> None:
        atomic_write(self.records / f"{sb.id}.json",
                     json.dumps({"id": sb.id, "created_at": sb.created_at, "daemon_pid": os.getpid()}).encode(),
                     fsync_file=False, fsync_dir=False)

__all__ = ["LiveSandbox", "Manager"]
