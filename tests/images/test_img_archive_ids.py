"""An image node's id says what it runs only where this host computed it. A snapshot's id is the hash of its
parent, its layer's digest and the env and workdir it sets (layers.snapshot_id): content-addressed, so the id
a sandbox's writes will get is known before they are snapshotted (a layer's digest has no times in it). An
archive's node claiming such an id with a layer of its own, or a snapshot with another env under the same id,
must never be what a later snapshot of this host runs."""

from __future__ import annotations

from pathlib import Path

import hutch
from img_support import one_layer_archive
from hutch.sandbox._host import layers as _layers


def _client():
    from hutch.sandbox import _client as c

    return c.default_client()


def _forged(path: Path, tmp: Path, base: str, node_id: str, text: str) -> Path:
    """An archive of one node of id `node_id` (kind "snapshot") whose layer's /who says `text`."""
    tree = tmp / "forged-tree"
    tree.mkdir(mode=0o755)
    (tree / "who").write_text(text)
    (tree / "who").chmod(0o644)
    return one_layer_archive(path, tree, base, node_id, "snapshot")


def _who_snapshot(make_sandbox, base, text: str, **body) -> dict:
    sb = make_sandbox(image=base)
    sb.files.write("/who", text.encode())
    return _client().json("POST", f"/v1/sandboxes/{sb.id}/snapshot", json=body)


def test_an_archive_cannot_claim_the_id_of_a_snapshot_this_host_makes_later(daemon, base, make_sandbox, tmp_path):
    # The id the victim's writes get, learnt by making them once (an attacker computes it offline), then removed.
    first = _who_snapshot(make_sandbox, base, "victim\n")
    assert first["id"] == _layers.snapshot_id(base.ref, first["layer"])
    _client().json("DELETE", f"/v1/images/{first['id']}")
    got = hutch.Image.import_(_forged(tmp_path / "forged.tar", tmp_path, base.ref, first["id"], "archive\n"),
                              base=base)
    assert got.ref == "image:" + first["id"]
    assert _client().json("GET", f"/v1/images/{first['id']}")["kind"] == "import"   # no snapshot of this host's
    again = _who_snapshot(make_sandbox, base, "victim\n")
    assert again["id"] == first["id"] and again["layer"] == first["layer"] and again["kind"] == "snapshot"
    assert make_sandbox(image=hutch.Image(again["ref"])).run("cat", "/who").stdout == "victim\n"


def test_an_archives_snapshot_of_its_own_id_stays_a_snapshot(daemon, base, make_sandbox, tmp_path):
    # What export writes of a snapshot of this host's: its id is the hash of what it runs, so it is one.
    snap = _who_snapshot(make_sandbox, base, "exported\n")
    out = tmp_path / "snap.tar"
    hutch.Image(snap["ref"]).export(out)
    _client().json("DELETE", f"/v1/images/{snap['id']}")
    assert hutch.Image.import_(out, base=base).ref == snap["ref"]
    assert _client().json("GET", f"/v1/images/{snap['id']}")["kind"] == "snapshot"


def test_two_snapshots_of_the_same_writes_with_other_env_are_two_images(daemon, base, make_sandbox):
    # The first sets an env (the raw snapshot route takes env and workdir); the second, of the same writes,
    # must not get the first's node and run with its env.
    planted = _who_snapshot(make_sandbox, base, "same\n", env={"PLANTED": "yes"}, workdir="/tmp")
    plain = _who_snapshot(make_sandbox, base, "same\n")
    assert plain["layer"] == planted["layer"]   # the same writes: one layer
    assert plain["id"] != planted["id"]
    assert plain["env"] == {} and plain["workdir"] is None
    sb = make_sandbox(image=hutch.Image(plain["ref"]))
    assert sb.run("sh", "-c", "echo \"[$PLANTED]\"").stdout == "[]\n"
    assert plain["id"] == _layers.snapshot_id(base.ref, plain["layer"])   # a snapshot without env keeps its id
