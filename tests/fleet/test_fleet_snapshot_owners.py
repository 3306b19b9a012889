"""A tenant's memory snapshot through the fleet (its daemons serve `hutch fleet up --tenants`): moved to another
node, it stays that tenant's there (its owner travels with it: the holder's digest answer names it, the import is
told it), so the tenant restores it on any node and another tenant still gets what an unknown id gets. And a
snapshot whose only holder node is gone: a SnapshotLostError naming the node, never a hang; it is back with the
node's return."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import time

import pytest
from fleet_support import RUN_TAG, TENANTS, node_args

import hutch

pytestmark = pytest.mark.skipif(shutil.which("runsc") is None, reason="runsc is not installed (scripts/setup.sh)")

COUNTER = "i=0; while :; do i=$((i+1)); echo $i > /tmp/n.tmp; mv /tmp/n.tmp /tmp/n; sleep 0.02; done"
TAGS = {**RUN_TAG, "t": "snap-owners"}


def _n(sb) -> int:
    deadline = time.monotonic() + 120
    while True:
        try:
            return int(sb.files.read("/tmp/n"))
        except (hutch.NotFoundError, ValueError):
            assert time.monotonic() < deadline, "the counter never wrote"
            time.sleep(0.05)


def _node_client(row, token: str | None = None):
    """A node's daemon on its socket: the operator's, or a tenant's with its token."""
    from hutch.sandbox import _client

    return _client.Client(_client.Endpoint(url="", token=token, socket_path=row["socket"]))


def _owners(fleet, key: str) -> dict:
    p = fleet.state_root / key / "tenant-owners.json"
    return json.loads(p.read_text()) if p.exists() else {}


def _maker(record) -> str | None:
    """The tenant of an ownership file's memory-snapshot record (TENANT, or {"tenant", "image"})."""
    return record.get("tenant") if isinstance(record, dict) else record


def _cordon(fleet, keys, on: bool = True) -> None:
    for k in keys:
        fleet.cli("fleet", "cordon", "--ray", fleet.address, *([] if on else ["--off"]), k)
    fleet.wait(lambda rs: all(r["cordoned"] == on for r in rs if r["key"] in keys), what="the cordons")
    time.sleep(1.2)   # the SDK's table is at most REFRESH old


@pytest.fixture
def shared_image(fleet_sdk, fleet_busybox):
    """An image of the operator's (a filesystem snapshot of busybox) shared with every tenant of the fleet."""
    sb = hutch.Sandbox.create(image=hutch.Image.from_directory(fleet_busybox), timeout=120, tags=TAGS)
    try:
        img = sb.snapshot_filesystem()
    finally:
        sb.terminate()
    for name in TENANTS:
        fleet_sdk.cli("tenant", "set", name, "--image", img.ref, "--file", str(fleet_sdk.tenants_file))
    try:
        yield img
    finally:
        fleet_sdk.sdk()   # the operator again: the fixture's teardown ends every tenant's sandboxes too
        for name in TENANTS:
            fleet_sdk.cli("tenant", "set", name, "--no-images", "--file", str(fleet_sdk.tenants_file))


def test_a_tenants_snapshot_moved_to_another_node_stays_its_own(fleet_sdk, shared_image):
    rows = {r["key"]: r for r in fleet_sdk.table()}
    fleet_sdk.sdk("ta")
    src = hutch.Sandbox.create("sh", "-c", COUNTER, image=shared_image, runtime="gvisor", timeout=120, tags=TAGS)
    holder = src.id.split("-")[0]
    snap = None
    try:
        while (counted := _n(src)) < 100:   # a count a fresh start would take seconds to reach
            time.sleep(0.1)
        snap = src.snapshot_memory()
        src.terminate()
        assert snap.id.startswith(holder)   # a fleet node's snapshot ids start with its key
        h = _node_client(rows[holder])
        want = h.json("GET", f"/v1/memory-snapshots/{snap.id}/digest")
        record = _owners(fleet_sdk, holder)["memory_snapshots"][snap.id]
        assert want["owner"] == "ta" and _maker(record) == "ta"

        # another tenant: the snapshot is no more there for it than an unknown id
        fleet_sdk.sdk("tb")
        with pytest.raises(hutch.NotFoundError, match="no memory snapshot"):
            hutch.Sandbox.restore(snap.id, tags=TAGS)
        assert snap.id not in [s.id for s in hutch.Snapshot.list()]

        # its holder cordoned: ta's restore goes to another node, which imports it as ta's
        fleet_sdk.sdk("ta")
        _cordon(fleet_sdk, [holder])
        try:
            copy = hutch.Sandbox.restore(snap, tags=TAGS)
        finally:
            _cordon(fleet_sdk, [holder], on=False)
        there = copy.id.split("-")[0]
        assert there != holder
        try:
            n1 = _n(copy)
            time.sleep(0.3)
            assert _n(copy) > n1 >= counted   # it carries on from the snapshot's count
        finally:
            copy.terminate()
        moved = _node_client(rows[there])
        assert moved.json("GET", f"/v1/memory-snapshots/{snap.id}/digest") == want   # the same, and ta's
        owners = _owners(fleet_sdk, there)
        assert owners["memory_snapshots"][snap.id] == record   # the holder's record: ta's, the image it showed ta
        assert any("ta" in holders for holders in owners["images"].values())   # its image is ta's there too
        assert _node_client(rows[there], fleet_sdk.tokens["ta"]).json(
            "GET", f"/v1/memory-snapshots/{snap.id}")["id"] == snap.id
        tb = _node_client(rows[there], fleet_sdk.tokens["tb"])
        unknown = "f" * 32
        for method, path, kw in [("GET", "/v1/memory-snapshots/{}", {}),
                                 ("POST", "/v1/memory-snapshots/{}/restore", {"json": {}}),
                                 ("DELETE", "/v1/memory-snapshots/{}", {})]:
            answers = []
            for sid in (snap.id, unknown):
                with pytest.raises(hutch.NotFoundError) as e:
                    tb.json(method, path.format(sid), **kw)
                answers.append(str(e.value).replace(sid, "ID"))
            assert answers[0] == answers[1], (method, path)   # exactly as an unknown id answers
        assert [s.id for s in hutch.Snapshot.list()].count(snap.id) == 1

        # an import for a tenant is refused, with nothing kept, unless the daemon knows the tenant and the digest
        archive = b"".join(h.request("GET", f"/v1/memory-snapshots/{snap.id}/export", stream=True).iter_bytes())
        third = next(k for k in rows if k not in (holder, there))
        store = fleet_sdk.state_root / third / "memory-snapshots"
        before = sorted(p.name for p in store.iterdir()) if store.is_dir() else []
        third_op = _node_client(rows[third])
        with pytest.raises(hutch.ConfigError, match="no tenant of this daemon"):
            third_op.json("POST", "/v1/memory-snapshots/import", params={"digest": want["digest"], "owner": "nobody"},
                          content=archive)
        with pytest.raises(hutch.ConfigError, match="owner= goes with digest="):
            third_op.json("POST", "/v1/memory-snapshots/import", params={"owner": "ta"}, content=archive)
        assert (sorted(p.name for p in store.iterdir()) if store.is_dir() else []) == before
        assert snap.id not in _owners(fleet_sdk, third).get("memory_snapshots", {})
        with pytest.raises(hutch.ConfigError, match="owner_image= goes with owner="):
            third_op.json("POST", "/v1/memory-snapshots/import", params={"digest": want["digest"],
                          "owner_image": "x"}, content=archive)

        # ta deletes it: every copy, and its records
        hutch.Snapshot.of(snap.id).delete()
        snap = None
        for k in (holder, there):
            with pytest.raises(hutch.NotFoundError):
                _node_client(rows[k]).json("GET", f"/v1/memory-snapshots/{want['id']}")
            assert want["id"] not in _owners(fleet_sdk, k).get("memory_snapshots", {})
    finally:
        fleet_sdk.sdk()
        src.terminate()
        if snap is not None:
            try:
                hutch.Snapshot.of(snap.id).delete()
            except hutch.NotFoundError:
                pass


def test_a_snapshot_whose_only_node_is_gone_is_lost_not_hung(fleet_sdk, fleet_busybox):
    """The node holding the only copy loses its daemon and its Ray node: a restore (from this process and by id)
    raises SnapshotLostError naming the node and the fix, at once and once the fleet marks the node dead; the
    node that comes back (same slot, key and state directory) has it again."""
    rows = fleet_sdk.table()
    worker = fleet_sdk.workers[-1]
    victim = next(r for r in rows if r["node_id"] == worker.node_id)
    others = [r["key"] for r in rows if r["key"] != victim["key"]]
    _cordon(fleet_sdk, others)   # the snapshot's sandbox goes to the node that will die
    try:
        src = hutch.Sandbox.create("sh", "-c", COUNTER, image=hutch.Image.from_directory(fleet_busybox),
                                   runtime="gvisor", timeout=120, tags=TAGS)
    finally:
        _cordon(fleet_sdk, others, on=False)
    assert src.id.startswith(victim["key"] + "-")
    _n(src)
    snap = src.snapshot_memory()
    os.kill(victim["pid"], signal.SIGKILL)   # its daemon dies without ending anything ...
    fleet_sdk.cluster.remove_node(worker, allow_graceful=False)   # ... and its Ray node with it
    fleet_sdk.workers.remove(worker)
    t0 = time.monotonic()
    for what in (snap, snap.id):
        with pytest.raises(hutch.SnapshotLostError, match=f"(?s){snap.id}.*{victim['key']}.*snap.export"):
            hutch.Sandbox.restore(what, tags=TAGS)
    assert time.monotonic() - t0 < 120   # a hang guard (a node's connect times out in 3 s), not a speed target
    fleet_sdk.wait(lambda rs: any(r["key"] == victim["key"] and not r["healthy"] for r in rs), what="node down")
    time.sleep(1.2)
    with pytest.raises(hutch.SnapshotLostError, match=f"(?s){victim['key']}.*which is lost"):
        hutch.Sandbox.restore(snap.id, tags=TAGS)
    with pytest.raises(hutch.NotFoundError):   # a SnapshotLostError is a NotFoundError too
        hutch.Snapshot.from_id(snap.id)
    # the node comes back: the same slot, key and state directory, and the snapshot with them
    fleet_sdk.workers.append(fleet_sdk.cluster.add_node(**node_args()))
    fleet_sdk.wait(lambda rs: any(r["key"] == victim["key"] and r["healthy"] and r["pid"] != victim["pid"]
                                  for r in rs), what="the node's return")
    time.sleep(1.2)
    copy = hutch.Sandbox.restore(snap.id, tags=TAGS)
    try:
        assert copy.id.startswith(victim["key"] + "-")
        _n(copy)
    finally:
        copy.terminate()
        hutch.Snapshot.of(snap.id).delete()


def _has_image(row, image_id: str) -> bool:
    try:
        _node_client(row).json("GET", f"/v1/images/{image_id}")
        return True
    except hutch.NotFoundError:
        return False


def test_a_tenants_image_moved_to_another_node_stays_its_own(fleet_sdk, shared_image):
    """A tenant's own image (a snapshot_filesystem of its sandbox) that a create moves to another node is recorded
    as the tenant's there (the holder's answer names its holders, the import is told them), so the tenant's create
    runs on that node, and another tenant's create and lookups of it answer as an unknown image's there too."""
    rows = {r["key"]: r for r in fleet_sdk.table()}
    fleet_sdk.sdk("ta")
    src = hutch.Sandbox.create("sleep", "600", image=shared_image, timeout=120, tags=TAGS)
    holder = src.id.split("-")[0]
    img, iid, there = None, None, None
    try:
        src.files.write("/mine", b"ta's own\n")
        img = src.snapshot_filesystem()
        iid = img.ref[len("image:"):]
        src.terminate()
        assert _owners(fleet_sdk, holder)["images"][iid] == ["ta"]
        info = _node_client(rows[holder]).json("GET", f"/v1/images/{iid}")
        assert info["owners"] == ["ta"]   # the operator's answer names its holders ...
        assert "owners" not in _node_client(rows[holder], fleet_sdk.tokens["ta"]).json(
            "GET", f"/v1/images/{iid}")   # ... a tenant's does not

        # its holder cordoned: ta's create goes to another node, which fetches the image and records it as ta's
        _cordon(fleet_sdk, [holder])
        try:
            sb = hutch.Sandbox.create("sleep", "600", image=img, timeout=120, tags=TAGS)
            there = sb.id.split("-")[0]
            try:
                assert sb.files.read("/mine") == b"ta's own\n"
            finally:
                sb.terminate()
            # another tenant: the image is on that node now, but no more there for it than an unknown one
            fleet_sdk.sdk("tb")
            with pytest.raises(hutch.NotFoundError, match="no image .* on this host|is on no node of the fleet"):
                hutch.Sandbox.create("true", image=img, timeout=120, tags=TAGS)
        finally:
            fleet_sdk.sdk("ta")
            _cordon(fleet_sdk, [holder], on=False)
        assert there != holder and _has_image(rows[there], iid)
        assert _owners(fleet_sdk, there)["images"][iid] == ["ta"]   # the holder's record
        assert _node_client(rows[there]).json("GET", f"/v1/images/{iid}")["owners"] == ["ta"]
        tb = _node_client(rows[there], fleet_sdk.tokens["tb"])
        answers = []
        for key in (iid, "f" * 64):
            with pytest.raises(hutch.NotFoundError) as e:
                tb.json("GET", f"/v1/images/{key}")
            answers.append(str(e.value).replace(key, "KEY"))
        assert answers[0] == answers[1]   # exactly as an unknown image answers

        # an import for a tenant is refused, with nothing kept, unless the daemon knows the tenant and the digest
        h = _node_client(rows[holder])
        archive = b"".join(h.request("GET", f"/v1/images/{iid}/export", stream=True).iter_bytes())
        third = next(k for k in rows if k not in (holder, there))
        third_op, owners_file = _node_client(rows[third]), fleet_sdk.state_root / third / "tenant-owners.json"
        before = owners_file.read_bytes() if owners_file.exists() else None
        with pytest.raises(hutch.ConfigError, match="no tenant of this daemon"):
            third_op.json("POST", "/v1/images/import", params={"digest": info["digest"], "owner": ["ta", "nobody"]},
                          content=archive)
        with pytest.raises(hutch.ConfigError, match="owner= goes with digest="):
            third_op.json("POST", "/v1/images/import", params={"owner": "ta"}, content=archive)
        assert not _has_image(rows[third], iid)
        assert (owners_file.read_bytes() if owners_file.exists() else None) == before
        # a record that fails (the ownership file is not one): the image it brought is not kept either
        owners_file.write_text("not the records")
        os.chmod(owners_file, 0o600)
        try:
            with pytest.raises(hutch.DaemonError, match="ownership file"):
                third_op.json("POST", "/v1/images/import", params={"digest": info["digest"], "owner": "ta"},
                              content=archive)
        finally:
            if before is None:
                owners_file.unlink()
            else:
                owners_file.write_bytes(before)
        assert not _has_image(rows[third], iid)
        # the operator's import by digest for ta: kept, and ta's
        got = third_op.json("POST", "/v1/images/import", params={"digest": info["digest"], "owner": "ta"},
                            content=archive)
        assert got["id"] == iid and _owners(fleet_sdk, third)["images"][iid] == ["ta"]
    finally:
        fleet_sdk.sdk()
        src.terminate()
        if img is not None:   # ta removes its image on every node: its records go with it
            for row in rows.values():
                with contextlib.suppress(hutch.NotFoundError):
                    _node_client(row, fleet_sdk.tokens["ta"]).json("DELETE", f"/v1/images/{iid}",
                                                                   params={"force": 1})
