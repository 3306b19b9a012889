"""Tenants (`hutch serve --tenants FILE`, docs/tenants.md) against a real daemon on TCP: each tenant's token
sees only its own sandboxes, images, volumes and snapshots (another's id answers as an unknown one, on every
route of the OpenAPI document), within its quotas (429 QuotaExceededError, nothing half-made), every call
that changes something in the audit log; the tenants file's errors; a rotated token stops working."""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import hashlib
import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

import hutch
from hutch_testing import restore_env
from sdk_support import REMOTE_ENV, RUN_TAG, start_remote, stop_remote

SHARED = "bb-shared"


def hutch_cli(*args: str, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hutch", *args], capture_output=True, text=True, timeout=60,
                          env=env or dict(os.environ))


def add_tenant(path: Path, name: str, *quotas: str, images=(SHARED,)) -> str:
    tf = path.parent / f"{name}.token"
    args = ["tenant", "add", name, "--file", str(path), "--token-file", str(tf)]
    for q in quotas:
        args += ["--quota", q]
    for i in images:
        args += ["--image", i]
    r = hutch_cli(*args)
    assert r.returncode == 0, r.stderr
    assert r.stdout == ""   # written to the file, never printed as well
    assert oct(tf.stat().st_mode & 0o777) == "0o600"
    return tf.read_text().strip()


class World:
    """The daemon, its operator's socket, the tenants' tokens."""

    def __init__(self, d: Path, remote, tokens: dict, tenants_file: Path, audit: Path):
        self.d, self.remote, self.tokens, self.tenants_file, self.audit = d, remote, tokens, tenants_file, audit
        self.sock = remote.run_dir / "run" / "hutch.sock"
        self._clients: list = []   # closed with the world (their pooled TLS connections were left to the gc)

    def client(self, token: str | None):
        """A raw HTTP client: as a tenant (its token, over TCP), or None: the operator (the Unix socket)."""
        from hutch.sandbox._client import Client, Endpoint

        if token is None:
            c = Client(Endpoint(url="", socket_path=str(self.sock)))
        else:
            c = Client(Endpoint(url=self.remote.url, token=token))
        self._clients.append(c)
        return c

    def close_clients(self) -> None:
        for c in self._clients:
            c.http.close()
        self._clients.clear()

    def as_tenant(self, name: str | None):
        """Point the SDK of this process at the daemon as tenant `name` (None: the operator)."""
        for k in ("HUTCH_TOKEN", "HUTCH_TOKEN_FILE", "HUTCH_URL"):
            os.environ.pop(k, None)
        os.environ["HUTCH_SOCKET"] = str(self.sock)
        if name is not None:
            os.environ.update(HUTCH_URL=self.remote.url, HUTCH_TOKEN=self.tokens[name])


@pytest.fixture(scope="module")
def world(busybox_root):
    saved = {k: os.environ.get(k) for k in REMOTE_ENV}
    d = Path(tempfile.mkdtemp(prefix="hutch-tenants-"))
    tf, audit = d / "etc" / "tenants.json", d / "log" / "audit.jsonl"
    tokens = {"a": add_tenant(tf, "a", "sandboxes=3", "memory=1G"), "b": add_tenant(tf, "b"),
              "c": add_tenant(tf, "c", "sandboxes=2", "cpu=1.5", "memory=200M", "disk=1M"),
              "r": add_tenant(tf, "r", "creates_per_second=1"), "v": add_tenant(tf, "v", "disk=48M")}
    assert oct(tf.stat().st_mode & 0o777) == "0o600" and "token_sha256" in tf.read_text()
    assert not any(t in tf.read_text() for t in tokens.values())   # digests only
    remote = start_remote(d, "--tenants", str(tf), "--audit-log", str(audit), "--audit-max-bytes", "20000",
                          "--audit-keep", "2")
    w = World(d, remote, tokens, tf, audit)
    os.environ["HUTCH_FINGERPRINT"] = remote.fingerprint
    os.environ["HUTCH_RUN_DIR"] = str(d / "client")
    try:
        # the operator shares an image: a snapshot of the busybox root (a host directory, which tenants may not use)
        w.as_tenant(None)
        with hutch.Sandbox.create(image=hutch.Image.from_directory(busybox_root), tags=RUN_TAG) as sb:
            sb.snapshot_filesystem(name=SHARED)
        yield w
    finally:
        try:
            w.as_tenant(None)
            for sb in hutch.Sandbox.list():
                sb.terminate()
        finally:
            w.close_clients()
            stop_remote(remote)
            restore_env(saved)
            shutil.rmtree(d, ignore_errors=True)


def _create(w: World, tenant: str, **kw):
    w.as_tenant(tenant)
    return hutch.Sandbox.create(image=kw.pop("image", SHARED), tags=RUN_TAG, detach=True, **kw)


def _cgroups(w: World) -> set[str]:
    """The daemon's sandbox cgroups (memory controller), but for its zygote's."""
    from hutch.sandbox._host.daemon import cgroup_parent_for

    base = Path("/sys/fs/cgroup/memory") / cgroup_parent_for(w.remote.run_dir / "run")
    return {p.name for p in base.iterdir() if p.is_dir() and p.name != "_zygote"}


# --- isolation, on every route --------------------------------------------------------------------------------


def _fill(path: str, ids: dict) -> str:
    return re.sub(r"\{(\w+)\}", lambda m: ids[m.group(1)], path)


def test_every_route_answers_another_tenants_ids_as_unknown_ones(world):
    """Walks the OpenAPI document: a route that takes an id, given tenant a's, answers tenant b exactly as an
    unknown id (status and body, ids aside); a listing shows b nothing of a's; a route tenants may not call
    answers as an unknown route. A route added without a decision for tenants is refused to them (default-deny)."""
    from hutch.sandbox._host.daemon.tenants import ROUTES

    w = world
    sa = _create(w, "a")
    try:
        sa.files.write("/tmp/x", b"1")
        p = sa.exec("sh", "-c", "read x", stdin=True)
        img = sa.snapshot_filesystem(name="mine")
        w.as_tenant("a")
        vol = hutch.Volume.from_name("va", create=True)
        vol.write("/f", b"v")
        a_ids = {"id": sa.id, "eid": p.id, "key": img.ref.split(":", 1)[1], "name": "va", "sid": "0" * 32}
        own = w.client(w.tokens["a"])
        assert own.json("GET", f"/v1/images/{a_ids['key']}")["id"] == a_ids["key"]
        assert own.json("GET", "/v1/volumes/va/files/list")["entries"]
        unknown = {"id": secrets.token_hex(6), "eid": secrets.token_hex(6), "key": secrets.token_hex(32),
                   "name": "vz" + secrets.token_hex(3), "sid": secrets.token_hex(16)}
        b = w.client(w.tokens["b"]).http
        doc = w.client(None).json("GET", "/v1/openapi.json")
        checked = 0
        for path, ops in doc["paths"].items():
            for method in ops:
                key = (method.upper(), path)
                query = {"path": "/tmp/x", "timeout": "0"}
                body = {"argv": ["true"], "network": {"mode": "none"}, "name": "va", "ref": "x"}
                if key not in ROUTES:   # the operator's: as an unknown route, whatever the ids
                    r = b.request(method, _fill(path, a_ids), params=query, json=body)
                    assert r.status_code == 404 and r.json()["error"] == "NotFoundError", (key, r.text)
                    assert "no route" in r.json()["message"], (key, r.text)
                    checked += 1
                    continue
                if "{" not in path:
                    continue   # listings and creates: below
                send = b
                if key == ("GET", "/v1/sandboxes/{id}/exec/pty"):
                    headers = {"Connection": "Upgrade", "Upgrade": "websocket", "Sec-WebSocket-Version": "13",
                               "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ=="}
                    send = None   # a connection of its own for each: an upgrade request ends its keep-alive
                else:
                    headers = {}

                def call(ids):
                    c = send or w.client(w.tokens["b"]).http
                    try:
                        return c.request(method, _fill(path, ids), params=query, headers=headers,
                                         **({"json": body} if method != "get" else {}))
                    finally:
                        if send is None:
                            c.close()
                try:
                    got, ref = call(a_ids), call(unknown)
                except Exception as e:
                    raise AssertionError(f"{key}: {e}; the daemon's log: {w.remote.log.read_text()[-2000:]}") from e
                assert got.status_code == 404 == ref.status_code, (key, got.text, ref.text)

                def norm(text, ids):
                    for k, v in ids.items():
                        text = text.replace(v, f"<{k}>")
                    return text
                assert norm(got.text, a_ids) == norm(ref.text, unknown), (key, got.text, ref.text)
                checked += 1
        routes = [(m.upper(), p) for p, ops in doc["paths"].items() for m in ops]
        assert checked == len([k for k in routes if k not in ROUTES or "{" in k[1]]) and checked > 30
        assert set(ROUTES) <= set(routes)   # every route tenants may call is in the document
        # listings: nothing of a's
        assert [s.id for s in hutch.Sandbox.list()] and sa.id in [s.id for s in hutch.Sandbox.list()]
        w.as_tenant("b")
        assert sa.id not in [s.id for s in hutch.Sandbox.list()]
        assert all(v["name"] != "va" for v in b.get("/v1/volumes").json()["volumes"])
        imgs = b.get("/v1/images").json()["images"]
        assert a_ids["key"] not in [i["id"] for i in imgs] and SHARED in [i["name"] for i in imgs]
        assert "mine" not in [i["name"] for i in imgs]
        # b's own volume of the same name is another volume
        vb = hutch.Volume.from_name("va", create=True)
        assert vb.list("/") == []
        hutch.Volume.delete("va")
        # the operator sees a's sandbox
        assert sa.id in [s["id"] for s in w.client(None).json("GET", "/v1/sandboxes")["sandboxes"]]
        p.kill()
    finally:
        w.as_tenant("a")
        sa.terminate()
        hutch.Volume.delete("va")


@pytest.mark.skipif(shutil.which("runsc") is None, reason="runsc is not installed (scripts/setup.sh)")
def test_memory_snapshots_are_their_tenants(world):
    """gVisor: a's memory snapshot is listed, restored and deleted by a only; to b its id is an unknown one;
    a restore is a's sandbox, charged to a's quotas."""
    w = world
    sa = _create(w, "a", runtime="gvisor", memory="128M")
    try:
        snap = sa.snapshot_memory()
        a, b = w.client(w.tokens["a"]).http, w.client(w.tokens["b"]).http
        other = secrets.token_hex(16)
        assert [s["id"] for s in a.get("/v1/memory-snapshots").json()["snapshots"]] == [snap.id]
        assert b.get("/v1/memory-snapshots").json()["snapshots"] == []
        for method, path in (("GET", "/v1/memory-snapshots/{}"), ("DELETE", "/v1/memory-snapshots/{}"),
                             ("POST", "/v1/memory-snapshots/{}/restore")):
            got, ref = b.request(method, path.format(snap.id)), b.request(method, path.format(other))
            assert got.status_code == ref.status_code == 404, (path, got.text)
            assert got.text.replace(snap.id, "<sid>") == ref.text.replace(other, "<sid>")
        w.as_tenant("a")
        kid = hutch.Sandbox.restore(snap, detach=True, tags=RUN_TAG)
        try:
            assert kid.id in [s.id for s in hutch.Sandbox.list()]
            assert w.client(w.tokens["a"]).json("GET", "/v1/tenant")["use"]["sandboxes"] == 2
            w.as_tenant("b")
            assert kid.id not in [s.id for s in hutch.Sandbox.list()]
        finally:
            kid.terminate()
        assert a.delete(f"/v1/memory-snapshots/{snap.id}").status_code == 204
    finally:
        sa.terminate()


def test_a_tenant_may_not_bind_host_paths_or_use_host_directories(world, busybox_root, tmp_path):
    w = world
    w.as_tenant("b")
    with pytest.raises(hutch.ConfigError, match="may not bind a host path"):
        hutch.Sandbox.create(image=SHARED, mounts=[hutch.Mount.bind(str(tmp_path), "/mnt")], tags=RUN_TAG)
    with pytest.raises(hutch.ConfigError, match="directory of the host"):
        hutch.Sandbox.create(image=hutch.Image.from_directory(busybox_root), tags=RUN_TAG)
    with pytest.raises(hutch.NotFoundError):   # an image not shared with it is unknown to it
        hutch.Sandbox.create(image="image:" + "e" * 64, tags=RUN_TAG)
    r = w.client(w.tokens["b"]).http.post("/v1/images/ensure", json={"ref": "debian-slim"})
    assert r.status_code == 404 and "cannot build images" in r.json()["message"]   # this daemon's state has none
    hutch.Volume.from_name("vv", create=True)
    sb = _create(w, "b", mounts=[hutch.Mount.volume("vv", "/data", readonly=False)])
    try:
        sb.run("sh", "-c", "echo hi > /data/f")
        assert hutch.Volume.from_name("vv").read("/f") == b"hi\n"
        info = w.client(w.tokens["b"]).json("GET", f"/v1/sandboxes/{sb.id}")
        assert [m["source"] for m in info["spec"]["mounts"]] == ["vv"] and info["spec"]["image"] == SHARED
    finally:
        sb.terminate()
        hutch.Volume.delete("vv")
    with pytest.raises(hutch.UnsupportedError, match="build steps"):
        _snapshot_with_key(w)


def _snapshot_with_key(w):
    sb = _create(w, "b")
    try:
        w.client(w.tokens["b"]).json("POST", f"/v1/sandboxes/{sb.id}/snapshot", json={"key": "a" * 64})
    finally:
        sb.terminate()


def test_names_are_per_tenant(world):
    w = world
    one = _create(w, "a", name="agent")
    two = _create(w, "b", name="agent")   # another tenant's name does not collide (nor say it exists)
    try:
        w.as_tenant("b")
        assert hutch.Sandbox.from_id("agent").id == two.id
        w.as_tenant("a")
        assert hutch.Sandbox.from_id("agent").id == one.id
    finally:
        one.terminate()
        two.terminate()


# --- quotas ---------------------------------------------------------------------------------------------------


def test_live_sandbox_quota_holds_under_concurrent_creates_and_leaves_nothing(world):
    w = world
    before = _cgroups(w)
    w.as_tenant("c")

    def one(_):
        try:
            return hutch.Sandbox.create(image=SHARED, tags=RUN_TAG, detach=True, memory="64M", cpu=0.5)
        except hutch.QuotaExceededError as e:
            return e
    with cf.ThreadPoolExecutor(8) as ex:
        got = list(ex.map(one, range(8)))
    made = [g for g in got if isinstance(g, hutch.Sandbox)]
    refused = [g for g in got if isinstance(g, hutch.QuotaExceededError)]
    try:
        assert len(made) == 2 and len(refused) == 6, got
        e = refused[0]
        assert e.quota == "sandboxes" and e.limit == 2 and e.used == 2, (e.quota, e.limit, e.used, str(e))
        assert "hutch tenant set c --quota sandboxes=" in str(e)
        # nothing of the refused ones: only the two sandboxes' cgroups are new
        time.sleep(0.2)
        assert len(_cgroups(w) - before - {s.id for s in made}) <= 4   # at most the refilled warm pool
        assert not (_cgroups(w) - before) - {s.id for s in made} - set(_warm(w))
        info = w.client(w.tokens["c"]).json("GET", "/v1/tenant")
        assert info["name"] == "c" and info["use"]["sandboxes"] == 2 and info["quotas"]["sandboxes"] == 2
    finally:
        for s in made:
            s.terminate()


def _warm(w: World) -> list[str]:
    return [p.stem for p in (w.remote.run_dir / "run" / "sandboxes").glob("*.json")]


def test_cpu_and_memory_quotas(world):
    w = world
    w.as_tenant("c")
    sb = hutch.Sandbox.create(image=SHARED, tags=RUN_TAG, detach=True, memory="150M", cpu=1.0)
    try:
        with pytest.raises(hutch.QuotaExceededError) as e:
            hutch.Sandbox.create(image=SHARED, tags=RUN_TAG, detach=True, memory="100M", cpu=0.25)
        assert e.value.quota == "memory" and e.value.limit == 200 << 20 and e.value.used == 150 << 20
        with pytest.raises(hutch.QuotaExceededError) as e:
            hutch.Sandbox.create(image=SHARED, tags=RUN_TAG, detach=True, memory="32M", cpu=1.0)
        assert e.value.quota == "cpu" and e.value.limit == 1.5 and e.value.used == 1.0
        assert len(hutch.Sandbox.list()) == 1
    finally:
        sb.terminate()


def test_create_rate_quota(world):
    w = world
    w.as_tenant("r")
    made = []
    try:
        made.append(hutch.Sandbox.create(image=SHARED, tags=RUN_TAG, detach=True))
        with pytest.raises(hutch.QuotaExceededError) as e:
            for _ in range(3):
                made.append(hutch.Sandbox.create(image=SHARED, tags=RUN_TAG, detach=True))
        assert e.value.quota == "creates_per_second" and e.value.limit == 1
        time.sleep(1.1)
        made.append(hutch.Sandbox.create(image=SHARED, tags=RUN_TAG, detach=True))   # the bucket refilled
    finally:
        for s in made:
            s.terminate()


def test_disk_quota_covers_volumes_and_images(world):
    w = world
    w.as_tenant("c")
    v = hutch.Volume.from_name("big", create=True)
    try:
        with pytest.raises(hutch.QuotaExceededError) as e:
            v.write("/blob", os.urandom(2 << 20))
        assert e.value.quota == "disk" and e.value.limit == 1 << 20
        assert v.list("/") == []   # nothing half-written
        sb = hutch.Sandbox.create(image=SHARED, tags=RUN_TAG, detach=True, memory="64M", cpu=0.5)
        try:
            sb.run("sh", "-c", "head -c 3000000 /dev/urandom > /blob")
            with pytest.raises(hutch.QuotaExceededError, match="disk"):
                sb.snapshot_filesystem(name="fat")
            imgs = w.client(w.tokens["c"]).json("GET", "/v1/images")["images"]
            assert "fat" not in [i["name"] for i in imgs]
            assert not [i for i in imgs if i["kind"] == "snapshot" and i["name"] != SHARED]
        finally:
            sb.terminate()
    finally:
        hutch.Volume.delete("big")


def _store_blocks(w: World, tenant: str) -> int:
    """Bytes the host disk holds for `tenant`'s volume store (its sparse file's blocks)."""
    return os.stat(w.remote.run_dir / "state" / "volume-stores" / f"{tenant}.img").st_blocks * 512


def test_a_sandbox_writing_into_a_volume_stops_at_its_tenants_disk_quota(world):
    """What a sandbox writes into a mounted volume is bounded by its tenant's disk quota as it is written: the
    writer gets EDQUOT at the quota (data, and metadata: a flood of files), the host's disk gives the tenant's
    store no more than that, the files API's writes answer QuotaExceededError, and room comes back when it
    deletes. The quota counts the tenant's images too, and follows `hutch tenant set`."""
    w = world
    w.as_tenant("v")
    v = hutch.Volume.from_name("scratch", create=True)
    try:
        base = _store_blocks(w, "v")
        sb = hutch.Sandbox.create(image=SHARED, tags=RUN_TAG, detach=True, memory="64M", cpu=0.5,
                                  mounts=[hutch.Mount.volume(v, "/v")])
        try:
            r = sb.run("sh", "-c", "dd if=/dev/zero of=/v/blob bs=1M count=200 2>&1; echo rc=$?; sync")
            assert "rc=1" in r.stdout and "quota exceeded" in r.stdout.lower(), r.stdout
            size = int(sb.run("stat", "-c", "%s", "/v/blob").stdout)
            assert 40 << 20 <= size <= 48 << 20, size
            assert _store_blocks(w, "v") - base <= (48 + 16) << 20   # the host gave it the quota, not 200M
            with pytest.raises(hutch.QuotaExceededError) as e:
                v.write("/more", b"x" * (8 << 20))
            assert e.value.quota == "disk"
            assert [f.name for f in v.list("/")] == ["blob"]   # nothing half-written
            # metadata counts too: a flood of empty files with long names stops at the quota as well
            assert sb.run("rm", "/v/blob").returncode == 0   # deleting needs no room, and gives it back
            r = sb.run("sh", "-c", "mkdir /v/many && cd /v/many && n=$(printf %0200d 0) && i=0; "
                       "while [ $i -lt 400000 ]; do : > f$i-$n; i=$((i+1)); done", timeout=600)
            assert r.returncode != 0 and "Disk quota exceeded" in r.stderr, r   # sh ends at a failed redirection
            sb.run("sync")
            held = _store_blocks(w, "v") - base
            print(f"host bytes of the store after the flood: {held >> 20} MiB")
            # metadata: btrfs charges it to the quota group late (at its transaction commits), so a fast flood of
            # empty files passes the quota (seen: 120 MiB for 48 MiB on an idle machine, ~70 MiB under load); the
            # bound the host relies on is the store's file, whose size the daemon fixed from the quota
            img = w.remote.run_dir / "state" / "volume-stores" / "v.img"
            assert held <= os.stat(img).st_size <= max(256 << 20, (48 << 20) * 5 // 4 + (128 << 20)), held
            r = sb.run("sh", "-c", "rm -rf /v/many && sync && dd if=/dev/zero of=/v/small bs=1M count=8 "
                       "2>/dev/null; echo rc=$?")
            assert "rc=0" in r.stdout, r
            # the quota follows the tenants file: lowered under what is written, the next write is refused
            assert hutch_cli("tenant", "set", "v", "--file", str(w.tenants_file), "--quota", "disk=4M").returncode == 0
            deadline = time.monotonic() + 30
            while "rc=0" in sb.run("sh", "-c", "dd if=/dev/zero of=/v/next bs=1M count=1 2>/dev/null; echo rc=$?;"
                                               " rm -f /v/next").stdout:
                assert time.monotonic() < deadline, "the lowered quota was not applied to the volume's store"
                time.sleep(0.5)
        finally:
            sb.terminate()
            assert hutch_cli("tenant", "set", "v", "--file", str(w.tenants_file), "--quota", "disk=48M").returncode == 0
    finally:
        hutch.Volume.delete("scratch")
    assert hutch.Volume.from_name("scratch", create=True).list("/") == []   # made anew: empty, in the same store
    hutch.Volume.delete("scratch")


def test_a_tenant_client_on_the_host_is_scoped_over_the_socket(world):
    """hutch.connect("unix:...", token= or token_file=), and HUTCH_TOKEN_FILE without HUTCH_URL: the SDK sends the
    tenant's token over the Unix socket too, so a tenant's client on the host sees and makes only its own."""
    from hutch.sandbox._client import disconnect

    w = world
    w.as_tenant(None)
    theirs = hutch.Sandbox.create(image=SHARED, tags=RUN_TAG, detach=True)   # the operator's
    tf = w.tenants_file.parent / "b.token"
    made = []
    try:
        for how in ("token", "token_file", "env"):
            w.as_tenant(None)   # the socket, no URL
            if how == "token":
                hutch.connect(f"unix:{w.sock}", token=w.tokens["b"])
            elif how == "token_file":
                hutch.connect(f"unix:{w.sock}", token_file=tf)
            else:
                os.environ["HUTCH_TOKEN_FILE"] = str(tf)
            try:
                sb = hutch.Sandbox.create(image=SHARED, tags=RUN_TAG, detach=True)
                made.append(sb)
                seen = {s.id for s in hutch.Sandbox.list()}
                assert sb.id in seen and theirs.id not in seen, how
                with pytest.raises(hutch.NotFoundError):
                    hutch.Sandbox.from_id(theirs.id).run("true")
            finally:
                disconnect()
                os.environ.pop("HUTCH_TOKEN_FILE", None)
        as_b = {s["id"] for s in w.client(w.tokens["b"]).json("GET", "/v1/sandboxes")["sandboxes"]}
        assert {s.id for s in made} <= as_b   # they are b's, over TCP as well
        with pytest.raises(hutch.ConfigError, match="not both"):
            hutch.connect(f"unix:{w.sock}", token=w.tokens["b"], token_file=tf)
        loose = w.d / "loose.token"
        loose.write_text(w.tokens["b"])
        loose.chmod(0o644)
        with pytest.raises(hutch.ConfigError, match="loose.token"):
            hutch.connect(f"unix:{w.sock}", token_file=loose)
    finally:
        disconnect()
        w.as_tenant(None)
        for sb in [theirs, *made]:
            hutch.Sandbox.from_id(sb.id).terminate()


def test_a_tenant_exports_its_images_but_imports_none(world, tmp_path):
    """Image export is a tenant's for the images it may use (scoped as every id route); import is the
    operator's: an archive is untrusted input the root daemon unpacks into the host-wide layer store, so a
    tenant's import answers as an unknown route and leaves nothing."""
    w = world
    sb = _create(w, "a")
    try:
        sb.files.write("/exported", b"mine")
        img = sb.snapshot_filesystem(name="to-export")
    finally:
        sb.terminate()
    out = tmp_path / "img.tar"
    img.export(out)
    import tarfile
    with tarfile.open(out) as tf:
        assert tf.getmembers()
    b = w.client(w.tokens["b"]).http
    assert b.get(f"/v1/images/{img.ref.split(':', 1)[1]}/export").status_code == 404   # a's: unknown to b
    a = w.client(w.tokens["a"]).http
    before = sorted(p.name for p in (w.remote.run_dir / "state" / "layers").iterdir())
    r = a.post("/v1/images/import", content=out.read_bytes(), headers={"Content-Type": "application/x-tar"})
    unknown = a.post("/v1/images/no-such-route", content=b"x")
    assert r.status_code == unknown.status_code == 404
    assert r.json() == {**unknown.json(), "message": unknown.json()["message"].replace("no-such-route", "import")}
    # nor with replace=1 (which moves an operator's name to an archive's image) or a digest (a fleet's transfer)
    for params in ({"replace": "1"}, {"replace": "1", "digest": "0" * 64}):
        r = a.post("/v1/images/import", params=params, content=out.read_bytes(),
                   headers={"Content-Type": "application/x-tar"})
        assert (r.status_code, r.json()["message"]) == (404, unknown.json()["message"].replace("no-such-route", "import"))
    assert sorted(p.name for p in (w.remote.run_dir / "state" / "layers").iterdir()) == before   # nothing kept


def test_a_tenants_exports_spool_one_at_a_time(world):
    """An export spools its archive on the host's disk before it answers; a tenant's exports go one at a time,
    so its spools on the host are one image's worth however many requests it opens."""
    import threading

    w = world
    sb = _create(w, "a")
    try:
        sb.run("sh", "-c", "head -c 24000000 /dev/urandom > /big")   # more than sockets buffer: the answer waits
        img = sb.snapshot_filesystem(name="to-spool")
    finally:
        sb.terminate()
    url = f"/v1/images/{img.ref.split(':', 1)[1]}/export"
    layers = w.remote.run_dir / "state" / "layers"
    spools = lambda: sorted(p.name for p in layers.iterdir() if p.name.startswith(".tmp-export-"))  # noqa: E731
    second: dict = {}

    def other():
        second["r"] = w.client(w.tokens["a"]).http.get(url)

    t = threading.Thread(target=other)
    with w.client(w.tokens["a"]).http.stream("GET", url) as first:
        assert first.status_code == 200
        chunks = first.iter_bytes()
        got = len(next(chunks))
        t.start()
        time.sleep(1.0)   # the second request is in; it waits for the first, spooling nothing
        assert len(spools()) == 1 and "r" not in second, (spools(), second)
        got += sum(len(c) for c in chunks)
    t.join(timeout=120)
    assert second["r"].status_code == 200 and len(second["r"].content) == got > 24_000_000
    deadline = time.monotonic() + 30   # each spool goes once its answer is sent, just after its last bytes
    while spools() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert spools() == []


def test_quota_error_is_a_documented_429(world):
    w = world
    w.as_tenant("c")
    made = [hutch.Sandbox.create(image=SHARED, tags=RUN_TAG, detach=True, memory="32M", cpu=0.25) for _ in range(2)]
    try:
        from hutch.sandbox._spec import SandboxSpec
        body = {"spec": SandboxSpec.build(image=SHARED, memory="32M", cpu=0.25, detach=True).to_dict()}
        r = w.client(w.tokens["c"]).http.post("/v1/sandboxes", json=body)
        assert r.status_code == 429
        d = r.json()
        assert d["error"] == "QuotaExceededError" and d["quota"] == "sandboxes" and d["limit"] == 2 and d["used"] == 2
    finally:
        for s in made:
            s.terminate()


# --- tokens and the tenants file --------------------------------------------------------------------------------


def test_rotation_invalidates_the_old_token_at_once(world):
    w = world
    old = add_tenant(w.tenants_file, "rot")
    assert w.client(old).json("GET", "/v1/tenant")["name"] == "rot"
    tf = w.d / "rot.new"
    r = hutch_cli("tenant", "rotate", "rot", "--file", str(w.tenants_file), "--token-file", str(tf))
    assert r.returncode == 0, r.stderr
    new = tf.read_text().strip()
    with pytest.raises(hutch.DaemonError, match="token"):
        w.client(old).json("GET", "/v1/tenant")
    assert w.client(new).json("GET", "/v1/tenant")["name"] == "rot"
    r = hutch_cli("tenant", "ls", "--file", str(w.tenants_file))
    assert "rot" in r.stdout and new not in r.stdout
    assert hutch_cli("tenant", "rm", "rot", "--file", str(w.tenants_file)).returncode == 0
    with pytest.raises(hutch.DaemonError, match="token"):
        w.client(new).json("GET", "/v1/tenant")


def test_a_removed_tenants_name_is_never_given_again(world):
    """What a tenant owned is recorded by its name (its sandboxes, images, memory snapshots, volumes): after
    `hutch tenant rm`, a new tenant of the same name would take it over. So the name goes to the file's
    "removed" and `tenant add` refuses it, as the daemon refuses a file that gives it again (the last good file
    stays in force); the operator still sees what the removed tenant left."""
    w = world
    tok = w.tokens["gone"] = add_tenant(w.tenants_file, "gone")
    sb = _create(w, "gone")
    try:
        r = hutch_cli("tenant", "rm", "gone", "--file", str(w.tenants_file))
        assert r.returncode == 0, r.stderr
        assert "gone" in json.loads(w.tenants_file.read_text())["removed"]
        with pytest.raises(hutch.DaemonError, match="token"):
            w.client(tok).json("GET", "/v1/tenant")
        r = hutch_cli("tenant", "add", "gone", "--file", str(w.tenants_file), "--token-file", str(w.d / "gone.2"))
        assert r.returncode == 1 and "was removed" in r.stderr and "another name" in r.stderr, r.stderr
        assert not (w.d / "gone.2").exists() and "gone" not in json.loads(w.tenants_file.read_text())["tenants"]
        # a hand edit that gives the name again: refused by the CLI, and by the daemon (the last good file stays)
        good = w.tenants_file.read_bytes()
        doc = json.loads(good)
        again = secrets.token_hex(16)
        doc["tenants"]["gone"] = {"token_sha256": hashlib.sha256(again.encode()).hexdigest(), "quotas": {}}
        w.tenants_file.write_text(json.dumps(doc))
        try:
            r = hutch_cli("tenant", "ls", "--file", str(w.tenants_file))
            assert r.returncode == 1 and "was removed" in r.stderr, r.stderr
            with pytest.raises(hutch.DaemonError, match="token"):
                w.client(again).json("GET", "/v1/tenant")
            assert w.client(w.tokens["b"]).json("GET", "/v1/tenant")["name"] == "b"   # the others go on
        finally:
            w.tenants_file.write_bytes(good)
        # its running sandbox, which nobody but the operator could reach any more, is terminated by the daemon
        # within a second of the removal (its log says so); the operator sees it ended
        op = w.client(None)
        deadline = time.monotonic() + 120   # a hang guard: the daemon looks every EGRESS_EVERY (1 s)
        while op.json("GET", f"/v1/sandboxes/{sb.id}")["status"] != "terminated" and time.monotonic() < deadline:
            time.sleep(0.2)
        assert op.json("GET", f"/v1/sandboxes/{sb.id}")["status"] == "terminated"
        assert f"tenant gone was removed: its sandbox {sb.id} is terminated" in w.remote.log.read_text()
        while sb.id in _cgroups(w) and time.monotonic() < deadline:   # its teardown goes on just after the status
            time.sleep(0.2)
        assert not [p for p in _cgroups(w) if p == sb.id]
    finally:
        w.as_tenant(None)
        w.tokens.pop("gone")
        with contextlib.suppress(hutch.NotFoundError, hutch.StateError):
            hutch.Sandbox.from_id(sb.id).terminate()


def test_tenants_file_errors(tmp_path):
    f = tmp_path / "t.json"
    add_tenant(f, "x")
    os.chmod(f, 0o640)
    r = hutch_cli("serve", "--tenants", str(f), "--socket", str(tmp_path / "s.sock"),
                  env=dict(os.environ, HUTCH_RUN_DIR=str(tmp_path / "run")))
    assert r.returncode == 1 and "chmod 600" in r.stderr, r.stderr
    os.chmod(f, 0o600)
    os.chown(f, 1234, 0)
    r = hutch_cli("tenant", "ls", "--file", str(f))
    assert r.returncode == 1 and "not root" in r.stderr, r.stderr
    os.chown(f, 0, 0)
    for bad, why in [('{"tenants": {"x": {"token_sha256": "zz"}}}', "64 hex"),
                     ('{"tenants": {"x": {"token_sha256": "' + "a" * 64 + '", "quotas": {"gpus": 1}}}}', "unknown quota"),
                     ('{"tenants": {"X Y": {}}}', "tenant name"), ("not json", "not JSON"),
                     ('{"tenants": {}, "removed": ["X Y"]}', "tenant name"), ('{"removed": "x"}', '"removed"')]:
        f.write_text(bad)
        r = hutch_cli("tenant", "ls", "--file", str(f))
        assert r.returncode == 1 and why in r.stderr, (bad, r.stderr)
    r = hutch_cli("tenant", "add", "y", "--file", str(tmp_path / "u.json"), "--quota", "memory=lots")
    assert r.returncode == 1 and "memory" in r.stderr
    r = hutch_cli("tenant", "add", "y", "--token", "x" * 20, "--file", str(tmp_path / "u.json"))
    assert r.returncode == 2   # no token on argv


# --- the audit log ----------------------------------------------------------------------------------------------


def test_audit_log_records_and_rotates(world):
    w = world
    sb = _create(w, "a")
    sb.run("true")
    sb.terminate()
    assert w.client(w.tokens["b"]).http.post(f"/v1/sandboxes/{sb.id}/terminate").status_code == 404
    lines = []
    for p in [w.audit.with_name(w.audit.name + ".2"), w.audit.with_name(w.audit.name + ".1"), w.audit]:
        if p.exists():
            assert p.stat().st_mode & 0o777 == 0o600 and p.stat().st_uid == 0
            lines += [json.loads(x) for x in p.read_text().splitlines()]
    mine = [x for x in lines if x["id"] == sb.id]
    acts = [(x["tenant"], x["action"], x["outcome"]) for x in mine]
    assert ("a", "POST /v1/sandboxes", "ok") in acts
    assert ("a", "POST /v1/sandboxes/{id}/exec", "ok") in acts
    assert ("a", "POST /v1/sandboxes/{id}/terminate", "ok") in acts
    assert ("b", "POST /v1/sandboxes/{id}/terminate", "404 NotFoundError") in acts
    assert all(set(x) >= {"time", "tenant", "action", "id", "outcome"} for x in lines)
    # rotation: past 20000 bytes the log moves to .1, .1 to .2; no .3 is kept
    client = w.client(w.tokens["b"]).http
    for _ in range(400):
        client.post(f"/v1/sandboxes/{secrets.token_hex(6)}/terminate")
    assert w.audit.with_name(w.audit.name + ".1").exists() and w.audit.with_name(w.audit.name + ".2").exists()
    assert not w.audit.with_name(w.audit.name + ".3").exists()
    assert w.audit.stat().st_size <= 20000


# --- fair create slots ------------------------------------------------------------------------------------------


def test_fair_slots_let_a_light_tenant_past_a_burst():
    """The admission itself (tenants.Accounts): a tenant within its share never waits behind another's burst;
    the burst gets what the others leave; freed slots go round the waiting tenants in turn."""
    import asyncio

    from hutch.sandbox._host.daemon.tenants import Accounts

    async def main():
        acc = Accounts(slots=4)
        running = {"a": 0, "b": 0, "c": 0}
        peak = {"a": 0, "b": 0, "c": 0}
        order = []

        async def create(name, hold):
            await acc.slot(name)
            running[name] += 1
            peak[name] = max(peak[name], running[name])
            order.append(name)
            try:
                await hold.wait()
            finally:
                running[name] -= 1
                acc.free(name)

        hold_a = asyncio.Event()
        burst = [asyncio.ensure_future(create("a", hold_a)) for _ in range(20)]
        await asyncio.sleep(0.01)
        assert running["a"] == 4   # alone, the burst takes every slot
        hold_b = asyncio.Event()
        light = asyncio.ensure_future(create("b", hold_b))
        await asyncio.sleep(0.01)
        assert running["b"] == 1   # within its share: b does not wait, even with every slot a's
        assert acc._allot() == {"b": 1, "a": 3}   # a is past its share: its next freed slot is not its own
        hold_b.set()
        await light
        hold_b.clear()
        more_b = [asyncio.ensure_future(create("b", hold_b)) for _ in range(3)]
        await asyncio.sleep(0.01)
        assert running["b"] == 2   # its equal share (half of 4) at once; the third waits
        hold_a.set()   # a's creates end; b holds its 2, a runs 2 at a time, and a slot freed goes round in turn
        await asyncio.sleep(0.05)
        bs = [i for i, n in enumerate(order) if n == "b"]
        assert len(bs) == 4 and bs[-1] < max(i for i, n in enumerate(order) if n == "a"), order   # not after a's 16
        assert max(peak.values()) <= 4 and running["b"] == 3
        hold_b.set()
        await asyncio.gather(*burst, *more_b)
        assert acc.inflight == {} and not acc.turn
        # cancelled waiters give their place back
        hold = asyncio.Event()
        first = [asyncio.ensure_future(create(n, hold)) for n in ("c", "c", "c", "c", "a", "a")]
        await asyncio.sleep(0.01)
        waiter = asyncio.ensure_future(acc.slot("a"))   # past a's share (2 of 4): it waits
        await asyncio.sleep(0.01)
        assert not waiter.done()
        waiter.cancel()
        await asyncio.gather(waiter, return_exceptions=True)
        hold.set()
        await asyncio.gather(*first)
        assert acc.inflight == {} and not acc.turn

    asyncio.run(main())


def _renamed(archive: bytes, name: str) -> bytes:
    """The image archive with its top node named `name` (what an operator might be handed)."""
    import io
    import tarfile

    from hutch.sandbox._host.archive import MANIFEST

    src, out = tarfile.open(fileobj=io.BytesIO(archive)), io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as dst:
        for m in src.getmembers():
            data = src.extractfile(m).read() if m.isfile() else None
            if m.name == MANIFEST:
                doc = json.loads(data)
                for n in doc["nodes"]:
                    n["name"] = name if n["id"] == doc["top"] else None
                data = json.dumps(doc).encode()
                m.size = len(data)
            dst.addfile(m, io.BytesIO(data) if data is not None else None)
    return out.getvalue()


def test_an_operators_import_gives_no_tenants_name_to_other_content(world):
    """A tenant's image names are t.TENANT.NAME in the host's one namespace of names. An operator's import of an
    archive carrying such a name (with replace=1 it moved the name off the tenant's own image) would hand the
    tenant content it never made under a name it uses: refused, before anything is stored, unless the import is
    for that tenant (owner=, with the digest its source answered: a fleet's transfer)."""
    w = world
    sa = _create(w, "a")
    sb = _create(w, "b")
    try:
        sa.files.write("/who", b"a's own\n")
        mine = sa.snapshot_filesystem(name="app")
        sb.files.write("/who", b"b's\n")
        theirs = sb.snapshot_filesystem()
    finally:
        sa.terminate()
        sb.terminate()
    op = w.client(None).http
    tid = theirs.ref.split(":", 1)[1]
    info = op.get(f"/v1/images/{tid}").json()
    exported = op.get(f"/v1/images/{tid}/export").content
    layers_dir = w.remote.run_dir / "state" / "layers"
    before = sorted(p.name for p in layers_dir.iterdir())
    from hutch.sandbox._host.archive import MANIFEST
    base = json.loads(__import__("tarfile").open(fileobj=__import__("io").BytesIO(exported))
                      .extractfile(MANIFEST).read())["base"]   # the busybox root, the shared image's base
    for name, params in (("t.a.app", {"replace": "1"}), ("t.a.app", {}), ("t.a.later", {}),
                         ("t.a.app", {"replace": "1", "digest": info["digest"], "owner": "b"})):
        r = op.post("/v1/images/import", params={"base": base, **params}, content=_renamed(exported, name),
                    headers={"Content-Type": "application/x-tar"})
        assert r.status_code == 409, (name, params, r.text)
        msg = r.json()["message"]
        assert "a name of tenant 'a'" in msg and "owner=a" in msg, msg
        assert sorted(p.name for p in layers_dir.iterdir()) == before   # nothing stored
    w.as_tenant("a")
    with hutch.Sandbox.create(image="app", tags=RUN_TAG) as s:
        assert s.run("cat", "/who").stdout == "a's own\n"
    assert hutch.Image.from_name("app").ref == mine.ref
    # the owners= checks are one for both imports: no owner without a digest, one owner for a memory snapshot
    r = op.post("/v1/images/import", params={"owner": "a"}, content=exported)
    assert r.status_code == 400 and "owner= goes with digest=" in r.json()["message"], r.text
    r = op.post("/v1/memory-snapshots/import", params={"owner": ["a", "b"], "digest": "0" * 64}, content=b"")
    assert r.status_code == 400 and "more than a memory snapshot may have here (1)" in r.json()["message"], r.text
    # for the tenant itself (a fleet moving a's image with the digest its source answered), the name comes
    r = op.post("/v1/images/import", params={"base": base, "replace": "1", "digest": info["digest"], "owner": "a"},
                content=_renamed(exported, "t.a.app"), headers={"Content-Type": "application/x-tar"})
    assert r.status_code == 201, r.text
    assert hutch.Image.from_name("app").ref == theirs.ref


def test_a_tenants_file_in_a_directory_another_user_owns_is_refused(tmp_path):
    """The file is root's and 0600, but the directory's owner may rename it away and back: an older copy of it
    (a removed tenant's or a rotated token working again), or a copy of theirs. Refused by the CLI before it
    writes there, and by the daemon's reading."""
    from hutch_testing import HOST_PYTHON, host_user, run_as

    from hutch.sandbox._host.daemon import tenants as T

    if HOST_PYTHON is None:
        pytest.skip("needs the host's python3.11 for the second account")
    public = Path(tempfile.mkdtemp(prefix="hutch-tf-"))
    os.chmod(public, 0o1777)
    try:
        with host_user() as other:
            theirs = public / "theirs"
            r = run_as(other, "import os, sys; os.mkdir(sys.argv[1], 0o755); print('made')", str(theirs))
            assert r.returncode == 0, r.stderr
            tf = theirs / "tenants.json"
            r = hutch_cli("tenant", "add", "x", "--file", str(tf), "--token-file", str(tmp_path / "x.token"))
            assert r.returncode == 1 and f"{theirs} belongs to uid {other.pw_uid}" in r.stderr, r.stderr
            assert not tf.exists() and not (tmp_path / "x.token").exists()
            good = tmp_path / "tenants.json"
            assert hutch_cli("tenant", "add", "x", "--file", str(good), "--token-file",
                             str(tmp_path / "x.token")).returncode == 0
            assert T.Registry(good).get("x") is not None   # root's directory: read
            os.chmod(theirs, 0o777)
            shutil.copy2(good, tf)   # root's file, 0600, in their directory
            os.chmod(theirs, 0o755)
            with pytest.raises(hutch.ConfigError, match=f"{theirs} belongs to uid {other.pw_uid}"):
                T.Registry(tf)
            os.unlink(tf)
    finally:
        shutil.rmtree(public, ignore_errors=True)
