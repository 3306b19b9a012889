"""Credentials in real sandboxes made through the SDK: the key reaches the API, never the sandbox.

The daemon runs in the suite's fake host netns and dials upstream trusting only the fake internet's CA
(HUTCH_EGRESS_UPSTREAM_CA); the sandboxes run the default image (python3 and Debian's CA bundle). The
sandbox looks for the secret every way it can: its processes' environments, every file, the memory of its
processes (read from the host), what the API echoes back, and the daemon's answers and log.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest
from egress_world import daemon_in_world

import hutch
from hutch import Network, Secret

SECRET = "sk-live-a4f09c2e7d1b4e8f93a6b5c4d3e2f1a0"
API = "api.example.test"
VAR = "HUTCH_TEST_EXAMPLE_KEY"


@pytest.fixture(scope="module")
def daemon(world):
    with daemon_in_world(world, "198.18.5.0/24", "default", {"HUTCH_EGRESS_UPSTREAM_CA": str(world.ca)},
                         default_image=True) as run_dir:
        yield run_dir


@pytest.fixture
def key(monkeypatch):
    monkeypatch.setenv(VAR, SECRET)


FETCH = r"""
import json, ssl, sys, urllib.request
url = sys.argv[1]
ctx = ssl.create_default_context() if len(sys.argv) < 3 else ssl._create_unverified_context()
try:
    with urllib.request.urlopen(urllib.request.Request(url, headers={"Authorization": "Bearer mine"}),
                                context=ctx, timeout=10) as r:
        print(r.status, r.read().decode())
except Exception as e:
    print("error", type(e).__name__, e)
"""


def fetch(sb, url, *extra):
    return sb.run("python3", "-c", FETCH, url, *extra, timeout=40).stdout


def headers_at(world, mark):
    return [(e["local"], e["headers"]) for e in world.events_since(mark) if e["kind"] == "http"]


def memory_holds(pids, needle: bytes) -> list[int]:
    """The host pids whose readable memory holds `needle` (read as root through /proc/PID/mem)."""
    found = []
    for pid in pids:
        try:
            maps = Path(f"/proc/{pid}/maps").read_text().splitlines()
            with open(f"/proc/{pid}/mem", "rb", buffering=0) as mem:
                for line in maps:
                    addr, perms = line.split()[:2]
                    if "r" not in perms:
                        continue
                    lo, hi = (int(x, 16) for x in addr.split("-"))
                    if hi - lo > 1 << 30:
                        continue
                    try:
                        mem.seek(lo)
                        if needle in mem.read(hi - lo):
                            found.append(pid)
                            break
                    except (OSError, ValueError, OverflowError):
                        continue
        except OSError:
            continue
    return found


def memfd_holds(pids, needle: bytes) -> list[str]:
    """gVisor: the sandbox's memory is the sentry's memory file (a memfd, `runsc-memory`, of the runsc
    processes in its cgroups): the files of those that hold `needle`, read as root through /proc/PID/fd, only
    where they have data (SEEK_DATA / SEEK_HOLE: the file is sparse, its size the sandbox's whole span)."""
    found = []
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if not os.readlink(f"/proc/{pid}/fd/{fd}").startswith("/memfd:runsc-memory"):
                    continue
                f = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDONLY)
            except OSError:
                continue
            try:
                off, size = 0, os.fstat(f).st_size
                while off < size:
                    try:
                        off = os.lseek(f, off, os.SEEK_DATA)
                    except OSError:   # ENXIO: no data past off
                        break
                    end = os.lseek(f, off, os.SEEK_HOLE)
                    while off < end:
                        n = min(end - off, 16 << 20)
                        if needle in os.pread(f, n + len(needle), off):
                            found.append(f"{pid}/fd/{fd}")
                            off = size
                            break
                        off += n
            finally:
                os.close(f)
    return found


def sandbox_pids(sb) -> list[int]:
    pids = set()
    for cg in sb.info.get("cgroups") or ():
        try:
            pids |= {int(x) for x in Path(cg, "cgroup.procs").read_text().split()}
        except OSError:
            pass
    return sorted(pids)


@pytest.mark.parametrize("runtime", ["native", "gvisor"])
def test_the_key_reaches_the_api_and_never_the_sandbox(daemon, world, key, runtime):
    """The memory searched: on native every readable mapping of the sandbox's processes (/proc/PID/mem); on
    gVisor, where the sandbox's memory is the sentry's, its memory file (memfd_holds)."""
    if runtime == "gvisor" and shutil.which("runsc") is None:
        pytest.skip("runsc is not installed (scripts/setup.sh)")
    mark = world.mark()
    sb = hutch.Sandbox.create(timeout=180, runtime=runtime, network=Network.allow(
        domains=[API, "www.example.test"], credentials={API: Secret.from_env(VAR)}))
    try:
        out = fetch(sb, f"https://{API}/echo-headers")
        assert out.startswith("200 "), out
        got = [h for local, h in headers_at(world, mark) if local == "198.51.100.10"]
        assert got and got[0]["authorization"] == f"Bearer {SECRET}"      # it reached the API
        assert SECRET not in out and json.loads(out[4:])["headers"]["authorization"].strip("*") == ""

        # another host, even with verification off in the sandbox: relayed unread, no credential added
        mark2 = world.mark()
        out = fetch(sb, "https://www.example.test/echo-headers", "insecure")
        assert out.startswith("200 ") and "authorization" in out, out
        assert [h["authorization"] for _, h in headers_at(world, mark2)] == ["Bearer mine"]

        # a process that made a brokered request is still alive: its memory, and everyone's, is searched
        p = sb.exec("python3", "-c", FETCH.replace("print(r.status", "import time; print(r.status") +
                    "\nimport sys; sys.stdout.flush(); sys.stdin.readline()", f"https://{API}/echo-headers")
        assert p.stdout.readline().startswith("200 ")
        pids = sandbox_pids(sb)
        assert pids, sb.info.get("cgroups")
        holds = memory_holds if runtime == "native" else memfd_holds
        assert holds(pids, SECRET.encode()) == []
        # (the scan does see what a process holds: the header it sent itself)
        assert holds(pids, b"Bearer mine"), "the memory scan finds nothing at all: it cannot see"
        p.stdin.close()
        p.wait()

        # every environment and every file of the sandbox
        r = sb.run("sh", "-c", "cat /proc/[0-9]*/environ | tr '\\0' '\\n'")
        assert SECRET not in r.stdout and VAR not in r.stdout
        r = sb.run("python3", "-c", f"""
import os
hits = []
for top in ("/",):
    for d, dirs, files in os.walk(top):
        if d == "/" : dirs[:] = [x for x in dirs if x not in ("proc", "sys", "dev")]
        for f in files:
            p = os.path.join(d, f)
            try:
                with open(p, "rb") as fh:
                    if {SECRET.encode()!r} in fh.read():
                        hits.append(p)
            except OSError:
                pass
print(hits)
""", timeout=120)
        assert r.stdout.strip() == "[]", r.stdout + r.stderr

        # what it trusts: its CA's certificate, and no key
        own = sb.files.read("/etc/hutch/egress-ca.pem").decode()
        bundle = sb.files.read("/etc/ssl/certs/ca-certificates.crt").decode()
        assert own.count("BEGIN CERTIFICATE") == 1 and own in bundle and bundle.count("BEGIN CERTIFICATE") > 50
        assert "PRIVATE KEY" not in own + bundle
        env = sb.run("sh", "-c", "echo $SSL_CERT_FILE $REQUESTS_CA_BUNDLE").stdout.split()
        assert env == ["/etc/ssl/certs/ca-certificates.crt"] * 2
        with sb.exec("sh", "-c", "echo $SSL_CERT_FILE $REQUESTS_CA_BUNDLE", pty=True) as t:   # on a terminal too
            assert t.wait(30) == 0
            out = b""
            while chunk := t.read(timeout=10):
                out += chunk
        assert out.decode().split() == ["/etc/ssl/certs/ca-certificates.crt"] * 2

        # the daemon's answers and log
        assert SECRET not in json.dumps(sb.info) and SECRET not in json.dumps(hutch.Sandbox.from_id(sb.id).info)
        assert sb.info["spec"]["network"]["credentials"][API]["env"] == VAR
        log = sb.network_log()
        assert any("credential brokered" in d["reason"] for d in log)
        assert SECRET not in json.dumps(list(log)) + json.dumps(log.limits)
    finally:
        sb.terminate()
    time.sleep(0.2)
    assert SECRET not in (daemon / "test-daemon.log").read_text(errors="replace")


def test_a_sandbox_without_credentials_is_unchanged(daemon, world):
    sb = hutch.Sandbox.create(timeout=120, network=Network.allow(domains=["www.example.test"]))
    try:
        r = sb.run("sh", "-c", "ls /etc/hutch 2>&1; echo ${SSL_CERT_FILE:-unset}")
        assert "No such file" in r.stdout and r.stdout.strip().endswith("unset"), r.stdout
        out = fetch(sb, "https://www.example.test/echo-headers", "insecure")
        assert out.startswith("200 ") and "Bearer mine" in out
    finally:
        sb.terminate()


def test_credentials_from_a_sandbox_file_and_given_later(daemon, world, key, tmp_path):
    (tmp_path / "sandbox.toml").write_text(f"""\
timeout = 120
[network]
domains = ["{API}"]
[network.credentials."{API}"]
from_env = "{VAR}"
header = "X-Api-Key"
format = "{{}}"
requests_per_minute = 2
""")
    mark = world.mark()
    with hutch.Sandbox.from_file(tmp_path / "sandbox.toml") as sb:
        assert fetch(sb, f"https://{API}/echo-headers").startswith("200 ")
        assert fetch(sb, f"https://{API}/echo-headers").startswith("200 ")
        assert "429" in fetch(sb, f"https://{API}/echo-headers")
        got = [h.get("x-api-key") for local, h in headers_at(world, mark)]
        assert got == [SECRET, SECRET]
    # a sandbox given a credential by set_network trusts its CA from then on
    sb = hutch.Sandbox.create(timeout=120, network=Network.allow(domains=[API]))
    try:
        assert fetch(sb, f"https://{API}/echo-headers").startswith("error")     # the fake CA is not its
        sb.set_network(Network.allow(domains=[API], credentials={API: Secret.from_env(VAR)}))
        out = sb.run("python3", "-c", FETCH, f"https://{API}/echo-headers",
                     env={"SSL_CERT_FILE": "/etc/ssl/certs/ca-certificates.crt"}, timeout=40).stdout
        assert out.startswith("200 ") and SECRET not in out, out
    finally:
        sb.terminate()


def test_a_missing_variable_is_named_and_creates_nothing(daemon, monkeypatch):
    monkeypatch.delenv(VAR, raising=False)
    before = {s.id for s in hutch.Sandbox.list()}
    with pytest.raises(hutch.NetworkPolicyError, match=f"export {VAR}"):
        hutch.Sandbox.create(network=Network.allow(domains=[API], credentials={API: Secret.from_env(VAR)}))
    assert {s.id for s in hutch.Sandbox.list()} == before
