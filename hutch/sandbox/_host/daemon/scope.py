"""What one request of a tenant may see and use (tenants.py says the rules; this applies them for the routes).

`Tenancy` is the daemon's state of `hutch serve --tenants`: the registry of the file, the accounts (quotas,
fair create slots), who owns which image and memory snapshot, the audit log. The routes call it with the
request's tenant (None: the operator, who sees everything as without tenants).

A tenant's view hides everything not its own behind the answer an unknown id gets: `hidden_*` raise that
same NotFoundError, and errors of the stores that name a tenant's stored volume or image name are given
back with its own name.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import os
import sys
from pathlib import Path

from hutch._core import paths
from hutch._core.atomic import atomic_write
from hutch._core.errors import ConfigError, Error, NotFoundError, QuotaExceededError, StateError
from hutch.sandbox._host import images, layers, volumes
from hutch.sandbox._host.daemon.tenants import NAME_RE as TENANT_NAME_RE
from hutch.sandbox._host.daemon.tenants import VOLUME_PREFIX, Accounts, Owners, Registry, Tenant, over_quota
from hutch.sandbox._host.daemon.volume_stores import VolumeStores
from hutch.sandbox._spec import VOLUME_NAME_RE

#: Disk use is recomputed at most this often (seconds) per tenant; writes in between are added to it.
DISK_TTL = 2.0
#: Seconds between charges of the egress gateway's byte counts to the tenants.
EGRESS_EVERY = 1.0
#: Seconds between updates of the tenants' volume stores' limits (to quota changes in the tenants file).
DISK_EVERY = 2.0


def unknown_image(key: str) -> NotFoundError:
    return NotFoundError(f"no image {key!r} on this host; list them with `hutch image ls`.")


def unknown_memsnap(sid: str) -> NotFoundError:
    return NotFoundError(f"no memory snapshot {sid}; list them with hutch.Snapshot.list().")


def egress_file() -> Path:
    """Where this daemon keeps its tenants' egress day: one file per daemon (its run dir names it), so that
    daemons sharing a state dir (fleet nodes on one host) do not overwrite each other's counts."""
    key = hashlib.sha256(str(paths.run_dir().absolute()).encode()).hexdigest()[:16]
    return paths.state_dir() / "tenant-egress" / f"{key}.json"


def import_owners(tenancy: "Tenancy | None", names: list[str], digest: str | None, what: str, source: str,
                  *, most: int | None = None) -> list[Tenant]:
    """The tenants an import's `?owner=NAME` (once per holder) names: a fleet moving a `what` its source records
    as theirs (the source's `source` route answers its digest and owners), checked before anything is read:
    only with a digest, at most `most` of them, and this daemon must serve tenants and know each of them. The
    image and the memory snapshot imports both ask here."""
    if not names:
        return []
    if digest is None:
        raise ConfigError(f"owner= goes with digest=: only {what} checked against its source's digest ({source} "
                          "answers both) is imported for a tenant.")
    if tenancy is None:
        raise ConfigError(f"owner={names[0][:80]!r}: this daemon serves no tenants, so it cannot keep {what} as a "
                          "tenant's; start it with --tenants FILE (`hutch fleet up --tenants FILE` for every "
                          "node), or import it without owner=.")
    most = len(tenancy.registry.by_name) if most is None else min(most, len(tenancy.registry.by_name))
    if len(names) > most:
        raise ConfigError(f"{len(names)} owner= values, more than {what} may have here ({most}); name each "
                          "holder once.")
    out = []
    for name in dict.fromkeys(names):
        t = tenancy.registry.get(name)
        if t is None:
            raise ConfigError(f"owner={name[:80]!r} is no tenant of this daemon's tenants file; add it (`hutch "
                              "tenant add`) with the same file on every node, then import again.")
        out.append(t)
    return out


def tenant_of_name(name: str) -> str | None:
    """The tenant whose namespace the image or volume name `name` is in (t.TENANT.NAME), else None."""
    if not name.startswith(VOLUME_PREFIX):
        return None
    tenant, dot, _ = name[len(VOLUME_PREFIX):].partition(".")
    return tenant if dot and TENANT_NAME_RE.match(tenant) else None


def import_name_check(owners: list[Tenant]):
    """archive.import_'s `name_check` for an import for `owners`: a name in a tenant's namespace (t.T.NAME, the
    image T calls NAME) comes in only with T among the owners. Else the operator's import would give T's name
    to content T never made (with replace, moving it off T's own image): a tenant's names are its own."""
    allowed = {t.name for t in owners}

    def check(name: str) -> None:
        tenant = tenant_of_name(name)
        if tenant is not None and tenant not in allowed:
            raise StateError(
                f"the archive names an image {name!r}, a name of tenant {tenant!r} (the image it calls "
                f"{name[len(VOLUME_PREFIX) + len(tenant) + 1:]!r}); an import gives a tenant's name only to an image "
                f"imported for that tenant (owner={tenant} with the digest= its source answers), so nothing was "
                "imported. Import it for the tenant, or give the image another name where it was exported.")
    return check


class Tenancy:
    def __init__(self, registry: Registry):
        self.registry = registry
        self.accounts = Accounts()
        self.owners = Owners(paths.state_dir() / "tenant-owners.json")
        self._relayed: dict[str, int] = {}   # sandbox id -> the gateway's count at its last charge
        self._cut: set[str] = set()          # sandboxes whose network was cut for their tenant's egress quota
        self._disk: dict[str, tuple[float, int]] = {}
        self._exports: dict[str, asyncio.Lock] = {}
        self.stores = VolumeStores()
        self.stores.start({n: t.quotas.disk for n, t in registry.by_name.items()})
        self.egress_file = egress_file()
        old = paths.state_dir() / "tenant-egress.json"   # where hutch kept them before (one file per state dir)
        source = self.egress_file if self.egress_file.exists() or not old.exists() else old
        why = self.accounts.load_egress(source)
        if why is not None:
            print(f"hutch daemon: {source} is ignored, every tenant's egress day starts afresh: {why}",
                  file=sys.stderr, flush=True)

    def export_lock(self, t: Tenant | None):
        """One export at a time per tenant. An export spools its archive on the host's disk first (to answer its
        size, or a clean error, before a byte goes out): one at a time, a tenant's spools stay within one image or
        snapshot it may use, not as many copies as it opens requests. The operator's are not bounded."""
        if t is None:
            return contextlib.nullcontext()
        return self._exports.setdefault(t.name, asyncio.Lock())

    def _write_egress(self, data: bytes) -> None:
        try:
            self.egress_file.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            atomic_write(self.egress_file, data, mode=0o600)
        except OSError as e:
            self.accounts.egress_dirty = True   # tried again at the next tick
            print(f"hutch daemon: could not save the tenants' egress counts to {self.egress_file}: {e}",
                  file=sys.stderr, flush=True)

    async def save(self) -> None:
        """Persist what a restart must keep (the last day's egress counts), atomically, off the event loop."""
        data = self.accounts.egress_doc()
        if data is not None:
            await asyncio.to_thread(self._write_egress, data)

    def close(self) -> None:
        """At the daemon's stop, once its sandboxes have ended (their last egress charged)."""
        data = self.accounts.egress_doc()
        if data is not None:
            self._write_egress(data)
        self.stores.close()

    # --- images ----------------------------------------------------------------------------------------

    def image_name(self, t: Tenant, name: str) -> str:
        return f"{VOLUME_PREFIX}{t.name}.{name}"

    def _shared_ids(self, t: Tenant) -> set[str]:
        out = set()
        for ref in t.images:
            try:
                out.add(images.resolve_image(ref).id)
            except Error:
                continue
        return out

    def may_use(self, t: Tenant, node_id: str) -> bool:
        return t.name in self.owners.images.get(node_id, ()) or node_id in self._shared_ids(t)

    def find_image(self, t: Tenant, key: str, *, own: bool = False) -> dict:
        """The image node `key` names for `t` (its own name, an id or id prefix of one it may use)."""
        try:
            if VOLUME_NAME_RE.match(key) and not key.startswith(layers.PREFIX):
                try:
                    return self._check(t, layers.find(self.image_name(t, key)), own)
                except NotFoundError:
                    pass
            node = layers.find(key[len(layers.PREFIX):] if key.startswith(layers.PREFIX) else key)
        except NotFoundError:
            raise unknown_image(key) from None
        except ConfigError:   # an ambiguous prefix would say that others' images exist
            raise unknown_image(key) from None
        try:
            return self._check(t, node, own)
        except NotFoundError:
            raise unknown_image(key) from None

    def _check(self, t: Tenant, node: dict, own: bool) -> dict:
        owned = t.name in self.owners.images.get(node["id"], ())
        if owned or (not own and node["id"] in self._shared_ids(t)):
            return node
        raise NotFoundError(node["id"])

    def image_ref(self, t: Tenant, ref: str) -> str:
        """The image reference a tenant's create may use: the default image, a shared one, or its own."""
        if ref == images.DEBIAN_SLIM:
            return ref
        if ref.startswith("dir:"):
            raise ConfigError(f"image {ref!r} is a directory of the host, which a tenant may not use; use the "
                              "default image, one the operator shares with you, or a snapshot of your own.")
        shared = {r for r in t.images}
        if ref in shared:
            return ref
        return layers.PREFIX + self.find_image(t, ref)["id"]

    def list_images(self, t: Tenant, items: list[dict]) -> list[dict]:
        shared, prefix = self._shared_ids(t), self.image_name(t, "")
        out = []
        for i in items:
            if i.get("kind") == "base" or i["id"] in shared or t.name in self.owners.images.get(i["id"], ()):
                name = i.get("name")
                if name and name.startswith(prefix):
                    i = {**i, "name": name[len(prefix):]}
                elif name and name.startswith(VOLUME_PREFIX):
                    i = {**i, "name": None}
                out.append(i)
        return out

    async def own_image(self, t: Tenant, node_id: str) -> None:
        """Record `t` as a holder of the image (in the ownership file every daemon of the state dir shares)."""
        await asyncio.to_thread(self.owners.own, "images", node_id, t.name)
        self._disk.pop(t.name, None)

    async def disown_image(self, t: Tenant, node_id: str) -> bool:
        """Drop `t`'s claim on the image; True if nobody else holds one (so it may be removed)."""
        try:
            return await asyncio.to_thread(self.owners.disown, "images", node_id, t.name)
        finally:
            self._disk.pop(t.name, None)

    async def own_memsnap(self, t: Tenant, sid: str, image: str | None = None) -> None:
        """Record `t` as the maker of memory snapshot `sid`, and `image`: the image its source showed `t` (as `t`
        named it), which its restores show too."""
        await asyncio.to_thread(self.owners.own, "memsnaps", sid, t.name, image)

    async def drop_memsnap(self, sid: str) -> None:
        if sid in self.owners.memsnaps:
            await asyncio.to_thread(self.owners.disown, "memsnaps", sid)

    # --- memory snapshots ----------------------------------------------------------------------------------

    def check_memsnap(self, t: Tenant, sid: str) -> None:
        if self.owners.memsnaps.get(sid) != t.name:
            from hutch.sandbox._host.gvisor import snapshots
            snapshots.path_of(sid)   # a malformed id is refused as for anyone
            raise unknown_memsnap(sid)

    # --- volumes -------------------------------------------------------------------------------------------

    def volume(self, t: Tenant, name) -> str:
        if not isinstance(name, str) or not VOLUME_NAME_RE.match(name) or len(t.volume(name)) > 63:
            raise ConfigError(f"volume name {name!r} must be 1-{62 - len(t.volume(''))} letters, digits, '_', '.', "
                              "'-', starting with a letter or digit.")
        return t.volume(name)

    def volume_out(self, t: Tenant, stored: str) -> str | None:
        p = t.volume("")
        return stored[len(p):] if stored.startswith(p) else None

    def translate(self, t: Tenant, e: Error, stored: str, name: str) -> Error:
        """`e` with the stored name of a tenant's volume or image replaced by its own."""
        msg = str(e).replace(stored, name)
        if msg == str(e):
            return e
        try:
            e2 = type(e)(msg)
        except TypeError:
            return e
        return e2

    # --- specs ---------------------------------------------------------------------------------------------

    def spec_for(self, t: Tenant, spec):
        """`spec` as the daemon runs it for `t`: no host binds, its own volumes, an image it may use."""
        mounts = []
        for m in spec.mounts:
            if m.kind == "bind":
                raise ConfigError(f"mount {m.target}: a tenant may not bind a host path ({m.source}) into a sandbox "
                                  "(that includes memory mounts, which are host directories); use a volume "
                                  "(hutch.Volume) or files.write.")
            if m.kind == "volume":
                m = dataclasses.replace(m, source=self.volume(t, m.source))
            mounts.append(m)
        return dataclasses.replace(spec, mounts=tuple(mounts), image=self.image_ref(t, spec.image))

    def shown_spec(self, t: Tenant, spec, like=None) -> dict:
        """`spec` (as the daemon runs it for `t`: a fork's or a restore's) as `t` gave it: its volumes by its own
        names; with `like` (a fork's source's shown spec, or {"image": ...} a restore's snapshot recorded), the
        source's image as it named it (a copy runs an image node of the snapshot, which the daemon names by its
        id)."""
        d = spec.to_dict()
        p = t.volume("")
        d["mounts"] = [{**m, "source": m["source"][len(p):]} if m.get("kind") == "volume" and
                       str(m.get("source", "")).startswith(p) else m for m in d["mounts"]]
        if like is not None and "image" in like:
            d["image"] = like["image"]
        return d

    # --- egress ------------------------------------------------------------------------------------------

    def charge_egress(self, mgr, sb) -> None:
        """Charge `sb`'s tenant what the gateway moved for it since the last charge."""
        if sb.tenant is None or mgr.network is None or not hasattr(mgr.network, "relayed"):
            return
        now = mgr.network.relayed(sb.id)
        seen = self._relayed.get(sb.id, 0)
        if now > seen:
            self.accounts.charge_egress(sb.tenant, now - seen)
            self._relayed[sb.id] = now

    async def egress_loop(self, mgr) -> None:
        """Every EGRESS_EVERY seconds: charge every tenant sandbox's egress; a tenant past its egress quota has
        its sandboxes' network set to none (the daemon's log says so); it may give them a network again (PUT
        .../network) and create sandboxes once its use of the last 24 hours falls under the quota."""
        from hutch.sandbox._spec import Network

        while True:
            await asyncio.sleep(EGRESS_EVERY)
            await self.end_removed(mgr)
            live = [s for s in mgr.sandboxes.values() if s.active and s.tenant is not None and s.spec is not None]
            for sb in live:
                self.charge_egress(mgr, sb)
            self._relayed = {k: v for k, v in self._relayed.items() if k in mgr.sandboxes}
            await self.save()
            for sb in live:
                t = self.registry.get(sb.tenant)
                q = t.quotas.egress_bytes_per_day if t is not None else None
                if q is None or sb.spec.network.mode == "none":
                    continue
                if self.accounts.egress_used(t.name) < q:
                    self._cut.discard(sb.id)
                elif sb.id not in self._cut:
                    self._cut.add(sb.id)
                    try:
                        await mgr.network.update(sb.id, Network.none(), keep_link=sb.gv is not None)
                        print(f"hutch daemon: tenant {t.name} is over its egress quota ({q} bytes a day): sandbox "
                              f"{sb.id}'s network is now none", file=sys.stderr, flush=True)
                    except Exception as e:  # noqa: BLE001 - it may have ended meanwhile
                        print(f"hutch daemon: could not cut sandbox {sb.id}'s network: {e}", file=sys.stderr)

    async def end_removed(self, mgr) -> None:
        """Terminate the sandboxes of tenants removed from the tenants file (`hutch tenant rm`: its "removed").
        Their token stopped working, so nobody could reach them but the operator, while they kept running on
        the host, holding its memory and CPU and their network. Seen within EGRESS_EVERY of the change."""
        self.registry.refresh()
        gone = [s for s in mgr.sandboxes.values() if s.active and s.tenant in self.registry.removed]
        for sb in gone:
            print(f"hutch daemon: tenant {sb.tenant} was removed: its sandbox {sb.id} is terminated",
                  file=sys.stderr, flush=True)
            try:
                await asyncio.shield(mgr.end(sb, "terminated"))
            except Exception as e:  # noqa: BLE001 - the next tick tries again
                print(f"hutch daemon: could not terminate sandbox {sb.id}: {e}", file=sys.stderr, flush=True)

    # --- quotas --------------------------------------------------------------------------------------------

    def live(self, mgr, t: Tenant) -> list:
        return [s for s in mgr.sandboxes.values()
                if s.active and s.tenant == t.name and s.spec is not None and not s.reserved]

    def image_bytes(self, t: Tenant) -> int:
        total = 0
        for nid, owners in list(self.owners.images.items()):
            if t.name in owners:
                try:
                    total += layers.layer_size(layers.get_node(nid).get("layer"))
                except Error:
                    continue
        return total

    def disk_used(self, t: Tenant, fresh: bool = False) -> int:
        import time
        hit = self._disk.get(t.name)
        if hit and not fresh and time.monotonic() - hit[0] < DISK_TTL:
            return hit[1]
        total = self.image_bytes(t)
        prefix = t.volume("")
        for home in (volumes.volumes_dir(), volumes.store_dir(t.name)):
            if home.is_dir():
                for d in home.iterdir():
                    if d.name.startswith(prefix):
                        total += _du(d)
        self._disk[t.name] = (time.monotonic(), total)
        return total

    def check_disk(self, t: Tenant, more: int = 0) -> None:
        q = t.quotas.disk
        if q is None:
            return
        used = self.disk_used(t, fresh=True)
        if used + more > q:
            raise over_quota(t, "disk", q, used, "bytes of images and volumes", more)

    def disk_full(self, t: Tenant, more: int = 0) -> QuotaExceededError:
        """The error of a volume write that its store refused (EDQUOT: the disk quota, as the filesystem counts)."""
        q = t.quotas.disk
        return over_quota(t, "disk", q if q is not None else 0, self.disk_used(t, fresh=True),
                          "bytes of images and volumes", more)

    # --- volume stores: the filesystem bounds a tenant's volumes by its disk quota as they are written --------

    def volume_store(self, t: Tenant) -> None:
        """Make sure `t`'s volume store is mounted and limited (blocking)."""
        self.stores.ensure(t.name, t.quotas.disk)
        self.sync_disk(t)

    def sync_disk(self, t: Tenant) -> None:
        """Set `t`'s volume store's limit to its disk quota less its images (blocking; cheap if unchanged)."""
        if t.name not in self.stores.roots:
            return
        q = t.quotas.disk
        self.stores.limit(t.name, None if q is None else q - self.image_bytes(t), q)

    async def disk_loop(self) -> None:
        """Every DISK_EVERY seconds: the stores' limits follow the tenants file's quotas and the images."""
        while True:
            await asyncio.sleep(DISK_EVERY)
            for name in list(self.stores.roots):
                t = self.registry.get(name)
                if t is not None:
                    try:
                        await asyncio.to_thread(self.sync_disk, t)
                    except OSError as e:
                        print(f"hutch daemon: cannot limit tenant {name}'s volume store: {e}", file=sys.stderr)

    def use(self, mgr, t: Tenant) -> dict:
        live = self.live(mgr, t)
        return {"sandboxes": len(live), "cpu": round(sum(s.spec.limits.cpu for s in live), 3),
                "memory": sum(s.spec.limits.memory for s in live), "disk": self.disk_used(t, fresh=True),
                "egress_bytes_per_day": self.accounts.egress_used(t.name)}

    async def admit(self, mgr, t: Tenant | None, n: int, cpu: float, memory: int, make):
        """Run `make()` (a create, fork or restore: a coroutine function) within `t`'s quotas and a fair slot;
        shielded once admitted (a client hanging up must not leave it half-made)."""
        acc = self.accounts
        who = t.name if t is not None else ""   # the operator's creates share the slots as a tenant's do
        ticket = acc.reserve(t, self.live(mgr, t), n, cpu, memory) if t is not None else None
        try:
            await acc.slot(who)
        except BaseException:
            if ticket:
                acc.release(ticket)
            raise

        async def run():
            try:
                made = await make()
                for sb in made if isinstance(made, list) else [made]:
                    sb.reserved = False   # counted as live from now on, as its reservation goes
                return made
            finally:
                acc.free(who)
                if ticket:
                    acc.release(ticket)
        return await asyncio.shield(run())



def _du(root: Path) -> int:
    total = 0
    stack = [str(root)]
    while stack:
        try:
            with os.scandir(stack.pop()) as it:
                for e in it:
                    try:
                        if e.is_dir(follow_symlinks=False):
                            stack.append(e.path)
                        else:
                            total += e.stat(follow_symlinks=False).st_blocks * 512
                    except OSError:
                        continue
        except OSError:
            continue
    return total


__all__ = ["QuotaExceededError", "Tenancy", "unknown_image", "unknown_memsnap"]
