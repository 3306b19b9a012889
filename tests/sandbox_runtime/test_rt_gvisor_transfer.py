"""Moving a memory snapshot between hosts: exported by one daemon, imported by another (its own state dir:
another host's store), restored there carrying on with the same memory; and the archive as hostile input to
the importing root daemon: damaged, forged, oversized, path tricks and host mismatches are refused with the
error that names them, and nothing is kept."""

from __future__ import annotations

import hashlib
import io
import json
import shutil
import tarfile
import time
from pathlib import Path

import pytest

from rt_support import Api, private_state_daemon

pytestmark = pytest.mark.skipif(shutil.which("runsc") is None, reason="runsc is not installed (scripts/setup.sh)")

COUNTER = ("dd if=/dev/urandom of=/m bs=1M count=4 2>/dev/null; h=$(md5sum < /m | cut -c1-32); i=0; "
           "while :; do i=$((i+1)); echo \"$i $h\" > /n.tmp; mv /n.tmp /n; sleep 0.02; done")
MANIFEST = "hutch-memory-snapshot.json"


@pytest.fixture(scope="module")
def hosts(tmp_path_factory, busybox_root):
    """Two daemons with stores of their own: the exporting host and the importing one."""
    with private_state_daemon(tmp_path_factory.mktemp("gvexp")) as a, \
            private_state_daemon(tmp_path_factory.mktemp("gvimp")) as b:
        apis = Api(a.sock, a.run_dir), Api(b.sock, b.run_dir)
        apis[1].base = f"dir:{busybox_root}"   # the importer names the directory base it means
        try:
            yield a, b, apis[0], apis[1]
        finally:
            for api in apis:
                api.close()


@pytest.fixture(scope="module")
def exported(hosts, busybox_root) -> tuple[bytes, str]:
    """A snapshot of a counting sandbox on host A as an archive (bytes), and the hash its memory holds."""
    a, _, api, _ = hosts
    sid = api.create(f"dir:{busybox_root}", runtime="gvisor", command=["sh", "-c", COUNTER])["id"]
    deadline = time.monotonic() + 20
    while api.http.get(f"/v1/sandboxes/{sid}/files/stat", params={"path": "/n"}).status_code != 200:
        assert time.monotonic() < deadline, "the counter never started"
        time.sleep(0.05)
    r = api.http.post(f"/v1/sandboxes/{sid}/snapshot-memory")
    assert r.status_code == 201, r.text
    snap = r.json()
    h = api.http.get(f"/v1/sandboxes/{sid}/files/read", params={"path": "/n"}).content.split()[1].decode()
    api.terminate(sid)
    r = api.http.get(f"/v1/memory-snapshots/{snap['id']}/export")
    assert r.status_code == 200 and r.headers["content-type"] == "application/x-tar", r.text[:300]
    api.http.delete(f"/v1/memory-snapshots/{snap['id']}")
    assert not [p for p in (Path(a.state_dir) / "memory-snapshots").iterdir()], "the export's spool was left"
    return r.content, h


def _import(api: Api, data: bytes, base: str | None = None):
    return api.http.post("/v1/memory-snapshots/import", content=data, headers={"Content-Type": "application/x-tar"},
                         params={"base": base or api.base})


def _left(d) -> list[str]:
    store = Path(d.state_dir) / "memory-snapshots"
    return sorted(p.name for p in store.iterdir()) if store.exists() else []


def test_exported_snapshot_is_restored_on_another_host_carrying_on(hosts, exported):
    _, b, _, api = hosts
    data, h = exported
    names = tarfile.open(fileobj=io.BytesIO(data)).getnames()
    assert names[0] == MANIFEST and names[-1] == "image.tar" and "mem/pages.img" in names, names
    r = _import(api, data)
    assert r.status_code == 201, r.text
    snap = r.json()
    assert snap["id"] in {s["id"] for s in api.http.get("/v1/memory-snapshots").json()["snapshots"]}
    r = api.http.post(f"/v1/memory-snapshots/{snap['id']}/restore", json={"detach": True})
    assert r.status_code == 201, r.text
    copy = r.json()["id"]
    api.created.append(copy)
    time.sleep(0.3)
    n1, h1 = api.http.get(f"/v1/sandboxes/{copy}/files/read", params={"path": "/n"}).content.split()
    time.sleep(0.3)
    n2, _ = api.http.get(f"/v1/sandboxes/{copy}/files/read", params={"path": "/n"}).content.split()
    assert int(n2) > int(n1) > 0 and h1.decode() == h, (n1, n2, h1, h)   # counts on, the same memory
    out, _, _ = api.sh(copy, "echo alive")
    assert out == "alive\n"
    api.terminate(copy)
    assert _import(api, data).status_code == 201   # again: a snapshot of its own id
    for s in api.http.get("/v1/memory-snapshots").json()["snapshots"]:
        assert api.http.delete(f"/v1/memory-snapshots/{s['id']}").status_code == 204
    assert _left(b) == []


def _members(data: bytes) -> list[tuple[tarfile.TarInfo, bytes]]:
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        return [(m, tar.extractfile(m).read() if m.isreg() else b"") for m in tar.getmembers()]


def _pack(members) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for m, content in members:
            m = tarfile.TarInfo(m.name) if isinstance(m, str) else m
            if m.isreg():
                m.size = len(content)
            tar.addfile(m, io.BytesIO(content) if m.isreg() else None)
    return buf.getvalue()


def _with_manifest(data: bytes, change) -> bytes:
    members = _members(data)
    m = json.loads(members[0][1])
    change(m)
    return _pack([(members[0][0], json.dumps(m).encode())] + members[1:])


def _refused(hosts, data: bytes, status: int, *words: str) -> dict:
    _, b, _, api = hosts
    r = _import(api, data)
    assert r.status_code == status, r.text
    body = r.json()
    for w in words:
        assert w in body["message"], body
    assert _left(b) == [], "a refused import left files behind"
    assert api.http.get("/v1/memory-snapshots").json()["snapshots"] == []
    return body


def test_a_snapshot_cannot_choose_a_host_directory_as_its_filesystems_base(hosts, exported, tmp_path):
    # The snapshot's filesystem sits on the busybox directory; only the importer may give a sandbox a host
    # directory: without base= (or with another one) nothing is kept.
    _, b, _, api = hosts
    for base in (None, f"dir:{tmp_path}"):
        r = api.http.post("/v1/memory-snapshots/import", content=exported[0], params={"base": base} if base else None,
                          headers={"Content-Type": "application/x-tar"})
        assert r.status_code == 400 and r.json()["error"] == "InvalidArchiveError", r.text
        assert ("may not choose a host directory" if base is None else "is not the base") in r.json()["message"], r.text
        assert _left(b) == [], "a refused import left files behind"
    assert api.http.get("/v1/memory-snapshots").json()["snapshots"] == []


def test_a_damaged_memory_file_is_refused_by_its_sha256(hosts, exported):
    members = _members(exported[0])
    i = next(i for i, (m, _) in enumerate(members) if m.name == "mem/pages.img")
    m, content = members[i]
    members[i] = (m, content[:100] + bytes([content[100] ^ 1]) + content[101:])
    body = _refused(hosts, _pack(members), 400, "sha256", "mem/pages.img")
    assert body["error"] == "InvalidArchiveError"


def test_another_runsc_build_flags_or_bundle_is_refused_naming_it(hosts, exported):
    data = exported[0]
    _refused(hosts, _with_manifest(data, lambda m: m["meta"].update(runsc="runsc version 0.0~20221219.0")),
             409, "same runsc build")
    _refused(hosts, _with_manifest(data, lambda m: m["meta"].update(flags=["--platform=ptrace"])), 409, "flags")
    _refused(hosts, _with_manifest(data, lambda m: m["meta"].update(bundle="busybox-sha256:" + "0" * 64)),
             409, "busybox")
    _refused(hosts, _with_manifest(data, lambda m: m["meta"].update(base="debian-slim-bookworm-x")),
             409, "base image")


def test_a_snapshot_of_another_format_is_refused_naming_both(hosts, exported):
    """A snapshot of format 1 (an older hutch: no bundle or base recorded, runsc's own /tmp in its bundle)
    would restore with other mounts than it was taken with: refused with the formats and the fix."""
    data = exported[0]
    body = _refused(hosts, _with_manifest(data, lambda m: m["meta"].update(format=1)), 409, "format 1", "format 2",
                    "take a new snapshot")
    assert body["error"] == "StateError", body
    _refused(hosts, _with_manifest(data, lambda m: m["meta"].update(format="2")), 400, "no format number")
    _refused(hosts, _with_manifest(data, lambda m: m["meta"].pop("base")), 400, "malformed")


def test_path_tricks_extra_members_and_wrong_order_are_refused(hosts, exported):
    members = _members(exported[0])
    evil = tarfile.TarInfo("mem/../../../../etc/hutch-evil")
    _refused(hosts, _pack(members[:1] + [(evil, b"x")] + members[1:]), 400, "should be")
    link = tarfile.TarInfo("mem/pages.img")
    link.type, link.linkname = tarfile.SYMTYPE, "/etc/shadow"
    _refused(hosts, _pack([(link, b"") if m.name == "mem/pages.img" else (m, c) for m, c in members]), 400,
             "regular file")
    _refused(hosts, _pack(members + [(tarfile.TarInfo("more"), b"x")]), 400, "more members")
    _refused(hosts, _pack(members[1:]), 400, MANIFEST)
    _refused(hosts, _with_manifest(exported[0], lambda m: m["mem"].update({"../x": {"size": 1, "sha256": "0" * 64}})),
             400, "memory files")
    _refused(hosts, b"not a tar at all" * 100, 400)


def test_sizes_are_bounded_by_the_spec_and_the_manifest(hosts, exported):
    data = exported[0]

    def grow(m):   # a memory image declared past its sandbox's memory limit
        m["mem"]["pages.img"]["size"] = 64 * 1024**3
        m["meta"]["memory_bytes"] = sum(v["size"] for v in m["mem"].values())
    _refused(hosts, _with_manifest(data, grow), 400, "memory limit")

    def shrink(m):   # a file longer than declared
        m["mem"]["pages.img"]["size"] -= 1
        m["meta"]["memory_bytes"] -= 1
    _refused(hosts, _with_manifest(data, shrink), 400, "declared")
    members = _members(data)
    big = json.dumps({"format": 1, "pad": "x" * 300_000}).encode()
    _refused(hosts, _pack([(members[0][0], big)] + members[1:]), 400, "at most")


def test_an_archive_cannot_give_the_sandbox_it_restores_cidr_egress(hosts, exported):
    # A CIDR rule reaches private and metadata addresses (169.254.169.254: a cloud host's credentials); the
    # restored sandbox runs the archive's processes, so only the importer may give it one.
    def cidr(m):
        m["meta"]["spec"]["network"] = {"mode": "allow", "domains": [], "cidrs": ["169.254.169.254/32"], "ports": [80]}
    body = _refused(hosts, _with_manifest(exported[0], cidr), 400, "169.254.169.254/32", "set_network")
    assert body["error"] == "InvalidArchiveError"


def test_a_spec_the_host_would_not_run_is_refused(hosts, exported):
    data = exported[0]
    bind = {"kind": "bind", "source": "/", "target": "/host", "readonly": False, "size": None}
    _refused(hosts, _with_manifest(data, lambda m: m["meta"]["spec"].update(mounts=[bind])), 400, "Mount.tmpfs")
    _refused(hosts, _with_manifest(data, lambda m: m["meta"]["spec"].update(image="dir:/")), 400, "image node")
    _refused(hosts, _with_manifest(data, lambda m: m["meta"]["spec"].update(runtime="native")), 400, "gVisor")
    other = "image:" + hashlib.sha256(b"another").hexdigest()
    _refused(hosts, _with_manifest(data, lambda m: m["meta"]["spec"].update(image=other)), 400, "not the snapshot's")


def test_a_snapshots_filesystem_takes_no_name_of_the_importing_host(hosts, exported):
    """The snapshot runs its image by id: a name its filesystem's node carries that names another image on the
    importing host stays there (an import moves no name unless told to, docs/images.md "Names")."""
    _, b, _, api = hosts
    data, _ = exported
    mine = "ef" * 32
    r = api.http.post("/v1/images/nodes", json={"id": mine, "parent": api.base, "name": "snap-fs-name"})
    assert r.status_code == 201, r.text
    members = _members(data)
    m = json.loads(members[0][1])
    inner = _members(members[-1][1])
    im = json.loads(inner[0][1])
    im["nodes"][-1]["name"] = "snap-fs-name"
    image_tar = _pack([(inner[0][0], json.dumps(im).encode())] + inner[1:])
    m["image"]["size"] = len(image_tar)
    r = _import(api, _pack([(members[0][0], json.dumps(m).encode())] + members[1:-1] + [(members[-1][0], image_tar)]))
    assert r.status_code == 201, r.text
    snap = r.json()
    assert api.http.get("/v1/images/snap-fs-name").json()["id"] == mine
    assert api.http.get(f"/v1/images/{snap['image'].split(':', 1)[1]}").json()["name"] is None
    assert api.http.delete(f"/v1/memory-snapshots/{snap['id']}").status_code == 204
    assert api.http.delete(f"/v1/images/{mine}").status_code in (200, 204)
    assert _left(b) == []
