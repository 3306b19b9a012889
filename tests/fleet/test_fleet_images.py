"""Images between the fleet's nodes: a node that lacks an image fetches it from one that has it (the source's
export into its import, verified by digest); a tampered transfer is refused and leaves nothing. The session's
fleet gives each node its own state directory, so each has its own image store, as on separate hosts."""

from __future__ import annotations

import io
import json
import tarfile
import time
from pathlib import Path

import pytest
from fleet_support import NODES, RUN_TAG

import hutch
from hutch._core.errors import NotFoundError


def _snapshot_on_some_node(root, content: bytes):
    """A filesystem snapshot of a sandbox that wrote /marker: (the image, the node key that stores it)."""
    sb = hutch.Sandbox.create(image=hutch.Image.from_directory(root), timeout=120, tags={**RUN_TAG, "t": "img"})
    try:
        sb.files.write("/marker", content)
        img = sb.snapshot_filesystem()
    finally:
        sb.terminate()
    return img, sb.id.split("-")[0]


def _fleet():
    from hutch.sandbox import _client

    return _client.default_client().fleet


def _has(fl, key: str, image_id: str) -> bool:
    try:
        fl.client(fl.nodes(0)[key]).json("GET", f"/v1/images/{image_id}")
        return True
    except NotFoundError:
        return False


def _store(row) -> set[str]:
    """Every path of a node's image store (layers, nodes, temp dirs)."""
    root = Path(row["state_dir"])
    return {str(p.relative_to(root)) for sub in ("layers", "nodes") if (root / sub).exists()
            for p in (root / sub).rglob("*")}


def test_each_node_has_its_own_image_store(ray_fleet):
    rows = ray_fleet.table()
    assert len({r["state_dir"] for r in rows}) == NODES and all(r["state_dir"].startswith(str(ray_fleet.state_root))
                                                                 for r in rows), rows


def test_a_node_that_never_had_an_image_fetches_it_and_runs_a_sandbox_from_it(fleet_sdk, fleet_busybox):
    img, home = _snapshot_on_some_node(fleet_busybox, b"moved between nodes\n")
    image_id = img.ref[len("image:"):]
    fl = _fleet()
    others = sorted(k for k in fl.nodes(0) if k != home)
    assert _has(fl, home, image_id) and not any(_has(fl, k, image_id) for k in others)
    fleet_sdk.cli("fleet", "cordon", "--ray", fleet_sdk.address, home)   # the create must go to a node without it
    try:
        fleet_sdk.wait(lambda rs: any(r["key"] == home and r["cordoned"] for r in rs), what="the cordon")
        time.sleep(1.2)   # our table is at most 1 s old
        sb = hutch.Sandbox.create(image=img, timeout=120, tags={**RUN_TAG, "t": "img"})
        there = sb.id.split("-")[0]
        assert there in others
        assert sb.run("cat", "/marker").stdout == "moved between nodes\n"
        assert _has(fl, there, image_id)
        src = fl.client(fl.nodes(0)[home]).json("GET", f"/v1/images/{image_id}")
        dst = fl.client(fl.nodes(0)[there]).json("GET", f"/v1/images/{image_id}")
        assert dst["digest"] == src["digest"] and dst["layer"] == src["layer"] and len(src["digest"]) == 64
        sb.terminate()
        # the AsyncSandbox fetches the same way (to the third node, the only one left without it)
        import asyncio

        third = [k for k in others if k != there][0]
        fleet_sdk.cli("fleet", "cordon", "--ray", fleet_sdk.address, there)
        fleet_sdk.wait(lambda rs: any(r["key"] == there and r["cordoned"] for r in rs), what="the cordon")
        time.sleep(1.2)

        async def main():
            a = await hutch.AsyncSandbox.create(image=img, timeout=120, tags={**RUN_TAG, "t": "img"})
            try:
                return a.id, (await a.run("cat", "/marker")).stdout
            finally:
                await a.terminate()
        aid, out = asyncio.run(main())
        assert aid.startswith(third + "-") and out == "moved between nodes\n"
    finally:
        for key in (home, *others):
            fleet_sdk.cli("fleet", "cordon", "--ray", fleet_sdk.address, "--off", key)


def _rewrite(archive: bytes, manifest=None, member=None) -> bytes:
    """The archive with its manifest changed by `manifest(dict)` or one layer file's bytes by `member(name, data)`."""
    out = io.BytesIO()
    with tarfile.open(fileobj=io.BytesIO(archive), mode="r:") as src, \
            tarfile.open(fileobj=out, mode="w:", format=tarfile.PAX_FORMAT) as dst:
        for m in src.getmembers():
            data = src.extractfile(m).read() if m.isreg() else None
            if m.name == "hutch-image.json" and manifest:
                data = json.dumps(manifest(json.loads(data))).encode()
            elif data is not None and member:
                data = member(m.name, data)
            m.size = len(data) if data is not None else m.size
            dst.addfile(m, io.BytesIO(data) if data is not None else None)
    return out.getvalue()


def test_a_tampered_transfer_is_refused_and_leaves_nothing_behind(fleet_sdk, fleet_busybox):
    img, home = _snapshot_on_some_node(fleet_busybox, b"the real content\n")
    image_id = img.ref[len("image:"):]
    fl = _fleet()
    nodes = fl.nodes(0)
    src, dst_key = fl.client(nodes[home]), sorted(k for k in nodes if k != home)[0]
    dst = fl.client(nodes[dst_key])
    info = src.json("GET", f"/v1/images/{image_id}")
    archive = src.request("GET", f"/v1/images/{image_id}/export").content
    row = next(r for r in fleet_sdk.table() if r["key"] == dst_key)
    before = _store(row)

    def env(m):   # consistent with itself (every layer still matches), but not the image the source has
        m["nodes"][-1]["env"] = {**(m["nodes"][-1].get("env") or {}), "LD_PRELOAD": "/tmp/evil.so"}
        return m
    forged = _rewrite(archive, manifest=env)
    with pytest.raises(hutch.InvalidArchiveError, match="digest"):
        dst.json("POST", "/v1/images/import", params={"digest": info["digest"]}, content=forged)
    flipped = _rewrite(archive, member=lambda name, data: data.replace(b"real", b"fake"))
    assert flipped != archive
    with pytest.raises(hutch.InvalidArchiveError, match="does not match its digest"):
        dst.json("POST", "/v1/images/import", params={"digest": info["digest"]}, content=flipped)
    with pytest.raises(hutch.ConfigError, match="64-hex-digit"):
        dst.json("POST", "/v1/images/import", params={"digest": "nope"}, content=archive)
    assert _store(row) == before and not _has(fl, dst_key, image_id)   # nothing stored, no temp left
    # the archive as the source made it passes the same check
    got = dst.json("POST", "/v1/images/import", params={"digest": info["digest"]}, content=archive)
    assert got["id"] == image_id and got["digest"] == info["digest"] and _has(fl, dst_key, image_id)
