"""Image archives are hostile input: every attack on `hutch image import` is refused with a clear error,
writes nothing outside the store (the host files it aims at stay as they were) and leaves nothing in it.
Most go through the real daemon; the limits that would take millions of entries are checked on the store
directly with lowered limits."""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import stat
import tarfile
from pathlib import Path

import pytest

import hutch
from hutch.sandbox._host import archive as _archive, layers as _layers

LAYER = "ab" * 32          # a digest the attacks name (their trees never hash to it: they never get that far)
NODE = "cd" * 32


def _manifest(base: str, layers: dict[str, dict], nodes: list[dict] | None = None) -> dict:
    if nodes is None:
        nodes = [{"id": NODE, "parent": base, "layer": next(iter(layers), None), "kind": "import"}]
    return {"format": 1, "top": nodes[-1]["id"] if nodes else NODE, "base": base, "nodes": nodes, "layers": layers}


def _info(name: str, kind=tarfile.REGTYPE, *, mode=0o644, uid=0, gid=0, linkname="", data: bytes = b""):
    info = tarfile.TarInfo(name)
    info.type, info.mode, info.uid, info.gid, info.linkname, info.size = kind, mode, uid, gid, linkname, len(data)
    info.mtime = 1_700_000_000
    return info, data


def _tar(path: Path, manifest: dict | bytes | None, members, *, root: bool = True) -> Path:
    """An archive: the manifest first, the layer's root directory, then `members` ((TarInfo, data) pairs)."""
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as t:
        if manifest is not None:
            data = manifest if isinstance(manifest, bytes) else json.dumps(manifest).encode()
            info, _ = _info(_archive.MANIFEST, data=data)
            t.addfile(info, io.BytesIO(data))
        if root:
            info, _ = _info(f"layers/{LAYER}", tarfile.DIRTYPE, mode=0o755)
            t.addfile(info)
        for info, data in members:
            t.addfile(info, io.BytesIO(data) if info.isreg() else None)
    return path


def _store(state_dir: Path) -> tuple[list[str], list[str]]:
    """What the store holds: layer dirs (and temp dirs) and image nodes."""
    layers = sorted(p for p in os.listdir(state_dir / "layers") if p != ".lock") \
        if (state_dir / "layers").is_dir() else []
    nodes = sorted(os.listdir(state_dir / "nodes")) if (state_dir / "nodes").is_dir() else []
    return layers, nodes


def _fingerprint(path: Path) -> tuple:
    st = os.lstat(path)
    content = path.read_bytes() if stat.S_ISREG(st.st_mode) else sorted(os.listdir(path))
    return st.st_mode, st.st_uid, st.st_gid, hashlib.sha256(repr(content).encode()).hexdigest()


@pytest.fixture
def victims(tmp_path):
    """A host file and a host directory the attacks aim at, with what they hold and how they look."""
    f = tmp_path / "victim.txt"
    f.write_text("host file\n")
    os.chmod(f, 0o644)
    d = tmp_path / "victim-dir"
    d.mkdir(mode=0o755)
    os.chmod(d, 0o755)
    (d / "inside").write_text("x")
    return f, d


def _refused(daemon, base, archive: Path, match: str, *untouched: Path) -> None:
    before = [_fingerprint(p) for p in untouched]
    store = _store(daemon.state_dir)
    with pytest.raises(hutch.ImageError) as refused:
        hutch.Image.import_(archive, base=base)   # the base the test means (an archive cannot choose a directory)
    assert [_fingerprint(p) for p in untouched] == before, "the import changed a host file outside the store"
    assert _store(daemon.state_dir) == store, "a refused import left something in the store"
    assert re.search(match, str(refused.value)), f"{match!r} not in: {refused.value}"


def _layers_meta(files=20, size=1 << 20):
    return {LAYER: {"files": files, "size": size, "opaque": []}}


def test_a_symlink_then_a_file_of_its_name_never_writes_the_host_file(daemon, base, tmp_path, victims):
    host_file, _ = victims
    archive = _tar(tmp_path / "a.tar", _manifest(base.ref, _layers_meta()), [
        _info(f"layers/{LAYER}/f", tarfile.SYMTYPE, linkname=str(host_file)),
        _info(f"layers/{LAYER}/f", mode=0o4755, uid=0, data=b"pwned by the archive\n"),
    ])
    _refused(daemon, base, archive, "appears twice", host_file)
    assert host_file.read_text() == "host file\n"


def test_a_symlink_then_a_directory_of_its_name_never_chowns_the_host_dir(daemon, base, tmp_path, victims):
    _, host_dir = victims
    archive = _tar(tmp_path / "d.tar", _manifest(base.ref, _layers_meta()), [
        _info(f"layers/{LAYER}/d", tarfile.SYMTYPE, linkname=str(host_dir)),
        _info(f"layers/{LAYER}/d", tarfile.DIRTYPE, mode=0o6777, uid=4242, gid=4242),
    ])
    _refused(daemon, base, archive, "appears twice", host_dir)
    st = os.stat(host_dir)
    assert (stat.S_IMODE(st.st_mode), st.st_uid) == (0o755, 0)


def test_a_path_through_a_symlink_is_refused(daemon, base, tmp_path, victims):
    _, host_dir = victims
    archive = _tar(tmp_path / "p.tar", _manifest(base.ref, _layers_meta()), [
        _info(f"layers/{LAYER}/esc", tarfile.SYMTYPE, linkname=str(host_dir)),
        _info(f"layers/{LAYER}/esc/planted", data=b"x"),
    ])
    _refused(daemon, base, archive, "through a symlink", host_dir)
    assert not (host_dir / "planted").exists()


@pytest.mark.parametrize("link", ["{host}", "layers/{layer}/../../../../{host}", "../{host}",
                                  "layers/" + "ef" * 32 + "/x", "layers/{layer}/missing", "layers/{layer}/sym"])
def test_a_hard_link_outside_its_layer_or_to_no_earlier_file_is_refused(daemon, base, tmp_path, victims, link):
    host_file, _ = victims
    target = link.format(host=str(host_file).lstrip("/") if not link.startswith("{") else host_file, layer=LAYER)
    archive = _tar(tmp_path / "h.tar", _manifest(base.ref, _layers_meta()), [
        _info(f"layers/{LAYER}/sym", tarfile.SYMTYPE, linkname=str(host_file)),
        _info(f"layers/{LAYER}/h", tarfile.LNKTYPE, linkname=str(target)),
        _info(f"layers/{LAYER}/h", data=b"written into the host file through the link\n"),
    ])
    _refused(daemon, base, archive, "hard link|'\\.\\.'|absolute", host_file)
    assert os.stat(host_file).st_nlink == 1


@pytest.mark.parametrize("name", ["layers/{layer}/../../../escaped", "/{tmp}/escaped", "layers/{layer}/./x",
                                  "layers/{layer}//x", "elsewhere/x", "layers/" + "ef" * 32 + "/x"])
def test_names_outside_the_layers_of_the_manifest_are_refused(daemon, base, tmp_path, name):
    member = name.format(layer=LAYER, tmp=str(tmp_path).lstrip("/"))
    archive = _tar(tmp_path / "n.tar", _manifest(base.ref, _layers_meta()), [_info(member, data=b"escaped\n")])
    _refused(daemon, base, archive, "refused")
    assert not (tmp_path / "escaped").exists() and not (daemon.state_dir / "escaped").exists()


def test_duplicates_devices_fifos_and_foreign_owners_are_refused(daemon, base, tmp_path):
    cases = {
        "appears twice": [_info(f"layers/{LAYER}/a", data=b"1"), _info(f"layers/{LAYER}/a", data=b"2")],
        "device, FIFO": [_info(f"layers/{LAYER}/sda", tarfile.BLKTYPE)],
        "device": [_info(f"layers/{LAYER}/mem", tarfile.CHRTYPE)],
        "FIFO": [_info(f"layers/{LAYER}/fifo", tarfile.FIFOTYPE)],
        "outside a sandbox's own ids": [_info(f"layers/{LAYER}/own", uid=1_000_000_000, data=b"x")],
        "root directory": [_info(f"layers/{LAYER}", tarfile.DIRTYPE)],
    }
    cases["device"][0][0].devmajor, cases["device"][0][0].devminor = 1, 1   # /dev/mem
    cases["modification time"] = [_info(f"layers/{LAYER}/t", data=b"x")]
    cases["modification time"][0][0].pax_headers = {"mtime": "1e400"}
    for why, members in cases.items():
        _refused(daemon, base, _tar(tmp_path / "x.tar", _manifest(base.ref, _layers_meta()), members), why)


def test_an_entry_before_its_directory_is_refused(daemon, base, tmp_path):
    archive = _tar(tmp_path / "o.tar", _manifest(base.ref, _layers_meta()), [_info(f"layers/{LAYER}/dir/f", data=b"x")])
    _refused(daemon, base, archive, "comes before its directory")
    archive = _tar(tmp_path / "r.tar", _manifest(base.ref, _layers_meta()), [_info(f"layers/{LAYER}/f", data=b"x")],
                   root=False)
    _refused(daemon, base, archive, "before its layer's root")


@pytest.mark.parametrize("what,manifest,match", [
    ("empty nodes", lambda b: _manifest(b, {}, nodes=[]), "lists no image"),
    ("no manifest", lambda b: None, "first member"),
    ("not json", lambda b: b"{not json", "not valid JSON"),
    ("duplicate key", lambda b: b'{"format": 1, "format": 1}', "twice"),
    ("format", lambda b: {**_manifest(b, _layers_meta()), "format": 2}, "format 1"),
    ("broken chain", lambda b: _manifest(b, _layers_meta(), [{"id": NODE, "parent": "image:" + "00" * 32,
                                                              "layer": LAYER}]), "one chain"),
    ("bad id", lambda b: _manifest(b, _layers_meta(), [{"id": "../../etc/passwd", "parent": b, "layer": LAYER}]),
     "64-hex"),
    ("layer unknown", lambda b: _manifest(b, _layers_meta(), [{"id": NODE, "parent": b, "layer": "ef" * 32}]),
     "not among"),
    ("unused layer", lambda b: _manifest(b, _layers_meta(), [{"id": NODE, "parent": b, "layer": None}]),
     "no node of it uses"),
    ("env type", lambda b: _manifest(b, _layers_meta(), [{"id": NODE, "parent": b, "layer": LAYER, "env": {"A": 1}}]),
     "env value"),
    ("name", lambda b: _manifest(b, _layers_meta(), [{"id": NODE, "parent": b, "layer": LAYER, "name": "../x"}]),
     "name"),
    ("base", lambda b: _manifest("image:" + "00" * 32, _layers_meta()), "base"),
    ("opaque", lambda b: _manifest(b, {LAYER: {"files": 5, "size": 1, "opaque": ["/../../x"]}}), "'\\.\\.'"),
    ("a missing layer", lambda b: _manifest(b, {**_layers_meta(), "ef" * 32: {"files": 1, "size": 0}},
                                            [{"id": NODE, "parent": b, "layer": LAYER},
                                             {"id": "12" * 32, "parent": "image:" + NODE, "layer": "ef" * 32}]),
     "does not hold"),
])
def test_an_invalid_or_empty_manifest_is_refused(daemon, base, tmp_path, what, manifest, match):
    archive = _tar(tmp_path / "m.tar", manifest(base.ref), [_info(f"layers/{LAYER}/f", data=b"x")])
    _refused(daemon, base, archive, match)


def test_a_layer_with_more_entries_or_bytes_than_declared_is_cut_short(daemon, base, tmp_path):
    many = [_info(f"layers/{LAYER}/f{i}") for i in range(3000)]
    _refused(daemon, base, _tar(tmp_path / "bomb.tar", _manifest(base.ref, _layers_meta(files=10)), many),
             "one more entry of layer .* than its manifest declares")
    big = [_info(f"layers/{LAYER}/big", data=b"\0" * 100_000)]
    _refused(daemon, base, _tar(tmp_path / "big.tar", _manifest(base.ref, _layers_meta(size=1000)), big),
             "larger than its manifest declares")
    _refused(daemon, base, _tar(tmp_path / "decl.tar", _manifest(base.ref, _layers_meta(files=10**9)), []),
             "declares more than 1000000 entries")


def test_an_entry_count_or_size_bomb_stops_at_the_limits(tmp_path, monkeypatch):
    """The store directly, with limits lowered so that the bomb stays small (defaults: _untar.MAX_*)."""
    monkeypatch.setenv("HUTCH_STATE_DIR", str(tmp_path / "state"))
    base = f"dir:{tmp_path}"
    bomb = _tar(tmp_path / "bomb.tar", _manifest(base, _layers_meta(files=50)),
                [_info(f"layers/{LAYER}/f{i}") for i in range(40)])
    with open(bomb, "rb") as f, pytest.raises(hutch.ImageError, match="declares more than 30 entries"):
        _archive.import_(f, _archive.ImportLimits(entries=30), base=base)
    big = _tar(tmp_path / "big.tar", _manifest(base, _layers_meta()), [_info(f"layers/{LAYER}/b", data=b"\0" * 300_000)])
    with open(big, "rb") as f, pytest.raises(hutch.ImageError, match="larger than 100000 bytes"):
        _archive.import_(f, _archive.ImportLimits(bytes=100_000), base=base)
    huge_header = tarfile.TarInfo(f"layers/{LAYER}/" + "n" * 200)
    huge_header.pax_headers = {"comment": "x" * (1 << 20)}
    with tarfile.open(tmp_path / "hdr.tar", "w", format=tarfile.PAX_FORMAT) as t:
        data = json.dumps(_manifest(base, _layers_meta())).encode()
        info, _ = _info(_archive.MANIFEST, data=data)
        t.addfile(info, io.BytesIO(data))
        t.addfile(huge_header)
    with open(tmp_path / "hdr.tar", "rb") as f, pytest.raises(hutch.ImageError, match="extended header"):
        _archive.import_(f, base=base)
    assert _store(tmp_path / "state") == ([], [])


def test_a_damaged_lower_layer_stores_none_of_the_archive(daemon, base, make_sandbox, tmp_path):
    """The digests of every layer are checked before any is kept (here the last one checked is the bad one)."""
    built = base.run_commands("echo low > /low").run_commands("echo high > /high").build(quiet=True)
    good = tmp_path / "good.tar"
    built.export(good)
    hutch_rm = hutch.Image.from_name(built.ref)
    from click.testing import CliRunner
    from hutch.cli import cli

    assert CliRunner().invoke(cli, ["image", "rm", hutch_rm.ref, "--force"]).exit_code == 0
    CliRunner().invoke(cli, ["image", "prune"])
    bad = tmp_path / "bad.tar"
    with tarfile.open(good) as src, tarfile.open(bad, "w", format=tarfile.PAX_FORMAT) as dst:
        for m in src.getmembers():
            data = src.extractfile(m).read() if m.isfile() else None
            if m.isfile() and m.name.endswith("/low"):
                data = b"LOW\n"
            dst.addfile(m, io.BytesIO(data) if data is not None else None)
    _refused(daemon, base, bad, "does not match its digest")
    assert hutch.Image.import_(good, base=base).ref == built.ref
    assert make_sandbox(image=built).run("cat", "/low", "/high").stdout == "low\nhigh\n"


def test_a_valid_layer_keeps_hard_links_setuid_bits_and_whiteouts_and_none_is_reachable_from_the_host(
        daemon, base, make_sandbox, tmp_path):
    tree = tmp_path / "tree"
    tree.mkdir()
    (tree / "data").write_text("shared\n")
    os.link(tree / "data", tree / "again")
    (tree / "suid").write_text("#!/bin/sh\nid -u\n")
    os.chmod(tree / "suid", 0o4755)
    (tree / "etc").mkdir()
    os.mknod(tree / "etc" / "passwd", stat.S_IFCHR | 0o600, 0)   # a whiteout: the base's /etc/passwd is gone
    os.chown(tree / "etc", 1000, 1000)
    meta = _layers.measure_tree(tree)
    digest = meta["digest"]
    archive = tmp_path / "ok.tar"
    with tarfile.open(archive, "w", format=tarfile.PAX_FORMAT) as t:
        nodes = [{"id": NODE, "parent": base.ref, "layer": digest}]
        data = json.dumps(_manifest(base.ref, {digest: meta}, nodes)).encode()
        info, _ = _info(_archive.MANIFEST, data=data)
        t.addfile(info, io.BytesIO(data))
        t.add(tree, arcname=f"layers/{digest}")
        assert any(m.islnk() for m in t.getmembers())
    img = hutch.Image.import_(archive, base=base)
    assert img.ref == "image:" + NODE
    out = make_sandbox(image=img).run("sh", "-c", "cat /data /again; stat -c '%a %u' /suid /etc; "
                                                  "test -e /etc/passwd && echo present || echo gone").stdout
    assert out == "shared\nshared\n4755 0\n755 1000\ngone\n"
    stored = daemon.state_dir / "layers" / digest / "fs"
    assert os.stat(stored / "suid").st_mode & stat.S_ISUID
    assert os.stat(stored / "again").st_ino == os.stat(stored / "data").st_ino
    st = os.stat(daemon.state_dir / "layers")
    assert (stat.S_IMODE(st.st_mode), st.st_uid) == (0o700, 0)   # so no host user reaches the setuid file
    pid = os.fork()
    if pid == 0:   # a host user: the layer's setuid file is out of its reach
        code = 3
        try:
            os.setgid(65534)
            os.setuid(65534)
            try:
                os.stat(stored / "suid")
                code = 1
            except PermissionError:
                code = 0
        finally:
            os._exit(code)
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
    assert not [p for p in os.listdir(daemon.state_dir / "layers") if p.startswith(".tmp-")]


def test_the_daemon_stops_spooling_an_upload_past_its_byte_limit(tmp_path, base):
    """HUTCH_IMPORT_MAX_BYTES of the daemon bounds the upload it spools to disk, not only what it extracts."""
    import shutil
    import tempfile

    from hutch_testing import sdk_pointed_at
    from img_support import start_daemon, stop_daemon

    run_dir = Path(tempfile.mkdtemp(prefix="hutch-img-run-"))
    state_dir = Path(tempfile.mkdtemp(prefix="hutch-img-state-"))
    try:
        with sdk_pointed_at(run_dir, HUTCH_STATE_DIR=str(state_dir)):
            proc = start_daemon(run_dir, extra_env={"HUTCH_IMPORT_MAX_BYTES": "200000"})
            try:
                big = _tar(tmp_path / "big.tar", _manifest(base.ref, _layers_meta(size=1 << 30)),
                           [_info(f"layers/{LAYER}/b", data=os.urandom(2 << 20))])
                with pytest.raises(hutch.ImageError, match="larger than 200000 bytes"):
                    hutch.Image.import_(big)
                assert _store(state_dir) == ([], [])
            finally:
                stop_daemon(proc)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
        shutil.rmtree(state_dir, ignore_errors=True)
