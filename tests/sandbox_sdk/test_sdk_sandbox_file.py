"""The sandbox file (hutch.SandboxFile, Sandbox.from_file, hutch validate, run -f, create -f).

The loader is checked as a pure function first (shape, errors at file:line:key, bounds of untrusted input,
the round trip with the Python API's spec, the published JSON Schema), then against the test daemon: what a
file declares is what the sandbox gets.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import jsonschema
import pytest

import hutch
from hutch.sandbox import _sbschema
from hutch.sandbox._sbfile import MAX_FILE_BYTES
from hutch.sandbox.sandbox import build_spec
from sdk_support import RUN_TAG

ROOT = Path(__file__).resolve().parents[2]
SCHEMA_DOC = ROOT / "docs" / "sandbox-file.schema.json"


def load(text: str, tmp_path: Path, name: str = "sandbox.toml") -> hutch.SandboxFile:
    p = tmp_path / name
    p.write_text(text)
    return hutch.SandboxFile.load(p)


def refused(text: str, tmp_path: Path) -> hutch.SandboxFileError:
    with pytest.raises(hutch.SandboxFileError) as e:
        load(text, tmp_path)
    return e.value


FULL = """\
command = ["python3", "agent.py"]
name = "agent-1"
timeout = 600
idle_timeout = 30
workdir = "/work"
image = { base = "debian-slim", steps = [
  { apt = ["git"] },
  { pip = ["httpx==0.27.*"], index_url = "https://pypi.example.org/simple" },
  { run = ["useradd -m agent", ["ls", "-l"]], network = { domains = ["deb.debian.org"] } },
  { copy = "./tools", to = "/opt/tools" },
  { env = { PYTHONUNBUFFERED = "1" } },
  { workdir = "/work" },
] }

[limits]
memory = "1G"
cpu = 0.5
pids = 64
disk = "2G"

[network]
domains = ["api.example.com", "*.cdn.example.com"]
cidrs = ["203.0.113.0/24"]
ports = [443]

[env]
MODE = "batch"
"odd name ü" = "tab\\there"
API_TOKEN = { from_env = "HUTCH_TEST_API_TOKEN" }

[tags]
team = "search"

[[mounts]]
kind = "bind"
source = "./data"
target = "/data"

[[mounts]]
kind = "bind"
source = "./out"
target = "/out"
readonly = false
owner = [1000, 1000]

[[mounts]]
kind = "tmpfs"
target = "/scratch"
size = "16M"

[[mounts]]
kind = "volume"
source = "cache"
target = "/cache"
readonly = true
"""


@pytest.fixture
def project(tmp_path):
    for d in ("data", "out", "tools"):
        (tmp_path / d).mkdir()
    (tmp_path / "tools" / "t.sh").write_text("echo t\n")
    return tmp_path


# --- what a file means --------------------------------------------------------------------------------------


def test_a_full_file_is_the_spec_the_python_api_builds(project):
    f = load(FULL, project)
    image = (hutch.Image.debian_slim().apt_install("git")
             .pip_install("httpx==0.27.*", index_url="https://pypi.example.org/simple")
             .run_commands("useradd -m agent", ["ls", "-l"], network=hutch.Network.allow(domains=["deb.debian.org"]))
             .copy_local_dir(project / "tools", "/opt/tools").env({"PYTHONUNBUFFERED": "1"}).workdir("/work"))
    mounts = [hutch.Mount.bind(project / "data", "/data"),
              hutch.Mount.bind(project / "out", "/out", readonly=False, owner=(1000, 1000)),
              hutch.Mount.tmpfs("/scratch", size="16M"), hutch.Mount.volume("cache", "/cache", readonly=True)]
    network = hutch.Network.allow(domains=["api.example.com", "*.cdn.example.com"], cidrs=["203.0.113.0/24"],
                                  ports=[443])
    spec = build_spec(("python3", "agent.py"), image=hutch.Image.debian_slim(), mounts=mounts, cpu=0.5,
                      memory="1G", pids=64, disk="2G", timeout=600, idle_timeout=30, workdir="/work",
                      env={"MODE": "batch", "odd name ü": "tab\there"}, tags={"team": "search"}, name="agent-1",
                      network=network, detach=False)
    assert f.spec == spec
    assert f.image == image
    assert f.env_from == (("API_TOKEN", "HUTCH_TEST_API_TOKEN"),)


def test_the_file_and_the_value_convert_losslessly(project):
    f = load(FULL, project)
    again = hutch.SandboxFile.loads(f.to_toml(), path=str(project / "elsewhere" / "x.toml"))
    assert again == f and again.to_toml() == f.to_toml()


@pytest.mark.parametrize("kw", [
    {},
    {"command": ("sh", "-c", 'echo "$A"\n\x7f\x01'), "timeout": None, "detach": True, "name": "n.1"},
    {"network": hutch.Network.open(), "env": {"A": "1", "B C": "é\"\\"}},
    {"network": hutch.Network.allow(cidrs=["198.51.100.0/24"], ports=None), "tags": {"a.b": "c d"}},
    {"mounts": [hutch.Mount.tmpfs("/t", size=12345), hutch.Mount.volume("v1", "/v")], "cpu": 3, "memory": 1,
     "idle_timeout": 0.25, "workdir": "/"},
])
def test_every_spec_of_the_python_api_survives_the_file(tmp_path, kw):
    from hutch.sandbox._spec import SandboxSpec

    spec = SandboxSpec.build(**kw)
    text = hutch.SandboxFile.from_spec(spec).to_toml()
    assert hutch.SandboxFile.loads(text).spec == spec, text


def test_relative_host_paths_are_the_files_directory_not_the_callers(project, tmp_path, monkeypatch):
    sub = project / "deploy"
    sub.mkdir()
    (sub / "data").mkdir()
    (sub / "sandbox.toml").write_text('[[mounts]]\nkind = "bind"\nsource = "data"\ntarget = "/data"\n')
    monkeypatch.chdir(project)   # project/data exists too: it must not be the one taken
    f = hutch.SandboxFile.load("deploy/sandbox.toml")
    assert f.spec.mounts[0].source == str(sub / "data")


def test_env_from_the_environment_is_read_at_create_and_a_missing_one_is_named(project, monkeypatch):
    f = load('[env]\nTOKEN = { from_env = "HUTCH_TEST_TOK" }\n', project)
    monkeypatch.delenv("HUTCH_TEST_TOK", raising=False)
    with pytest.raises(hutch.ConfigError, match="export HUTCH_TEST_TOK"):
        f.create_kwargs()
    monkeypatch.setenv("HUTCH_TEST_TOK", "s3cret")
    command, kw = f.create_kwargs(timeout=5, command=["true"])
    assert kw["env"] == {"TOKEN": "s3cret"} and kw["timeout"] == 5 and command == ("true",)
    assert "s3cret" not in f.to_toml()
    with pytest.raises(hutch.ConfigError, match="unknown overrides"):
        f.create_kwargs(memroy="1G")


# --- errors name the file, the line, the key and the fix ---------------------------------------------------


@pytest.mark.parametrize("text,line,key,words", [
    ('timeout = "soon"\n', 1, "timeout", "number or 'never'"),
    ('name = "x"\n\n[limits]\nmemroy = "1G"\n', 4, "limits.memroy", "did you mean 'memory'"),
    ('[limits]\ncpu = 1\nmemory = "lots"\n', 3, "limits.memory", "like '512M'"),
    ('[limits]\ncpu = 5000\n', 2, "limits.cpu", "larger than 1024"),
    ('[[mounts]]\nkind = "tmpfs"\ntarget = "/a"\n\n[[mounts]]\nkind = "bind"\nsource = "./nope"\ntarget = "/x"\n',
     7, "mounts[1].source", "does not exist on the host"),
    ('[[mounts]]\nkind = "bind"\nsource = "."\ntarget = "rel"\n', 4, "mounts[0].target", "absolute path"),
    ('[[mounts]]\nkind = "nfs"\ntarget = "/x"\n', 1, "mounts[0]", "kind = one of"),
    ('[[mounts]]\nkind = "tmpfs"\ntarget = "/x"\nsource = "/etc"\n', 4, "mounts[0].source", "not a known key"),
    ('[env]\nGITHUB_TOKEN = "ghp_abc"\n', 2, "env.GITHUB_TOKEN", 'from_env = "GITHUB_TOKEN"'),
    ('image = { steps = [\n  { apt = ["git"] },\n  { pip = ["-e ."] },\n] }\n', 3, "image.steps[1]",
     "not a requirement"),
    ('image = { steps = [{ apt = ["git"], pip = ["x"] }] }\n', 1, "image.steps[0].pip", "not a known key"),
    ('[network]\nports = [443]\ndomains = [\n  "ok.example.com",\n  "bad domain",\n]\n', 5, "network.domains[1]",
     "not a valid DNS name"),
    ('[network]\nmode = "none"\ndomains = ["a.example.com"]\n', 1, "network", 'mode = "allow"'),
    ('[network]\nports = [0]\n', 2, "network.ports[0]", "smaller than 1"),
    ('image = { steps = [{ copy = "./agent", to = "/home/user" }] }\n', 1, "image.steps[0]",
     "agent does not exist on this host"),
    ('command = "python3 agent.py"\n', 1, "command", "must be an array"),
    ('version = 2\n', 1, "version", "must be 1"),
    ('include = "/etc/hutch/base.toml"\n', 1, "include", "not a known key"),
    ('a = [\n', 1, None, "not valid TOML"),
    ('x = 1\ny = = 2\n', 2, None, "not valid TOML"),
    ('[[mounts]]\nkind = "tmpfs"\ntarget = "/a"\n[[mounts]]\nkind = "tmpfs"\ntarget = "/a/"\n', None, "mounts",
     "share"),
])
def test_errors_name_file_line_key_and_fix(tmp_path, text, line, key, words):
    e = refused(text, tmp_path)
    where = str(tmp_path / "sandbox.toml")
    assert str(e).startswith(f"{where}:{line if line else ''}"), str(e)
    if line:
        assert e.line == line, str(e)
    assert e.key == key and e.path == where
    if key:
        assert f":{e.line}: {key}: " in str(e)
    assert words in str(e)


def test_a_secret_is_never_written_inline_nor_dumped(tmp_path):
    from hutch.sandbox._spec import SandboxSpec

    for name in ("API_KEY", "OPENAI_API_KEY", "DB_PASSWORD", "SECRET", "aws_secret_access_key", "GH_TOKEN"):
        assert "from_env" in str(refused(f'[env]\n{name} = "x"\n', tmp_path))
    assert load('[env]\nKEYBOARD = "us"\nMONKEY = "1"\n', tmp_path).spec.env == (("KEYBOARD", "us"), ("MONKEY", "1"))
    with pytest.raises(hutch.ConfigError, match="looks like a secret"):
        hutch.SandboxFile.from_spec(SandboxSpec.build(env={"API_KEY": "k"})).to_toml()


# --- untrusted input: bounded, no waits, nothing from elsewhere --------------------------------------------


def test_a_file_larger_than_the_bound_is_refused_unread(tmp_path):
    p = tmp_path / "big.toml"
    p.write_text("# " + "x" * MAX_FILE_BYTES + "\n")
    with pytest.raises(hutch.SandboxFileError, match="larger than"):
        hutch.SandboxFile.load(p)
    with pytest.raises(hutch.SandboxFileError, match="larger than"):
        hutch.SandboxFile.loads("# " + "x" * MAX_FILE_BYTES)


def test_a_fifo_or_a_device_is_refused_at_once(tmp_path):
    fifo = tmp_path / "fifo.toml"
    os.mkfifo(fifo)
    done = []
    t = threading.Thread(target=lambda: done.append(pytest.raises(hutch.SandboxFileError,
                                                                  hutch.SandboxFile.load, fifo)), daemon=True)
    t.start()
    t.join(5)
    assert done, "loading a FIFO waited for a writer"
    with pytest.raises(hutch.SandboxFileError, match="not a regular file"):
        hutch.SandboxFile.load("/dev/zero")
    with pytest.raises(hutch.SandboxFileError, match="cannot read"):
        hutch.SandboxFile.load(tmp_path / "missing.toml")


def test_deep_nesting_and_long_arrays_and_bad_bytes_are_refused(tmp_path):
    e = refused("command = [" + ", ".join('"x"' for _ in range(_sbschema.MAX_ITEMS + 1)) + "]\n", tmp_path)
    assert e.key == "command" and "more than" in str(e)
    e = refused("[env]\n" + "".join(f'A{i} = "1"\n' for i in range(_sbschema.MAX_KEYS + 1)), tmp_path)
    assert e.key == "env" and "more than" in str(e)
    (tmp_path / "latin1.toml").write_bytes(b'name = "\xe9"\n')
    with pytest.raises(hutch.SandboxFileError, match="UTF-8"):
        hutch.SandboxFile.load(tmp_path / "latin1.toml")


def test_deep_nesting_is_a_clean_error_not_a_crash(tmp_path):
    try:
        load("a = " + "[" * 50000 + "]" * 50000 + "\n", tmp_path)
    except hutch.SandboxFileError as e:
        assert e.path.endswith("sandbox.toml")
    else:
        pytest.fail("a 50,000-deep array was accepted")


# --- the JSON Schema: derived from the spec, published, and agreeing with the loader ------------------------


def test_the_published_schema_is_the_one_the_spec_makes():
    assert json.loads(SCHEMA_DOC.read_text()) == hutch.SandboxFile.schema(), (
        "docs/sandbox-file.schema.json is stale: regenerate it with "
        "`hutch validate --schema > docs/sandbox-file.schema.json`")


def test_the_schema_covers_every_field_of_the_spec_and_fails_on_a_new_one():
    import dataclasses

    from hutch.sandbox._spec import Limits, Network, SandboxSpec

    s = hutch.SandboxFile.schema()
    assert set(s["properties"]) == {f.name for f in dataclasses.fields(SandboxSpec)} - {"capabilities"} | {"version"}
    assert set(s["properties"]["limits"]["properties"]) == {f.name for f in dataclasses.fields(Limits)}
    assert {f.name for f in dataclasses.fields(Network)} <= set(s["$defs"]["network"]["properties"])

    @dataclasses.dataclass(frozen=True)
    class Grown(SandboxSpec):
        gpus: int = 0

    with pytest.raises(RuntimeError, match="does not describe Grown.gpus"):
        _sbschema._fields_of(Grown, _sbschema._FIELDS, _sbschema.NOT_IN_FILE)


@pytest.mark.parametrize("text,ok", [
    (FULL, True),
    ('[limits]\nmemroy = "1G"\n', False),
    ('[[mounts]]\nkind = "nfs"\ntarget = "/x"\n', False),
    ('timeout = "never"\nimage = "image:abc"\n', True),
    ('timeout = -1\n', False),
    ('[network]\nports = "all"\ndomains = ["a.example.com"]\n', True),
    ('[env]\nX = { from_env = "Y", extra = 1 }\n', False),
    ('image = { steps = [{ apt = ["git"], pip = ["x"] }] }\n', False),
])
def test_a_standard_validator_and_the_loader_agree_on_the_shape(project, text, ok):
    import tomllib

    validator = jsonschema.Draft202012Validator(hutch.SandboxFile.schema())
    jsonschema.Draft202012Validator.check_schema(hutch.SandboxFile.schema())
    assert validator.is_valid(tomllib.loads(text)) == ok
    if ok:
        load(text, project)
    else:
        refused(text, project)


# --- against the daemon: what the file says is what the sandbox gets ---------------------------------------


def _file_for(busybox_root, tmp_path, extra: str = "") -> Path:
    (tmp_path / "data").mkdir(exist_ok=True)
    (tmp_path / "data" / "in.txt").write_text("from the host\n")
    p = tmp_path / "sandbox.toml"
    p.write_text(f"""\
timeout = 90
workdir = "/tmp"
image = {{ directory = "{busybox_root}" }}
{extra}
[limits]
memory = "96M"
pids = 40

[env]
MODE = "file"
TOKEN = {{ from_env = "HUTCH_TEST_FILE_TOKEN" }}

[tags]
suite = "{RUN_TAG['suite']}"
from = "file"

[[mounts]]
kind = "bind"
source = "data"
target = "/data"

[[mounts]]
kind = "tmpfs"
target = "/scratch"
size = "8M"
""")
    return p


def test_from_file_creates_the_sandbox_the_file_declares(daemon, busybox_root, tmp_path, monkeypatch):
    monkeypatch.setenv("HUTCH_TEST_FILE_TOKEN", "tok-123")
    path = _file_for(busybox_root, tmp_path)
    with hutch.Sandbox.from_file(path, cpu=0.5) as sb:
        r = sb.run("sh", "-c", 'echo "$MODE $TOKEN $PWD"; cat /data/in.txt; echo x > /data/new; '
                               'grep " /scratch " /proc/mounts | grep -o size=[0-9a-z]*')
        assert r.stdout.splitlines()[:2] == ["file tok-123 /tmp", "from the host"]
        assert "size=8192k" in r.stdout and not (tmp_path / "data" / "new").exists()
        spec = sb.info["spec"]
        assert spec["limits"]["memory"] == 96 << 20 and spec["limits"]["pids"] == 40
        assert spec["limits"]["cpu"] == 0.5 and spec["timeout"] == 90
        assert sb.tags == {"suite": RUN_TAG["suite"], "from": "file"}


def test_async_from_file_is_the_same(daemon, busybox_root, tmp_path, monkeypatch):
    import asyncio

    monkeypatch.setenv("HUTCH_TEST_FILE_TOKEN", "tok-a")

    async def main():
        sb = await hutch.AsyncSandbox.from_file(_file_for(busybox_root, tmp_path), command=["sleep", "30"])
        async with sb:
            r = await sb.run("sh", "-c", 'echo "$TOKEN"')
            return r.stdout, sb.info["spec"]["command"]

    assert asyncio.run(main()) == ("tok-a\n", ["sleep", "30"])


def test_an_invalid_file_creates_nothing(daemon, busybox_root, tmp_path, monkeypatch):
    monkeypatch.setenv("HUTCH_TEST_FILE_TOKEN", "x")
    path = _file_for(busybox_root, tmp_path, extra='idle_timeout = "soon"\n')
    before = {s.id for s in hutch.Sandbox.list(tags=RUN_TAG)}
    with pytest.raises(hutch.SandboxFileError, match=r"sandbox.toml:4: idle_timeout"):
        hutch.Sandbox.from_file(path)
    assert {s.id for s in hutch.Sandbox.list(tags=RUN_TAG)} == before


def hutch_cli(*args, **kw):
    return subprocess.run([sys.executable, "-m", "hutch", *args], capture_output=True, text=True, timeout=90, **kw)


def test_cli_validate(tmp_path):
    good, bad = tmp_path / "good.toml", tmp_path / "bad.toml"
    good.write_text('[limits]\nmemory = "1G"\n[network]\ndomains = ["api.example.com"]\n')
    bad.write_text('[limits]\nmemory = "1G"\ncpus = 2\n')
    r = hutch_cli("validate", str(good))
    assert r.returncode == 0 and "valid" in r.stdout and "api.example.com" in r.stdout
    r = hutch_cli("validate", str(bad))
    assert r.returncode == 1 and f"{bad}:3: limits.cpus: is not a known key; did you mean 'cpu'?" in r.stderr
    r = hutch_cli("validate", "--schema")
    assert r.returncode == 0 and json.loads(r.stdout) == hutch.SandboxFile.schema()


def test_cli_run_and_create_with_a_file(daemon, busybox_root, tmp_path):
    path = _file_for(busybox_root, tmp_path, extra='command = ["sh", "-c", "echo $MODE; cat /data/in.txt"]\n')
    env = {**os.environ, "HUTCH_TEST_FILE_TOKEN": "t"}
    r = hutch_cli("run", "-f", str(path), stdin=subprocess.DEVNULL, env=env)
    assert (r.returncode, r.stdout) == (0, "file\nfrom the host\n"), r.stderr
    r = hutch_cli("run", "-f", str(path), "-e", "MODE=flag", "--", "sh", "-c", 'echo "$MODE $TOKEN"',
                  stdin=subprocess.DEVNULL, env=env)
    assert (r.returncode, r.stdout) == (0, "flag t\n"), r.stderr
    r = hutch_cli("sandbox", "create", "-f", str(path), "--detach", "--tag", "via=cli", "--", "sleep", "60", env=env)
    assert r.returncode == 0, r.stderr
    sb = hutch.Sandbox.from_id(r.stdout.strip())
    try:
        assert sb.tags == {"suite": RUN_TAG["suite"], "from": "file", "via": "cli"}
        assert sb.info["spec"]["command"] == ["sleep", "60"] and sb.info["spec"]["detach"] is True
        assert sb.run("cat", "/data/in.txt").stdout == "from the host\n"
    finally:
        sb.terminate()
    r = hutch_cli("run", "-f", str(tmp_path / "nope.toml"), "--", "true", env=env)
    assert r.returncode == 1 and "cannot read the sandbox file" in r.stderr


def test_a_files_network_budgets_round_trip_and_none_refuses_them(tmp_path):
    f = load('[network]\ndomains = ["*.example.com"]\nrequests_per_minute = 600\nbytes_per_minute = 5000000\n',
             tmp_path)
    assert f.spec.network == hutch.Network.allow(domains=["*.example.com"], requests_per_minute=600,
                                                 bytes_per_minute=5_000_000)
    assert hutch.SandboxFile.loads(f.to_toml()) == f
    f = load('[network]\nmode = "open"\nbytes_per_minute = 7000\n', tmp_path)
    assert f.spec.network == hutch.Network.open(bytes_per_minute=7000)
    assert hutch.SandboxFile.loads(f.to_toml()) == f
    e = refused('[network]\nmode = "none"\nrequests_per_minute = 5\n', tmp_path)
    assert "requests_per_minute" in str(e)
    e = refused('[network]\ndomains = ["a.example.com"]\nbytes_per_minute = 0\n', tmp_path)
    assert "bytes_per_minute" in e.key and "smaller than 1" in str(e), str(e)


def test_credentials_in_a_file_are_references_and_round_trip(tmp_path):
    f = load('[network]\ndomains = ["api.example.com"]\n[network.credentials."api.example.com"]\n'
             'from_env = "EXAMPLE_KEY"\nheader = "X-Api-Key"\nformat = "{}"\nbytes_per_minute = 100000\n', tmp_path)
    (host, secret), = f.spec.network.credentials
    assert host == "api.example.com" and secret == hutch.Secret.from_env(
        "EXAMPLE_KEY", header="X-Api-Key", format="{}", bytes_per_minute=100000)
    assert hutch.SandboxFile.loads(f.to_toml()) == f
    e = refused('[network]\ndomains = ["api.example.com"]\n[network.credentials."api.example.com"]\n'
                'value = "sk-inline-secret-123"\n', tmp_path)
    assert e.key == 'network.credentials."api.example.com".value' and "not a known key" in str(e)
    e = refused('[network]\ndomains = ["a.example.com"]\n[network.credentials."b.example.com"]\n'
                'from_env = "K"\n', tmp_path)
    assert e.key == "network" and "not in the allowed domains" in str(e)
    from hutch.sandbox._spec import SandboxSpec

    inline = hutch.Network.allow(domains=["api.example.com"],
                                 credentials={"api.example.com": hutch.Secret.from_value("sk-value-123456")})
    with pytest.raises(hutch.ConfigError, match="never holds a secret"):
        hutch.SandboxFile.from_spec(SandboxSpec.build(network=inline)).to_toml()


def test_a_memory_mount_is_the_memory_wings_own_value(tmp_path):
    store = tmp_path / "agent-memory"
    hutch.Memory(store)
    f = load('[[mounts]]\nkind = "memory"\nstore = "agent-memory"\ntarget = "/memory"\nwritable = true\n', tmp_path)
    assert f.provided == (hutch.MemoryMount(str(store), "/memory", writable=True),) and f.spec.mounts == ()
    assert hutch.SandboxFile.loads(f.to_toml()) == f
    _, kw = f.create_kwargs()
    assert kw["mounts"] == [hutch.MemoryMount(str(store), "/memory", writable=True)]
    e = refused('[[mounts]]\nkind = "memory"\nstore = "nope"\ntarget = "/memory"\n', tmp_path)
    assert e.key == "mounts[0]" and "not a memory store" in str(e)


@pytest.mark.parametrize("text,words", [
    ("a" + ".a" * (MAX_FILE_BYTES // 2 - 10) + "\n", "dots outside strings"),          # tomllib: 40 s
    ("[" + "a." * (MAX_FILE_BYTES // 2 - 10) + "a]\n", "dots outside strings"),        # then a recursion crash
    ("a" + " . a" * (MAX_FILE_BYTES // 4 - 10) + " =\n", "dots outside strings"),
    ("env = " + "{b = " * 900 + "1" + "}" * 900 + "\n", "nested too deeply"),
])
def test_a_hostile_file_is_refused_at_once(tmp_path, text, words):
    import time

    t0 = time.monotonic()
    e = refused(text[:MAX_FILE_BYTES], tmp_path)
    assert words in str(e) and time.monotonic() - t0 < 20   # a hang guard (10x a loaded run), not a speed target


def test_dots_inside_strings_and_comments_do_not_count(tmp_path):
    f = load('[network]  # a.b.c.d.e.f.g.h.i.j.k.l.m.n.o.p.q.r.s.t.u.v.w.x.y.z.a.b.c.d.e.f.g.h.i\n'
             'domains = ["a.b.c.d.e.f.g.h.i.j.k.l.m.n.o.p.q.r.s.t.u.v.w.x.y.z.a.b.c.d.e.f.g.h.example.com"]\n'
             'cidrs = []\n'
             '[limits]\ncpu = 0.5\n', tmp_path)
    assert f.spec.limits.cpu == 0.5 and len(f.spec.network.domains) == 1
    f = load('command = ["""' + "a.b." * 40 + '\n' + "c.d." * 40 + '"""]\n', tmp_path)
    assert f.spec.command[0].startswith("a.b.")


def test_a_file_reads_only_the_environment_it_is_given(tmp_path, monkeypatch):
    monkeypatch.setenv("HUTCH_TEST_HOST_SECRET", "host-secret-value-123")
    f = load('[env]\nA = { from_env = "HUTCH_TEST_HOST_SECRET" }\n[network]\ndomains = ["api.example.com"]\n'
             '[network.credentials."api.example.com"]\nfrom_env = "HUTCH_TEST_HOST_SECRET"\n', tmp_path)
    assert f.environment == ("HUTCH_TEST_HOST_SECRET",)
    with pytest.raises(hutch.ConfigError, match="HUTCH_TEST_HOST_SECRET, which is not set"):
        f.create_kwargs(environ={})
    _, kw = f.create_kwargs(environ={"HUTCH_TEST_HOST_SECRET": "given-value-12345"})
    (host, secret), = kw["network"].credentials
    assert kw["env"] == {"A": "given-value-12345"} and secret.reveal() == "given-value-12345"
    assert secret.env == "HUTCH_TEST_HOST_SECRET" and "given-value" not in repr(kw["network"])
    r = subprocess.run([sys.executable, "-m", "hutch", "validate", str(tmp_path / "sandbox.toml")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "reads from the environment at create: HUTCH_TEST_HOST_SECRET" in r.stdout
