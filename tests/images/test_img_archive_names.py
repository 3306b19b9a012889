"""A name is what other code runs (`Sandbox.create(image="agent")`, an agent_image setting, a tenant's shared
image): an import never moves one of this host's names to other content unless its caller says so
(`replace=True`, `hutch image import --replace`, `?replace=1`). Refused, it names the image that has the name
here, the archive's digest and the flag, and stores nothing; the same content again is no change."""

from __future__ import annotations

import io
import json
import secrets
import tarfile
from pathlib import Path

import pytest

import hutch
from hutch.sandbox._host import archive as _archive, layers as _layers


def _archive_named(path: Path, base: str, tmp: Path, name: str, text: str) -> tuple[Path, dict]:
    """An archive of one image named `name` whose /who says `text`; (path, its manifest)."""
    tree = tmp / f"tree-{secrets.token_hex(4)}"
    tree.mkdir(mode=0o755)
    (tree / "who").write_text(text)
    meta = _layers.measure_tree(tree)
    node = secrets.token_hex(32)
    manifest = {"format": 1, "top": node, "base": base, "layers": {meta["digest"]: meta},
                "nodes": [{"id": node, "parent": base, "layer": meta["digest"], "kind": "import", "name": name}]}
    _write(path, manifest, {meta["digest"]: tree})
    return path, manifest


def _write(path: Path, manifest: dict, trees: dict[str, Path]) -> None:
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as t:
        data = json.dumps(manifest).encode()
        info = tarfile.TarInfo(_archive.MANIFEST)
        info.size = len(data)
        t.addfile(info, io.BytesIO(data))
        for digest, tree in trees.items():
            t.add(tree, arcname=f"layers/{digest}")


def _store(state_dir: Path) -> tuple[list[str], list[bytes]]:
    layers = sorted(p for p in (state_dir / "layers").iterdir() if p.name != ".lock")
    return [p.name for p in layers], [p.read_bytes() for p in sorted((state_dir / "nodes").iterdir())]


def _who(make_sandbox, image: str) -> str:
    return make_sandbox(image=image).run("cat", "/who").stdout


def test_an_import_does_not_move_a_name_of_this_host_unless_told_to(daemon, base, make_sandbox, tmp_path):
    mine = base.run_commands("echo mine > /who").build(name="agent-img", quiet=True)
    archive, manifest = _archive_named(tmp_path / "theirs.tar", base.ref, tmp_path, "agent-img", "archive\n")
    digest = _layers.chain_digest(manifest["nodes"], base.ref)
    before = _store(daemon.state_dir)
    with pytest.raises(hutch.StateError) as refused:
        hutch.Image.import_(archive, base=base)
    msg = str(refused.value)
    for part in ("'agent-img'", mine.ref[:len("image:") + 12], digest[:12], "replace=True", "--replace"):
        assert part in msg, (part, msg)
    assert _store(daemon.state_dir) == before, "a refused import stored something"
    assert hutch.Image.from_name("agent-img").ref == mine.ref
    assert _who(make_sandbox, "agent-img") == "mine\n"

    moved = hutch.Image.import_(archive, base=base, replace=True)   # the caller says so: the name moves
    assert moved.ref == "image:" + manifest["top"] != mine.ref
    assert hutch.Image.from_name("agent-img").ref == moved.ref
    assert _who(make_sandbox, "agent-img") == "archive\n"
    assert hutch.Image.import_(archive, base=base).ref == moved.ref   # the same content again: no change
    assert hutch.Image.from_name("agent-img").ref == moved.ref
    assert _who(make_sandbox, mine.ref) == "mine\n"   # still here, by id, without the name


def test_an_image_here_under_another_name_keeps_it(daemon, base, tmp_path):
    """An archive of an image this host has under another name would take that name off it (and leave it
    free for the next archive): refused the same way."""
    mine = base.run_commands("echo kept > /who").build(name="keeps-its-name", quiet=True)
    out = tmp_path / "mine.tar"
    mine.export(out)
    assert hutch.Image.import_(out, base=base).ref == mine.ref   # its own export: no change
    with tarfile.open(out) as src:
        manifest = json.loads(src.extractfile(_archive.MANIFEST).read())
        renamed = tmp_path / "renamed.tar"
        with tarfile.open(renamed, "w", format=tarfile.PAX_FORMAT) as dst:
            manifest["nodes"][-1]["name"] = "another-name"
            data = json.dumps(manifest).encode()
            info = tarfile.TarInfo(_archive.MANIFEST)
            info.size = len(data)
            dst.addfile(info, io.BytesIO(data))
            for m in src.getmembers()[1:]:
                dst.addfile(m, src.extractfile(m) if m.isfile() else None)
    with pytest.raises(hutch.StateError, match="'keeps-its-name'.*'another-name'.*replace=True"):
        hutch.Image.import_(renamed, base=base)
    assert hutch.Image.from_name("keeps-its-name").ref == mine.ref
    with pytest.raises(hutch.NotFoundError):
        hutch.Image.from_name("another-name")


def test_the_cli_refuses_and_replace_moves(daemon, base, tmp_path):
    from click.testing import CliRunner
    from hutch.cli import cli

    mine = base.run_commands("echo cli > /who").build(name="cli-name", quiet=True)
    archive, manifest = _archive_named(tmp_path / "cli.tar", base.ref, tmp_path, "cli-name", "archive\n")
    r = CliRunner().invoke(cli, ["image", "import", str(archive), "--base", base.ref])
    assert r.exit_code != 0 and "--replace" in r.output, r.output
    assert hutch.Image.from_name("cli-name").ref == mine.ref
    r = CliRunner().invoke(cli, ["image", "import", str(archive), "--base", base.ref, "--replace"])
    assert r.exit_code == 0, r.output
    assert hutch.Image.from_name("cli-name").ref == "image:" + manifest["top"]


def test_a_transfer_by_digest_comes_in_and_leaves_this_hosts_names(daemon, base, make_sandbox, tmp_path):
    """A fleet's transfer (?digest=) asks for an image by id: it is imported, without a name that names
    another image here (that one keeps it); replace=1 moves it there too."""
    from hutch.sandbox import _client

    mine = base.run_commands("echo here > /who").build(name="fleet-name", quiet=True)
    archive, manifest = _archive_named(tmp_path / "fleet.tar", base.ref, tmp_path, "fleet-name", "sent\n")
    digest = _layers.chain_digest(manifest["nodes"], base.ref)
    with open(archive, "rb") as f:
        got = _client.default_client().json("POST", "/v1/images/import", params={"digest": digest}, content=f)
    assert (got["id"], got["digest"]) == (manifest["top"], digest)
    assert hutch.Image.from_name("fleet-name").ref == mine.ref
    assert _who(make_sandbox, got["ref"]) == "sent\n"
    with open(archive, "rb") as f:
        _client.default_client().json("POST", "/v1/images/import", params={"digest": digest, "replace": "1"},
                                      content=f)
    assert hutch.Image.from_name("fleet-name").ref == got["ref"]


def test_the_store_checks_names_under_its_lock(daemon, base, monkeypatch):
    """put_nodes decides under the store lock, so an image named between an import's first check and its
    write is not taken either; nothing of the chain is written."""
    monkeypatch.setenv("HUTCH_STATE_DIR", str(daemon.state_dir))
    holder = secrets.token_hex(32)
    _layers.put_node(holder, base.ref, layer=None, kind="snapshot", name="raced", pinned=True)
    low, top = secrets.token_hex(32), secrets.token_hex(32)
    chain = [{"id": low, "parent": base.ref, "layer": None, "kind": "import"},
             {"id": top, "parent": "image:" + low, "layer": None, "kind": "import", "name": "raced"}]

    class Refused(Exception):
        pass

    def refuse(moves):
        return Refused([(n["id"], h["id"]) for n, h in moves])

    with pytest.raises(Refused) as e:
        _layers.put_nodes(chain, names="refuse", refuse=refuse)
    assert e.value.args[0] == [(top, holder)]
    assert not _layers.has_node(low) and not _layers.has_node(top)
    _layers.put_nodes(chain, names="keep", refuse=refuse)
    assert _layers.find("raced")["id"] == holder and _layers.get_node(top)["name"] is None
    _layers.put_nodes(chain, names="replace", refuse=refuse)
    assert _layers.find("raced")["id"] == top
    for nid in (top, low, holder):
        _layers.remove(nid, set(), force=True)
