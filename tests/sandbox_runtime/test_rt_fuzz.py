"""The daemon's HTTP API under property-based fuzzing, driven by the OpenAPI document it serves.

schemathesis turns GET /v1/openapi.json into hypothesis strategies: requests that fit the document
(positive) and requests that break it (negative: malformed JSON, wrong types, out-of-range and huge
values, odd unicode). On top of them the test sends bad ids and real ones (a running sandbox, a live
exec, a volume), paths that try to climb out of a sandbox or a volume, and TCP requests with a missing
or wrong token, over the Unix socket and over TCP with TLS, and as a tenant (`serve(tenants=...)`, whose token
must never reach the operator's sandboxes it is aimed at: docs/tenants.md). Every answer must come within a bound,
never be a 5xx, and be a documented JSON error whenever it is not a success. At the end nothing the
fuzzer made may be left: every sandbox it created is terminated, then the daemon's cgroups, mounts and
descriptors must be back to where they were, and nothing may have appeared outside a volume or on the
host's root.

Bounded for CI: HUTCH_FUZZ_EXAMPLES (per operation, default 100) and HUTCH_FUZZ_SECONDS (the whole run,
default 150) raise it for a longer hunt. Every operation gets its share of what is left of the run's seconds,
and at least MIN_EXAMPLES requests however slow the ones before it were, so no operation goes unfuzzed.
"""

from __future__ import annotations

import json
import os
from collections import Counter
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from schemathesis.generation import GenerationMode  # noqa: E402

from hutch._core import errors  # noqa: E402
from hutch._core import settings as hutch_settings  # noqa: E402
from hutch.sandbox._host.daemon.openapi import OPERATIONS  # noqa: E402
from hutch.sandbox._host.instance import names_for  # noqa: E402
from rt_support import Daemon, uds_client  # noqa: E402

schemathesis.serializer.alias("application/x-tar", "application/octet-stream")   # an archive is raw bytes
EXAMPLES = hutch_settings.FUZZ_EXAMPLES.get()
BUDGET = hutch_settings.FUZZ_SECONDS.get()
ANSWER_WITHIN = 60.0     # seconds for any answer's head (a hang fails the test; a gVisor create or teardown takes
                         # 20 s and more on a loaded 2-core machine, so this is a hang guard, not a speed target)
OP_SECONDS = 120.0       # one operation's share at most: later examples are not sent (pytest's timeout is 300 s)
MIN_EXAMPLES = 3         # every operation is sent at least this many, however the budget went before it
BODY_CAP = 4 << 20       # bytes of a body read before the response is closed
TOKEN = "fuzz-t0ken-of-the-tests"
ERROR_NAMES = {n for n in dir(errors) if isinstance(getattr(errors, n), type)
               and issubclass(getattr(errors, n), errors.Error)}
CLIMBS = ["../../../../etc/shadow", "/../../../etc/shadow", "/proc/1/root/etc/shadow", "/proc/self/root/etc/shadow",
          "/home/user/../../../../etc/shadow", "..", "/", ".", "/dev/zero", "/proc/self/mem", "/sys/kernel",
          "a/../../b", "/home/user/link/escape", "\u202e/etc", "/etc/marker\x00x", "//etc//shadow", "/" + "a" * 5000,
          "/home/user/" + "d/" * 300 + "f", "%2e%2e/%2e%2e/etc/shadow", "~root/.ssh"]
# values that break parsers and arithmetic more often than random data does: Python's json reads NaN and
# Infinity, timers overflow, sizes wrap, NUL ends C strings, `$` takes a trailing newline
EXTREMES = [float("nan"), float("inf"), -float("inf"), 1e308, -1, 0, 10**30, -(10**30), 2**63, True, None, "",
            "\x00", "a\n", "a" * 70000, "\u202e", "../../..", [], {}, [[[[[[]]]]]], "-1", "1e400", "0x10"]
QUERY_EXTREMES = ["nan", "inf", "-inf", "1e400", "-1", "0x10", "", "\x00", "9" * 400, "1 ", "\u0661", "true ", "0644\n"]
OPS = sorted(f"{m.upper()} {p}" for m, p in OPERATIONS)
_deadline = [0.0]
_timings: dict[str, tuple[float, int]] = {}
_statuses: Counter = Counter()


@pytest.fixture(scope="module")
def world(busybox_root, tmp_path_factory):
    """A private daemon (its own run and state dirs, TCP with TLS and a token), two sandboxes, a live exec
    and a volume for the fuzzer to aim at; torn down with the leak checks of the module docstring."""
    base = tmp_path_factory.mktemp("fuzz")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    state = base / "state"
    subprocess.run([sys.executable, "-m", "hutch", "tls-fingerprint"], env=dict(os.environ, HUTCH_STATE_DIR=str(state)),
                   check=True, capture_output=True, timeout=60)
    from hutch.sandbox._host.daemon import tenants as T

    tenants_file = tmp_path_factory.mktemp("fuzz-tenants") / "tenants.json"   # outside base: see the last check
    tenant_token = T.add(tenants_file, "fz", T.Quotas(sandboxes=4, memory=4 << 30, disk=64 << 20, creates_per_second=5))
    d = Daemon(base / "run", listen=f"127.0.0.1:{port}", token=TOKEN, env={"HUTCH_STATE_DIR": str(state)},
               tls=(state / "tls" / "daemon.crt", state / "tls" / "daemon.key"),
               serve_kw={"tenants": str(tenants_file)})
    bind_src = base / "bind-src"     # the only host path a fuzzed bind mount may name
    bind_src.mkdir()
    root_before = set(os.listdir("/"))
    try:
        d.start()
    except BaseException:   # one that started but did not answer in time must not outlive the test
        d.stop()
        d.cleanup_cgroups()
        raise
    unix = uds_client(d.sock, timeout=ANSWER_WITHIN)
    tcp = httpx.Client(base_url=f"https://127.0.0.1:{port}", verify=False, timeout=ANSWER_WITHIN)
    image = f"dir:{busybox_root}"
    w = {"daemon": d, "unix": unix, "tcp": tcp, "image": image, "bind_src": str(bind_src), "port": port,
         "tenant_token": tenant_token}
    try:
        ids = []
        for _ in range(2):
            r = unix.post("/v1/sandboxes", json={"spec": {"image": image, "detach": True, "timeout": 900}})
            assert r.status_code == 201, r.text
            ids.append(r.json()["id"])
        for sid in ids:
            r = unix.post(f"/v1/sandboxes/{sid}/exec", json={"argv": ["sh", "-c", "mkdir -p /home/user/d && "
                                                                      "echo hi > /home/user/f.txt && ln -s / /home/user/link"]})
            assert r.status_code == 200
        r = unix.put(f"/v1/sandboxes/{ids[1]}/network", json={"network": {"mode": "allow", "domains": ["example.com"]}})
        assert r.status_code == 204, r.text
        assert _links(d), "a sandbox with a network policy has a veth: the leak check must see it"
        assert unix.post("/v1/volumes", json={"name": "fuzzvol", "create": True}).status_code == 200
        assert unix.put("/v1/volumes/fuzzvol/files/write", params={"path": "/a.txt"}, content=b"a").status_code == 204
        # a command that waits on its stdin: the exec routes get a real exec id to chew on
        live = unix.stream("POST", f"/v1/sandboxes/{ids[0]}/exec", json={"argv": ["cat"], "stdin": True}, timeout=None)
        resp = live.__enter__()
        w.update(ids=ids, eid=resp.headers["X-Hutch-Exec-Id"], live=live)
        w["doc"] = unix.get("/v1/openapi.json").json()
        w["fds"] = _fd_count(d.proc.pid)
        w["cgroups"] = _cgroups(d)
        _deadline[0] = time.monotonic() + BUDGET
        yield w
        slow = sorted(_timings.items(), key=lambda kv: -kv[1][0])[:8]
        print(f"\nfuzzing: {sum(_statuses.values())} requests, statuses {dict(sorted(_statuses.items()))}; slowest: "
              + ", ".join(f"{k} {t:.1f} s/{n}" for k, (t, n) in slow), file=sys.stderr)
        live.__exit__(None, None, None)
        _end_everything(unix)
        left = _leftovers(w)
        assert not left, f"the fuzzer left: {left}"
    finally:
        unix.close()
        tcp.close()
        d.stop()
        d.cleanup_cgroups()
    assert not _links(d), f"veths left after the daemon stopped: {_links(d)}"
    assert not _nft_table(d), "the daemon's nftables table was left after it stopped"
    stopped = [line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines() if str(d.run_dir) in line]
    assert not stopped, f"mounts left after the daemon stopped: {stopped}"
    assert not _cgroups(d), "cgroups left after the daemon stopped"
    assert set(os.listdir("/")) <= root_before, f"new entries on the host's /: {set(os.listdir('/')) - root_before}"
    escaped = sorted(p.name for p in base.iterdir()) + sorted(os.listdir(bind_src))
    assert escaped == ["bind-src", "run", "run-daemon.log", "state"], f"files outside a volume: {escaped}"


def _links(d: Daemon) -> list[str]:
    """The veths of this daemon's egress gateway (its own prefix: other daemons' are not counted)."""
    prefix = names_for(d.run_dir).link_prefix
    out = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, timeout=10).stdout
    return [n for n in (ln.split(":")[1].strip().split("@")[0] for ln in out.splitlines()) if n.startswith(prefix)]


def _nft_table(d: Daemon) -> bool:
    out = subprocess.run(["nft", "list", "tables"], capture_output=True, text=True, timeout=10).stdout
    return names_for(d.run_dir).nft_table in out


def _fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _cgroup_parent(d: Daemon) -> Path:
    base = Path("/sys/fs/cgroup")
    return base / d.cgroup_parent if (base / "cgroup.controllers").exists() else base / "memory" / d.cgroup_parent


def _cgroups(d: Daemon) -> set[str]:
    parent = _cgroup_parent(d)
    return {p.name for p in parent.iterdir() if p.is_dir()} if parent.is_dir() else set()


def _end_everything(client: httpx.Client) -> None:
    for sb in client.get("/v1/sandboxes").json()["sandboxes"]:
        client.post(f"/v1/sandboxes/{sb['id']}/terminate")


def _leftovers(w) -> list[str]:
    """What the run left while the daemon still runs: sandboxes, cgroups beyond the warm pool's, mounts of
    sandboxes, descriptors."""
    d, unix = w["daemon"], w["unix"]
    left = [f"sandbox {sb['id']}" for sb in unix.get("/v1/sandboxes").json()["sandboxes"]]
    pool = unix.get("/v1/doctor").json()["warm_pool"]["target"]
    deadline = time.monotonic() + 60   # the warm pool refills in the background (a hang guard: polled)
    while True:
        extra = _cgroups(d) - w["cgroups"]
        mounts = [line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()
                  if str(d.run_dir / "mnt") in line]
        fds = _fd_count(d.proc.pid)
        links = _links(d)
        if (len(extra) <= pool and not mounts and not links and fds <= w["fds"] + 8) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    if len(extra) > pool:
        left.append(f"{len(extra)} cgroups beyond the warm pool's {pool}: {sorted(extra)[:5]}")
    left += [f"mount {m}" for m in mounts] + [f"veth {n}" for n in links]
    log = Path(d.log).read_text(errors="replace")   # an exception nobody handled, a coroutine never awaited
    if log.count("Traceback") or log.count("Error handling request"):
        left += [f"daemon log: {line.strip()[:200]}" for line in log.splitlines()
                 if "Traceback" in line or "Warning:" in line or "Error handling request" in line][:5]
    left += [f"daemon log: {line.strip()[:200]}" for line in log.splitlines() if "Warning:" in line][:5]
    if fds > w["fds"] + 8:
        left.append(f"daemon descriptors {w['fds']} -> {fds}: " +
                    ", ".join(sorted({os.readlink(f"/proc/{d.proc.pid}/fd/{n}").split(":")[0]
                                      for n in os.listdir(f"/proc/{d.proc.pid}/fd")})))
    return left


@pytest.fixture(scope="module")
def schema(world):
    doc = json.loads(json.dumps(world["doc"]))
    # The document describes the real API; the fuzzer's bind mounts may only name a throwaway host directory
    # (a writable bind of a random existing host path is the API working as documented, and not for a test).
    doc["components"]["schemas"]["Mount"]["properties"]["source"] = {"type": "string", "enum": [world["bind_src"]],
                                                                     "nullable": True}
    return schemathesis.openapi.from_dict(doc)


def _aim(case, data, w) -> None:
    """Point some cases at real things (a sandbox, its live exec, the volume, the busybox image), and give
    path= the traversal attempts."""
    pp = case.path_parameters or {}
    mostly = st.integers(0, 3).map(bool)   # 3 in 4: deep paths need real things; the rest tries bad ids
    if "id" in pp and data.draw(mostly):
        pp["id"] = data.draw(st.sampled_from(w["ids"]))
    if "eid" in pp and data.draw(mostly):
        pp["eid"] = w["eid"]
    if "name" in pp and data.draw(mostly):
        pp["name"] = "fuzzvol"
    if isinstance(case.query, dict) and "path" in case.query and data.draw(st.booleans()):
        case.query["path"] = data.draw(st.sampled_from(CLIMBS))
    body = case.body
    if isinstance(body, dict) and isinstance(body.get("spec"), dict):
        spec = body["spec"]
        if data.draw(mostly):
            spec["image"] = w["image"]
        mounts = spec.get("mounts")
        for m in mounts if isinstance(mounts, list) else []:   # negative cases break the schema's source rule too
            if isinstance(m, dict) and m.get("kind") == "bind":
                m["source"] = w["bind_src"]
    if data.draw(st.integers(0, 3)) == 0:
        _poke(case, data)
    if case.path.endswith("/wait") and isinstance(case.query, dict):
        try:   # a long poll holds up to a minute by design (the cap: test_rt_api_input.py); keep the run short
            if float(case.query.get("timeout", "60")) > 1:
                case.query["timeout"] = "1"
        except (TypeError, ValueError):
            pass
    if isinstance(body, dict) and body.get("ref") == "debian-slim":   # would build the default image
        body["ref"] = w["image"]


def _poke(case, data) -> None:
    """Replace one leaf of the JSON body, or one query value, with an extreme."""
    if isinstance(case.query, dict) and case.query and data.draw(st.booleans()):
        case.query[data.draw(st.sampled_from(sorted(case.query)))] = data.draw(st.sampled_from(QUERY_EXTREMES))
        return
    if data.draw(st.integers(0, 9)) == 0 and case.media_type == "application/json":
        _deep_cases.add(id(case))   # nesting past the parser's recursion limit
        return
    node = case.body
    for _ in range(4):
        if isinstance(node, dict) and node:
            key = data.draw(st.sampled_from(sorted(node, key=str)))
        elif isinstance(node, list) and node:
            key = data.draw(st.integers(0, len(node) - 1))
        else:
            return
        if not isinstance(node[key], (dict, list)) or not node[key] or data.draw(st.booleans()):
            node[key] = data.draw(st.sampled_from(EXTREMES))
            return
        node = node[key]


_deep_cases: set[int] = set()


def _send(case, w, via: str, auth: str):
    kw = case.as_transport_kwargs(base_url="http://hutch")
    headers = {k: v for k, v in kw.get("headers", {}).items() if k.lower() not in ("connection", "accept-encoding")}
    if via == "tenant":   # a tenant of the daemon (tenants.py): the aimed-at ids are the operator's, not its own
        client = w["tcp"]
        headers["Authorization"] = f"Bearer {w['tenant_token']}"
    elif via == "tcp":
        client = w["tcp"]
        if auth == "good":
            headers["Authorization"] = f"Bearer {TOKEN}"
        elif auth == "wrong":
            headers["Authorization"] = "Bearer not-the-token"
    else:
        client = w["unix"]
    url = kw["url"].replace("http://hutch", "")
    content = kw.get("data")
    if "json" in kw:
        content = json.dumps(kw["json"]).encode()   # allow_nan: NaN and Infinity go out as Python writes them
    if id(case) in _deep_cases:
        _deep_cases.discard(id(case))
        content = b"[" * 200000 + b"]" * 200000
    if isinstance(content, str):
        content = content.encode("utf-8", "surrogatepass")
    req = client.build_request(kw["method"], url, params=kw.get("params") or None, headers=headers, content=content)
    t0 = time.monotonic()
    try:
        resp = client.send(req, stream=True)
    except httpx.TimeoutException as e:
        raise AssertionError(f"{case.method} {url} hung: no answer within {ANSWER_WITHIN} s") from e
    try:
        if case.path.endswith("/lease") and resp.status_code == 200:
            body = b""    # a lease stays open by design: its head is the answer
        else:
            chunks, size = [], 0
            for chunk in resp.iter_raw():
                chunks.append(chunk)
                size += len(chunk)
                if size > BODY_CAP or time.monotonic() - t0 > ANSWER_WITHIN:
                    break
            body = b"".join(chunks)
    finally:
        resp.close()
    return resp, body


#: The answer to a request aiohttp cannot parse (a request line or header over 8 KiB, broken framing): no token
#: could be read from it either, so it is refused as unreadable (400), never run, whatever its token.
UNREADABLE = "could not be read as HTTP"


def _check(case, resp, body, auth: str) -> None:
    what = f"{case.method} {resp.request.url} -> {resp.status_code} {body[:300]!r}"
    assert resp.status_code < 500, f"a server error: {what}"
    if resp.status_code >= 400:
        assert resp.headers.get("content-type", "").startswith("application/json"), f"an error that is not JSON: {what}"
        err = json.loads(body)
        assert err.get("error") in ERROR_NAMES, f"an error without a hutch error class: {what}"
        assert isinstance(err.get("message"), str) and len(err["message"]) > 10, f"an error without a message: {what}"
    unreadable = resp.status_code == 400 and UNREADABLE.encode() in body
    if auth != "good" and resp.status_code != 401 and not unreadable:
        raise AssertionError(f"a TCP request without the right token was not refused with 401: {what}")
    host_shadow = _host_shadow()
    if host_shadow and resp.status_code == 200:
        assert host_shadow not in body, f"the host's /etc/shadow came out of a sandbox or volume: {what}"


def _conforms(op: dict, resp, body: bytes) -> None:
    """The answer is one the document describes: its status (or range) and, with a body, a content type
    listed for that status."""
    code = str(resp.status_code)
    described = op["responses"].get(code) or op["responses"].get(code[0] + "XX")
    what = f"{resp.request.method} {resp.request.url} -> {code}"
    assert described is not None, f"an answer the OpenAPI document does not describe: {what} {body[:200]!r}"
    types = list(described.get("content", {}))
    ctype = resp.headers.get("content-type", "").split(";")[0]
    if types and body:
        assert ctype in types, f"{what}: content type {ctype!r}, the document says {types}"


def _host_shadow() -> bytes:
    try:
        first = Path("/etc/shadow").read_bytes().split(b"\n", 1)[0]
    except OSError:
        return b""
    return first if len(first) > 8 else b""


@pytest.mark.slow
@pytest.mark.parametrize("label", OPS)
def test_fuzz_operation(label, world, schema):
    method, path = label.split(" ", 1)
    op = schema[path][method.upper()]
    strategy = st.one_of(op.as_strategy(generation_mode=GenerationMode.POSITIVE),
                         op.as_strategy(generation_mode=GenerationMode.NEGATIVE))
    seen: list[int] = []

    def fuzz(n: int) -> None:
        # n examples, all sent: an example that returned early by the clock would make hypothesis's replay of
        # the same choices draw differently (FlakyStrategyDefinition), so the clock picks n instead
        @settings(max_examples=n, deadline=None, database=None, derandomize=False,
                  suppress_health_check=list(HealthCheck))
        @given(data=st.data())
        def run(data):
            case = data.draw(strategy)
            _aim(case, data, world)
            via = data.draw(st.sampled_from(["unix", "tcp", "tenant"]))
            auth = data.draw(st.sampled_from(["good"] * 6 + ["missing", "wrong"])) if via == "tcp" else "good"
            resp, body = _send(case, world, via, auth)
            seen.append(resp.status_code)
            _check(case, resp, body, auth)
            if via == "tenant":
                theirs = [i for i in (*world["ids"], world["eid"]) if i in resp.request.url.path]
                assert not (theirs and resp.status_code < 300), (
                    f"a tenant reached the operator's {theirs}: {case.method} {resp.request.url} -> {resp.status_code}")
            if auth == "good":
                _conforms(world["doc"]["paths"][path][method.lower()], resp, body)

        run()

    t0 = time.monotonic()
    left = sum(1 for o in OPS if o not in _timings)   # this one and those after it share what is left
    stop_at = t0 + min(OP_SECONDS, max(0.0, _deadline[0] - t0) / max(1, left))
    fuzz(min(MIN_EXAMPLES, EXAMPLES))
    per = (time.monotonic() - t0) / max(1, len(seen))
    more = min(EXAMPLES - len(seen), int((stop_at - time.monotonic()) / max(per, 1e-3)))
    if more > 0:
        fuzz(more)
    _timings[label] = (time.monotonic() - t0, len(seen))
    _statuses.update(seen)
