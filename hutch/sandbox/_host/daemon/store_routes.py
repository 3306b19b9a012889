"""HTTP routes of the layer store and the volumes (docs/api.md): snapshots, image nodes, rm/prune,
export/import, volumes and their files. Added to the app by `add_routes`."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import tempfile

from aiohttp import web

from hutch._core.errors import ConfigError, Error, InvalidArchiveError, QuotaExceededError, StateError, UnsupportedError
from hutch.sandbox._host import archive, images, layers, volumes
from hutch.sandbox._host.daemon.execs import error_from_reply, live_channel
from hutch.sandbox._host.daemon.http import json_body, query_flag, query_mode, query_path, send_fd
from hutch.sandbox._host.daemon.scope import import_name_check, import_owners
from hutch.sandbox._spec import NAME_PATTERN, check_volume_name

CHUNK = 1 << 18


def _str_or_none(body: dict, key: str) -> str | None:
    v = body.get(key)
    if v is not None and not isinstance(v, str):
        raise ConfigError(f"{key}={v!r} must be a string.")
    return v


def _env(body: dict) -> dict:
    env = body.get("env") or {}
    if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        raise ConfigError("env must map strings to strings.")
    return env


async def _run(fn, *args, **kw):
    return await asyncio.get_running_loop().run_in_executor(None, lambda: fn(*args, **kw))


class StoreRoutes:
    def __init__(self, mgr):
        self.mgr = mgr

    # --- what running sandboxes use ------------------------------------------------------------

    def _active(self):
        return [sb for sb in self.mgr.sandboxes.values() if sb.active and sb.spec is not None]

    def _in_use(self) -> tuple[set[str], set[str]]:
        nodes, layer_ids = set(), set()
        store = layers.layers_dir()
        for sb in self._active():
            img = sb.image
            if img is None:
                continue
            if layers.node_id_of(img.ref):
                nodes.add(img.id)
            for d in img.lowerdirs:
                if d.parent.parent == store:
                    layer_ids.add(d.parent.name)
        return nodes, layer_ids

    # --- snapshots and image nodes -------------------------------------------------------------

    async def snapshot(self, request):
        t = request.get("tenant")
        sb = self.mgr.get(request.match_info["id"], t)
        ch = live_channel(sb)
        body = await json_body(request, optional=True)
        key, name = _str_or_none(body, "key"), _str_or_none(body, "name")
        if key is not None and (len(key) != 64 or any(c not in "0123456789abcdef" for c in key)):
            raise ConfigError(f"key={key!r} must be 64 hex digits (a build step's key).")
        if t is not None:
            if key is not None:   # a step's key is shared by whoever builds the same step: not across tenants
                raise UnsupportedError("a tenant cannot record build steps (key=): their cache is shared by the "
                                       "host; snapshot without a key, or ask the operator to build and share the image.")
            if name is not None:
                self.mgr.tenancy.volume(t, name)   # the same rule of names
                name = self.mgr.tenancy.image_name(t, name)
            self.mgr.tenancy.check_disk(t)
        reply, fds = await ch.request({"op": "upper"})
        if not reply["ok"] or not fds:
            raise error_from_reply(reply)
        sb.touch()
        try:
            node = await _run(self._commit, fds[0], sb, key, name, _env(body), _str_or_none(body, "workdir"),
                              _str_or_none(body, "description") or "")
        finally:
            os.close(fds[0])
        if t is not None:
            ten = self.mgr.tenancy

            async def settle():   # shielded: a client that hangs up must not leave it half-recorded
                fresh = not ten.owners.images.get(node["id"])
                try:
                    await ten.own_image(t, node["id"])
                except BaseException:   # not recorded as its: an image nobody may reach goes again
                    if fresh:
                        await _run(layers.remove, node["id"], self._in_use()[0], force=True)
                    raise
                try:
                    ten.check_disk(t)
                except QuotaExceededError:   # nothing half-made: the image goes again (unless others hold it)
                    if await ten.disown_image(t, node["id"]) and fresh:
                        await _run(layers.remove, node["id"], self._in_use()[0], force=True)
                    raise
            await asyncio.shield(settle())
            if node.get("name"):
                node = {**node, "name": name[len(ten.image_name(t, "")):]}
        return web.json_response(node, status=201)

    @staticmethod
    def _commit(upper: int, sb, key, name, env, workdir, description) -> dict:
        dfd = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=upper)
        try:
            # back to the sandbox's own ids; no more bytes than its disk= (sparse files and hard links copy whole)
            digest, meta = layers.commit_tree(dfd, sb.uid_base, sb.spec.limits.disk)
        finally:
            os.close(dfd)
        parent = sb.spec.image
        node_id = key or layers.snapshot_id(parent, digest, env, workdir)
        node = layers.put_node(node_id, parent, layer=digest, kind="step" if key else "snapshot", env=env,
                                workdir=workdir, name=name, pinned=key is None,
                                description=description or f"snapshot of sandbox {sb.id}")
        return {**node, "size": meta["size"], "files": meta["files"]}

    async def put_node(self, request):
        """A node without a layer (an env or workdir step), or a name/pin for an existing image."""
        body = await json_body(request, optional=True)
        nid, parent = _str_or_none(body, "id"), _str_or_none(body, "parent")
        if not nid or not parent:
            raise ConfigError('the body must be {"id": <64 hex>, "parent": <image ref>, "env": {...}, "workdir": ...}.')
        await _run(images.resolve_image, parent)   # the parent must exist (NotFoundError names the fix)
        node = await _run(layers.put_node, nid, parent, layer=None, kind=body.get("kind") or "step",
                          env=_env(body), workdir=_str_or_none(body, "workdir"), name=_str_or_none(body, "name"),
                          description=_str_or_none(body, "description") or "", pinned=bool(body.get("pinned")))
        return web.json_response(node, status=201)

    def _find(self, request, *, own: bool = False):
        """The node of the route's {key}: for a tenant, only one it may use (`own`: made by it)."""
        key, t = request.match_info["key"], request.get("tenant")
        if t is None:
            return _run(layers.find, key)
        return _run(self.mgr.tenancy.find_image, t, key, own=own)

    async def get_node(self, request):
        node = await self._find(request)
        nodes, base = await _run(layers.chain, node["id"])   # every ancestor and layer present, else 404
        node = {**node, "size": layers.layer_size(node.get("layer")),
                "digest": layers.chain_digest(list(reversed(nodes)), base)}
        t = request.get("tenant")
        if t is not None:
            node = self.mgr.tenancy.list_images(t, [node])[0]
        else:   # the operator's answer: who holds it here goes with it (a fleet's import is told it: ?owner=)
            ten = self.mgr.tenancy
            node = {**node, "owners": list(ten.owners.images.get(node["id"], ())) if ten is not None else []}
        return web.json_response(node)

    async def remove(self, request):
        nodes, _ = self._in_use()
        t, force = request.get("tenant"), query_flag(request, "force")
        if t is None:
            removed = await _run(layers.remove, request.match_info["key"], nodes, force=force)
            return web.json_response({"removed": removed})
        node = await self._find(request, own=True)
        async def settle():   # shielded: a client that hangs up must not leave it half-removed
            if not await self.mgr.tenancy.disown_image(t, node["id"]):   # another tenant holds the same image
                return [node["ref"]]
            try:
                return await _run(layers.remove, node["id"], nodes, force=force)
            except BaseException:
                await self.mgr.tenancy.own_image(t, node["id"])
                raise
        return web.json_response({"removed": await asyncio.shield(settle())})

    async def prune(self, request):
        nodes, layer_ids = self._in_use()
        return web.json_response(await _run(layers.prune, layer_ids, nodes))

    async def export(self, request):
        key = (await self._find(request))["id"]
        await _run(layers.chain, key)   # 404 before anything is spooled
        tenancy = self.mgr.tenancy
        async with (tenancy.export_lock(request.get("tenant")) if tenancy else contextlib.nullcontext()):
            return await self._export(request, key)

    async def _export(self, request, key):
        layers.private_dir(layers.layers_dir())   # a host that never stored a layer has no store yet
        fd, tmp = tempfile.mkstemp(prefix=".tmp-export-", dir=layers.layers_dir())
        try:
            with os.fdopen(fd, "wb") as f:
                await _run(archive.export, key, f)
            return await send_fd(request, os.open(tmp, os.O_RDONLY | os.O_CLOEXEC), os.path.getsize(tmp),
                                 "application/x-tar")
        finally:
            os.unlink(tmp)

    async def import_(self, request):
        limits = archive.ImportLimits.from_env()
        digest = request.query.get("digest")
        if digest is not None and not layers.ID_RE.match(digest):
            raise ConfigError(f"digest={digest[:80]!r} must be an image's 64-hex-digit digest (GET /v1/images/KEY "
                              "answers it as \"digest\").")
        base = request.query.get("base")
        if base is not None and (base == archive.ANY_BASE or "\0" in base or len(base) > 4096):
            raise ConfigError(f"base={base[:80]!r} must be the image reference of the base the archive sits on "
                              "(debian-slim or dir:/PATH).")
        if digest is not None and base is None:
            base = archive.ANY_BASE   # the digest, from the source the importer runs, vouches for the whole chain
        # A name of this host moves to the archive's content only when asked (?replace=1). A transfer by digest
        # asks for that image by id: it comes in, and this host's names stay where they are.
        names = "replace" if query_flag(request, "replace") else "keep" if digest is not None else "refuse"
        owners = import_owners(self.mgr.tenancy, request.query.getall("owner", []), digest, "an image",
                               "GET /v1/images/ID")
        layers.private_dir(layers.layers_dir())
        before = set(os.listdir(layers.nodes_dir())) if owners and layers.nodes_dir().is_dir() else set()
        fd, tmp = tempfile.mkstemp(prefix=".tmp-import-", dir=layers.layers_dir())
        try:
            with os.fdopen(fd, "wb") as f:
                size = 0
                async for chunk in request.content.iter_chunked(CHUNK):
                    size += len(chunk)
                    if size > limits.bytes:   # the spool is bounded too, not only what is extracted from it
                        raise InvalidArchiveError(f"the image archive is larger than {limits.bytes} bytes "
                                         "(HUTCH_IMPORT_MAX_BYTES of the daemon); raise that limit if it is yours.")
                    f.write(chunk)
            with open(tmp, "rb") as f:
                result = await _run(archive.import_, f, limits, digest=digest, base=base, names=names,
                                    name_check=import_name_check(owners))
            if owners:
                await asyncio.shield(self._own_imported(owners, result["id"], before))
            return web.json_response(result, status=201)
        finally:
            os.unlink(tmp)

    async def _own_imported(self, owners: list, node_id: str, before: set[str]) -> None:
        """Record each of `owners` as a holder of the imported image, as its snapshot did on the source (an image
        has as many holders as tenants made it: one already others' here gains these). If a record fails, the
        nodes this import brought, which nobody may reach, go again."""
        ten = self.mgr.tenancy
        held = set(ten.owners.images.get(node_id, ()))
        try:
            for t in owners:
                await ten.own_image(t, node_id)
        except BaseException:
            brought = {n[:-len(".json")] for n in set(os.listdir(layers.nodes_dir())) - before if n.endswith(".json")}
            for t in (t for t in owners if t.name not in held):
                with contextlib.suppress(Exception):
                    await ten.disown_image(t, node_id)
            for nid in sorted(brought):
                if not ten.owners.images.get(nid):
                    with contextlib.suppress(Error):
                        await _run(layers.remove, nid, self._in_use()[0], force=True)
            raise

    # --- volumes -------------------------------------------------------------------------------

    def _users(self, name: str, tenant=None) -> list[str]:
        return [sb.id for sb in self._active() if (tenant is None or sb.tenant == tenant.name)
                and any(m.kind == "volume" and m.source == name for m in sb.spec.mounts)]

    async def _vol(self, request, name, fn, *args, **kw):
        """`fn(stored name, *args)` for the volume `name` as the request's tenant names it (its own only),
        errors naming it as the tenant does."""
        t = request.get("tenant")
        if t is None:
            return await _run(fn, name, *args, **kw)
        stored = self.mgr.tenancy.volume(t, name)
        try:
            return await _run(fn, stored, *args, **kw)
        except Error as e:
            raise self.mgr.tenancy.translate(t, e, stored, name) from None

    async def volumes(self, request):
        vols = await _run(volumes.list_volumes)
        t = request.get("tenant")
        if t is None:
            return web.json_response({"volumes": [{**v, "in_use": self._users(v["name"])} for v in vols]})
        out = []
        for v in vols:
            own = self.mgr.tenancy.volume_out(t, v["name"])
            if own is not None:
                out.append({**v, "name": own, "in_use": self._users(v["name"], t)})
        return web.json_response({"volumes": out})

    async def volume(self, request):
        body = await json_body(request, optional=True)
        t = request.get("tenant")
        name = check_volume_name(body.get("name")) if t is None else body.get("name")
        fn = volumes.create if body.get("create") else volumes.info
        if t is not None and body.get("create"):
            self.mgr.tenancy.volume(t, name)   # a bad name is refused before a store is made for it
            await _run(self.mgr.tenancy.volume_store, t)
        info = await self._vol(request, name, fn)
        stored = name if t is None else self.mgr.tenancy.volume(t, name)
        return web.json_response({**info, "name": name, "in_use": self._users(stored, t)})

    async def remove_volume(self, request):
        t = request.get("tenant")
        name = check_volume_name(request.match_info["name"]) if t is None else request.match_info["name"]
        stored = name if t is None else self.mgr.tenancy.volume(t, name)
        await self._vol(request, name, volumes.info)   # 404 first: whether it is in use says it exists
        users = self._users(stored, t)
        if users and not query_flag(request, "force"):
            raise StateError(f"volume {name!r} is mounted by running sandbox(es) {', '.join(users)}; terminate "
                             "them first, or pass --force (force=1) to remove it anyway (they see it emptied).")
        await self._vol(request, name, volumes.remove_volume)
        return web.Response(status=204)

    async def vol_list(self, request):
        entries = await self._vol(request, request.match_info["name"], volumes.list_dir, request.query.get("path", "/"))
        return web.json_response({"entries": entries})

    async def vol_read(self, request):
        fd, size = await self._vol(request, request.match_info["name"], volumes.open_read, query_path(request, "/data.csv"))
        return await send_fd(request, fd, size)

    async def vol_write(self, request):
        mode = query_mode(request)
        t = request.get("tenant")
        if t is not None:
            await self._vol(request, request.match_info["name"], volumes.info)   # an unknown one: 404 first
        data = await request.read()   # a volume file call: bounded by client_max_size
        if t is not None:
            self.mgr.tenancy.check_disk(t, len(data))
        try:
            await self._vol(request, request.match_info["name"], volumes.write, query_path(request, "/data.csv"), [data],
                            mode)
        except OSError as e:
            if t is None or e.errno not in (errno.EDQUOT, errno.ENOSPC):
                raise
            raise self.mgr.tenancy.disk_full(t, len(data)) from None   # its store is full: nothing was left
        return web.Response(status=204)

    async def vol_remove(self, request):
        await self._vol(request, request.match_info["name"], volumes.remove, query_path(request, "/data.csv"),
                        recursive=query_flag(request, "recursive"))
        return web.Response(status=204)


def add_routes(r: web.UrlDispatcher, mgr) -> None:
    h = StoreRoutes(mgr)
    r.add_post("/v1/sandboxes/{id}/snapshot", h.snapshot)
    r.add_post("/v1/images/nodes", h.put_node)
    r.add_post("/v1/images/prune", h.prune)
    r.add_post("/v1/images/import", h.import_)
    r.add_get("/v1/images/{key}", h.get_node)
    r.add_delete("/v1/images/{key}", h.remove)
    r.add_get("/v1/images/{key}/export", h.export)
    r.add_get("/v1/volumes", h.volumes)
    r.add_post("/v1/volumes", h.volume)
    r.add_delete("/v1/volumes/{name}", h.remove_volume)
    r.add_get("/v1/volumes/{name}/files/list", h.vol_list)
    r.add_get("/v1/volumes/{name}/files/read", h.vol_read)
    r.add_put("/v1/volumes/{name}/files/write", h.vol_write)
    r.add_post("/v1/volumes/{name}/files/remove", h.vol_remove)


__all__ = ["add_routes"]


_FLAG = {"type": "string", "enum": ["0", "1", "true", "false", "yes", "no"]}
_QUERY = {"path": {"type": "string", "minLength": 1}, "force": _FLAG, "recursive": _FLAG, "replace": _FLAG,
          "mode": {"type": "string", "pattern": "^[0-7]{1,4}$"}, "digest": {"type": "string", "pattern": "^[0-9a-f]{64}$"},
          "base": {"type": "string", "minLength": 1, "maxLength": 4096},
          "owner": {"type": "string", "minLength": 1}}
_STR = {"type": "string"}
_ENV = {"type": "object", "additionalProperties": {"type": "string"}}
_HEX64 = {"type": "string", "pattern": "^[0-9a-f]{64}$"}
_VOLUME_NAME = {"type": "string", "pattern": NAME_PATTERN}


def _op(summary: str, code: str = "200", body: str | None = None, query: tuple = (), schema: dict | None = None) -> dict:
    op: dict = {"summary": summary, "responses": {code: {"description": "ok"}}}
    if body == "json":
        op["requestBody"] = {"required": False, "content": {"application/json": {"schema": schema or {"type": "object"}}}}
    elif body:
        op["requestBody"] = {"required": True, "content": {body: {"schema": {"type": "string", "format": "binary"}}}}
    if query:
        op["parameters"] = [{"name": q.rstrip("?"), "in": "query", "required": q == "path",   # "path?": optional
                             "schema": _QUERY[q.rstrip("?")]} for q in query]
    return op


#: The OpenAPI operations of these routes (merged into openapi.OPERATIONS).
OPERATIONS = {
    ("post", "/v1/sandboxes/{id}/snapshot"): _op(
        "Freeze the sandbox's writable layer into an image", "201", "json",
        schema={"type": "object", "properties": {"name": {**_STR, "nullable": True}, "key": {**_HEX64, "nullable": True},
                                                 "env": _ENV, "workdir": {**_STR, "nullable": True},
                                                 "description": {**_STR, "nullable": True}}}),
    ("post", "/v1/images/nodes"): _op(
        "Record an image without a layer (env, workdir) or name/pin one", "201", "json",
        schema={"type": "object", "required": ["id", "parent"], "properties": {
            "id": _HEX64, "parent": _STR, "env": _ENV, "workdir": {**_STR, "nullable": True},
            "name": {**_STR, "nullable": True}, "description": {**_STR, "nullable": True}, "pinned": {"type": "boolean"},
            "kind": {"type": "string", "enum": ["step", "snapshot"]}}}),
    ("post", "/v1/images/prune"): _op("Remove unpinned build cache and unused layers"),
    ("post", "/v1/images/import"): _op("Import an image archive (tar); with digest, only the image of that digest; "
                                       "a dir: base only if named by base; a name of this host moves to the "
                                       "archive's image only with replace (409 otherwise; with digest it stays); owner "
                                       "(with digest, once per tenant): recorded as a holder of it",
                                       "201", "application/x-tar", query=("digest?", "base?", "replace", "owner?")),
    ("get", "/v1/images/{key}"): _op("One image (id, prefix or name), 404 unless every layer is present"),
    ("delete", "/v1/images/{key}"): _op("Remove an image", query=("force",)),
    ("get", "/v1/images/{key}/export"): _op("The image as a tar archive (its layers, not its base)"),
    ("get", "/v1/volumes"): _op("List volumes and the sandboxes that mount them"),
    ("post", "/v1/volumes"): _op("Look up (or with create: true, create) a volume", body="json",
                                 schema={"type": "object", "required": ["name"], "properties": {
                                     "name": _VOLUME_NAME, "create": {"type": "boolean"}}}),
    ("delete", "/v1/volumes/{name}"): _op("Remove a volume (refused while mounted unless force=1)", "204",
                                          query=("force",)),
    ("get", "/v1/volumes/{name}/files/list"): _op("List a directory of a volume (default /)", query=("path?",)),
    ("get", "/v1/volumes/{name}/files/read"): _op("Read a file of a volume", query=("path",)),
    ("put", "/v1/volumes/{name}/files/write"): _op("Write a file of a volume (temp file + rename)", "204",
                                                   "application/octet-stream", ("path", "mode")),
    ("post", "/v1/volumes/{name}/files/remove"): _op("Remove a file or directory of a volume", "204",
                                                     query=("path", "recursive")),
}
