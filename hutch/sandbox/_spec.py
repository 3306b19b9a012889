"""Frozen value objects that declare a sandbox: mounts, network policy, limits.

Everything about a sandbox's isolation is fixed here, at construction, and each
constructor validates its input and names the fix when it is wrong. The spec
travels to the daemon as JSON (`to_dict` / `from_dict`).
"""

from __future__ import annotations

import dataclasses
import ipaddress
import math
import re
from dataclasses import asdict, dataclass, field
from pathlib import PurePosixPath
from typing import Any, Literal

from hutch._core.errors import ConfigError, InvalidSpecError, NetworkPolicyError

# Defaults, named in one place.
DEFAULT_IMAGE = "debian-slim"
DEFAULT_TIMEOUT = 300.0          # seconds a sandbox may live unless told otherwise
DEFAULT_MEMORY = 512 * 1024**2   # bytes
DEFAULT_PIDS = 512
DEFAULT_DISK = 1024**3           # bytes of writable layer
DEFAULT_CPU = 1.0
DEFAULT_WORKDIR = "/home/user"
#: The sandbox's unprivileged user: `exec(user="user")` runs as this uid and gid (no root inside either; in
#: the default user-namespace mode an unprivileged, unmapped-elsewhere host uid too). Its name and home are
#: the image's business (Image.code_interpreter() has user:1000 owning /home/user).
SANDBOX_USER_ID = 1000
EXEC_USERS = ("root", "user")
#: The capabilities a sandbox may keep (image build steps: apt, dpkg, useradd need them); none by default.
BUILD_CAPABILITIES = ("CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "NET_BIND_SERVICE", "SETGID", "SETUID")
#: Where a sandbox runs: "native" (the kernel's namespaces, the default) or "gvisor" (runsc: memory snapshots,
#: restore and fork; docs/architecture.md, "The gVisor runtime").
RUNTIMES = ("native", "gvisor")
#: What `idle_timeout` does to a sandbox that ran nothing for that long: end it, or pause it (resumed on the next call).
ON_IDLE = ("terminate", "pause")

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kKmMgGtT]?)(i?[bB]?)?\s*$")
_UNITS = {"": 1, "k": 1024, "m": 1024**2, "g": 1024**3, "t": 1024**4}
MAX_SIZE = 1 << 50   # 1 PiB: more than any host has; a larger size is a typo (the kernel would take it as "no limit")


def parse_size(value: int | str, what: str) -> int:
    """'512M', '1G', '1.5GiB', 1048576 -> bytes. Raises InvalidSpecError naming `what`."""
    if isinstance(value, bool):
        raise InvalidSpecError(f"{what}={value!r} is not a size; give bytes as an int or a string like '512M' or '2G'.")
    if isinstance(value, int):
        n = value
    elif isinstance(value, str) and (m := _SIZE_RE.match(value)):
        n = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    else:
        raise InvalidSpecError(f"{what}={value!r} is not a size; give bytes as an int or a string like '512M' or '2G'.")
    if n <= 0:
        raise InvalidSpecError(f"{what}={value!r} must be positive; give a size like '512M'.")
    if n > MAX_SIZE:
        raise InvalidSpecError(f"{what}={value!r} is more than 1 PiB, more than any host has; give a size like '2G'.")
    return n


def abs_path(path: str, what: str) -> str:
    if not isinstance(path, str) or not path.startswith("/") or "\0" in path:
        raise InvalidSpecError(f"{what}={path!r} must be an absolute path inside the sandbox, like '/data'.")
    p = PurePosixPath(path)
    if ".." in p.parts:
        raise InvalidSpecError(f"{what}={path!r} must not contain '..'; give the plain absolute path.")
    return str(p)


_MAX_ID = 4294967294   # (uid_t)-1 is "no id"


def parse_owner(owner, readonly: bool) -> tuple[int, int] | None:
    """Mount.bind's owner=: None, "root", a host uid (its gid the same number) or (uid, gid) -> (uid, gid)."""
    if owner is None:
        return None
    if readonly:
        raise InvalidSpecError("Mount.bind owner= chooses who owns what the sandbox writes, so it needs "
                               "readonly=False; drop owner= for a read-only bind.")
    if owner == "root":
        return (0, 0)
    ids = (owner, owner) if isinstance(owner, int) else tuple(owner) if isinstance(owner, (tuple, list)) else ()
    if len(ids) != 2 or any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i <= _MAX_ID for i in ids):
        raise InvalidSpecError(f"Mount.bind owner={owner!r} must be a host uid like 1000, a (uid, gid) pair, "
                               "or 'root' (then what the sandbox writes there is host root's).")
    return ids


#: A volume's name, checked alike by the SDK and by the daemon (whose directory under volumes/ it names).
#: (NAME_PATTERN is its JSON Schema form; the regex ends at \Z, as `$` would take a trailing newline.)
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$"
VOLUME_NAME_RE = re.compile(NAME_PATTERN[:-1] + r"\Z")


def check_volume_name(name) -> str:
    if not isinstance(name, str) or not VOLUME_NAME_RE.match(name):
        raise ConfigError(f"volume name {name!r} must be 1-63 letters, digits, '_', '.', '-', "
                          "starting with a letter or digit.")
    return name


_MOUNT_FIELDS = {"kind", "target", "source", "readonly", "size", "owner"}


@dataclass(frozen=True)
class Mount:
    """A filesystem mounted into a sandbox. Build with `Mount.bind`, `Mount.tmpfs` or `Mount.volume`.

    Every one is nosuid and nodev. What root in the sandbox writes through a writable bind is owned on
    the host by the sandbox's own unprivileged uid, unless `owner` (host uid, gid) says otherwise.
    """

    kind: Literal["bind", "tmpfs", "volume"]
    target: str
    source: str | None = None
    readonly: bool = True
    size: int | None = None
    owner: tuple[int, int] | None = None

    @classmethod
    def bind(cls, source: str, target: str, *, readonly: bool = True, owner=None) -> "Mount":
        """Bind a host path into the sandbox; read-only unless `readonly=False` is said.

        Root in the sandbox writes there as an unprivileged host uid of the sandbox's own (no host user
        becomes root through a setuid file it leaves), and host files show as their owners would to a
        stranger: writable only where their mode lets others write. `owner=1000` (or `(uid, gid)`) makes
        that host user root inside this bind instead: what root writes is theirs, files they own are
        root's, other owners' files read-only; `owner="root"` does so for host root, explicitly.
        """
        import os

        if not isinstance(source, (str, os.PathLike)):
            raise InvalidSpecError(f"Mount.bind source={source!r} must be a host path.")
        src = os.path.abspath(os.fspath(source))
        if not os.path.exists(src):
            raise InvalidSpecError(
                f"Mount.bind source {src!r} does not exist on the host; create it first or fix the path."
            )
        return cls("bind", abs_path(target, "Mount.bind target"), src, bool(readonly),
                   owner=parse_owner(owner, bool(readonly)))

    @classmethod
    def tmpfs(cls, target: str, *, size: int | str = "64M") -> "Mount":
        """An empty, writable, memory-backed directory that vanishes with the sandbox."""
        return cls("tmpfs", abs_path(target, "Mount.tmpfs target"), None, False, parse_size(size, "Mount.tmpfs size"))

    @classmethod
    def volume(cls, volume: Any, target: str, *, readonly: bool = False) -> "Mount":
        """A named hutch Volume (see `hutch.Volume`); `volume` is a Volume or its name."""
        name = getattr(volume, "name", volume)
        if not isinstance(name, str) or not VOLUME_NAME_RE.match(name):
            raise InvalidSpecError(f"Mount.volume volume={volume!r} is not a volume name; use hutch.Volume.from_name(...).")
        return cls("volume", abs_path(target, "Mount.volume target"), name, bool(readonly))

    def to_dict(self) -> dict:
        d = asdict(self)
        if self.owner is None:   # only when said: a daemon of an earlier version knows no owner
            del d["owner"]
        return d

    @classmethod
    def from_dict(cls, d) -> "Mount":
        """Rebuild from `to_dict()` output through the constructor of its kind, so it is checked as that
        constructor checks (a bind's source must exist here); a field its kind cannot have is refused."""
        if not isinstance(d, dict) or d.get("kind") not in ("bind", "tmpfs", "volume") or set(d) - _MOUNT_FIELDS:
            raise InvalidSpecError(f"mount {d!r} is malformed; build mounts with hutch.Mount.bind/tmpfs/volume.")
        kind = d["kind"]
        target: Any = d.get("target")   # each checked by the constructor of its kind
        source: Any = d.get("source")
        owner = d.get("owner")
        given: dict[str, object]
        if kind == "bind" and not (isinstance(d.get("source"), str) and d["source"].startswith("/")):
            raise InvalidSpecError(f"mount {d!r}: a bind's source must be an absolute host path.")
        if kind == "bind":
            m = cls.bind(source, target, readonly=d.get("readonly", True),
                         owner=list(owner) if isinstance(owner, (list, tuple)) else owner)
            given = {"size": None}
        elif kind == "tmpfs":
            m = cls.tmpfs(target, size=d.get("size", "64M"))
            given = {"source": None, "readonly": False, "owner": None}
        else:
            m = cls.volume(source, target, readonly=d.get("readonly", False))
            given = {"size": None, "owner": None}
        wrong = sorted(k for k, v in given.items() if k in d and d[k] != v)
        if wrong:
            raise InvalidSpecError(f"mount {d!r}: a {kind} mount takes no {', '.join(wrong)}; "
                                   f"build it with hutch.Mount.{kind}(...).")
        return m


#: Request headers a credential may not set: they frame the request or steer the connection.
_HEADERS_NOT_SET = {"host", "content-length", "transfer-encoding", "connection", "upgrade", "te", "trailer",
                    "keep-alive", "expect", "proxy-connection"}
_HEADER_RE = re.compile(r"^[A-Za-z0-9!#$%&'*+.^_`|~-]{1,64}\Z")
_ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}\Z")
MIN_SECRET = 8          # characters: a shorter one could not be told from ordinary text when it is redacted
MAX_SECRET = 8192


@dataclass(frozen=True)
class Secret:
    """A credential the egress gateway adds to a sandbox's requests to one host; the sandbox never holds it.

    Give it in `Network.allow(credentials={"api.example.com": Secret.from_env("EXAMPLE_KEY")})`. The gateway
    terminates the sandbox's TLS to that host with a per-sandbox CA, sets `header` to `format` with the
    secret for "{}", re-encrypts to the real server (verifying its certificate), and redacts the secret from
    what comes back. `requests_per_minute` / `bytes_per_minute` cap what the sandbox sends through the host
    with it. The value never appears in a repr, in `to_dict()`, in a sandbox file or in the daemon's answers.
    """

    env: str | None = None                 # the caller's environment variable it is read from, at create
    header: str = "Authorization"
    format: str = "Bearer {}"
    requests_per_minute: int | None = None
    bytes_per_minute: int | None = None
    value: str | None = field(default=None, repr=False)   # from_value's, or the daemon's copy of it

    @classmethod
    def from_env(cls, name: str, *, header: str = "Authorization", format: str = "Bearer {}",
                 requests_per_minute: int | None = None, bytes_per_minute: int | None = None) -> "Secret":
        """The secret in the caller's environment variable `name`, read when the sandbox is created."""
        if not isinstance(name, str) or not _ENV_NAME_RE.match(name):
            raise NetworkPolicyError(f"Secret.from_env({name!r}): give the name of an environment variable, "
                                     "like 'EXAMPLE_KEY'.")
        return cls._checked(name, None, header, format, requests_per_minute, bytes_per_minute)

    @classmethod
    def from_value(cls, value: str, *, header: str = "Authorization", format: str = "Bearer {}",
                   requests_per_minute: int | None = None, bytes_per_minute: int | None = None) -> "Secret":
        """A secret the caller holds (never written to a sandbox file: use from_env there)."""
        _check_value(value, "Secret.from_value")
        return cls._checked(None, value, header, format, requests_per_minute, bytes_per_minute)

    @classmethod
    def _checked(cls, env, value, header, format, rpm, bpm) -> "Secret":
        if not isinstance(header, str) or not _HEADER_RE.match(header) or header.lower() in _HEADERS_NOT_SET:
            raise NetworkPolicyError(f"Secret header={header!r} must be a request header name like 'Authorization' "
                                     f"or 'X-Api-Key' (not one of {', '.join(sorted(_HEADERS_NOT_SET))}).")
        if (not isinstance(format, str) or format.count("{}") != 1 or format.replace("{}", "").count("{")
                or format.replace("{}", "").count("}") or len(format) > 256 or any(c in format for c in "\r\n\0")):
            raise NetworkPolicyError(f"Secret format={format!r} must hold '{{}}' once (where the secret goes) "
                                     "and no other braces or line breaks, like 'Bearer {}'.")
        for what, n in (("requests_per_minute", rpm), ("bytes_per_minute", bpm)):
            if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
                raise NetworkPolicyError(f"Secret {what}={n!r} must be a positive int, or None for no cap.")
        return cls(env, header, format, rpm, bpm, value)

    def with_value(self, value: str) -> "Secret":
        """This secret, its value given now (a sandbox file's reference read from a chosen environment)."""
        return dataclasses.replace(self, value=_check_value(value, f"${self.env}" if self.env else "the value"))

    def reveal(self) -> str:
        """The secret's value: from_value's, or the environment variable's now."""
        if self.value is not None:
            return self.value
        from hutch._core.settings import caller_environ

        environ = caller_environ()
        if self.env is None or self.env not in environ:
            raise NetworkPolicyError(f"the credential Secret.from_env({self.env!r}) reads ${self.env}, which is "
                                     f"not set; export {self.env} before creating the sandbox.")
        return _check_value(environ[self.env], f"${self.env}")

    def header_value(self) -> str:
        """The header's value as sent upstream."""
        return self.format.replace("{}", self.reveal())

    def to_dict(self, *, reveal: bool = False) -> dict:
        """The JSON form without the value; `reveal=True` adds it (only for the request to the daemon)."""
        d = {"env": self.env, "header": self.header, "format": self.format,
             "requests_per_minute": self.requests_per_minute, "bytes_per_minute": self.bytes_per_minute}
        if reveal:
            d["value"] = self.reveal()
        return d

    @classmethod
    def from_dict(cls, d) -> "Secret":
        if not isinstance(d, dict) or set(d) - {"env", "header", "format", "requests_per_minute",
                                                "bytes_per_minute", "value"}:
            raise NetworkPolicyError("a credential must be an object of env, header, format, requests_per_minute, "
                                     "bytes_per_minute and value, as Secret.to_dict(reveal=True) makes it.")
        env, value = d.get("env"), d.get("value")
        if env is not None and (not isinstance(env, str) or not _ENV_NAME_RE.match(env)):
            raise NetworkPolicyError(f"a credential's env={env!r} is not an environment variable's name.")
        if value is not None:
            _check_value(value, "a credential's value")
        elif env is None:
            raise NetworkPolicyError("a credential needs env (Secret.from_env) or a value (Secret.from_value).")
        return cls._checked(env, value, d.get("header", "Authorization"), d.get("format", "Bearer {}"),
                            d.get("requests_per_minute"), d.get("bytes_per_minute"))

    def __repr__(self) -> str:
        src = f"from_env({self.env!r})" if self.env else "from_value(<hidden>)"
        return f"Secret.{src}[header={self.header!r}]"


def _check_value(value, what: str) -> str:
    if not isinstance(value, str) or not MIN_SECRET <= len(value) <= MAX_SECRET:
        raise NetworkPolicyError(f"{what} must be a string of {MIN_SECRET} to {MAX_SECRET} characters (a shorter "
                                 "one could not be told apart from ordinary text when it is redacted).")
    if any(c in value for c in "\r\n\0") or not value.isprintable():
        raise NetworkPolicyError(f"{what} holds a line break or a control character; a header value cannot.")
    return value


def matching_domain(domains, name: str) -> str | None:
    """The entry of `domains` that admits the (normalized) `name`, or None: the one rule, which the gateway uses.
    "*.example.com" admits one or more labels below example.com, never the apex."""
    for d in domains:
        if d.startswith("*."):
            if name.endswith(d[1:]) and len(name) > len(d) - 1:
                return d
        elif name == d:
            return d
    return None


_DOMAIN_RE = re.compile(r"^(\*\.)?([a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?\.)*[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?\Z")


@dataclass(frozen=True)
class Network:
    """A sandbox's network egress policy. Build with `none()`, `allow(...)` or `open()`.

    Wildcards: "*.example.com" matches any name with at least one more label
    below example.com (a.example.com, a.b.example.com), never example.com itself;
    list both to allow both. A wildcard is only ever the whole leftmost label, and
    not directly above a top-level domain ("*.com" is refused). Names compare
    case-insensitively, without a trailing dot.

    CIDR rules admit raw TCP to those addresses on the policy's ports. Private,
    CGNAT, link-local and metadata addresses are reached only through a CIDR
    rule lying inside their block (`cidrs=["10.1.0.0/16"]`, not "0.0.0.0/0");
    loopback, multicast, the host and other sandboxes never. `ports=None` means
    every TCP port. See docs/egress.md.

    `requests_per_minute` / `bytes_per_minute` (allow and open) cap what the sandbox moves through each
    entry of the policy over a sliding minute: each domain entry (a wildcard is one entry, whatever names
    below it are used), each CIDR, and under `open()` everything together; bytes count both ways. A
    credential's own budget (`Secret`) caps its host as well. None: no cap. See docs/egress.md, "Budgets".
    """

    mode: Literal["none", "allow", "open"] = "none"
    domains: tuple[str, ...] = ()
    cidrs: tuple[str, ...] = ()
    ports: tuple[int, ...] = ()
    credentials: tuple[tuple[str, Secret], ...] = ()   # (host, Secret), sorted; see Secret
    requests_per_minute: int | None = None             # per entry of the policy (see above)
    bytes_per_minute: int | None = None

    @classmethod
    def none(cls) -> "Network":
        """No network at all: loopback only. The default."""
        return cls("none")

    @classmethod
    def open(cls, *, requests_per_minute: int | None = None, bytes_per_minute: int | None = None) -> "Network":
        """The public internet, never private, loopback, link-local or metadata ranges; the budgets cap all of
        it together."""
        return cls("open")._with_budget(requests_per_minute, bytes_per_minute)

    @classmethod
    def allow(cls, domains=(), cidrs=(), ports=(443, 80), credentials=None, *, requests_per_minute=None,
              bytes_per_minute=None) -> "Network":
        """Only these domains (DNS names, '*.' wildcards) and CIDR ranges, on these TCP ports.

        `credentials` maps an allowed host (an exact name) to a `hutch.Secret` that the gateway adds to the
        sandbox's HTTPS requests to it, so the sandbox never holds the key (docs/egress.md, Credentials).
        `requests_per_minute` / `bytes_per_minute` cap each domain and CIDR entry (see the class)."""
        every_port = ports is None
        domains, cidrs, ports = (_entries(v) for v in (domains, cidrs, () if every_port else ports))
        if not every_port and not ports:
            raise NetworkPolicyError("ports=[] allows nothing; give ports like [443, 80], or ports=None for every port.")
        doms = []
        for d in domains:
            if not isinstance(d, str):
                raise NetworkPolicyError(f"domain {d!r} is not a string; give names like 'api.example.com'.")
            n = d.strip().lower().rstrip(".")
            if not _DOMAIN_RE.match(n) or len(n) > 253 or "." not in n.lstrip("*."):
                raise NetworkPolicyError(
                    f"domain {d!r} is not a valid DNS name; give 'api.example.com' or '*.example.com' "
                    "(a wildcard only as the whole leftmost label)."
                )
            if n.replace(".", "").isdigit():
                raise NetworkPolicyError(f"domain {d!r} is an address, not a name; put it in cidrs, e.g. cidrs=['{n}/32'].")
            doms.append(n)
        nets = []
        for c in cidrs:
            try:
                net = ipaddress.ip_network(str(c), strict=False)
            except ValueError as e:
                raise NetworkPolicyError(f"cidr {c!r} is not an address range; give one like '203.0.113.0/24'.") from e
            if net.version != 4:
                raise NetworkPolicyError(f"cidr {c!r} is IPv6; sandboxes have no IPv6, give an IPv4 range.")
            nets.append(str(net))
        prts = []
        for p in ports:
            if isinstance(p, bool) or not isinstance(p, int) or not 1 <= p <= 65535:
                raise NetworkPolicyError(f"port {p!r} is not a TCP port; give an int in 1..65535.")
            prts.append(p)
        if not doms and not nets:
            raise NetworkPolicyError("Network.allow() needs at least one domain or cidr; use Network.none() for no network.")
        policy = cls("allow", tuple(sorted(set(doms))), tuple(sorted(set(nets))), tuple(sorted(set(prts))))
        return policy._with_credentials(credentials)._with_budget(requests_per_minute, bytes_per_minute)

    def _with_budget(self, rpm, bpm) -> "Network":
        for what, n in (("requests_per_minute", rpm), ("bytes_per_minute", bpm)):
            if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
                raise NetworkPolicyError(f"Network {what}={n!r} must be a positive int, or None for no cap.")
        return dataclasses.replace(self, requests_per_minute=rpm, bytes_per_minute=bpm) if rpm or bpm else self

    def _with_credentials(self, credentials) -> "Network":
        if not credentials:
            return self
        if not isinstance(credentials, dict):
            raise NetworkPolicyError("credentials must be a dict of host to hutch.Secret, e.g. "
                                     "{'api.example.com': hutch.Secret.from_env('EXAMPLE_KEY')}.")
        out = {}
        for host, secret in credentials.items():
            h = host.strip().lower().rstrip(".") if isinstance(host, str) else host
            if not isinstance(h, str) or h.startswith("*") or not _DOMAIN_RE.match(h) or "." not in h:
                raise NetworkPolicyError(f"credential host {host!r} must be one exact DNS name like "
                                         "'api.example.com' (no wildcard: a key goes to the one host it is for).")
            if not isinstance(secret, Secret):
                raise NetworkPolicyError(f"credentials[{host!r}] is not a hutch.Secret; use "
                                         "hutch.Secret.from_env('VAR', header='Authorization', format='Bearer {}').")
            if matching_domain(self.domains, h) is None:
                raise NetworkPolicyError(f"credential host {h!r} is not in the allowed domains; add it to domains=.")
            out[h] = secret
        return dataclasses.replace(self, credentials=tuple(sorted(out.items())))

    def to_dict(self, *, reveal: bool = False) -> dict:
        """The JSON form: {"mode", "domains", "cidrs", "ports"}, and "credentials" when there are any (their
        values only with `reveal=True`, for the request to the daemon)."""
        d: dict[str, object] = {"mode": self.mode, "domains": list(self.domains), "cidrs": list(self.cidrs),
                                "ports": list(self.ports)}
        if self.credentials:
            d["credentials"] = {h: s.to_dict(reveal=reveal) for h, s in self.credentials}
        for k in ("requests_per_minute", "bytes_per_minute"):
            if getattr(self, k) is not None:
                d[k] = getattr(self, k)
        return d

    @classmethod
    def from_dict(cls, d) -> "Network":
        """Rebuild from `to_dict()` output, validating it as the named constructors do."""
        if isinstance(d, Network):
            return d
        if not isinstance(d, dict):
            raise NetworkPolicyError(f"network={d!r} is not a policy; send Network.to_dict(), e.g. {{'mode': 'none'}}.")
        unknown = set(d) - {"mode", "domains", "cidrs", "ports", "credentials", "requests_per_minute",
                            "bytes_per_minute"}
        if unknown:
            raise NetworkPolicyError(f"network has unknown fields {sorted(unknown)}; use mode, domains, cidrs, ports, "
                                     "credentials, requests_per_minute, bytes_per_minute.")
        budget = {k: d[k] for k in ("requests_per_minute", "bytes_per_minute") if d.get(k) is not None}
        creds = d.get("credentials")
        if creds is not None and (not isinstance(creds, dict) or d.get("mode") != "allow"):
            raise NetworkPolicyError("network credentials must be an object of host to credential, and only "
                                     "with mode 'allow'.")
        mode = d.get("mode", "none")
        if mode == "none":
            if budget:
                raise NetworkPolicyError("network mode 'none' moves nothing to budget; give requests_per_minute and "
                                         "bytes_per_minute only with 'allow' or 'open'.")
            return cls.none()
        if mode == "open":
            return cls.open(**budget)
        if mode == "allow":
            ports = d.get("ports", (443, 80))
            if isinstance(ports, (list, tuple)) and len(ports) == 0:
                ports = None   # to_dict's form of "every port"
            return cls.allow(domains=d.get("domains") or (), cidrs=d.get("cidrs") or (), ports=ports,
                             credentials={h: Secret.from_dict(c) for h, c in (creds or {}).items()}, **budget)
        raise NetworkPolicyError(f"network mode {mode!r} is unknown; use 'none', 'allow' or 'open'.")


def _entries(value) -> list:
    """A policy list given as any iterable but a string or a mapping (whose keys would pass for entries)."""
    if isinstance(value, (str, bytes, dict)):
        value = None
    try:
        return list(value)
    except TypeError:
        raise NetworkPolicyError("domains, cidrs and ports must be lists, e.g. domains=['api.example.com'].") from None


@dataclass(frozen=True)
class Limits:
    """Resource limits of a sandbox (bytes, processes, CPUs)."""

    memory: int = DEFAULT_MEMORY
    cpu: float = DEFAULT_CPU
    pids: int = DEFAULT_PIDS
    disk: int = DEFAULT_DISK

    @classmethod
    def of(cls, *, memory=DEFAULT_MEMORY, cpu=DEFAULT_CPU, pids=DEFAULT_PIDS, disk=DEFAULT_DISK) -> "Limits":
        if isinstance(cpu, bool) or not isinstance(cpu, (int, float)) or not 0.01 <= cpu <= 1024:
            raise InvalidSpecError(f"cpu={cpu!r} must be a number of CPUs between 0.01 and 1024, like 1.0 or 0.5.")
        if isinstance(pids, bool) or not isinstance(pids, int) or not 1 <= pids <= 1 << 22:
            raise InvalidSpecError(f"pids={pids!r} must be a positive int, the most processes the sandbox may run.")
        return cls(parse_size(memory, "memory"), float(cpu), pids, parse_size(disk, "disk"))


def _timeout(value, what: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise InvalidSpecError(f"{what}={value!r} must be a positive, finite number of seconds, or None.")
    return float(value)


@dataclass(frozen=True)
class SandboxSpec:
    """Everything that declares a sandbox. Immutable; sent to the daemon as JSON."""

    command: tuple[str, ...] = ()
    image: str = DEFAULT_IMAGE
    mounts: tuple[Mount, ...] = ()
    network: Network = field(default_factory=Network.none)
    limits: Limits = field(default_factory=Limits)
    timeout: float | None = DEFAULT_TIMEOUT
    idle_timeout: float | None = None
    workdir: str = DEFAULT_WORKDIR
    env: tuple[tuple[str, str], ...] = ()
    tags: tuple[tuple[str, str], ...] = ()
    name: str | None = None
    detach: bool = False
    capabilities: tuple[str, ...] = ()   # kept capabilities, a subset of BUILD_CAPABILITIES; image builds only
    runtime: str = "native"              # RUNTIMES: the kernel's namespaces, or gVisor (runsc)
    on_idle: str = "terminate"           # ON_IDLE: what idle_timeout does

    @classmethod
    def build(cls, command=(), *, image=DEFAULT_IMAGE, mounts=(), network=None, memory=DEFAULT_MEMORY,
              cpu=DEFAULT_CPU, pids=DEFAULT_PIDS, disk=DEFAULT_DISK, timeout=DEFAULT_TIMEOUT,
              idle_timeout=None, workdir=DEFAULT_WORKDIR, env=None, tags=None, name=None,
              detach=False, capabilities=(), runtime="native", on_idle="terminate") -> "SandboxSpec":
        """Validate user arguments into a spec; every error names the argument and the fix."""
        argv = tuple(command)
        for a in argv:
            if not isinstance(a, str):
                raise InvalidSpecError(f"command argument {a!r} is not a string; pass argv as strings, not a shell line.")
        if not isinstance(image, str) or not image:
            raise InvalidSpecError(f"image={image!r} must be an image reference; use hutch.Image.debian_slim() or an image id.")
        ms = tuple(mounts)
        for m in ms:
            if not isinstance(m, Mount):
                raise InvalidSpecError(f"mounts entry {m!r} is not a Mount; build one with hutch.Mount.bind/tmpfs/volume.")
        targets = [m.target for m in ms]
        if len(set(targets)) != len(targets):
            raise InvalidSpecError(f"two mounts share a target in {targets}; give each mount its own path.")
        if network is None:
            network = Network.none()
        if not isinstance(network, Network):
            raise InvalidSpecError(f"network={network!r} is not a Network; use hutch.Network.none(), .allow(...) or .open().")
        envs = _str_pairs(env, "env")
        for k, v in envs:
            if not k or "=" in k or "\0" in k:
                raise InvalidSpecError(f"env name {k!r} is not a valid environment variable name.")
            if "\0" in v:
                raise InvalidSpecError(f"env {k}={v!r} holds a NUL byte, which no environment can carry.")
        tgs = _str_pairs(tags, "tags")
        caps = capabilities or ()
        if isinstance(caps, str) or not isinstance(caps, (list, tuple, set, frozenset)) or \
                not all(isinstance(c, str) for c in caps):
            raise InvalidSpecError(f"capabilities={caps!r} must be a list of names from {list(BUILD_CAPABILITIES)}.")
        caps = tuple(sorted(set(caps)))
        if not set(caps) <= set(BUILD_CAPABILITIES):
            raise InvalidSpecError(f"capabilities={list(caps)!r}: a sandbox may keep only {list(BUILD_CAPABILITIES)}.")
        if name is not None and (not isinstance(name, str) or not VOLUME_NAME_RE.match(name)):
            raise InvalidSpecError(f"name={name!r} must be 1-63 letters, digits, '_', '.', '-', starting with a letter or digit.")
        if runtime not in RUNTIMES:
            raise InvalidSpecError(f"runtime={runtime!r} must be one of {', '.join(map(repr, RUNTIMES))}: 'native' "
                                   "(the default) or 'gvisor' (runsc; memory snapshots, restore and fork).")
        if on_idle not in ON_IDLE:
            raise InvalidSpecError(f"on_idle={on_idle!r} must be one of {', '.join(map(repr, ON_IDLE))}: what "
                                   "idle_timeout does to an idle sandbox.")
        return cls(
            command=argv, image=image, mounts=ms, network=network,
            limits=Limits.of(memory=memory, cpu=cpu, pids=pids, disk=disk),
            timeout=_timeout(timeout, "timeout"), idle_timeout=_timeout(idle_timeout, "idle_timeout"),
            workdir=abs_path(workdir, "workdir"), env=envs, tags=tgs, name=name, detach=bool(detach),
            capabilities=caps, runtime=runtime, on_idle=on_idle,
        )

    def to_dict(self, *, reveal: bool = False) -> dict:
        """The JSON form; a credential's value only with `reveal=True` (the SDK's request to the daemon)."""
        d = asdict(dataclasses.replace(self, network=Network.none()))
        d["mounts"] = [m.to_dict() for m in self.mounts]
        d["network"] = self.network.to_dict(reveal=reveal)
        return d

    @classmethod
    def from_dict(cls, d) -> "SandboxSpec":
        """Rebuild from `to_dict()` output (JSON), validating it exactly as `build` does: the daemon builds
        every spec it runs here, so a spec is valid wherever it was made. Fields it does not know are ignored."""
        if not isinstance(d, dict):
            raise InvalidSpecError(f"sandbox spec {d!r} is not an object; send the JSON that SandboxSpec.to_dict() makes.")
        limits = d.get("limits") or {}
        if not isinstance(limits, dict):
            raise InvalidSpecError(f"limits={limits!r} must be an object of memory, cpu, pids and disk.")
        command, mounts = d.get("command") or [], d.get("mounts") or []
        for what, v in (("command", command), ("mounts", mounts)):
            if not isinstance(v, (list, tuple)):
                raise InvalidSpecError(f"{what}={v!r} must be a list; send the JSON that SandboxSpec.to_dict() makes.")
        return cls.build(
            command, image=d.get("image", DEFAULT_IMAGE), mounts=[Mount.from_dict(m) for m in mounts],
            network=Network.from_dict(d.get("network", {"mode": "none"})),
            memory=limits.get("memory", DEFAULT_MEMORY), cpu=limits.get("cpu", DEFAULT_CPU),
            pids=limits.get("pids", DEFAULT_PIDS), disk=limits.get("disk", DEFAULT_DISK),
            timeout=d.get("timeout", DEFAULT_TIMEOUT), idle_timeout=d.get("idle_timeout"),
            workdir=d.get("workdir", DEFAULT_WORKDIR), env=_pairs_dict(d.get("env"), "env"),
            tags=_pairs_dict(d.get("tags"), "tags"), name=d.get("name"), detach=bool(d.get("detach", False)),
            capabilities=d.get("capabilities") or (), runtime=d.get("runtime", "native"),
            on_idle=d.get("on_idle", "terminate"))


def _pairs_dict(value, what: str) -> dict | None:
    """to_dict's sorted [key, value] pairs -> the dict `build` takes (which checks the strings)."""
    if value is None:
        return None
    if not isinstance(value, (list, tuple)) or not all(isinstance(p, (list, tuple)) and len(p) == 2
                                                       and isinstance(p[0], str) for p in value):
        raise InvalidSpecError(f"{what}={value!r} must be a list of [name, value] pairs, as SandboxSpec.to_dict() makes.")
    return dict(value)


def _str_pairs(value, what: str) -> tuple[tuple[str, str], ...]:
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise InvalidSpecError(f"{what}={value!r} must be a dict of str to str.")
    out = []
    for k, v in value.items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise InvalidSpecError(f"{what} entry {k!r}: {v!r} must map a str to a str.")
        out.append((k, v))
    return tuple(sorted(out))
