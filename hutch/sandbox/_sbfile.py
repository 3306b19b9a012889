"""`hutch.SandboxFile`: a sandbox declared in a TOML file, the Dockerfile of an agent's sandbox.

    # sandbox.toml
    command = ["python3", "agent.py"]
    timeout = 600
    image = { base = "debian-slim", steps = [{ pip = ["httpx"] }, { copy = "./agent", to = "/home/user" }] }
    [limits]
    memory = "1G"
    [network]
    domains = ["api.example.com"]
    [env]
    API_TOKEN = { from_env = "API_TOKEN" }   # taken from the caller's environment at create, never inline

    sb = hutch.Sandbox.from_file("sandbox.toml", timeout=60)   # keyword arguments override the file

A file is untrusted input: it is read only up to MAX_FILE_BYTES, it includes nothing, its relative host paths
are the file's directory's, and every value goes through the constructor the Python API uses (a bind's source
must exist, as `Mount.bind` wants). A SandboxFile is a frozen value (a SandboxSpec plus what is made at create:
the image's build steps, provided mounts, values from the environment) and `to_toml()` writes it back: loading
that text gives the same value. The shape is _sbschema's JSON Schema (docs/sandbox-file.schema.json).
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import stat
import tomllib
from dataclasses import dataclass, field

from hutch._core.errors import ConfigError, Error, NotFoundError, SandboxFileError
from hutch._core.settings import caller_environ
from hutch.sandbox import _provided, _sbschema
from hutch.sandbox._spec import Mount, Network, SandboxSpec, Secret
from hutch.sandbox.image import Image

MAX_FILE_BYTES = 256 * 1024
FORMAT_VERSION = 1
#: Env names that hold secrets by convention: such a value is taken from the environment, never written inline.
SECRET_NAME_RE = re.compile(r"(^|_)(KEY|APIKEY|TOKEN|SECRET|PASSWORD|PASSWD|PASS|CREDENTIALS?|PRIVATE)(_|$)", re.I)
_CREATE_KEYS = ("image", "mounts", "cpu", "memory", "pids", "disk", "timeout", "idle_timeout", "workdir", "env",
                "tags", "name", "network", "detach", "runtime", "on_idle")


@dataclass(frozen=True)
class SandboxFile:
    """A sandbox file, loaded: `spec` (image = the base reference), `image` (the base plus build steps), the
    `provided` mounts (hutch.MemoryMount) that come after spec.mounts, and `env_from` ((name, variable) pairs
    read from the caller's environment at create). Make one with `SandboxFile.load(path)`."""

    spec: SandboxSpec
    image: Image
    provided: tuple = ()
    env_from: tuple[tuple[str, str], ...] = ()
    path: str | None = field(default=None, compare=False)

    @classmethod
    def load(cls, path: "str | os.PathLike") -> "SandboxFile":
        """Read and validate a sandbox file; a SandboxFileError names the file, line and key, and the fix."""
        path = os.fspath(path)
        return cls.loads(_read(path), path=path)

    @classmethod
    def loads(cls, text: str, *, path: "str | None" = None) -> "SandboxFile":
        """Validate TOML text; relative host paths are those of `path`'s directory (else the working directory)."""
        where = path or "<sandbox file>"
        if len(text.encode("utf-8", "surrogatepass")) > MAX_FILE_BYTES:
            raise SandboxFileError(f"{where}: the file is larger than {MAX_FILE_BYTES} bytes; a sandbox file "
                                   "declares, it does not carry data (copy files with an image step).", path=where)
        _check_key_depth(text, where)
        try:
            doc = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            m = re.search(r"\(at line (\d+), column (\d+)\)", str(e))
            line = int(m.group(1)) if m else max(1, len(text.splitlines()))   # else: "at end of document"
            what = re.sub(r"\s*\(at line \d+, column (\d+)\)", r" at column \1", str(e)) if m else str(e)
            raise SandboxFileError(f"{where}:{line}: not valid TOML: {what}; fix the syntax "
                                   "(https://toml.io).", path=where, line=line) from None
        except RecursionError:
            raise SandboxFileError(f"{where}: values are nested too deeply; a sandbox file needs a few levels.",
                                   path=where) from None
        base = os.path.dirname(os.path.abspath(path)) if path else os.getcwd()
        try:
            return _Builder(doc, text, where, base).build()
        except RecursionError:
            raise SandboxFileError(f"{where}: values are nested too deeply; a sandbox file needs a few levels.",
                                   path=where) from None

    @classmethod
    def from_spec(cls, spec: SandboxSpec, *, image: "Image | None" = None) -> "SandboxFile":
        """The file of a spec (and of an image with build steps, whose base must be spec.image)."""
        image = image or Image(spec.image)
        if image.ref != spec.image:
            raise ConfigError(f"image {image.ref!r} is not the spec's {spec.image!r}; give the spec's image.")
        return cls(spec, image)

    @property
    def environment(self) -> tuple[str, ...]:
        """The caller's environment variables the file reads at create (env values and credentials), sorted."""
        return tuple(sorted({v for _, v in self.env_from} | {c.env for _, c in self.spec.network.credentials
                                                             if c.env and c.value is None}))

    def create_kwargs(self, *, environ=None, **overrides) -> tuple[tuple[str, ...], dict]:
        """(command, keyword arguments of Sandbox.create) with `overrides` (create's names, or `command`)
        replacing the file's values. What the file takes from the environment is read now, from `environ` (a
        mapping; default os.environ): give a file you do not trust only the variables it may have."""
        source = caller_environ() if environ is None else environ
        s = self.spec

        def read(var: str, what: str) -> str:
            if var not in source:
                raise ConfigError(f"{self.path or 'the sandbox file'}: {what} is taken from the environment "
                                  f"variable {var}, which is not set; export {var} before creating the sandbox.")
            return source[var]

        env = dict(s.env)
        for name, var in self.env_from:
            env[name] = read(var, f"env {name}")
        network = s.network
        if network.credentials:   # read here, from `source`, not later from os.environ
            network = dataclasses.replace(network, credentials=tuple(
                (h, c if c.value is not None or c.env is None else c.with_value(read(c.env, f"the credential for {h}")))
                for h, c in network.credentials))
        kw = dict(image=self.image, mounts=list(s.mounts) + list(self.provided), cpu=s.limits.cpu,
                  memory=s.limits.memory, pids=s.limits.pids, disk=s.limits.disk, timeout=s.timeout,
                  idle_timeout=s.idle_timeout, workdir=s.workdir, env=env, tags=dict(s.tags), name=s.name,
                  network=network, detach=s.detach, runtime=s.runtime, on_idle=s.on_idle)
        command = overrides.pop("command", s.command)
        unknown = sorted(set(overrides) - set(_CREATE_KEYS))
        if unknown:
            raise ConfigError(f"from_file() got unknown overrides {unknown}; give Sandbox.create's keyword "
                              f"arguments ({', '.join(_CREATE_KEYS)}) or command=[...].")
        if isinstance(command, str):
            raise ConfigError(f"command={command!r} must be an argv list like ['python3', 'agent.py'].")
        kw.update(overrides)
        return tuple(command), kw

    def to_toml(self) -> str:
        """The file's text; `SandboxFile.loads(f.to_toml()) == f`."""
        return _render(self)

    @staticmethod
    def schema() -> dict:
        """The JSON Schema of a sandbox file (published as docs/sandbox-file.schema.json)."""
        return _sbschema.schema()


#: Dots outside strings on one line: a dotted key's depth. tomllib takes time quadratic in it (a 256 KiB line of
#: `a.a.a...` keeps it busy for 40 s), and a sandbox file's deepest key has four.
MAX_KEY_DOTS = 32
_TRIPLES = ('"""', "'''")


def _check_key_depth(text: str, where: str) -> None:
    """Refuse a line with more than MAX_KEY_DOTS dots outside strings and comments, before tomllib sees it."""
    i, n, line, dots, quote = 0, len(text), 1, 0, None
    while i < n:
        c = text[i]
        if quote:
            if quote in _TRIPLES and text.startswith(quote, i):
                i, quote = i + 3, None
                continue
            if c == "\\" and quote in ('"', '"""'):
                i += 2
                continue
            if c == quote:
                quote = None
            elif c == "\n":
                line += 1
                if quote not in _TRIPLES:
                    quote = None   # a one-line string cannot go on (tomllib will say so)
        elif c in "\"'":
            quote = c * 3 if text.startswith(c * 3, i) else c
            i += len(quote)
            continue
        elif c == "#":
            j = text.find("\n", i)
            i = n if j < 0 else j
            continue
        elif c == "\n":
            line, dots = line + 1, 0
        elif c == ".":
            dots += 1
            if dots > MAX_KEY_DOTS:
                raise SandboxFileError(f"{where}:{line}: more than {MAX_KEY_DOTS} dots outside strings on one line; "
                                       "a sandbox file's keys are a few levels deep (quote a name that has dots).",
                                       path=where, line=line)
        i += 1


def _read(path: str) -> str:
    """The file's text, reading at most MAX_FILE_BYTES + 1 of a regular file (no FIFO or device waits)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise SandboxFileError(f"{path}: cannot read the sandbox file ({e.strerror}); give the path of a TOML file.",
                               path=path) from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise SandboxFileError(f"{path}: is not a regular file; give the path of a TOML file.", path=path)
        data = b""
        while len(data) <= MAX_FILE_BYTES and (chunk := os.read(fd, MAX_FILE_BYTES + 1 - len(data))):
            data += chunk
    finally:
        os.close(fd)
    if len(data) > MAX_FILE_BYTES:
        raise SandboxFileError(f"{path}: the file is larger than {MAX_FILE_BYTES} bytes; a sandbox file declares, "
                               "it does not carry data (copy files with an image step).", path=path)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise SandboxFileError(f"{path}: is not UTF-8 (byte {e.start}); save it as UTF-8.", path=path) from None


class _Builder:
    """One pass over a parsed file: the schema's structure first, then each part through its constructor,
    every error placed at its key's line."""

    def __init__(self, doc: dict, text: str, where: str, base: str):
        self.doc, self.where, self.base = doc, where, base
        self.lines = _Lines(text)

    def fail(self, path: tuple, message: str) -> SandboxFileError:
        path = _narrow(self.doc, path, message)
        line = self.lines.line_of(path, self.doc)
        key = _key_text(path)
        return SandboxFileError(f"{self.where}:{line}: {key + ': ' if key else ''}{message}",
                                path=self.where, line=line, key=key or None)

    def at(self, path: tuple, make):
        try:
            return make()
        except SandboxFileError:
            raise
        except Error as e:   # a constructor's message names the fix
            raise self.fail(path, str(e)) from None

    def host_path(self, p: str) -> str:
        return os.path.normpath(os.path.join(self.base, os.path.expanduser(p)))

    def build(self) -> SandboxFile:
        d = self.doc
        try:
            _sbschema.check(d)
        except _sbschema.Problem as p:
            raise self.fail(p.path, p.message) from None
        image = self.at(("image",), lambda: self.image(d.get("image")))
        mounts: list = []
        provided: list = []
        for i, m in enumerate(d.get("mounts", ())):
            made = self.at(("mounts", i), lambda m=m: self.mount(m))
            (provided if not isinstance(made, Mount) else mounts).append(made)
        net = d.get("network", {})
        network = self.at(("network",), lambda: self.network(net))
        limits = d.get("limits", {})
        for k, v in limits.items():
            self.at(("limits", k), lambda k=k, v=v: SandboxSpec.build(**{k: v}))
        env, env_from = {}, []
        for k, v in d.get("env", {}).items():
            if isinstance(v, dict):
                env_from.append((k, v["from_env"]))
            elif SECRET_NAME_RE.search(k):
                raise self.fail(("env", k), f"{k} looks like a secret, and a secret is never written in the file: "
                                            f'write {k} = {{ from_env = "{k}" }} to take it from the environment '
                                            "at create.")
            else:
                env[k] = v
            self.at(("env", k), lambda k=k: SandboxSpec.build(env={k: ""}))
        kw = {k: _seconds(d[k]) for k in ("timeout", "idle_timeout") if k in d}
        kw.update({k: d[k] for k in ("workdir", "name", "detach", "tags", "runtime", "on_idle") if k in d})
        for k, v in kw.items():
            self.at((k,), lambda k=k, v=v: SandboxSpec.build(**{k: v}))
        spec = self.at(("mounts",), lambda: SandboxSpec.build(
            tuple(d.get("command", ())), image=image.ref, mounts=mounts, network=network, env=env, **limits, **kw))
        targets = [m.target for m in spec.mounts] + [p.target for p in provided]
        dup = sorted({t for t in targets if targets.count(t) > 1})
        if dup:
            raise self.fail(("mounts",), f"two mounts share the target {dup[0]}; give each mount its own path.")
        return SandboxFile(spec, image, tuple(provided), tuple(sorted(env_from)), path=self.where)

    def image(self, v) -> Image:
        if v is None:
            return Image.debian_slim()
        if isinstance(v, str):
            return _base(v)
        if "base" in v and "directory" in v:
            raise ConfigError("give base or directory, not both.")
        image = Image.from_directory(self.host_path(v["directory"])) if "directory" in v else _base(
            v.get("base", "debian-slim"))
        for i, step in enumerate(v.get("steps", ())):
            image = self.at(("image", "steps", i), lambda step=step, image=image: self.step(image, step))
        return image

    def step(self, image: Image, s: dict) -> Image:
        if "apt" in s:
            return image.apt_install(*s["apt"])
        if "pip" in s:
            return image.pip_install(*s["pip"], index_url=s.get("index_url"))
        if "run" in s:
            net = self.network(s["network"]) if "network" in s else None
            return image.run_commands(*s["run"], network=net)
        if "copy" in s:
            src = self.host_path(s["copy"])
            if not os.path.exists(src):   # neither a file nor a directory: say that, not "not a file"
                raise NotFoundError(f"copy: {src} does not exist on this host; fix the path (a file or a directory, "
                                    "relative to the sandbox file).")
            return (image.copy_local_dir if os.path.isdir(src) else image.copy_local_file)(src, s["to"])
        if "env" in s:
            return image.env(s["env"])
        return image.workdir(s["workdir"])

    def mount(self, m: dict):
        kind = m["kind"]
        if kind == "bind":
            owner = m.get("owner")
            return Mount.bind(self.host_path(m["source"]), m["target"], readonly=m.get("readonly", True),
                              owner=tuple(owner) if isinstance(owner, list) else owner)
        if kind == "tmpfs":
            return Mount.tmpfs(m["target"], size=m.get("size", "64M"))
        if kind == "volume":
            return Mount.volume(m["source"], m["target"], readonly=m.get("readonly", False))
        return _provided.provider(kind)(self.host_path(m["store"]), m["target"], writable=m.get("writable", False))

    def network(self, n: dict) -> Network:
        mode = n.get("mode", "allow" if n.get("domains") or n.get("cidrs") else "none")
        budget = {k: n[k] for k in ("requests_per_minute", "bytes_per_minute") if k in n}
        if mode != "allow":
            extra = sorted(k for k in ("domains", "cidrs", "ports", "credentials") if k in n)
            if extra:
                raise ConfigError(f"mode = {mode!r} takes no {', '.join(extra)}; use mode = \"allow\" with them.")
            if mode == "open":
                return Network.open(**budget)
            if budget:
                raise ConfigError(f"mode = \"none\" takes no {', '.join(sorted(budget))}: nothing moves to budget; "
                                  "use them with mode = \"allow\" or \"open\".")
            return Network.none()
        ports = n.get("ports", [443, 80])
        creds = {h: Secret.from_env(c["from_env"], header=c.get("header", "Authorization"),
                                    format=c.get("format", "Bearer {}"),
                                    requests_per_minute=c.get("requests_per_minute"),
                                    bytes_per_minute=c.get("bytes_per_minute"))
                 for h, c in n.get("credentials", {}).items()}
        return Network.allow(domains=n.get("domains", []), cidrs=n.get("cidrs", []),
                             ports=None if ports == "all" else ports, credentials=creds, **budget)


def _base(ref: str) -> Image:
    if ref == "code-interpreter":
        return Image.code_interpreter()
    return Image.of(ref)


def _seconds(v):
    return None if v == "never" else v


def _key_text(path: tuple) -> str:
    out = ""
    for p in path:
        if isinstance(p, int):
            out += f"[{p}]"
        else:
            out += ("." if out else "") + (p if re.fullmatch(r"[A-Za-z0-9_-]+", p) else _str(p))
    return out


class _Lines:
    """Which line of the text defines which key path; a path not found falls back to its nearest parent's line."""

    _KEY = r'(?:[A-Za-z0-9_-]+|"(?:[^"\\]|\\.)*"|\'[^\']*\')'

    def __init__(self, text: str):
        self.where: dict[tuple, int] = {}
        self.text_lines = text.splitlines()
        table: tuple = ()
        counters: dict[tuple, int] = {}
        array: tuple | None = None      # the key of a multi-line array being read, its depth and entries
        depth = entries = 0
        for n, raw in enumerate(text.splitlines(), 1):
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            if array is not None:
                if depth == 1 and line[0] in "{[\"'0123456789-tf":
                    self.where.setdefault(array + (entries,), n)
                    entries += 1
                depth += _depth(line)
                if depth <= 0:
                    array = None
                continue
            if m := re.match(rf"^\[\[\s*({self._KEY}(?:\s*\.\s*{self._KEY})*)\s*\]\]", line):
                key = _keys(m.group(1))
                counters[key] = counters.get(key, -1) + 1
                table = key + (counters[key],)
                self.where.setdefault(table, n)
            elif m := re.match(rf"^\[\s*({self._KEY}(?:\s*\.\s*{self._KEY})*)\s*\]", line):
                table = _keys(m.group(1))
                self.where.setdefault(table, n)
            elif m := re.match(rf"^({self._KEY}(?:\s*\.\s*{self._KEY})*)\s*=\s*(.*)$", line):
                key = table + _keys(m.group(1))
                self.where.setdefault(key, n)
                rest = m.group(2)
                if rest.startswith("[") and _depth(rest) > 0:
                    array, depth, entries = key, _depth(rest), 0
                    if rest[1:].strip() and rest[1:].strip()[0] not in "#":
                        entries = 1
                        self.where.setdefault(key + (0,), n)

    def line_of(self, path: tuple, doc: dict) -> int:
        """The line of `path`: its own if recorded, else the first line at or after its nearest recorded parent's
        that holds its first string (or its key)."""
        for i in range(len(path), -1, -1):
            if path[:i] in self.where or i == 0:
                start = self.where.get(path[:i], 1)
                break
        if i == len(path):
            return start
        needle = _first_string(_get(doc, path))
        needles = [_str(needle), f"'{needle}'"] if needle is not None else []
        if isinstance(path[-1], str):
            needles.append(path[-1])
        for n, line in enumerate(self.text_lines[start - 1:], start):
            if any(x in line for x in needles):
                return n
        return start


def _get(doc, path: tuple):
    for p in path:
        try:
            doc = doc[p]
        except (KeyError, IndexError, TypeError):
            return None
    return doc


def _first_string(v) -> str | None:
    if isinstance(v, str):
        return v
    if isinstance(v, dict):
        v = list(v.values())
    if isinstance(v, list):
        for x in v:
            if (s := _first_string(x)) is not None:
                return s
    return None


#: A constructor's message names the part it refuses ("Mount.bind source ...", "domain 'x' ..."): the key of it.
_PART_RE = {"mounts": re.compile(r"^Mount\.\w+ (source|target|size|owner|volume)\b"),
            "network": re.compile(r"^(domain|cidr|port) ('[^']*'|\S+)")}


def _narrow(doc: dict, path: tuple, message: str) -> tuple:
    """A constructor's error on a whole table -> the key (and entry) it names, where the message says."""
    if len(path) == 2 and path[0] == "mounts" and (m := _PART_RE["mounts"].match(message)):
        key = {"volume": "source"}.get(m.group(1), m.group(1))
        return path + (key,) if isinstance(_get(doc, path), dict) and key in _get(doc, path) else path
    if path == ("network",) and (m := _PART_RE["network"].match(message)):
        key = m.group(1) + "s"
        values = _get(doc, path + (key,))
        if isinstance(values, list):
            for i, v in enumerate(values):
                if repr(v) == m.group(2) or str(v) == m.group(2):
                    return path + (key, i)
            return path + (key,)
    return path


def _keys(dotted: str) -> tuple:
    parts = re.findall(r'"((?:[^"\\]|\\.)*)"|\'([^\']*)\'|([A-Za-z0-9_-]+)', dotted)
    return tuple(a or b or c for a, b, c in parts)


def _depth(text: str) -> int:
    """How much deeper in brackets a line leaves us (strings and comments skipped)."""
    d, q, i = 0, None, 0
    while i < len(text):
        c = text[i]
        if q:
            if c == "\\" and q == '"':
                i += 1
            elif c == q:
                q = None
        elif c in "\"'":
            q = c
        elif c == "#":
            break
        elif c in "[{":
            d += 1
        elif c in "]}":
            d -= 1
        i += 1
    return d


# --- writing ---------------------------------------------------------------------------------------------


def _str(s: str) -> str:
    out = []
    for c in s:
        o = ord(c)
        if c in '"\\':
            out.append("\\" + c)
        elif o < 0x20 or o == 0x7F:
            out.append({"\n": "\\n", "\t": "\\t", "\r": "\\r"}.get(c, f"\\u{o:04X}"))
        else:
            out.append(c)
    return '"' + "".join(out) + '"'


def _k(key: str) -> str:
    return key if re.fullmatch(r"[A-Za-z0-9_-]+", key) else _str(key)


def _v(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if not math.isfinite(v):
            raise ConfigError(f"{v!r} cannot be written in a sandbox file.")
        return repr(v)
    if isinstance(v, str):
        return _str(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_v(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{_k(k)} = {_v(x)}" for k, x in v.items()) + " }" if v else "{}"
    raise ConfigError(f"{v!r} cannot be written in a sandbox file.")


def _network_dict(n: Network) -> dict:
    budget = {k: getattr(n, k) for k in ("requests_per_minute", "bytes_per_minute") if getattr(n, k) is not None}
    if n.mode != "allow":
        return {"mode": n.mode, **budget}
    return {"mode": "allow", "domains": list(n.domains), "cidrs": list(n.cidrs),
            "ports": list(n.ports) if n.ports else "all", **budget}


def _credentials(n: Network) -> list[str]:
    out = []
    for host, s in n.credentials:
        if s.env is None:
            raise ConfigError(f"the credential for {host} is a Secret.from_value, and a sandbox file never holds a "
                              "secret: use Secret.from_env('VAR') to write it as a reference.")
        d = {"from_env": s.env, "header": s.header, "format": s.format}
        d.update({k: getattr(s, k) for k in ("requests_per_minute", "bytes_per_minute") if getattr(s, k)})
        out += ["", f"[network.credentials.{_str(host)}]"] + [f"{k} = {_v(v)}" for k, v in d.items()]
    return out


def _step_dict(step) -> dict:
    a = step.args
    if step.kind == "apt":
        return {"apt": a["packages"]}
    if step.kind == "pip":
        return {"pip": a["packages"], **({"index_url": a["index_url"]} if a.get("index_url") else {})}
    if step.kind == "run":
        return {"run": a["commands"], **({"network": _network_dict(Network.from_dict(a["network"]))}
                                         if a.get("network") else {})}
    if step.kind == "copy":
        return {"copy": step.local, "to": a["remote"]}
    return {step.kind: a[step.kind]}


def _render(f: SandboxFile) -> str:
    s = f.spec
    if s.capabilities:
        raise ConfigError("capabilities are for image builds only and have no place in a sandbox file.")
    top: list[tuple[str, object]] = [("version", FORMAT_VERSION)]
    if s.command:
        top.append(("command", list(s.command)))
    defaults = SandboxSpec()
    for k in ("name", "detach", "workdir", "runtime", "on_idle"):
        if getattr(s, k) != getattr(defaults, k):
            top.append((k, getattr(s, k)))
    for k in ("timeout", "idle_timeout"):
        if getattr(s, k) != getattr(defaults, k):
            top.append((k, "never" if getattr(s, k) is None else getattr(s, k)))
    if f.image.steps:
        base = f.image.ref
        top.append(("image", {**({"directory": base[4:]} if base.startswith("dir:") else {"base": base}),
                              "steps": [_step_dict(st) for st in f.image.steps]}))
    else:
        top.append(("image", f.image.ref))
    out = [f"{_k(k)} = {_v(v)}" for k, v in top]
    out += ["", "[limits]"] + [f"{x.name} = {_v(getattr(s.limits, x.name))}" for x in dataclasses.fields(s.limits)]
    out += ["", "[network]"] + [f"{k} = {_v(v)}" for k, v in _network_dict(s.network).items()]
    out += _credentials(s.network)
    env: dict[str, object] = {k: v for k, v in s.env}
    for k, v in env.items():
        if SECRET_NAME_RE.search(k):
            raise ConfigError(f"env {k} looks like a secret, which a sandbox file never holds inline; give it as "
                              f"SandboxFile(env_from=(('{k}', 'VAR'),)) to take it from the environment at create.")
    env.update({k: {"from_env": var} for k, var in f.env_from})
    if env:
        out += ["", "[env]"] + [f"{_k(k)} = {_v(v)}" for k, v in sorted(env.items())]
    if s.tags:
        out += ["", "[tags]"] + [f"{_k(k)} = {_v(v)}" for k, v in s.tags]
    for m in s.mounts:
        d = {k: v for k, v in m.to_dict().items() if v is not None}
        if m.kind == "tmpfs":
            d.pop("readonly", None)
        if "owner" in d:
            d["owner"] = list(d["owner"])
        out += ["", "[[mounts]]"] + [f"{k} = {_v(v)}" for k, v in d.items()]
    for p in f.provided:
        out += ["", "[[mounts]]", f"kind = {_v(_provided.kind_of(p))}", f"store = {_v(p.store)}",
                f"target = {_v(p.target)}", f"writable = {_v(p.writable)}"]
    return "\n".join(out) + "\n"
