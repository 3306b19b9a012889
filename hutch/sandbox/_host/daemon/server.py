"""The daemon's HTTP API (docs/api.md) on aiohttp: one handler per route, errors as JSON."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import os
import signal
import tempfile

from aiohttp import web

from hutch._core import errors
from hutch._core.errors import ConfigError, NetworkPolicyError
from hutch._version import VERSION
from hutch.sandbox._host import archive, images, layers
from hutch.sandbox._host.daemon.doctor import report as doctor_report
from hutch.sandbox._host.daemon.execs import live_channel
from hutch.sandbox._host.daemon.http import json_body, query_flag, query_mode, query_path, query_seconds, send_fd
from hutch.sandbox._host.daemon.manager import Manager
from hutch.sandbox._host.daemon.terminal import serve_pty
from hutch.sandbox._host.daemon.openapi import openapi_document
from hutch.sandbox._host.daemon.scope import import_owners, unknown_memsnap
from hutch.sandbox._host.daemon.store_routes import add_routes as add_store_routes
from hutch.sandbox._host.daemon.tenants import ROUTES as TENANT_ROUTES
from hutch.sandbox._host.daemon.tenants import Tenant
from hutch.sandbox._host.gvisor import snapshots as memsnaps
from hutch.sandbox._host.untar import ImportLimits
from hutch.sandbox._api import EXIT, FRAMES_CONTENT_TYPE, STDERR, STDOUT, encode_frame
from hutch.sandbox._spec import Network, SandboxSpec

DRAIN_AFTER_EXIT = 0.2   # seconds to keep reading output a background child may still hold open
LEASE_POLL = 1.0         # fallback check of a lease's connection (disconnects also cancel the handler)
CHUNK = 1 << 16
OUTPUT_CHUNK = 1 << 20   # an exec's output is read (and framed) in pieces up to this size
HEADERS_AFTER = 0.005    # a silent command's response headers wait this long for output to ride along
PTY_ROUTE = "/v1/sandboxes/{id}/exec/pty"

_STATUS = [
    (errors.NotFoundError, 404), (errors.QuotaExceededError, 429), (errors.ConfigError, 400), (errors.StateError, 409),
    (errors.DaemonError, 503), (errors.SandboxTimeout, 504), (errors.Error, 500),
]


def error_response(e: BaseException) -> web.Response:
    if isinstance(e, errors.Error):
        status = next(code for cls, code in _STATUS if isinstance(e, cls))
        body = {"error": type(e).__name__, "message": str(e)}
        if isinstance(e, errors.QuotaExceededError):
            body.update(quota=e.quota, limit=e.limit, used=e.used)
    elif isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):   # the host's disk, not a bug
        status = 503
        body = {"error": "DaemonError", "message": f"the host's disk is full ({e.strerror}"
                + (f": {e.filename}" if e.filename else "") + "); nothing was kept. Free space on the disk holding "
                "the daemon's state directory (images, volumes), then retry."}
    else:
        status = 500
        body = {"error": "DaemonError", "message": f"the daemon failed: {type(e).__name__}: {e}. See its log."}
    return web.json_response(body, status=status)


def make_app(mgr: Manager, gate=None) -> web.Application:
    """The API's app. `gate` (listen.Gate) accepted the connections: every request must come through one
    of its connections (Unix peers it checked; TCP requests carry its token), else it is refused."""

    @web.middleware
    async def guard(request: web.Request, handler):
        conn = gate.lookup(request.transport) if gate is not None else None
        if conn is None:
            resp = web.json_response({"error": "DaemonError", "message":
                                      "this connection did not come through the daemon's listeners."}, status=403)
            resp.force_close()
            return resp
        who = gate.authorize(conn, request.headers.get("Authorization"))
        if who is None:
            resp = web.json_response({"error": "DaemonError", "message":
                                      "missing or wrong bearer token; send Authorization: Bearer <token> "
                                      "(the SDK sends $HUTCH_TOKEN or the file $HUTCH_TOKEN_FILE)."}, status=401)
            resp.force_close()
            return resp
        tenant = request["tenant"] = who if isinstance(who, Tenant) else None
        route = request.match_info.route.resource
        canonical = route.canonical if route is not None else None
        if tenant is not None and (request.method, canonical) not in TENANT_ROUTES:   # default-deny
            return web.json_response({"error": "NotFoundError", "message":
                                      f"no route {request.method} {request.path}; see GET /v1/openapi.json."},
                                     status=404)
        conn.begin()
        resp = None
        try:
            resp = await handler(request)
            return resp
        except web.HTTPException as e:
            if e.status == 404:
                return web.json_response({"error": "NotFoundError", "message":
                                          f"no route {request.method} {request.path}; see GET /v1/openapi.json."},
                                         status=404)
            if e.status == 405:
                return web.json_response({"error": "ConfigError", "message":
                                          f"{request.method} is not allowed on {request.path}; see GET /v1/openapi.json."},
                                         status=405)
            raise
        except (asyncio.CancelledError, ConnectionResetError):
            raise
        except Exception as e:  # noqa: BLE001 - every failure becomes a JSON error body
            resp = error_response(e)
            return resp
        finally:
            conn.end()
            if getattr(mgr, "audit", None) is not None and (request.method not in ("GET", "HEAD") or canonical == PTY_ROUTE):
                _audit(mgr.audit, request, tenant, canonical, resp)

    app = web.Application(middlewares=[guard], client_max_size=1 << 30)
    h = Handlers(mgr)
    r = app.router
    r.add_get("/v1/health", h.health)
    r.add_get("/v1/openapi.json", h.openapi)
    r.add_get("/v1/doctor", h.doctor)
    r.add_get("/v1/tenant", h.tenant)
    r.add_post("/v1/sandboxes", h.create)
    r.add_get("/v1/sandboxes", h.list)
    r.add_get("/v1/sandboxes/{id}", h.info)
    r.add_post("/v1/sandboxes/{id}/terminate", h.terminate)
    r.add_post("/v1/sandboxes/{id}/wait", h.wait)
    r.add_post("/v1/sandboxes/{id}/pause", h.pause)
    r.add_post("/v1/sandboxes/{id}/resume", h.resume)
    r.add_post("/v1/sandboxes/{id}/snapshot-memory", h.snapshot_memory)
    r.add_post("/v1/sandboxes/{id}/fork", h.fork)
    r.add_get("/v1/memory-snapshots", h.memory_snapshots)
    r.add_get("/v1/memory-snapshots/{sid}", h.memory_snapshot)
    r.add_delete("/v1/memory-snapshots/{sid}", h.delete_memory_snapshot)
    r.add_get("/v1/memory-snapshots/{sid}/export", h.export_memory_snapshot)
    r.add_get("/v1/memory-snapshots/{sid}/digest", h.memory_snapshot_digest)
    r.add_post("/v1/memory-snapshots/import", h.import_memory_snapshot)
    r.add_post("/v1/memory-snapshots/{sid}/restore", h.restore)
    r.add_get("/v1/sandboxes/{id}/lease", h.lease)
    r.add_post("/v1/sandboxes/{id}/exec", h.exec)
    r.add_get("/v1/sandboxes/{id}/exec/pty", h.exec_pty)
    r.add_post("/v1/sandboxes/{id}/exec/{eid}/stdin", h.stdin)
    r.add_post("/v1/sandboxes/{id}/exec/{eid}/kill", h.kill)
    r.add_post("/v1/sandboxes/{id}/exec/{eid}/wait", h.exec_wait)
    r.add_get("/v1/sandboxes/{id}/files/read", h.read)
    r.add_put("/v1/sandboxes/{id}/files/write", h.write)
    r.add_get("/v1/sandboxes/{id}/files/list", h.list_files)
    r.add_get("/v1/sandboxes/{id}/files/stat", h.stat)
    r.add_post("/v1/sandboxes/{id}/files/remove", h.remove)
    r.add_post("/v1/sandboxes/{id}/files/mkdir", h.mkdir)
    r.add_post("/v1/images/ensure", h.ensure_image)
    r.add_get("/v1/images", h.images)
    r.add_put("/v1/sandboxes/{id}/network", h.set_network)
    r.add_get("/v1/sandboxes/{id}/network/log", h.network_log)
    add_store_routes(r, mgr)   # snapshots, image store, volumes (store_routes.py)
    return app


def _audit(log, request, tenant, canonical, resp) -> None:
    """One line of the audit log: who, what (method and route), on which id, and how it ended."""
    mi = request.match_info
    target = next((mi[k] for k in ("id", "sid", "key", "name") if k in mi), None)
    status = resp.status if resp is not None else 499   # none: the client went away first
    outcome = "ok" if status < 400 else f"{status}"
    body = getattr(resp, "body", None)
    if isinstance(body, bytes) and body[:1] == b"{" and len(body) < 1 << 16:
        try:
            d = json.loads(body)
        except ValueError:
            d = {}
        if status >= 400 and isinstance(d.get("error"), str):
            outcome = f"{status} {d['error']}"
        elif target is None and isinstance(d.get("id"), str):
            target = d["id"]   # a create: the sandbox it made
    try:
        log.write(tenant.name if tenant is not None else None, f"{request.method} {canonical or request.path}",
                  target, outcome)
    except OSError as e:   # a full disk must not fail the request; the daemon's log says so
        import sys
        print(f"hutch daemon: the audit log could not be written ({e})", file=sys.stderr)


class Handlers:
    def __init__(self, mgr: Manager):
        self.mgr = mgr
        self.tenancy = getattr(mgr, "tenancy", None)   # a Manager.__new__ of a test that only routes has none

    def _sb(self, request):
        """The sandbox of the route's {id}, if the request's tenant (or the operator) may see it."""
        return self.mgr.get(request.match_info["id"], request.get("tenant"))

    async def tenant(self, request):
        t = request.get("tenant")
        if t is None:
            return web.json_response({"name": None, "operator": True, "tenants": self.tenancy is not None})
        return web.json_response({"name": t.name, "operator": False, "quotas": t.quotas.to_dict(),
                                  "images": list(t.images), "use": self.tenancy.use(self.mgr, t)})

    async def health(self, request):
        body = {"version": VERSION, "pid": os.getpid(), "sandboxes": self.mgr.active_count(),
                "max_sandboxes": self.mgr.max_sandboxes}
        why = self.mgr.unavailable()
        if why:   # not healthy while it cannot start sandboxes
            return web.json_response({**body, "error": "DaemonError", "message": why}, status=503)
        return web.json_response(body)

    async def doctor(self, request):
        return web.json_response(await asyncio.to_thread(doctor_report, self.mgr))   # walks the image store

    async def openapi(self, request):
        return web.json_response(openapi_document(request.app))

    async def create(self, request):
        body = await json_body(request)
        if not isinstance(body.get("spec"), dict):
            raise ConfigError('the body must be {"spec": SandboxSpec.to_dict()}.')
        spec = SandboxSpec.from_dict(body["spec"])
        t = request.get("tenant")
        if self.tenancy is None:
            # Shielded: a client that hangs up mid-create must not leave a half-built sandbox; without
            # its lease the sandbox is ended after the grace period.
            sb = await asyncio.shield(self.mgr.create(spec))
        else:   # quotas checked and reserved, a fair slot, then (shielded) the create
            given = spec
            if t is not None:
                spec = self.tenancy.spec_for(t, spec)
            sb = await self.tenancy.admit(self.mgr, t, 1, spec.limits.cpu, spec.limits.memory,
                                          lambda: self.mgr.create(spec, t.name if t is not None else None))
            if t is not None:
                sb.shown_spec = given.to_dict()
        return web.json_response(sb.info(), status=201)

    async def list(self, request):
        tags = {}
        for t in request.query.getall("tag", []):
            k, sep, v = t.partition(":")
            if not sep:
                raise ConfigError(f"tag={t!r} must be key:value.")
            tags[k] = v
        return web.json_response({"sandboxes": [sb.info() for sb in self.mgr.list(tags, request.get("tenant"))]})

    async def info(self, request):
        return web.json_response(self._sb(request).info())

    async def terminate(self, request):
        sb = self._sb(request)
        await asyncio.shield(self.mgr.end(sb, "terminated"))
        return web.json_response(sb.info())

    async def pause(self, request):
        sb = self._sb(request)
        await asyncio.shield(self.mgr.pause(sb))
        return web.json_response(sb.info())

    async def resume(self, request):
        sb = self._sb(request)
        await asyncio.shield(self.mgr.resume(sb))
        return web.json_response(sb.info())

    # --- memory snapshots, restore, fork (gVisor) --------------------------------------------

    async def snapshot_memory(self, request):
        sb = self._sb(request)
        task = asyncio.ensure_future(self.mgr.gvisor.snapshot_memory(sb))
        try:
            snap = await asyncio.shield(task)
        except asyncio.CancelledError:   # the client went away: finish (runsc cannot be stopped), keep nothing
            task.add_done_callback(_drop_snapshot)
            raise
        t = request.get("tenant")
        if t is not None:
            async def settle():   # shielded: a client that hangs up must not leave it half-recorded
                try:
                    await self.tenancy.own_memsnap(t, snap["id"], (sb.shown_spec or {}).get("image"))
                    await self.tenancy.own_image(t, layers.node_id_of(snap["image"]) or snap["image"])
                except BaseException:   # its ownership could not be recorded: keep no snapshot nobody may reach
                    await asyncio.to_thread(_drop_snapshot_id, snap["id"])
                    with contextlib.suppress(Exception):
                        await self.tenancy.drop_memsnap(snap["id"])
                    raise
            await asyncio.shield(settle())
        return web.json_response(snap, status=201)

    async def fork(self, request):
        sb = self._sb(request)
        body = await json_body(request, optional=True)
        n = body.get("n", 1)
        detach = _flag(body.get("detach", False), "detach")
        t = request.get("tenant")
        if self.tenancy is None:
            # shielded as a create is: copies a client leaves behind lose their lease and end after the grace period
            kids = await asyncio.shield(self.mgr.capped(n, lambda: self.mgr.gvisor.fork(sb, n, detach=detach)))
        else:
            # copies of a tenant's sandbox are the tenant's, whoever asks (the operator too): charged to its quotas
            owner = self.tenancy.registry.get(sb.tenant) if sb.tenant is not None else None

            async def make():
                got = await self.mgr.capped(n, lambda: self.mgr.gvisor.fork(sb, n, detach=detach))
                for k in got:
                    k.tenant = sb.tenant
                    if owner is not None and k.spec is not None:   # shown as its tenant named things
                        k.shown_spec = self.tenancy.shown_spec(owner, k.spec, sb.shown_spec)
                return got
            kids = await self.tenancy.admit(self.mgr, owner if sb.tenant is not None else t,
                                            n if isinstance(n, int) and not isinstance(n, bool) else 1,
                                            sb.spec.limits.cpu, sb.spec.limits.memory, make)
        return web.json_response({"sandboxes": [k.info() for k in kids]}, status=201)

    async def restore(self, request):
        body = await json_body(request, optional=True)
        tags = body.get("tags") or {}
        if not isinstance(tags, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in tags.items()):
            raise ConfigError("tags must map strings to strings.")
        sid, detach = request.match_info["sid"], _flag(body.get("detach", False), "detach")
        t = request.get("tenant")
        if self.tenancy is None:
            sb = await asyncio.shield(self.mgr.capped(1, lambda: self.mgr.gvisor.restore(sid, detach=detach, tags=tags)))
        else:
            if t is not None:
                self.tenancy.check_memsnap(t, sid)
            else:   # the operator's restore of a tenant's snapshot is the tenant's, charged to its quotas
                maker = self.tenancy.owners.memsnaps.get(sid)
                t = self.tenancy.registry.get(maker) if maker is not None else None
            spec = await asyncio.to_thread(_snapshot_spec, sid)

            async def make():
                got = await self.mgr.capped(1, lambda: self.mgr.gvisor.restore(sid, detach=detach, tags=tags))
                got.tenant = t.name if t is not None else None
                if t is not None and got.spec is not None:   # shown as its tenant named things
                    image = self.tenancy.owners.memsnap_image(sid)
                    got.shown_spec = self.tenancy.shown_spec(t, got.spec, {"image": image} if image else None)
                return got
            sb = await self.tenancy.admit(self.mgr, t, 1, spec.limits.cpu, spec.limits.memory, make)
        return web.json_response(sb.info(), status=201)

    def _memsnaps(self, request, snaps: list) -> list:
        t = request.get("tenant")
        return snaps if t is None else [s for s in snaps if self.tenancy.owners.memsnaps.get(s["id"]) == t.name]

    async def memory_snapshots(self, request):
        return web.json_response({"snapshots": self._memsnaps(request, await asyncio.to_thread(memsnaps.list_all))})

    async def memory_snapshot(self, request):
        sid = request.match_info["sid"]
        for s in self._memsnaps(request, await asyncio.to_thread(memsnaps.list_all)):
            if s["id"] == sid:
                return web.json_response(s)
        memsnaps.path_of(sid)   # a malformed id: ConfigError
        raise unknown_memsnap(sid)

    async def delete_memory_snapshot(self, request):
        sid, t = request.match_info["sid"], request.get("tenant")
        if t is not None:
            self.tenancy.check_memsnap(t, sid)
        await asyncio.to_thread(memsnaps.remove, sid)
        if self.tenancy is not None:
            await self.tenancy.drop_memsnap(sid)
        return web.Response(status=204)

    async def export_memory_snapshot(self, request):
        sid = request.match_info["sid"]
        memsnaps.path_of(sid)   # a malformed id: ConfigError, before anything is spooled
        memsnaps.store_dir().mkdir(parents=True, exist_ok=True, mode=0o700)
        fd, tmp = tempfile.mkstemp(prefix=memsnaps.spool_prefix("export"), suffix=".tmp",
                                   dir=memsnaps.store_dir())
        try:
            with os.fdopen(fd, "wb") as f:
                await self.mgr.gvisor.export(sid, f)
            return await send_fd(request, os.open(tmp, os.O_RDONLY | os.O_CLOEXEC), os.path.getsize(tmp),
                                 "application/x-tar")
        finally:
            os.unlink(tmp)

    async def memory_snapshot_digest(self, request):
        sid = request.match_info["sid"]
        memsnaps.path_of(sid)   # a malformed id: ConfigError
        d = await self.mgr.gvisor.digest(sid)
        # the operator's route: who owns it here goes with it (a fleet's import is told it: ?owner=)
        d["owner"] = self.tenancy.owners.memsnaps.get(sid) if self.tenancy is not None else None
        d["owner_image"] = self.tenancy.owners.memsnap_image(sid) if d["owner"] is not None else None
        return web.json_response(d)

    async def import_memory_snapshot(self, request):
        digest = request.query.get("digest")
        if digest is not None and not (len(digest) == 64 and not set(digest) - set("0123456789abcdef")):
            raise errors.ConfigError(f"digest={digest[:80]!r} must be a memory snapshot's 64-hex-digit digest (GET "
                                     "/v1/memory-snapshots/ID/digest answers it).")
        base = request.query.get("base")
        if base is not None and (base == archive.ANY_BASE or "\0" in base or len(base) > 4096):
            raise errors.ConfigError(f"base={base[:80]!r} must be the image reference of the base the snapshot's "
                                     "filesystem sits on (debian-slim or dir:/PATH).")
        owners = import_owners(self.tenancy, request.query.getall("owner", []), digest, "a memory snapshot",
                               "GET /v1/memory-snapshots/ID/digest", most=1)
        owner = owners[0] if owners else None
        shown = request.query.get("owner_image")   # the image its source showed its owner (the holder's record)
        if shown is not None and (owner is None or "\0" in shown or not 0 < len(shown) <= 200):
            raise errors.ConfigError("owner_image= goes with owner=: the image the snapshot's source showed its "
                                     "tenant, as the holder's digest answer names it (1-200 characters).")
        limits = ImportLimits.from_env()
        memsnaps.store_dir().mkdir(parents=True, exist_ok=True, mode=0o700)
        before = set(os.listdir(memsnaps.store_dir()))
        fd, tmp = tempfile.mkstemp(prefix=memsnaps.spool_prefix("import"), suffix=".tmp",
                                   dir=memsnaps.store_dir())
        try:
            with os.fdopen(fd, "wb") as f:
                size = 0
                async for chunk in request.content.iter_chunked(CHUNK):
                    size += len(chunk)
                    if size > limits.bytes:   # the spool is bounded too, not only what is read from it
                        raise errors.InvalidArchiveError(
                            f"the snapshot archive is larger than {limits.bytes} bytes (HUTCH_IMPORT_MAX_BYTES of "
                            "the daemon); raise that limit if it is yours.")
                    f.write(chunk)
            with open(tmp, "rb") as f:
                snap = await asyncio.shield(self.mgr.gvisor.import_(f, limits, digest=digest, base=base))
            if owner is not None:
                await asyncio.shield(self._own_imported(owner, snap, shown, new=snap["id"] not in before))
            return web.json_response(snap, status=201)
        finally:
            os.unlink(tmp)

    async def _own_imported(self, t, snap: dict, shown: str | None, *, new: bool) -> None:
        """Record `t` as the owner of the imported snapshot and a holder of its image, as its snapshot_memory did
        on the source; a snapshot of another tenant here is refused; a new one whose record fails is not kept."""
        sid = snap["id"]
        try:
            have = self.tenancy.owners.memsnaps.get(sid)
            if have is not None and have != t.name:
                raise errors.StateError(f"memory snapshot {sid} is here already as another tenant's; nothing was "
                                        "imported for tenant " + t.name + ": delete it here first.")
            await self.tenancy.own_memsnap(t, sid, shown)
            await self.tenancy.own_image(t, layers.node_id_of(snap["image"]) or snap["image"])
        except BaseException:
            if new:   # keep no snapshot nobody may reach
                await asyncio.to_thread(_drop_snapshot_id, sid)
                with contextlib.suppress(Exception):
                    await self.tenancy.drop_memsnap(sid)
            raise

    async def wait(self, request):
        sb = self._sb(request)
        seconds = query_seconds(request)   # before the coroutine below exists: a refusal must not orphan it
        try:
            await asyncio.wait_for(sb.gone.wait(), seconds)
        except asyncio.TimeoutError:
            pass
        return web.json_response(sb.info())

    async def lease(self, request):
        sb = self._sb(request)
        if not sb.active:
            return web.json_response(sb.info())
        resp = web.StreamResponse(headers={"Content-Type": "text/plain"})
        self.mgr.lease_opened(sb)
        try:
            await resp.prepare(request)
            await resp.write(b"\n")  # flushes the headers: the client may read that its lease is held
            while not sb.gone.is_set():
                tr = request.transport
                if tr is None or tr.is_closing():
                    break
                try:
                    await asyncio.wait_for(sb.gone.wait(), LEASE_POLL)
                except asyncio.TimeoutError:
                    pass
        finally:
            self.mgr.lease_closed(sb)
        return resp

    # --- exec ---------------------------------------------------------------------------

    async def exec(self, request):
        sb = self._sb(request)
        body = await json_body(request)
        if body.get("pty") is not None:
            raise ConfigError("an exec on a terminal (pty) is a WebSocket: GET /v1/sandboxes/{id}/exec/pty, its "
                              "first message this body (docs/api.md); the SDK's exec(..., pty=True) speaks it.")
        ex = await self.mgr.execs.start(sb, body.get("argv"), body.get("env"), body.get("workdir"),
                                       body.get("timeout"), bool(body.get("stdin")), body.get("stdout", True),
                                       body.get("stderr", True), body.get("max_output"), body.get("user", "root"))
        out = _Output(asyncio.get_running_loop(), ex)
        resp = None
        task = asyncio.current_task()
        self.mgr.streams.add(task)
        try:
            if ex.stdin_w is not None:  # the client needs the exec id (a header) to feed stdin: send it now
                resp = await _prepare(request, ex, immediate=True)
            deadline = None
            while True:
                if out.frames:
                    data = out.take()
                    if resp is None:  # headers leave together with the first output
                        resp = await _prepare(request, ex, immediate=False)
                    await resp.write(data)   # waits while the client is slow: backpressure on the pipes
                    out.resume()
                    continue
                if ex.exited.done():
                    if not out.open:
                        break
                    if deadline is None:  # a background child may hold the output open: drain briefly
                        deadline = asyncio.get_running_loop().time() + DRAIN_AFTER_EXIT
                    elif asyncio.get_running_loop().time() >= deadline:
                        break
                if resp is None and deadline is None:
                    timeout = HEADERS_AFTER   # a silent command: send the headers soon anyway
                else:
                    timeout = None if deadline is None else max(0.0, deadline - asyncio.get_running_loop().time())
                woke = await out.wait(timeout)
                if not woke and resp is None and not ex.exited.done():
                    resp = await _prepare(request, ex, immediate=True)
            status = self.mgr.execs.result(sb, ex)
            if ex.max_output is not None:
                status = {**status, "stdout_dropped": out.dropped[STDOUT], "stderr_dropped": out.dropped[STDERR]}
            final = encode_frame(EXIT, json.dumps(status).encode())
            if resp is None:  # a quick command: headers, output and exit status in one write
                resp = await _prepare(request, ex, immediate=False)
            await resp.write_eof(final)
            return resp
        finally:
            self.mgr.streams.discard(task)
            out.close()
            ex.streaming = False
            if not ex.exited.done():  # the client went away: the command goes with it
                await self.mgr.execs.kill(sb, ex, signal.SIGKILL, "killed")
            if ex.stdin_w is not None:
                try:
                    os.close(ex.stdin_w)
                except OSError:
                    pass
                ex.stdin_w = None

    async def exec_pty(self, request):
        return await serve_pty(request, self.mgr, self._sb(request))

    async def stdin(self, request):
        sb = self._sb(request)
        ex = self.mgr.execs.find(sb, request.match_info["eid"])
        data = await request.read()
        if ex.stdin_w is None:
            if data or not query_flag(request, "eof"):
                raise errors.StateError("this exec's stdin is closed or was not requested; pass stdin=True to exec.")
            return web.Response(status=204)
        fd = ex.stdin_w
        view = memoryview(data)
        os.set_blocking(fd, False)
        loop = asyncio.get_running_loop()
        try:
            while view:
                try:
                    view = view[os.write(fd, view):]
                except BlockingIOError:
                    fut = loop.create_future()
                    loop.add_writer(fd, fut.set_result, None)
                    try:
                        await fut
                    finally:
                        loop.remove_writer(fd)
        except BrokenPipeError as e:
            raise errors.StateError("the command closed its stdin or has exited.") from e
        if query_flag(request, "eof"):
            ex.stdin_w = None
            os.close(fd)
        sb.touch()
        return web.Response(status=204)

    async def exec_wait(self, request):
        """How a command ended, without its output: a client that has not read all of it (so the daemon
        holds the rest back) still learns that the command exited, was killed or timed out."""
        sb = self._sb(request)
        ex = self.mgr.execs.find(sb, request.match_info["eid"])
        seconds = query_seconds(request)
        try:
            await asyncio.wait_for(asyncio.shield(ex.exited), seconds)
        except asyncio.TimeoutError:
            return web.json_response({"returncode": None, "reason": None})
        return web.json_response(self.mgr.execs.result(sb, ex))

    async def kill(self, request):
        sb = self._sb(request)
        ex = self.mgr.execs.find(sb, request.match_info["eid"])
        body = await json_body(request, optional=True)
        sig = body.get("signal", signal.SIGKILL)
        if isinstance(sig, bool) or not isinstance(sig, int) or not 1 <= sig <= 64:
            raise ConfigError(f"signal={sig!r} must be a signal number, like 9 or 15.")
        await self.mgr.execs.kill(sb, ex, sig, "killed")
        return web.Response(status=204)

    # --- files --------------------------------------------------------------------------

    async def read(self, request):
        sb = self._sb(request)
        reply, fds = await self.mgr.execs.file_call(sb, "read", query_path(request, "/home/user/a.txt"))
        return await send_fd(request, fds[0], reply["size"])

    async def write(self, request):
        sb = self._sb(request)
        path = query_path(request, "/home/user/a.txt")
        mode = query_mode(request)
        reply, fds = await self.mgr.execs.file_call(sb, "write_open", path, mode=mode)
        fd, tmp = fds[0], reply["tmp"]
        try:
            async for chunk in request.content.iter_chunked(CHUNK * 4):
                view = memoryview(chunk)
                while view:
                    view = view[os.write(fd, view):]
        except BaseException as e:
            os.close(fd)
            await self.mgr.execs.file_call(sb, "write_abort", path, tmp=tmp)
            if isinstance(e, OSError) and e.errno in (28, 122):  # ENOSPC, EDQUOT
                raise errors.StateError(f"writing {path}: the sandbox's disk limit is reached; "
                                          "create it with a larger disk= or remove files.") from e
            raise
        os.close(fd)
        await self.mgr.execs.file_call(sb, "write_commit", path, tmp=tmp)
        return web.Response(status=204)

    async def list_files(self, request):
        sb = self._sb(request)
        reply, _ = await self.mgr.execs.file_call(sb, "list", query_path(request, "/home/user/a.txt"))
        return web.json_response({"entries": reply["entries"]})

    async def stat(self, request):
        sb = self._sb(request)
        reply, _ = await self.mgr.execs.file_call(sb, "stat", query_path(request, "/home/user/a.txt"))
        return web.json_response(reply["entry"])

    async def remove(self, request):
        sb = self._sb(request)
        await self.mgr.execs.file_call(sb, "remove", query_path(request, "/home/user/a.txt"),
                                       recursive=query_flag(request, "recursive"))
        return web.Response(status=204)

    async def mkdir(self, request):
        sb = self._sb(request)
        await self.mgr.execs.file_call(sb, "mkdir", query_path(request, "/home/user/a.txt"),
                                       parents=query_flag(request, "parents"))
        return web.Response(status=204)

    # --- images -------------------------------------------------------------------------

    async def ensure_image(self, request):
        body = await json_body(request)
        ref = body.get("ref")
        if not isinstance(ref, str) or not ref:
            raise ConfigError('the body must be {"ref": "<image reference>"}.')
        t = request.get("tenant")
        if t is not None:
            ref = self.tenancy.image_ref(t, ref)   # only what it may use, and built already: a build is the host's
            try:
                await asyncio.to_thread(images.resolve_image, ref)
            except errors.NotFoundError:
                raise errors.NotFoundError(f"image {body['ref']!r} is not built on this host, and a tenant cannot "
                                           "build images; ask the operator to build it (`hutch image build`) and share "
                                           "it with you.") from None
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        await resp.prepare(request)

        def progress(ev: dict) -> None:
            loop.call_soon_threadsafe(events.put_nowait, ev)

        job = loop.run_in_executor(None, images.ensure_image, ref, progress)
        while True:
            getter = asyncio.ensure_future(events.get())
            done, _ = await asyncio.wait([getter, job], return_when=asyncio.FIRST_COMPLETED)
            if getter in done:
                await resp.write(json.dumps(getter.result()).encode() + b"\n")
                continue
            getter.cancel()
            while not events.empty():
                await resp.write(json.dumps(events.get_nowait()).encode() + b"\n")
            try:
                img = job.result()
                last = {"done": True, "ref": img.ref, "id": img.id}
            except errors.Error as e:
                last = {"error": type(e).__name__, "message": str(e)}
            except Exception as e:  # noqa: BLE001
                last = {"error": "ImageError", "message": f"building image {ref!r} failed: {e}"}
            await resp.write(json.dumps(last).encode() + b"\n")
            await resp.write_eof()
            return resp

    async def images(self, request):
        lister = getattr(images, "list_images", None) or _built_images
        items = await asyncio.get_running_loop().run_in_executor(None, lister)
        items = [i if isinstance(i, dict) else vars(i) for i in items]
        t = request.get("tenant")
        if t is not None:
            items = self.tenancy.list_images(t, items)
        return web.json_response({"images": items})

    # --- network ------------------------------------------------------------------------

    async def set_network(self, request):
        sb = self._sb(request)
        body = await json_body(request)
        d = body.get("network")
        if not isinstance(d, dict):
            raise ConfigError('the body must be {"network": {...}} as Network makes it.')
        net = Network.from_dict(d)   # validates like the named constructors; errors name the entry
        t = request.get("tenant")
        if t is not None and net.mode != "none":
            self.tenancy.accounts.egress_check(t)   # over its egress quota: no network until its day's use falls
        if self.mgr.network is None:
            raise NetworkPolicyError("this daemon runs no egress gateway, so a sandbox's network cannot change; "
                                     "sandboxes here have Network.none().")
        live_channel(sb)
        if sb.gv is not None and not sb.gv.network and net.mode != "none":
            raise errors.UnsupportedError(f"gVisor sandbox {sb.id} was created without a network, and gVisor cannot "
                                          "be given a network link afterwards; create it with network= set (a policy "
                                          "can then change freely).")
        # gVisor's netstack took the link over at start: Network.none() keeps it (refusing everything), since a
        # new one would not be seen
        await self.mgr.network.update(sb.id, net, keep_link=sb.gv is not None)
        await self.mgr.trust_egress_ca(sb)
        return web.Response(status=204)

    async def network_log(self, request):
        sb = self._sb(request)
        if self.mgr.network is None:
            return web.json_response({"decisions": []})
        return web.json_response(self.mgr.network.log(sb.id))


def _flag(value, name: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{name}={value!r} must be true or false.")
    return value


def _snapshot_spec(sid: str) -> SandboxSpec:
    """The spec a restore of memory snapshot `sid` runs (its limits are what the quotas charge)."""
    try:
        d = json.loads((memsnaps.path_of(sid) / "meta.json").read_text())
        return SandboxSpec.from_dict(d["spec"])
    except (FileNotFoundError, NotADirectoryError):
        raise unknown_memsnap(sid) from None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"memory snapshot {sid}'s meta.json is malformed ({e}); take a new snapshot.") from None


def _drop_snapshot(task: asyncio.Future) -> None:
    if not task.cancelled() and task.exception() is None:
        _drop_snapshot_id(task.result()["id"])


def _drop_snapshot_id(sid: str) -> None:
    try:
        memsnaps.remove(sid)
    except Exception:  # noqa: BLE001 - gone already
        pass


def _built_images() -> list[dict]:
    """The images built on this host: each images_dir()/<name>/image.json."""
    out = []
    base = images.images_dir() if hasattr(images, "images_dir") else None
    for meta in sorted(base.glob("*/image.json")) if base and base.is_dir() else ():
        try:
            d = json.loads(meta.read_text())
            out.append({k: d.get(k) for k in ("ref", "id", "size", "created_at")})
        except (OSError, ValueError):
            continue
    return out


class _Coalesced(web.StreamResponse):
    """Headers wait for the first body write and leave in the same packet (aiohttp >= 3.12 honours this)."""

    _send_headers_immediately = False


async def _prepare(request: web.Request, ex, *, immediate: bool) -> web.StreamResponse:
    cls = web.StreamResponse if immediate else _Coalesced
    resp = cls(headers={"Content-Type": FRAMES_CONTENT_TYPE, "X-Hutch-Exec-Id": ex.eid})
    await resp.prepare(request)
    return resp


class _Output:
    """An exec's stdout and stderr pipes, read straight from the event loop into frames.

    Lighter than a transport and a task per pipe (this is on every exec's path). Flow control: a
    reader pauses while PAUSE_AT framed bytes wait for the client (and the handler waits for the
    client to take each write), so the daemon holds at most a few MiB per exec and a slow client
    slows the command. Past the exec's max_output a stream is no longer framed: it is drained into
    /dev/null (spliced, never copied) and counted, so the command runs on at full speed.
    """

    PAUSE_AT = OUTPUT_CHUNK

    def __init__(self, loop: asyncio.AbstractEventLoop, ex) -> None:
        self.loop = loop
        self.fds = {fd: kind for fd, kind in ((ex.out_r, STDOUT), (ex.err_r, STDERR)) if fd is not None}
        self.open = set(self.fds)
        self.paused: set[int] = set()
        self.frames: list[bytes] = []
        self.size = 0
        self.budget = {fd: ex.max_output for fd in self.fds}   # None: everything goes to the client
        self.dropped = {STDOUT: 0, STDERR: 0}
        self.waiter: asyncio.Future | None = None
        self.exited = ex.exited
        for fd in self.fds:
            os.set_blocking(fd, False)
            loop.add_reader(fd, self._readable, fd)

    def _readable(self, fd: int) -> None:
        budget = self.budget[fd]
        try:
            if budget == 0:
                n = _discard(fd)
                self.dropped[self.fds[fd]] += n
                if n:
                    return
                data = b""
            else:
                data = os.read(fd, OUTPUT_CHUNK)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if data:
            if budget is not None and len(data) > budget:
                self.dropped[self.fds[fd]] += len(data) - budget
                data = data[:budget]
            if budget is not None:
                self.budget[fd] = budget - len(data)
            self.frames.append(encode_frame(self.fds[fd], data))
            self.size += len(data)
            if self.size >= self.PAUSE_AT and self.budget[fd] != 0:
                self.loop.remove_reader(fd)
                self.paused.add(fd)
        else:
            self.loop.remove_reader(fd)
            self.open.discard(fd)
        self._wake()

    def take(self) -> bytes:
        data = b"".join(self.frames)
        self.frames.clear()
        self.size = 0
        return data

    def resume(self) -> None:
        for fd in self.paused:
            if fd in self.open:
                self.loop.add_reader(fd, self._readable, fd)
        self.paused.clear()

    async def wait(self, timeout: float | None) -> bool:
        """Until output (or its end) arrives, the command exits, or `timeout`; False on the timeout."""
        self.waiter = fut = self.loop.create_future()
        watch = not self.exited.done()
        if watch:
            self.exited.add_done_callback(self._wake)
        timer = self.loop.call_later(timeout, self._wake, None, False) if timeout is not None else None
        try:
            return await fut
        finally:
            if timer is not None:
                timer.cancel()
            if watch:
                self.exited.remove_done_callback(self._wake)
            self.waiter = None

    def _wake(self, _f=None, value: bool = True) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(value)

    def close(self) -> None:
        for fd in self.fds:
            if fd in self.open and fd not in self.paused:
                self.loop.remove_reader(fd)
            try:
                os.close(fd)
            except OSError:
                pass
        self.open.clear()


_devnull = -1


def _discard(fd: int) -> int:
    """Move what the pipe `fd` holds into /dev/null; the number of bytes (0 at its end)."""
    global _devnull
    if _devnull < 0:
        _devnull = os.open("/dev/null", os.O_WRONLY | os.O_CLOEXEC)
    try:
        return os.splice(fd, _devnull, OUTPUT_CHUNK, flags=os.SPLICE_F_NONBLOCK)
    except BlockingIOError:
        raise
    except OSError as e:
        if e.errno != errno.EINVAL:   # EINVAL: no splice here; a read does the same, with a copy
            raise
        return len(os.read(fd, OUTPUT_CHUNK))


__all__ = ["error_response", "make_app"]
