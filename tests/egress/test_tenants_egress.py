"""A tenant's egress quota (docs/tenants.md) charged from the real gateway's byte counts: a tenant's sandbox
fetches through the gateway in the test world, the bytes count against its day, and past the quota its
creates answer 429 and its sandboxes lose their network."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import httpx
import pytest
from egress_world import daemon_in_world
from hutch_testing import make_busybox_root

import hutch
from hutch import Network

BUSYBOX = shutil.which("busybox")


@pytest.fixture(scope="module")
def tenant_world(world):
    if BUSYBOX is None:
        pytest.skip("busybox-static is not installed (scripts/debian-packages.txt lists it)")
    from hutch.sandbox._host.daemon import tenants as T

    tmp = Path(tempfile.mkdtemp(prefix="hutch-egress-tenants-"))
    try:
        root = make_busybox_root(tmp / "root", BUSYBOX)
        tf = tmp / "etc" / "tenants.json"
        token = T.add(tf, "e", T.Quotas(egress_bytes_per_day=200_000), ["bb-egress"])
        env = {"HUTCH_STATE_DIR": str(tmp / "state")}   # its own: the day's egress count is kept there
        with daemon_in_world(world, "198.18.7.0/24", "default", env, args=("--tenants", str(tf))) as run_dir:
            with hutch.Sandbox.create(image=hutch.Image.from_directory(root)) as sb:   # the operator shares an image
                sb.snapshot_filesystem(name="bb-egress")
            http = httpx.Client(transport=httpx.HTTPTransport(uds=str(run_dir / "hutch.sock")), base_url="http://hutch",
                                headers={"Authorization": f"Bearer {token}"}, timeout=60)
            try:
                yield http
            finally:
                http.close()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _create(http, image="bb-egress", **kw):
    from hutch.sandbox._spec import SandboxSpec

    spec = SandboxSpec.build(image=image, detach=True, timeout=120, **kw).to_dict()
    return http.post("/v1/sandboxes", json={"spec": spec})


def _run(http, sid: str, *argv: str) -> tuple[int, bytes]:
    from hutch.sandbox._api import EXIT, STDOUT, FrameDecoder

    r = http.post(f"/v1/sandboxes/{sid}/exec", json={"argv": list(argv)})
    assert r.status_code == 200, r.text
    out, code = b"", None
    for kind, payload in FrameDecoder().feed(r.content):
        if kind == STDOUT:
            out += payload
        elif kind == EXIT:
            code = json.loads(payload)["returncode"]
    return code, out


def test_egress_is_charged_and_its_quota_holds(tenant_world):
    http = tenant_world
    r = _create(http, network=Network.allow(domains=["www.example.test"]))
    assert r.status_code == 201, r.text
    sid = r.json()["id"]
    try:
        code, _ = _run(http, sid, "wget", "-q", "-O", "/dev/null", "http://www.example.test/bytes/300000")
        assert code == 0
        deadline = time.monotonic() + 10
        while (use := http.get("/v1/tenant").json()["use"]["egress_bytes_per_day"]) < 300_000:
            assert time.monotonic() < deadline, use
            time.sleep(0.2)
        assert use < 400_000   # what was fetched, with its headers: not counted twice
        r = _create(http)
        assert r.status_code == 429, r.text
        d = r.json()
        assert d["error"] == "QuotaExceededError" and d["quota"] == "egress_bytes_per_day" and d["limit"] == 200_000
        deadline = time.monotonic() + 10   # its sandbox loses its network at the next charge
        while _run(http, sid, "wget", "-q", "-T", "3", "-O", "/dev/null", "http://www.example.test/bytes/10")[0] == 0:
            assert time.monotonic() < deadline
            time.sleep(0.5)
        r = http.put(f"/v1/sandboxes/{sid}/network",
                     json={"network": Network.allow(domains=["www.example.test"]).to_dict(reveal=True)})
        assert r.status_code == 429 and r.json()["quota"] == "egress_bytes_per_day"
    finally:
        http.post(f"/v1/sandboxes/{sid}/terminate")
    assert not [s for s in http.get("/v1/sandboxes").json()["sandboxes"]]


def test_egress_counts_survive_a_daemon_restart(world):
    """The day's count is kept in the daemon's state dir (atomically, root's 0600, one file per daemon): a
    restarted daemon still refuses the tenant past its quota, another daemon sharing the state dir does not take
    it over, and a file that is not its own (another user may write it) is refused."""
    if BUSYBOX is None:
        pytest.skip("busybox-static is not installed (scripts/debian-packages.txt lists it)")
    from hutch.sandbox._host.daemon import tenants as T

    tmp = Path(tempfile.mkdtemp(prefix="hutch-egress-restart-"))
    state = tmp / "state"   # its own state dir: the file is the state dir's, not the other daemons' of this session
    env = {"HUTCH_STATE_DIR": str(state)}
    tf = tmp / "etc" / "tenants.json"
    token = T.add(tf, "r", T.Quotas(egress_bytes_per_day=200_000), ["bb-restart"])

    def client(run_dir):
        return httpx.Client(transport=httpx.HTTPTransport(uds=str(run_dir / "hutch.sock")), base_url="http://hutch",
                            headers={"Authorization": f"Bearer {token}"}, timeout=60)

    run = tmp / "run"   # the daemon's run dir, the same at each start: it names the daemon
    run.mkdir(mode=0o700)
    args = ("--tenants", str(tf))
    try:
        root = make_busybox_root(tmp / "root", BUSYBOX)
        with daemon_in_world(world, "198.18.9.0/24", "default", env, args=args, run_dir=run) as run_dir:
            with hutch.Sandbox.create(image=hutch.Image.from_directory(root)) as sb:
                sb.snapshot_filesystem(name="bb-restart")
            with client(run_dir) as http:
                spec = {"image": "bb-restart", "network": Network.allow(domains=["www.example.test"])}
                r = _create(http, **spec)
                assert r.status_code == 201, r.text
                sid = r.json()["id"]
                try:
                    code, _ = _run(http, sid, "wget", "-q", "-O", "/dev/null", "http://www.example.test/bytes/300000")
                    assert code == 0
                finally:
                    http.post(f"/v1/sandboxes/{sid}/terminate")   # its last bytes are charged as it ends
                before = http.get("/v1/tenant").json()["use"]["egress_bytes_per_day"]
                assert before >= 300_000
        (saved,) = (state / "tenant-egress").iterdir()
        st = os.stat(saved)
        assert st.st_uid == 0 and st.st_mode & 0o777 == 0o600
        assert not [p for p in saved.parent.iterdir() if p.name.startswith(".tmp-")]   # nothing half-written left
        # another daemon on the same state dir (its own run dir) counts a day of its own, and leaves this one's
        with daemon_in_world(world, "198.18.9.0/24", "default", env, args=args) as run_dir:
            with client(run_dir) as http:
                assert http.get("/v1/tenant").json()["use"]["egress_bytes_per_day"] == 0
        with daemon_in_world(world, "198.18.9.0/24", "default", env, args=args, run_dir=run) as run_dir:
            with client(run_dir) as http:
                assert http.get("/v1/tenant").json()["use"]["egress_bytes_per_day"] == before
                r = _create(http, "bb-restart")
                assert r.status_code == 429 and r.json()["quota"] == "egress_bytes_per_day", r.text
        os.chmod(saved, 0o666)   # another user could have written it: not believed, the day starts afresh
        with daemon_in_world(world, "198.18.9.0/24", "default", env, args=args, run_dir=run) as run_dir:
            with client(run_dir) as http:
                assert http.get("/v1/tenant").json()["use"]["egress_bytes_per_day"] == 0
            assert f"{saved} is ignored" in (run_dir / "test-daemon.log").read_text()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
