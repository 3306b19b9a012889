"""The sandbox file's shape: a JSON Schema built from the spec's own fields, and the check the loader runs.

The schema is made here from `SandboxSpec`, `Limits` and `Network`'s dataclass fields (a field the file does
not describe fails `schema()` at once, so the spec and the file cannot drift apart); docs/sandbox-file.schema.json
is its published copy, and a test keeps the two equal. `check()` holds a parsed file to the schema's structure
(types, unknown keys, bounds) and names the key path of what is wrong; what a value means (a size, a path, a
domain, the patterns of the schema) is then checked by the same constructors the Python API uses.
"""

from __future__ import annotations

import dataclasses
import difflib

from hutch.sandbox._spec import BUILD_CAPABILITIES, ON_IDLE, RUNTIMES, Limits, Network, SandboxSpec

#: Bounds of an untrusted file, beyond the file's size (_sbfile.MAX_FILE_BYTES).
MAX_ITEMS = 256          # entries of any array (mounts, steps, command, domains ...)
MAX_STRING = 8192        # characters of any string
MAX_KEYS = 256           # keys of any table (env, tags ...)

_STR = {"type": "string", "maxLength": MAX_STRING}
_STRS = {"type": "array", "items": _STR, "maxItems": MAX_ITEMS}
_SIZE = {"oneOf": [{"type": "integer", "minimum": 1}, {"type": "string", "pattern": r"^\s*\d+(\.\d+)?\s*[kKmMgGtT]?(i?[bB]?)?\s*$"}],
         "description": "bytes, or a size like '512M', '2G', '1.5GiB'"}
_SECONDS = {"oneOf": [{"type": "number", "exclusiveMinimum": 0}, {"const": "never"}],
            "description": "seconds, or \"never\""}
_NAME = {"type": "string", "pattern": r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$"}


def _table(props: dict, *, required=(), description: str = "") -> dict:
    t = {"type": "object", "properties": props, "additionalProperties": False, "maxProperties": MAX_KEYS}
    if required:
        t["required"] = list(required)
    if description:
        t["description"] = description
    return t


_ENV_FROM = _table({"from_env": {"type": "string", "pattern": r"^[A-Za-z_][A-Za-z0-9_]{0,127}$",
                                 "description": "the caller's environment variable to take the value from at create"}},
                   required=["from_env"], description="a value taken from the caller's environment when the sandbox "
                                                      "is created, so that no secret is written in the file")
_SECRET = _table({
    "from_env": {"type": "string", "pattern": r"^[A-Za-z_][A-Za-z0-9_]{0,127}$",
                 "description": "the caller's environment variable that holds the secret (read at create)"},
    "header": {"type": "string", "pattern": r"^[A-Za-z0-9!#$%&'*+.^_`|~-]{1,64}$",
               "description": "the request header the gateway sets, default Authorization"},
    "format": {"type": "string", "maxLength": 256, "description": "the header's value, '{}' standing for the secret; "
                                                                   "default 'Bearer {}'"},
    "requests_per_minute": {"type": "integer", "minimum": 1, "description": "requests to this host per minute"},
    "bytes_per_minute": {"type": "integer", "minimum": 1, "description": "bytes both ways to this host per minute"},
}, required=["from_env"], description="a credential the egress gateway adds to requests to this host; the sandbox "
                                      "never holds it (docs/egress.md, Credentials)")

_MOUNTS = {
    "bind": _table({"kind": {"const": "bind"}, "source": _STR, "target": _STR, "readonly": {"type": "boolean"},
                    "owner": {"oneOf": [{"const": "root"}, {"type": "integer", "minimum": 0},
                                        {"type": "array", "items": {"type": "integer", "minimum": 0},
                                         "minItems": 2, "maxItems": 2}]}},
                   required=["kind", "source", "target"],
                   description="a host path (relative to the file's directory), read-only unless readonly = false"),
    "tmpfs": _table({"kind": {"const": "tmpfs"}, "target": _STR, "size": _SIZE}, required=["kind", "target"],
                    description="an empty memory-backed directory"),
    "volume": _table({"kind": {"const": "volume"}, "source": _NAME, "target": _STR, "readonly": {"type": "boolean"}},
                     required=["kind", "source", "target"], description="a named hutch volume"),
    "memory": _table({"kind": {"const": "memory"}, "store": _STR, "target": _STR, "writable": {"type": "boolean"}},
                     required=["kind", "store", "target"],
                     description="a memory store's view (hutch.MemoryMount); store relative to the file's directory"),
}

_STEPS = {
    "apt": _table({"apt": _STRS}, required=["apt"], description="Image.apt_install"),
    "pip": _table({"pip": _STRS, "index_url": _STR}, required=["pip"], description="Image.pip_install"),
    "run": _table({"run": {"type": "array", "maxItems": MAX_ITEMS, "items": {"oneOf": [_STR, _STRS]}},
                   "network": {"$ref": "#/$defs/network"}}, required=["run"], description="Image.run_commands"),
    "copy": _table({"copy": _STR, "to": _STR}, required=["copy", "to"],
                   description="Image.copy_local_file / copy_local_dir; copy relative to the file's directory"),
    "env": _table({"env": {"type": "object", "additionalProperties": _STR, "maxProperties": MAX_KEYS}},
                  required=["env"], description="Image.env"),
    "workdir": _table({"workdir": _STR}, required=["workdir"], description="Image.workdir"),
}

_IMAGE = {"oneOf": [_STR, _table({
    "base": {**_STR, "description": "an image reference: debian-slim (default), code-interpreter, image:<id>"},
    "directory": {**_STR, "description": "a prepared root directory on the host (relative to the file's directory)"},
    "steps": {"type": "array", "maxItems": MAX_ITEMS, "items": {"oneOf": list(_STEPS.values())}},
})], "description": "an image reference, or a base and build steps (hutch.Image)"}

#: What each spec field is in the file. `capabilities` is left out on purpose: it is for image builds only.
_FIELDS = {
    "command": {**_STRS, "description": "argv of the sandbox's main process (none: it waits for exec)"},
    "image": _IMAGE,
    "mounts": {"type": "array", "maxItems": MAX_ITEMS, "items": {"oneOf": list(_MOUNTS.values())}},
    "network": {"$ref": "#/$defs/network"},
    "limits": None,   # built from Limits' fields below
    "timeout": {**_SECONDS, "description": "seconds the sandbox may live (default 300), or \"never\""},
    "idle_timeout": {**_SECONDS, "description": "seconds without activity before it ends (default: no limit)"},
    "workdir": {**_STR, "description": "working directory inside (default /home/user)"},
    "env": {"type": "object", "maxProperties": MAX_KEYS, "additionalProperties": {"oneOf": [_STR, _ENV_FROM]},
            "description": "environment variables; a secret only as { from_env = \"VAR\" }, never inline"},
    "tags": {"type": "object", "maxProperties": MAX_KEYS, "additionalProperties": _STR},
    "name": {**_NAME, "description": "a unique name to find the sandbox by"},
    "detach": {"type": "boolean", "description": "outlive the creating process (until timeout or kill)"},
    "runtime": {"enum": list(RUNTIMES), "description": "the kernel's namespaces (native, default) or gVisor's runsc"},
    "on_idle": {"enum": list(ON_IDLE), "description": "what idle_timeout does: terminate (default) or pause"},
}
_LIMITS = {"memory": {**_SIZE, "description": "RAM limit (default 512M)"},
           "cpu": {"type": "number", "minimum": 0.01, "maximum": 1024, "description": "CPUs (default 1.0)"},
           "pids": {"type": "integer", "minimum": 1, "maximum": 1 << 22, "description": "processes (default 512)"},
           "disk": {**_SIZE, "description": "bytes of writable layer (default 1G)"}}
_NETWORK = {"mode": {"enum": ["none", "allow", "open"]}, "domains": _STRS, "cidrs": _STRS,
            "ports": {"oneOf": [{"type": "array", "maxItems": 1024, "items": {"type": "integer", "minimum": 1,
                                                                            "maximum": 65535}},
                                {"const": "all"}]},
            "credentials": {"type": "object", "maxProperties": MAX_KEYS, "additionalProperties": _SECRET,
                            "description": "host -> the credential the gateway injects for it"},
            "requests_per_minute": {"type": "integer", "minimum": 1, "description": "requests (a connection relayed "
                                    "unread counts as one) through each domain or cidr entry per minute; under "
                                    "mode open, through all of it"},
            "bytes_per_minute": {"type": "integer", "minimum": 1, "description": "bytes both ways through each "
                                 "domain or cidr entry per minute; under mode open, through all of it"}}
NOT_IN_FILE = {"capabilities"}


def _fields_of(cls, described: dict, leave_out=()) -> dict:
    names = [f.name for f in dataclasses.fields(cls) if f.name not in leave_out]
    missing = [n for n in names if n not in described]
    if missing:
        raise RuntimeError(f"the sandbox file does not describe {cls.__name__}.{', '.join(missing)}: add it to "
                           "hutch/sandbox/_sbschema.py (and the loader) and regenerate docs/sandbox-file.schema.json")
    return {n: described[n] for n in names}


def schema() -> dict:
    """The JSON Schema of a sandbox file (draft 2020-12), derived from the spec's fields."""
    assert set(BUILD_CAPABILITIES)   # the one field left out is the build-only capabilities
    props = dict(_fields_of(SandboxSpec, _FIELDS, NOT_IN_FILE))
    props["limits"] = _table(_fields_of(Limits, _LIMITS))
    net = _fields_of(Network, _NETWORK)
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "hutch sandbox file",
        "description": "A sandbox declared in TOML: hutch.Sandbox.from_file(path), hutch run -f, hutch validate.",
        **_table({"version": {"const": 1, "description": "the file format's version (1)"}, **props}),
        "$defs": {"network": _table(net, description="egress policy (hutch.Network)")},
    }


# --- the structural check ---------------------------------------------------------------------------------


class Problem(Exception):
    """What is wrong, at which key path (a tuple of keys and indices)."""

    def __init__(self, path: tuple, message: str):
        super().__init__(message)
        self.path = path
        self.message = message


def check(doc: dict, root: dict | None = None) -> None:
    """Raise Problem for the first place `doc` leaves the schema."""
    root = root or schema()
    _check(doc, root, (), root)


def _type_ok(value, t: str) -> bool:
    if t == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if t == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, {"string": str, "boolean": bool, "array": list, "object": dict}[t])


def _describe(s: dict) -> str:
    if "const" in s:
        return repr(s["const"])
    if "enum" in s:
        return " or ".join(map(repr, s["enum"]))
    if "oneOf" in s:
        return " or ".join(_describe(b) for b in s["oneOf"])
    return {"string": "a string", "integer": "an integer", "number": "a number", "boolean": "true or false",
            "array": "an array", "object": "a table"}.get(str(s.get("type")), "a value")


def _branch(value, branches: list) -> dict | None:
    """The branch a table chooses: the one whose `kind` (or the first required key) it names."""
    for b in branches:
        if b.get("type") != "object" or not isinstance(value, dict):
            continue
        kind = b["properties"].get("kind", {}).get("const")
        if kind is not None and value.get("kind") == kind:
            return b
        if kind is None and b.get("required") and b["required"][0] in value:
            return b
    return None


def _check(value, s: dict, path: tuple, root: dict) -> None:
    if "$ref" in s:
        s = root["$defs"][s["$ref"].rsplit("/", 1)[1]]
    if "oneOf" in s:
        fits = [b for b in s["oneOf"] if _fits(value, b, root)]
        if fits:
            return
        typed = [b for b in s["oneOf"] if b.get("type") and _type_ok(value, b["type"])]
        chosen = _branch(value, s["oneOf"]) or (typed[0] if len(typed) == 1 else None)
        if chosen is not None:
            return _check(value, chosen, path, root)
        tables = [b for b in s["oneOf"] if b.get("type") == "object"]
        if isinstance(value, dict) and tables:
            keys = [b["properties"]["kind"]["const"] if "kind" in b["properties"] else b["required"][0]
                    for b in tables]
            if "kind" in tables[0]["properties"]:
                raise Problem(path, f"needs kind = one of {', '.join(map(repr, keys))}")
            raise Problem(path, f"needs exactly one of the keys {', '.join(keys)}")
        raise Problem(path, f"must be {_describe(s)}, not {_show(value)}")
    if "const" in s and value != s["const"]:
        raise Problem(path, f"must be {s['const']!r}, not {_show(value)}")
    if "enum" in s and value not in s["enum"]:
        raise Problem(path, f"must be {_describe(s)}, not {_show(value)}")
    t = s.get("type")
    if t and not _type_ok(value, t):
        raise Problem(path, f"must be {_describe(s)}, not {_show(value)}")
    if t == "string":
        if len(value) > s.get("maxLength", MAX_STRING):
            raise Problem(path, f"is longer than {s.get('maxLength', MAX_STRING)} characters")
        # a pattern is left to the constructor the value goes to, whose message names the fix in words
    if t in ("integer", "number"):
        if "minimum" in s and value < s["minimum"] or "exclusiveMinimum" in s and value <= s["exclusiveMinimum"]:
            least = s.get("minimum", s.get("exclusiveMinimum"))
            raise Problem(path, f"{value!r} is smaller than {least}" + ("" if "minimum" in s else " or equal to it"))
        if "maximum" in s and value > s["maximum"]:
            raise Problem(path, f"{value!r} is larger than {s['maximum']}")
    if t == "array":
        if len(value) > s.get("maxItems", MAX_ITEMS):
            raise Problem(path, f"has {len(value)} entries, more than {s.get('maxItems', MAX_ITEMS)}")
        if len(value) < s.get("minItems", 0):
            raise Problem(path, f"needs {s['minItems']} entries")
        for i, v in enumerate(value):
            _check(v, s.get("items", {}), path + (i,), root)
    if t == "object":
        if len(value) > s.get("maxProperties", MAX_KEYS):
            raise Problem(path, f"has {len(value)} keys, more than {s.get('maxProperties', MAX_KEYS)}")
        props = s.get("properties", {})
        for k, v in value.items():
            if k in props:
                _check(v, props[k], path + (k,), root)
            elif s.get("additionalProperties") is False:
                near = difflib.get_close_matches(k, list(props), n=1)
                hint = f"; did you mean {near[0]!r}?" if near else f"; the keys here are {', '.join(props)}"
                raise Problem(path + (k,), f"is not a known key{hint}")
            elif isinstance(s.get("additionalProperties"), dict):
                _check(v, s["additionalProperties"], path + (k,), root)
        for k in s.get("required", ()):
            if k not in value:
                raise Problem(path, f"needs the key {k!r}")


def _fits(value, s: dict, root: dict) -> bool:
    try:
        _check(value, s, (), root)
        return True
    except Problem:
        return False


def _show(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
