"""Every environment variable hutch reads: one table, typed, with its default and its meaning.

Which setting wins: an explicit argument, then the environment variable, then the default here.
Each value is read when it is used (`STATE_DIR.get()`), not when a module is imported, so a
daemon started with its own environment and a test's `monkeypatch.setenv` see the value now.
An empty variable counts as unset. A bad value is a ConfigError naming the variable and the fix.

No other module of hutch reads os.environ (tests/test_settings.py holds the code to that), except:
the stdlib-only modules of the zygote, the inits and the sandbox's inside, which never see these
variables; and a child process's environment passed on whole (`env=dict(os.environ, ...)`).

docs/settings.md is this table, written by `python -m hutch._core.settings --markdown > docs/settings.md`.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, TypeVar

from hutch._core.errors import ConfigError

T = TypeVar("T")

#: The groups of the table, in its order: who reads the variables of each.
GROUPS = {
    "caller": "The caller's process (the SDK, the CLI)",
    "daemon": "The host daemon (`hutch serve`), read from its own environment",
    "build": "Image builds (run by the caller: `Image.build`, `hutch image build`)",
    "memory": "Memory stores, search and the MCP server",
    "dev": "Tests, benchmarks and examples of this repository",
}


@dataclass(frozen=True)
class Setting(Generic[T]):
    """One environment variable: its name, how its text becomes a value, its default and meaning."""

    name: str
    kind: str                       # the table's "type" column
    parse: Callable[[str], T]       # raises ValueError (its message says what is wrong) on a bad value
    default: T                      # None when unset means "not given" (then T includes None)
    meaning: str
    group: str
    shown_default: str | None = None   # the table's text when the default is not a plain value
    secret: bool = False               # never printed, not even in an error

    @property
    def default_text(self) -> str:
        if self.shown_default is not None:
            return self.shown_default
        if self.default is None:
            return "unset"
        if isinstance(self.default, bool):
            return "1" if self.default else "0"
        if isinstance(self.default, (tuple, list)):
            return ",".join(map(str, self.default))
        return str(self.default)

    def raw(self, environ: Mapping[str, str] | None = None) -> str | None:
        """The variable's text, or None when it is unset or empty."""
        value = (os.environ if environ is None else environ).get(self.name)
        return value or None

    def is_set(self, environ: Mapping[str, str] | None = None) -> bool:
        return self.raw(environ) is not None

    def get(self, environ: Mapping[str, str] | None = None) -> T:
        """The typed value now (from `environ`, default os.environ), else the default."""
        raw = self.raw(environ)
        if raw is None:
            return self.default
        return self.parse_text(raw)

    def parse_text(self, raw: str) -> T:
        try:
            return self.parse(raw)
        except ValueError as e:
            shown = "(the value given)" if self.secret else f"={raw!r}"
            raise ConfigError(f"${self.name}{shown} {e}; fix it or unset it for the default "
                              f"({self.default_text}). docs/settings.md lists every setting.") from None

    def pop(self) -> str | None:
        """Take the variable out of this process's environment (a secret nothing we start may inherit);
        its text, or None when it was unset or empty."""
        return os.environ.pop(self.name, None) or None


# ---- parsers: each raises ValueError saying what a good value is ----

def _text(raw: str) -> str:
    return raw


def _path(raw: str) -> Path:
    if "\0" in raw:
        raise ValueError("holds a NUL byte; give a file system path")
    return Path(raw)


def _positive_int(raw: str) -> int:
    try:
        value = int(raw.strip())
    except ValueError:
        value = 0
    if value <= 0:
        raise ValueError("must be a positive whole number")
    return value


def _count(raw: str) -> int:
    try:
        value = int(raw.strip())
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError("must be a whole number, 0 or more")
    return value


def _seconds(raw: str) -> float:
    try:
        value = float(raw.strip())
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise ValueError("must be a number of seconds, 0 or more")
    return value


_TRUE, _FALSE = {"1", "true", "yes", "on"}, {"0", "false", "no", "off"}


def _flag(raw: str) -> bool:
    v = raw.strip().lower()
    if v in _TRUE:
        return True
    if v in _FALSE:
        return False
    raise ValueError("must be 1 or 0")


def _names(raw: str) -> tuple[str, ...]:
    names = tuple(x.strip() for x in raw.split(",") if x.strip())
    if not names:
        raise ValueError("must be a comma-separated list of names")
    return names


def _choice(*options: str) -> Callable[[str], str]:
    def parse(raw: str) -> str:
        if raw not in options:
            raise ValueError(f"must be one of {', '.join(options)}")
        return raw
    return parse


def _url(raw: str) -> str:
    if not raw.startswith(("http://", "https://")) or len(raw) < 10:
        raise ValueError("must be a URL like http://HOST/PATH")
    return raw


SETTINGS: dict[str, Setting] = {}


def _setting(name: str, kind: str, parse: Callable[[str], T], default: T, meaning: str, group: str,
             **kw) -> Setting[T]:
    assert group in GROUPS and name not in SETTINGS, name
    s = Setting(name, kind, parse, default, meaning, group, **kw)
    SETTINGS[name] = s
    return s


# ---- the table ----

STATE_DIR = _setting(
    "HUTCH_STATE_DIR", "path", _path, Path("/var/lib/hutch"),
    "Persistent state: images, layers, volumes, snapshots.", "daemon")
RUN_DIR = _setting(
    "HUTCH_RUN_DIR", "path", _path, Path("/run/hutch"),
    "Runtime state: the daemon's socket (the SDK finds it there too), pid file, per-sandbox records.", "daemon")
SOCKET = _setting(
    "HUTCH_SOCKET", "path", _path, None,
    "The Unix socket of the host daemon (the daemon listens on it, the SDK and CLI connect to it).", "caller",
    shown_default="$HUTCH_RUN_DIR/hutch.sock")
URL = _setting(
    "HUTCH_URL", "URL", _text, None,
    "A remote daemon's TLS listener (https://HOST:PORT, `hutch serve --listen`); unset: the local socket.",
    "caller", shown_default="unset (the local socket)")
TOKEN = _setting(
    "HUTCH_TOKEN", "secret", _text, None,
    "The bearer token of a daemon's TCP listener: the SDK sends it to $HUTCH_URL; `hutch serve` takes it out "
    "of its environment.", "caller", secret=True)
TOKEN_FILE = _setting(
    "HUTCH_TOKEN_FILE", "path", _path, None,
    "A file (mode 0600) holding $HUTCH_TOKEN, read when HUTCH_TOKEN is unset.", "caller")
CA = _setting(
    "HUTCH_CA", "path", _path, None,
    "A PEM file of the CA (or the certificate itself) that signs a remote daemon's certificate.", "caller")
FINGERPRINT = _setting(
    "HUTCH_FINGERPRINT", "SHA-256", _text, None,
    "Pins a remote daemon's certificate by its SHA-256 fingerprint (`hutch serve --listen` prints it).", "caller")
TERM = _setting(
    "TERM", "text", _text, None,
    "The terminal type a terminal session (`hutch run -it`) gives the sandbox's programs.", "caller")

PATH = _setting(
    "PATH", "text", _text, None,
    "Where the daemon finds the programs it runs by name (ip, nft, git, runsc): `hutch serve` refuses to start "
    "if another user owns or may write one of its directories.", "daemon", shown_default="the system's")

USERNS = _setting(
    "HUTCH_USERNS", "flag", _flag, True,
    "1: each sandbox in a user namespace of its own; 0 opts out (root inside is host root without "
    "capabilities).", "daemon")
NATIVE_INIT = _setting(
    "HUTCH_NATIVE_INIT", "flag", _flag, True,
    "1: each sandbox's init serves as the static C init (native/initd.c, built by scripts/setup.sh) once its "
    "root is built; 0 keeps the Python init (also what a checkout without the binary gets).", "daemon")
WARM_POOL = _setting(
    "HUTCH_WARM_POOL", "count", _count, 4,
    "Inits kept ready in their cgroups and namespaces, so a create takes one instead of starting one.", "daemon")
LAYERS = _setting(
    "HUTCH_LAYERS", "disk|tmpfs", _choice("disk", "tmpfs"), "disk",
    "Where writable layers live: disk (a btrfs store, a quota per sandbox) or tmpfs (what a sandbox writes "
    "counts against its memory limit).", "daemon")
MEMORY_SNAPSHOTS_MAX = _setting(
    "HUTCH_MEMORY_SNAPSHOTS_MAX", "bytes", _positive_int, 64 * 1024**3,
    "All memory snapshots of a host together; a snapshot past it is refused.", "daemon",
    shown_default="68719476736 (64 GiB)")
IMPORT_MAX_ENTRIES = _setting(
    "HUTCH_IMPORT_MAX_ENTRIES", "count", _positive_int, 1_000_000,
    "Entries one image archive import may hold.", "daemon")
IMPORT_MAX_BYTES = _setting(
    "HUTCH_IMPORT_MAX_BYTES", "bytes", _positive_int, 64 << 30,
    "Bytes one image archive import may unpack.", "daemon", shown_default="68719476736 (64 GiB)")
DEBIAN_MIRROR = _setting(
    "HUTCH_DEBIAN_MIRROR", "URL", _url, None,
    "The Debian mirror debootstrap makes the base image from.", "daemon",
    shown_default="unset (debootstrap's default, deb.debian.org)")
EGRESS_RESOLVERS = _setting(
    "HUTCH_EGRESS_RESOLVERS", "list", _names, None,
    "The egress gateway's upstream DNS resolvers (IPv4[:port], comma-separated).", "daemon",
    shown_default="the nameservers of /etc/resolv.conf")
EGRESS_SUBNET = _setting(
    "HUTCH_EGRESS_SUBNET", "IPv4 network", _text, None,
    "The subnet the egress gateway gives sandboxes' links.", "daemon",
    shown_default="the first free of hutch's candidates")
EGRESS_UPSTREAM_CA = _setting(
    "HUTCH_EGRESS_UPSTREAM_CA", "path", _path, None,
    "A PEM bundle the gateway trusts when it dials a credential's host.", "daemon",
    shown_default="unset (the system's CA store)")

APT_HOSTS: Setting[tuple[str, ...]] = _setting(
    "HUTCH_APT_HOSTS", "list", _names, ("deb.debian.org", "security.debian.org"),
    "The names an apt build step may reach (comma-separated).", "build")
PIP_HOSTS: Setting[tuple[str, ...]] = _setting(
    "HUTCH_PIP_HOSTS", "list", _names, ("pypi.org", "files.pythonhosted.org"),
    "The names a pip build step may reach (comma-separated).", "build")
PIP_CERT = _setting(
    "HUTCH_PIP_CERT", "path", _path, None,
    "A CA bundle a pip build step trusts (a TLS-inspecting proxy's); else $PIP_CERT, else /etc/pip.conf's cert.",
    "build")
PIP_CERT_PIP = _setting(
    "PIP_CERT", "path", _path, None,
    "pip's own variable, read when HUTCH_PIP_CERT is unset.", "build")

MEMORY = _setting(
    "HUTCH_MEMORY", "path", _path, None,
    "The store `hutch mem` and `hutch mcp` use when --store is not given.", "memory",
    shown_default="the current directory")
AUTHOR = _setting(
    "HUTCH_AUTHOR", "Name <email>", _text, None,
    "The author of a store's commits when a write names none.", "memory", shown_default="hutch's own identity")
WORDNET_DIR = _setting(
    "HUTCH_WORDNET_DIR", "path", _path, Path("/usr/share/wordnet"),
    "Where WordNet's dictionary files are (search's category reading); missing: that reading is off.", "memory")
MCP_TOKEN = _setting(
    "HUTCH_MCP_TOKEN", "secret", _text, None,
    "The bearer token of `hutch mcp --http` (taken out of its environment); unset: a new one each start.",
    "memory", secret=True)
OPENAI_API_KEY = _setting(
    "OPENAI_API_KEY", "secret", _text, None,
    "The key for an OpenAI-compatible embedder or reasoner when none is given.", "memory", secret=True)
REASONER_URL = _setting(
    "HUTCH_REASONER_URL", "URL", _url, None,
    "The OpenAI-compatible endpoint (base URL, e.g. http://127.0.0.1:8000/v1) of search's optional reasoner: "
    "`OpenAIReasoner.from_settings()`, `hutch mem search --reasoner`, bench/locomo.py's reasoner rows.", "memory",
    shown_default="unset (no reasoner)")
REASONER_MODEL = _setting(
    "HUTCH_REASONER_MODEL", "text", _text, "gpt-4o-mini",
    "The reasoner's model name.", "memory")
REASONER_KEY_FILE = _setting(
    "HUTCH_REASONER_KEY_FILE", "path", _path, None,
    "A file (mode 0600) holding the reasoner's API key; read before $OPENAI_API_KEY.", "memory")
REASONER_TIMEOUT = _setting(
    "HUTCH_REASONER_TIMEOUT", "seconds", _seconds, 15.0,
    "`OpenAIReasoner.from_settings()`: what one request to the reasoner may take in all; past it search answers "
    "without it.", "memory")

FUZZ_EXAMPLES = _setting(
    "HUTCH_FUZZ_EXAMPLES", "count", _positive_int, 100,
    "tests/sandbox_runtime/test_rt_fuzz.py: examples per API operation.", "dev")
FUZZ_SECONDS = _setting(
    "HUTCH_FUZZ_SECONDS", "seconds", _seconds, 150.0,
    "tests/sandbox_runtime/test_rt_fuzz.py: the whole fuzzing run's budget.", "dev")
LOCOMO_DIR = _setting(
    "HUTCH_LOCOMO_DIR", "path", _path, Path(__file__).resolve().parents[3] / "shared" / "data" / "locomo-dev",
    "The LoCoMo data set (bench/locomo.py, bench/memory_store.py, the ingest test).", "dev",
    shown_default="shared/data/locomo-dev beside the repository")


def check(group: str | None = None) -> None:
    """Read every setting (of `group`) now: the first bad value raises its ConfigError."""
    for s in SETTINGS.values():
        if group is None or s.group == group:
            s.get()


def caller_environ() -> Mapping[str, str]:
    """This process's environment, for variables the caller names itself (a sandbox file's
    `{ from_env = "VAR" }`, `Secret.from_env("VAR")`): those are the caller's values, not hutch's settings."""
    return os.environ


def markdown() -> str:
    """docs/settings.md: the table, by group."""
    out = ["# Settings", "",
           "<!-- written by `python -m hutch._core.settings --markdown > docs/settings.md`; "
           "tests/test_settings.py fails when it is stale -->", "",
           "Every environment variable hutch reads, from one module (`hutch/_core/settings.py`). Which setting wins: "
           "an explicit argument, then the variable, then the default. A variable is read when it is used; "
           "an empty one counts as unset; a bad value is an error naming the variable and the fix.", ""]
    for group, title in GROUPS.items():
        out += [f"## {title}", "", "| Variable | Type | Default | Meaning |", "|---|---|---|---|"]
        for s in SETTINGS.values():
            if s.group == group:
                cells = (f"`{s.name}`", s.kind, s.default_text, s.meaning)
                out.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
        out.append("")
    return "\n".join(out)


def main(argv: list[str]) -> int:
    if argv == ["--markdown"]:
        sys.stdout.write(markdown())
        return 0
    if argv == ["--check"]:
        try:
            check()
        except ConfigError as e:
            print(e, file=sys.stderr)
            return 1
        return 0
    print("usage: python -m hutch._core.settings --markdown | --check", file=sys.stderr)
    return 2


__all__ = ["GROUPS", "SETTINGS", "Setting", "caller_environ", "check", "markdown", *(n for n in list(globals())
           if n.isupper() and isinstance(globals()[n], Setting))]

if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
