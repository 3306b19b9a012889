"""Tenants of one daemon (`hutch serve --tenants FILE`): who a request is, what it may see, what it may use.

The tenants file (JSON, root's, mode 0600; anything readable by others is refused):

    {"tenants": {"acme": {"token_sha256": "<64 hex>", "quotas": {"sandboxes": 10, "cpu": 8, "memory": "16G",
                          "disk": "20G", "creates_per_second": 5, "egress_bytes_per_day": "1G"},
                          "images": ["python-base"]}}}

holds the SHA-256 of each tenant's token, never the token (`hutch tenant add` prints it once), and under
"removed" the names of removed tenants, never given again (`remove`: what a tenant owned is recorded by its
name, so a new tenant of that name would take it over). The daemon
rereads the file when it changes (its inode, size or mtime), so `hutch tenant rotate|set|rm` take effect at
the next request; a file that turns bad is refused in the log and the last good one stays in force.

A tenant sees only what is its own: sandboxes it made (and their forks and restores), the images and memory
snapshots it made, its volumes (stored under a name of its own, `t.<tenant>.<name>`), and uses besides the
default image only the images the file shares with it. Another tenant's id answers exactly as an unknown id.
Routes are default-deny: `ROUTES` names what a tenant may call; anything else answers as an unknown route.

Quotas (all optional; absent: unlimited): `sandboxes` live at once, the sums of their `cpu` and `memory`
limits, `disk` (bytes of its images' layers and its volumes), `creates_per_second` (a token bucket, bursts
of one second's worth, at least one), `egress_bytes_per_day` (a sliding day of the egress gateway's
counters). Over one: QuotaExceededError (HTTP 429) naming the quota, its limit and the use; checked before
anything is made, and creates in flight are reserved, so concurrent creates cannot race past a limit.

Creates are admitted through `SLOTS` fair slots, shared max-min fairly between the tenants with creates
running or waiting: each gets what it asks up to an equal share, the rest goes to those that want more, and
slots freed go to waiting tenants in turn (round-robin). A tenant within its share never waits for another's
creates, so one tenant's burst queues behind its own requests, not in front of others'.
"""

from __future__ import annotations

import asyncio
import fcntl
import hashlib
import json
import os
import re
import secrets
import stat
import sys
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

from hutch._core import paths
from hutch._core.atomic import atomic_write
from hutch._core.errors import ConfigError, DaemonError, QuotaExceededError
from hutch.sandbox._spec import parse_size

NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_-]{0,31}\Z")
#: Largest tenants file read.
MAX_FILE = 4 << 20
#: Largest ownership file (state_dir()/tenant-owners.json) read or written: some 100,000 records.
MAX_OWNERS = 16 << 20
#: Creates run at once (the rest wait, shared fairly between tenants: Accounts.slot): more than two per core
#: adds latency, not throughput (a create is CPU work of the daemon, its zygote and the init).
SLOTS = max(4, 2 * (os.cpu_count() or 1))
#: Where `hutch tenant` edits and `hutch serve --tenants` reads by default.
DEFAULT_FILE = Path("/etc/hutch/tenants.json")
#: A tenant's volumes are stored as VOLUME_PREFIX + tenant + "." + its name for them.
VOLUME_PREFIX = "t."
DAY = 86400.0
#: Seconds a slot is kept for a tenant after it asked for one (while it runs no create: between its creates).
RECENT = 1.0
#: Seconds of one bucket of a tenant's egress counts (what the day's sliding window moves by).
EGRESS_BUCKET = 60

# What a tenant may call (method, route as the app names it): "own" routes are scoped to what is its own,
# "open" ones carry no id. Everything else (doctor, the image store's writes, imports) is the operator's.
ROUTES = {
    ("GET", "/v1/health"): "open", ("GET", "/v1/openapi.json"): "open", ("GET", "/v1/tenant"): "open",
    ("POST", "/v1/sandboxes"): "own", ("GET", "/v1/sandboxes"): "own",
    **{(m, "/v1/sandboxes/{id}" + p): "own" for m, p in (
        ("GET", ""), ("POST", "/terminate"), ("POST", "/wait"), ("POST", "/pause"), ("POST", "/resume"),
        ("POST", "/snapshot-memory"), ("POST", "/fork"), ("GET", "/lease"), ("POST", "/exec"), ("GET", "/exec/pty"),
        ("POST", "/exec/{eid}/stdin"), ("POST", "/exec/{eid}/kill"), ("POST", "/exec/{eid}/wait"),
        ("GET", "/files/read"), ("PUT", "/files/write"), ("GET", "/files/list"), ("GET", "/files/stat"),
        ("POST", "/files/remove"), ("POST", "/files/mkdir"), ("PUT", "/network"), ("GET", "/network/log"),
        ("POST", "/snapshot"))},
    ("GET", "/v1/memory-snapshots"): "own", ("GET", "/v1/memory-snapshots/{sid}"): "own",
    ("DELETE", "/v1/memory-snapshots/{sid}"): "own", ("POST", "/v1/memory-snapshots/{sid}/restore"): "own",
    ("POST", "/v1/images/ensure"): "own", ("GET", "/v1/images"): "own", ("GET", "/v1/images/{key}"): "own",
    ("DELETE", "/v1/images/{key}"): "own", ("GET", "/v1/images/{key}/export"): "own",
    ("GET", "/v1/volumes"): "own", ("POST", "/v1/volumes"): "own", ("DELETE", "/v1/volumes/{name}"): "own",
    ("GET", "/v1/volumes/{name}/files/list"): "own", ("GET", "/v1/volumes/{name}/files/read"): "own",
    ("PUT", "/v1/volumes/{name}/files/write"): "own", ("POST", "/v1/volumes/{name}/files/remove"): "own",
}


@dataclass(frozen=True)
class Quotas:
    """A tenant's limits; None: unlimited."""

    sandboxes: int | None = None
    cpu: float | None = None
    memory: int | None = None
    disk: int | None = None
    creates_per_second: float | None = None
    egress_bytes_per_day: int | None = None

    @classmethod
    def from_dict(cls, d, where: str) -> "Quotas":
        if not isinstance(d, dict):
            raise ConfigError(f"{where}: quotas must be an object of {', '.join(cls.names())}.")
        unknown = set(d) - set(cls.names())
        if unknown:
            raise ConfigError(f"{where}: unknown quota {sorted(unknown)[0]!r}; the quotas are {', '.join(cls.names())}.")
        return cls(**{k: _quota_value(k, v, where) for k, v in d.items()})

    @staticmethod
    def names() -> tuple[str, ...]:
        return tuple(f.name for f in fields(Quotas))

    def to_dict(self) -> dict:
        return {k: v for k, v in ((f.name, getattr(self, f.name)) for f in fields(self)) if v is not None}

    def with_pairs(self, pairs) -> "Quotas":
        """These quotas changed by `k=v` strings (v `none` or `-` removes the limit)."""
        d = self.to_dict()
        for p in pairs:
            k, sep, v = p.partition("=")
            if not sep:
                raise ConfigError(f"--quota {p!r} must be NAME=VALUE, like sandboxes=10 or memory=16G.")
            if v.strip().lower() in ("none", "-", ""):
                d.pop(k, None)
                if k not in self.names():
                    raise ConfigError(f"unknown quota {k!r}; the quotas are {', '.join(self.names())}.")
            else:
                d[k] = v
        return Quotas.from_dict(d, "--quota")


def _quota_value(k: str, v, where: str):
    if v is None:
        return None
    what = f"{where}: quota {k}"
    if k in ("memory", "disk", "egress_bytes_per_day"):
        return parse_size(v, what)
    try:
        n = float(v) if not isinstance(v, bool) else -1.0
    except (TypeError, ValueError):
        n = -1.0
    if k == "sandboxes":
        if n != int(n) or n < 0 or n > 1 << 20:
            raise ConfigError(f"{what}={v!r} must be a whole number of sandboxes, 0 or more.")
        return int(n)
    if not 0 < n <= 1 << 20:
        raise ConfigError(f"{what}={v!r} must be a positive number" + (" of CPUs." if k == "cpu" else " per second."))
    return n


@dataclass(frozen=True)
class Tenant:
    name: str
    token_sha256: str
    quotas: Quotas = Quotas()
    images: tuple[str, ...] = ()

    def to_dict(self) -> dict:
        d = {"token_sha256": self.token_sha256, "quotas": self.quotas.to_dict()}
        if self.images:
            d["images"] = list(self.images)
        return d

    def volume(self, name: str) -> str:
        """The store's name of this tenant's volume `name`."""
        return f"{VOLUME_PREFIX}{self.name}.{name}"


def digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def check_name(name) -> str:
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise ConfigError(f"tenant name {name!r} must be 1-32 lowercase letters, digits, '_' or '-', starting "
                          "with a letter or digit.")
    return name


# --- the file ---------------------------------------------------------------------------------------------


def read_file(path: str | os.PathLike) -> dict[str, Tenant]:
    """The tenants of `path`; a ConfigError naming the fix for a file that is not root's and private, or bad."""
    return read_doc(path)[0]


def _own_directory(p: Path) -> None:
    """The tenants file's directory, and those above it, are root's and writable by no other user (a sticky one,
    /tmp, may be): else its owner renames the file away and back, e.g. an older copy in which a removed tenant or
    a rotated token works again, or one with a tenant of their own."""
    paths.owned_by_root(p.absolute().parent, "--tenants / --file (/etc/hutch/tenants.json, say)",
                        sticky=True)


def read_doc(path: str | os.PathLike) -> tuple[dict[str, Tenant], tuple[str, ...]]:
    """The tenants of `path` and the names of those removed (never given again: see `remove`)."""
    p = Path(path)
    _own_directory(p)
    try:
        fd = os.open(p, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        raise ConfigError(f"tenants file {p}: cannot read it ({e.strerror}); make one with `hutch tenant add NAME "
                          f"--file {p}`.") from e
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"tenants file {p} is not a regular file.")
        if st.st_uid != 0:
            raise ConfigError(f"tenants file {p} is owned by uid {st.st_uid}, not root; whoever may change it chooses "
                              f"who drives the daemon: `chown root:root {p}`.")
        if st.st_mode & 0o077:
            raise ConfigError(f"tenants file {p} may be read or written by other users (mode "
                              f"{stat.S_IMODE(st.st_mode):04o}); `chmod 600 {p}`.")
        data = os.read(fd, MAX_FILE + 1)
    finally:
        os.close(fd)
    if len(data) > MAX_FILE:
        raise ConfigError(f"tenants file {p} is larger than {MAX_FILE} bytes.")
    return parse_doc(data, str(p))


def parse(data: bytes, where: str) -> dict[str, Tenant]:
    return parse_doc(data, where)[0]


def parse_doc(data: bytes, where: str) -> tuple[dict[str, Tenant], tuple[str, ...]]:
    try:
        doc = json.loads(data.decode("utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise ConfigError(f"tenants file {where} is not JSON ({e}); fix it or rewrite it with `hutch tenant`.") from e
    if not isinstance(doc, dict) or set(doc) - {"tenants", "removed"} or not isinstance(doc.get("tenants", {}), dict) \
            or not isinstance(doc.get("removed", []), list):
        raise ConfigError(f'tenants file {where} must be {{"tenants": {{NAME: {{"token_sha256": ..., "quotas": '
                          '{...}, "images": [...]}}}}, "removed": [NAME, ...]} (docs/tenants.md).')
    removed = tuple(dict.fromkeys(check_name(n) for n in doc.get("removed", [])))
    out: dict[str, Tenant] = {}
    seen: set[str] = set()
    for name, d in doc.get("tenants", {}).items():
        w = f"tenants file {where}: tenant {name!r}"
        check_name(name)
        if not isinstance(d, dict) or set(d) - {"token_sha256", "quotas", "images"}:
            raise ConfigError(f"{w} must be an object of token_sha256, quotas and images.")
        h = d.get("token_sha256")
        if not isinstance(h, str) or not re.fullmatch(r"[0-9a-f]{64}", h):
            raise ConfigError(f"{w}: token_sha256 must be 64 hex digits (`hutch tenant rotate {name}` makes a new token).")
        if h in seen:
            raise ConfigError(f"{w} has the same token as another tenant; `hutch tenant rotate {name}`.")
        seen.add(h)
        imgs = d.get("images", [])
        if not isinstance(imgs, list) or not all(isinstance(i, str) and 0 < len(i) <= 200 for i in imgs):
            raise ConfigError(f"{w}: images must be a list of image names or ids shared with it.")
        out[name] = Tenant(name, h, Quotas.from_dict(d.get("quotas", {}), w), tuple(imgs))
    again = sorted(set(out) & set(removed))
    if again:
        raise ConfigError(f"tenants file {where}: tenant {again[0]!r} was removed (it is in \"removed\"), and a removed "
                          "name is never given again: what it owned (sandboxes, images, memory snapshots, volumes) is "
                          "recorded by its name, so a new tenant of that name would take it over. Give the tenant "
                          "another name.")
    return out, removed


def write_file(path: str | os.PathLike, tenants: dict[str, Tenant], removed=()) -> None:
    """Replace the tenants file (root's, 0600), its directory made 0700 if missing."""
    p = Path(path)
    _own_directory(p)   # before anything is made there
    p.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    doc = {"tenants": {n: t.to_dict() for n, t in sorted(tenants.items())}}
    if removed:
        doc["removed"] = list(removed)
    atomic_write(p, (json.dumps(doc, indent=2) + "\n").encode(), mode=0o600)


def load_or_empty(path: str | os.PathLike) -> dict[str, Tenant]:
    return read_file(path) if os.path.lexists(path) else {}


def _load_doc(path) -> tuple[dict[str, Tenant], tuple[str, ...]]:
    return read_doc(path) if os.path.lexists(path) else ({}, ())


def new_token() -> str:
    return "hutch_" + secrets.token_urlsafe(32)


def add(path, name: str, quotas: Quotas, images=()) -> str:
    """Add tenant `name`; returns its token (the file keeps only its digest)."""
    ts, removed = _load_doc(path)
    check_name(name)
    if name in ts:
        raise ConfigError(f"tenant {name!r} exists already; change it with `hutch tenant set {name}` or give its "
                          f"token anew with `hutch tenant rotate {name}`.")
    if name in removed:
        raise ConfigError(f"tenant {name!r} was removed, and a removed name is never given again: what it owned "
                          "(sandboxes, images, memory snapshots, volumes) is recorded by its name, so a new tenant of "
                          "that name would take it over; give the new tenant another name (docs/tenants.md).")
    token = new_token()
    ts[name] = Tenant(name, digest(token), quotas, tuple(images))
    write_file(path, ts, removed)
    return token


def _existing(ts: dict, name: str, path) -> Tenant:
    if name not in ts:
        raise ConfigError(f"no tenant {name!r} in {path}; `hutch tenant ls --file {path}` lists them.")
    return ts[name]


def set_(path, name: str, quota_pairs=(), images=None) -> Tenant:
    ts, removed = read_doc(path)
    t = _existing(ts, name, path)
    t = replace(t, quotas=t.quotas.with_pairs(quota_pairs), images=tuple(images) if images is not None else t.images)
    ts[name] = t
    write_file(path, ts, removed)
    return t


def rotate(path, name: str) -> str:
    ts, removed = read_doc(path)
    t = _existing(ts, name, path)
    token = new_token()
    ts[name] = replace(t, token_sha256=digest(token))
    write_file(path, ts, removed)
    return token


def remove(path, name: str) -> None:
    """Remove tenant `name`: its token stops working, and its name goes to the file's "removed", never to be given
    again. Everything it owned is recorded by its name (its sandboxes, the ownership file's images and memory
    snapshots, its volumes `t.<name>.*` and their store), so a new tenant of the same name would have taken it
    over; the operator still sees all of it and removes what is no longer wanted."""
    ts, removed = read_doc(path)
    _existing(ts, name, path)
    del ts[name]
    write_file(path, ts, (*removed, name))


class Registry:
    """The daemon's view of the tenants file, reread when it changes (see the module docstring)."""

    def __init__(self, path: str | os.PathLike, log=None):
        self.path = Path(path)
        self.log = log
        self.by_name, self.removed = read_doc(self.path)   # a bad file at start is the operator's error, raised
        self._index()
        self._stamp = self._stat()
        self._checked = 0.0

    def _index(self) -> None:
        self.by_digest = {t.token_sha256: t for t in self.by_name.values()}

    def _stat(self):
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return (st.st_ino, st.st_size, st.st_mtime_ns, st.st_mode, st.st_uid)

    def refresh(self) -> None:
        stamp = self._stat()
        if stamp == self._stamp:
            return
        self._stamp = stamp
        try:
            self.by_name, self.removed = read_doc(self.path)
        except ConfigError as e:
            if self.log is not None:
                self.log.note("tenants-file", f"hutch daemon: the tenants file changed and is refused, the last "
                                              f"good one stays in force: {e}")
            return
        self._index()

    def lookup(self, header: str | None) -> Tenant | None:
        """The tenant whose token `header` ("Bearer <token>") carries, or None."""
        if not header or not header.startswith("Bearer "):
            return None
        self.refresh()
        return self.by_digest.get(digest(header[7:]))

    def get(self, name: str) -> Tenant | None:
        return self.by_name.get(name)


# --- quotas and fair admission ------------------------------------------------------------------------------


@dataclass
class _Account:
    tokens: float = 0.0
    stamp: float = 0.0
    reserved: list = field(default_factory=lambda: [0, 0.0, 0])   # creates in flight: count, cpu, memory
    egress: deque = field(default_factory=deque)                 # [bucket start, bytes] charged, a sliding day
    egress_total: int = 0
    waiting: deque = field(default_factory=deque)                # futures of creates waiting for a slot


class Accounts:
    """Per-tenant accounts: create reservations, the create rate, egress, and the fair create slots."""

    def __init__(self, slots: int = SLOTS):
        self.accounts: dict[str, _Account] = {}
        self.slots = slots
        self.inflight: dict[str, int] = {}   # creates running, by tenant
        self.seen: dict[str, float] = {}     # when each tenant last asked for a slot (monotonic)
        self._timer = None
        self.turn: OrderedDict[str, None] = OrderedDict()   # tenants with creates waiting, in round-robin order
        self.egress_dirty = False

    def account(self, name: str) -> _Account:
        a = self.accounts.get(name)
        if a is None:
            a = self.accounts[name] = _Account(stamp=time.monotonic())
            a.tokens = -1.0   # filled at its first use
        return a

    def reserve(self, tenant: Tenant, live: list, n: int, cpu: float, memory: int) -> tuple:
        """Check `n` new sandboxes of `cpu` and `memory` each against `tenant`'s quotas, counting `live` (its
        active sandboxes' limits) and the creates in flight; reserve them (QuotaExceededError if over)."""
        q, a = tenant.quotas, self.account(tenant.name)
        r = a.reserved
        if q.sandboxes is not None and len(live) + r[0] + n > q.sandboxes:
            raise over_quota(tenant, "sandboxes", q.sandboxes, len(live) + r[0], "live sandboxes", n)
        if q.cpu is not None:
            used = sum(s.spec.limits.cpu for s in live) + r[1]
            if used + n * cpu > q.cpu + 1e-9:
                raise over_quota(tenant, "cpu", q.cpu, round(used, 3), "CPUs of its sandboxes' limits", n * cpu)
        if q.memory is not None:
            used = sum(s.spec.limits.memory for s in live) + r[2]
            if used + n * memory > q.memory:
                raise over_quota(tenant, "memory", q.memory, used, "bytes of its sandboxes' memory limits", n * memory)
        if q.creates_per_second is not None:
            now = time.monotonic()
            burst = max(1.0, q.creates_per_second)
            if a.tokens < 0:
                a.tokens = burst
            a.tokens = min(burst, a.tokens + (now - a.stamp) * q.creates_per_second)
            a.stamp = now
            if a.tokens < n:
                raise over_quota(tenant, "creates_per_second", q.creates_per_second, q.creates_per_second,
                            "creates per second (it is at the rate now; retry in "
                            f"{(n - a.tokens) / q.creates_per_second:.2f} s)", n)
            a.tokens -= n
        self.egress_check(tenant)
        r[0] += n
        r[1] += n * cpu
        r[2] += n * memory
        return (tenant.name, n, cpu, memory)

    def release(self, ticket: tuple) -> None:
        name, n, cpu, memory = ticket
        r = self.accounts[name].reserved
        r[0] -= n
        r[1] -= n * cpu
        r[2] -= n * memory

    # egress: bytes the gateway moved for a tenant's sandboxes, charged as they are counted, in buckets of
    # EGRESS_BUCKET seconds (a day is at most 1440 of them per tenant, however many sandboxes and charges)
    def charge_egress(self, name: str, nbytes: int) -> None:
        if nbytes > 0:
            a = self.account(name)
            now = time.time()
            start = now - now % EGRESS_BUCKET
            if a.egress and a.egress[-1][0] == start:
                a.egress[-1][1] += nbytes
            else:
                a.egress.append([start, nbytes])
            a.egress_total += nbytes
            self.egress_dirty = True
            self._expire(a)

    def _expire(self, a: _Account) -> None:
        cut = time.time() - DAY
        while a.egress and a.egress[0][0] + EGRESS_BUCKET <= cut:   # a bucket leaves once all of it is a day old
            a.egress_total -= a.egress.popleft()[1]
            self.egress_dirty = True

    def egress_used(self, name: str) -> int:
        a = self.account(name)
        self._expire(a)
        return a.egress_total

    def egress_doc(self) -> bytes | None:
        """The last day's egress buckets as the file keeps them (load_egress), None if unchanged since the last
        call (made on the event loop; written elsewhere)."""
        if not self.egress_dirty:
            return None
        self.egress_dirty = False
        doc = {"version": 1, "bucket": EGRESS_BUCKET,
               "tenants": {n: list(a.egress) for n, a in self.accounts.items() if a.egress}}
        return json.dumps(doc, separators=(",", ":")).encode()

    def load_egress(self, path: Path) -> str | None:
        """Take the buckets a previous daemon saved at `path`; a reason if the file was refused (it is then
        ignored: a day starts afresh), None if it was taken or there is none."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        except OSError as e:
            return f"cannot read it ({e.strerror})"
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
                return "it is not a regular file that only this daemon's user may write"
            data = os.read(fd, MAX_FILE + 1)
        finally:
            os.close(fd)
        try:
            doc = json.loads(data) if len(data) <= MAX_FILE else None
            if not isinstance(doc, dict) or doc.get("version") != 1 or doc.get("bucket") != EGRESS_BUCKET:
                raise ValueError("not a version 1 file of this bucket size")
            cut, now = time.time() - DAY, time.time()
            taken: dict[str, deque] = {}
            for name, buckets in doc["tenants"].items():
                check_name(name)
                q: deque = deque()
                for start, n in buckets:
                    if (type(start) not in (int, float) or type(n) is not int or n < 0 or start > now + EGRESS_BUCKET
                            or (q and start <= q[-1][0]) or len(q) > DAY // EGRESS_BUCKET + 2):
                        raise ValueError(f"bad bucket for {name}")
                    if start + EGRESS_BUCKET > cut:
                        q.append([float(start), n])
                taken[name] = q
        except (ValueError, TypeError, KeyError, AttributeError, ConfigError) as e:
            return f"it is not a file of egress counts ({e})"
        for name, q in taken.items():
            a = self.account(name)
            a.egress, a.egress_total = q, sum(n for _, n in q)
        return None

    def egress_check(self, tenant: Tenant) -> None:
        q = tenant.quotas.egress_bytes_per_day
        if q is not None and (used := self.egress_used(tenant.name)) >= q:
            raise over_quota(tenant, "egress_bytes_per_day", q, used, "bytes of egress in the last 24 hours")

    # fair slots: while a slot is free any create takes it; once all `slots` are taken, they are shared max-min
    # fairly between the tenants with creates running or waiting (each gets what it asks up to an equal share, the
    # rest goes to those that want more), and a tenant within its share is admitted at once (past `slots`: the
    # others drain back to their shares as their creates end)
    def _allot(self, extra: str | None = None) -> dict[str, int]:
        demand = {n: c + len(self.accounts[n].waiting) for n, c in self.inflight.items() if c} | {
            n: self.inflight.get(n, 0) + len(self.accounts[n].waiting) for n in self.turn}
        now = time.monotonic()
        for n, t in self.seen.items():   # a tenant between its creates counts as asking for one
            if n not in demand and now - t < RECENT:
                demand[n] = 1
        if extra is not None:
            demand[extra] = self.inflight.get(extra, 0) + len(self.accounts[extra].waiting) + 1
        allot, left = {}, self.slots
        for i, (n, d) in enumerate(sorted(demand.items(), key=lambda kv: kv[1])):
            allot[n] = min(d, max(1, -(-left // (len(demand) - i))))   # at least 1 each, however many ask
            left = max(0, left - allot[n])
        return allot

    def _room(self, name: str) -> bool:
        """Is a slot free for `name`? One nobody uses, beyond one kept for each other tenant that asked for one
        within RECENT seconds and runs none now (between its creates: a steady tenant's next create finds its
        slot, not one more of a burst's)."""
        now = time.monotonic()
        kept = sum(1 for n, t in self.seen.items() if n != name and not self.inflight.get(n) and now - t < RECENT)
        return sum(self.inflight.values()) + kept < self.slots

    async def slot(self, name: str) -> None:
        """Wait for a create slot (see above); a tenant within its share never waits for another's creates."""
        a = self.account(name)
        self.seen[name] = time.monotonic()
        if not a.waiting and ((not self.turn and self._room(name))
                              or self.inflight.get(name, 0) < self._allot(name).get(name, 1)):
            self.inflight[name] = self.inflight.get(name, 0) + 1
            return
        fut = asyncio.get_running_loop().create_future()
        a.waiting.append(fut)
        self.turn.setdefault(name, None)
        self._later()
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.free(name)   # it was handed a slot as it was cancelled: pass it on
            else:
                try:
                    a.waiting.remove(fut)
                except ValueError:
                    pass
                if not a.waiting:
                    self.turn.pop(name, None)
            raise

    def free(self, name: str) -> None:
        """A create of `name` ended: hand slots to the tenants waiting, in turn, while they are within their share."""
        self.inflight[name] -= 1
        if not self.inflight[name]:
            del self.inflight[name]
        self._dispatch()

    def _dispatch(self) -> None:
        self._timer = None
        progressed = True
        while progressed and self.turn:
            progressed = False
            allot = self._allot()
            for n in list(self.turn):
                a = self.accounts[n]
                while a.waiting and a.waiting[0].done():
                    a.waiting.popleft()
                if not a.waiting:
                    self.turn.pop(n, None)
                    continue
                if self._room(n) or self.inflight.get(n, 0) < allot.get(n, 1):
                    self.inflight[n] = self.inflight.get(n, 0) + 1
                    a.waiting.popleft().set_result(None)
                    self.turn.move_to_end(n)   # to the back of the line
                    if not a.waiting:
                        self.turn.pop(n, None)
                    progressed = True
                    break
        self._later()

    def _later(self) -> None:
        """Creates wait while slots are kept for others: look again once those keeps have lapsed."""
        if self.turn and self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(RECENT, self._dispatch)


def _num(x) -> str:
    return f"{x:g}" if isinstance(x, float) else str(x)


def over_quota(tenant: Tenant, quota: str, limit, used, what: str, asked=1) -> QuotaExceededError:
    return QuotaExceededError(
        f"tenant {tenant.name!r} is over its {quota} quota: the limit is {_num(limit)} {what}, {_num(used)} in use, "
        f"and this asks for {_num(asked)} more; end some of its sandboxes or ask the operator to raise it "
        f"(`hutch tenant set {tenant.name} --quota {quota}=...`).",
        quota=quota, limit=limit, used=used)


# --- what a tenant may see and use ------------------------------------------------------------------------


class Owners:
    """Which tenants hold which image node, and which tenant made which memory snapshot: the file
    state_dir()/tenant-owners.json, {"images": {NODE_ID: [TENANT, ...]}, "memory_snapshots": {SID: TENANT or
    {"tenant": TENANT, "image": IMAGE}}} (IMAGE: the image its source showed the tenant, as it named it, which its
    restores show too: they run the snapshot's own image node).

    Every daemon that uses the state dir (fleet nodes on one host) shares it, so a change is a read-modify-write
    under an exclusive lock (flock on tenant-owners.json.lock): the file is read again under the lock, changed,
    and replaced by an atomic rename, so no daemon's record is lost to another's write. Reads take the file as
    it stands (a rename is atomic: the old whole file or the new one), again whenever its inode, size or times
    change. The file is root's (the daemon's user's) and 0600, and untrusted when read: one that is larger
    than MAX_OWNERS, not the daemon's, or not a file of ownership records is refused with an error naming it
    and the fix, and left as it is (nothing is written over it)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.lock_path = self.path.with_name(self.path.name + ".lock")
        self._state: tuple = (None, {}, {}, {})   # (the file's stamp, images, memory snapshots, their images)
        self._state = (self._stamp(),) + self._read()   # a bad file at start: the operator's error, raised
        self.refused: str | None = None   # why the file, changed since, is refused (its last good view in force)

    # the tables as the file last had them (images: node id -> tenants; memsnaps: snapshot id -> tenant)
    @property
    def images(self) -> dict[str, list[str]]:
        self.refresh()
        return self._state[1]

    @property
    def memsnaps(self) -> dict[str, str]:
        self.refresh()
        return self._state[2]

    def memsnap_image(self, sid: str) -> str | None:
        """The image memory snapshot `sid`'s source showed its tenant (None: not recorded)."""
        self.refresh()
        return self._state[3].get(sid)

    def _stamp(self):
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return None
        return (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)

    def refresh(self) -> None:
        stamp = self._stamp()
        if stamp == self._state[0]:
            return
        try:
            self._state = (stamp,) + self._read()
            self.refused = None
        except ConfigError as e:   # another writer left it bad: keep the last good view; writes are refused
            if self.refused != str(e):
                print(f"hutch daemon: {e}", file=sys.stderr, flush=True)
            self.refused = str(e)
            self._state = (stamp,) + self._state[1:]

    def _read(self) -> tuple[dict, dict, dict]:
        """The tables of the file (empty if there is none: images, memory snapshots' tenants and their images);
        ConfigError naming the fix if it is refused."""
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except FileNotFoundError:
            return {}, {}, {}
        except OSError as e:
            raise self._bad(f"cannot be read ({e.strerror})") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise self._bad("is not a regular file")
            if st.st_uid != os.geteuid() or st.st_mode & 0o077:
                raise self._bad(f"is not the daemon's private file (owner uid {st.st_uid}, mode "
                                f"{stat.S_IMODE(st.st_mode):04o}; it must be uid {os.geteuid()}'s, 0600)")
            chunks, n = [], 0
            while n <= MAX_OWNERS:
                b = os.read(fd, MAX_OWNERS + 1 - n)
                if not b:
                    break
                chunks.append(b)
                n += len(b)
        finally:
            os.close(fd)
        if n > MAX_OWNERS:
            raise self._bad(f"is larger than {MAX_OWNERS} bytes")
        try:
            doc = json.loads(b"".join(chunks).decode("utf-8"))
            if not isinstance(doc, dict) or set(doc) - {"images", "memory_snapshots"}:
                raise ValueError('not an object of "images" and "memory_snapshots"')
            images, memsnaps = doc.get("images", {}), doc.get("memory_snapshots", {})
            if not isinstance(images, dict) or not isinstance(memsnaps, dict):
                raise ValueError('"images" and "memory_snapshots" must be objects')
            out_i: dict[str, list[str]] = {}
            for k, v in images.items():
                v = [v] if isinstance(v, str) else v   # one tenant per image, as the first files had it
                if not isinstance(v, list) or not _owner_key(k) or not all(_owner_name(n) for n in v):
                    raise ValueError(f"image {k[:80]!r}: not a node id and a list of tenant names")
                if v:
                    out_i[k] = list(dict.fromkeys(v))
            out_m, out_s = {}, {}
            for k, v in memsnaps.items():
                if isinstance(v, dict) and set(v) == {"tenant", "image"} and _owner_key(v["image"]):
                    v, out_s[k] = v["tenant"], v["image"]
                if not _owner_key(k) or not _owner_name(v):
                    raise ValueError(f"memory snapshot {k[:80]!r}: not a snapshot id and a tenant name (or "
                                     '{"tenant": NAME, "image": IMAGE})')
                out_m[k] = v
        except (ValueError, UnicodeDecodeError, RecursionError) as e:
            raise self._bad(f"is not a file of ownership records ({str(e)[:200]})") from None
        return out_i, out_m, out_s

    def _bad(self, why: str) -> ConfigError:
        return ConfigError(
            f"the tenants' ownership file {self.path} {why}; it is left as it is and nothing is written over it. "
            f"Restore it from a backup (or fix it: {{\"images\": {{NODE_ID: [TENANT, ...]}}, \"memory_snapshots\": "
            f"{{SID: TENANT}}}}, chmod 600, chown root), or move it away to start with no ownership records (the "
            f"tenants then see none of the images and memory snapshots they made).")

    def update(self, change):
        """Apply `change(images, memsnaps, shown)` (it edits the dicts in place; its result is returned; `shown`:
        memory snapshot id -> the image its restores show) to the file as it is now, under the lock, and write it
        back atomically (blocking: call it from a thread)."""
        self.lock_path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        lfd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            st = os.fstat(lfd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
                raise ConfigError(f"the tenants' ownership lock {self.lock_path} is not a file of the daemon's "
                                  f"user; remove it (`rm {self.lock_path}`).")
            fcntl.flock(lfd, fcntl.LOCK_EX)
            try:
                images, memsnaps, shown = self._read()   # as the file is now, with every other daemon's records
            except ConfigError as e:   # not the caller's doing: the daemon's (503), and the file stays as it is
                raise DaemonError(str(e)) from None
            result = change(images, memsnaps, shown)
            images = {k: v for k, v in images.items() if v}
            shown = {k: v for k, v in shown.items() if k in memsnaps}
            doc_m = {k: {"tenant": v, "image": shown[k]} if k in shown else v for k, v in memsnaps.items()}
            data = json.dumps({"images": images, "memory_snapshots": doc_m}, separators=(",", ":")).encode()
            if len(data) > MAX_OWNERS:
                raise DaemonError(f"the tenants' ownership file {self.path} would be larger than {MAX_OWNERS} bytes; "
                                  "remove images or memory snapshots no longer needed.")
            atomic_write(self.path, data, mode=0o600)
            self._state = (self._stamp(), images, memsnaps, shown)   # still ours: others write under the lock
            self.refused = None
            return result
        finally:
            os.close(lfd)   # and with it the lock

    def own(self, table: str, key: str, tenant: str, image: str | None = None) -> None:
        """Record that `tenant` holds `key` of `table` ("images": one of its holders; "memsnaps": its maker, and
        `image` the image its source showed it, if given)."""
        def change(images, memsnaps, shown):
            if table == "images":
                holders = images.setdefault(key, [])
                if tenant not in holders:
                    holders.append(tenant)
            else:
                memsnaps[key] = tenant
                shown.pop(key, None)
                if image is not None and _owner_key(image):
                    shown[key] = image
        self.update(change)

    def disown(self, table: str, key: str, tenant: str | None = None) -> bool:
        """Drop `tenant`'s claim on `key` (None: every claim); True if nobody holds it now."""
        def change(images, memsnaps, shown):
            if table == "images":
                holders = images.get(key, [])
                if tenant is None:
                    holders.clear()
                elif tenant in holders:
                    holders.remove(tenant)
                if not holders:
                    images.pop(key, None)
                return not holders
            if tenant is None or memsnaps.get(key) == tenant:
                memsnaps.pop(key, None)
            return key not in memsnaps
        return self.update(change)

    def drop(self, table: str, key: str) -> None:
        """Forget `key` of `table` (it is gone), if any record names it."""
        if key in getattr(self, table):
            self.disown(table, key)

    def of(self, table: str, tenant: str) -> set[str]:
        if table == "images":
            return {k for k, v in self.images.items() if tenant in v}
        return {k for k, v in self.memsnaps.items() if v == tenant}


def _owner_key(k) -> bool:
    return isinstance(k, str) and 0 < len(k) <= 200


def _owner_name(n) -> bool:
    return isinstance(n, str) and NAME_RE.match(n) is not None


# --- the audit log --------------------------------------------------------------------------------------------


class AuditLog:
    """JSON lines written by the daemon only: root's, 0600, rotated at `max_bytes` keeping `keep` old files
    (PATH.1 newest ... PATH.keep oldest)."""

    def __init__(self, path: str | os.PathLike, max_bytes: int = 16 << 20, keep: int = 5):
        self.path = Path(path).absolute()
        self.max_bytes, self.keep = max_bytes, keep
        parent = self.path.parent
        parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        st = os.stat(parent)
        if st.st_uid != 0 or st.st_mode & 0o022:
            raise ConfigError(f"--audit-log {self.path}: its directory {parent} may be written by others than root "
                              f"(owner uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):04o}); give it a directory "
                              "only root writes, like /var/log/hutch.")
        from hutch.sandbox._host import volumes
        vd = volumes.volumes_dir().absolute()
        if self.path == vd or vd in self.path.parents:
            raise ConfigError(f"--audit-log {self.path} is inside the volumes, which sandboxes write; put it elsewhere.")
        self.fd = -1
        self._open()

    def _open(self) -> None:
        try:
            self.fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as e:   # a symlink (never followed), a directory, ...
            raise ConfigError(f"--audit-log {self.path} cannot be opened ({e.strerror}); it must be a regular file "
                              "of root's (not a symlink) or not exist yet.") from None
        st = os.fstat(self.fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != 0:
            os.close(self.fd)
            raise ConfigError(f"--audit-log {self.path} is not a regular file of root's.")
        os.fchmod(self.fd, 0o600)
        self.size = st.st_size

    def write(self, tenant: str | None, action: str, target: str | None, outcome: str, **extra) -> None:
        rec = {"time": round(time.time(), 6), "tenant": tenant, "action": action, "id": target, "outcome": outcome}
        rec.update({k: v for k, v in extra.items() if v is not None})
        line = (json.dumps(rec, separators=(",", ":")) + "\n").encode()
        if self.size + len(line) > self.max_bytes and self.size:
            self._rotate()
        os.write(self.fd, line)
        self.size += len(line)

    def _rotate(self) -> None:
        os.close(self.fd)
        for i in range(self.keep - 1, 0, -1):
            src = self.path.with_name(f"{self.path.name}.{i}")
            if src.exists():
                os.replace(src, self.path.with_name(f"{self.path.name}.{i + 1}"))
        if self.keep > 0:
            os.replace(self.path, self.path.with_name(f"{self.path.name}.1"))
        else:
            os.unlink(self.path)
        self._open()

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


__all__ = ["Accounts", "AuditLog", "DEFAULT_FILE", "Owners", "Quotas", "ROUTES", "Registry", "Tenant", "add",
           "check_name", "digest", "parse_doc", "read_doc", "read_file", "remove", "rotate", "set_"]
