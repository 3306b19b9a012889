"""Filesystem snapshots: writes and deletions survive, content addressing, daemon restart,
export/import between stores, image rm and prune."""

from __future__ import annotations

import io
import json
import tarfile

import pytest
from click.testing import CliRunner

import hutch
from hutch.cli import cli

WRITE = ("mkdir -p /data/sub && echo hello > /data/sub/a.txt && ln -s sub/a.txt /data/link && "
         "chmod 600 /data/sub/a.txt && rm /etc/passwd && rm -rf /root && mkdir /root && echo new > /root/only && "
         "dd if=/dev/urandom of=/data/blob bs=64k count=16 2>/dev/null && md5sum /data/blob > /data/blob.md5")
CHECK = ("cat /data/sub/a.txt /data/link; stat -c %a /data/sub/a.txt; md5sum -c -s /data/blob.md5 && echo blob-ok; "
         "ls /root; test -e /etc/passwd && echo passwd-present || echo passwd-gone")
EXPECT = "hello\nhello\n600\nblob-ok\nonly\npasswd-gone\n"


def test_snapshot_sees_writes_and_deletions(make_sandbox, busybox_root):
    (busybox_root / "root" / "old").write_text("lower")
    try:
        sb = make_sandbox()
        sb.run("sh", "-c", WRITE, check=True)
        snap = sb.snapshot_filesystem()
        assert snap.ref.startswith("image:")
        sb2 = make_sandbox(image=snap)
        assert sb2.run("sh", "-c", CHECK).stdout == EXPECT   # /root/old is hidden: the dir became opaque
        # the source sandbox goes on; a second snapshot of unchanged content is the same image
        assert sb.snapshot_filesystem().ref == snap.ref
        sb.run("sh", "-c", "echo more > /data/more", check=True)
        assert sb.snapshot_filesystem().ref != snap.ref
        # stacking: a snapshot of a sandbox made from a snapshot keeps both layers' changes
        sb2.run("sh", "-c", "rm /data/sub/a.txt; echo second > /data/second", check=True)
        snap2 = sb2.snapshot_filesystem(name="stacked")
        out = make_sandbox(image=snap2).run("sh", "-c", "ls /data/sub; cat /data/second /data/link || true").stdout
        assert "a.txt" not in out and "second" in out
        assert hutch.Image.from_name("stacked").ref == snap2.ref
    finally:
        (busybox_root / "root" / "old").unlink()


def test_snapshots_survive_a_daemon_restart(make_sandbox, daemon):
    sb = make_sandbox()
    sb.run("sh", "-c", WRITE, check=True)
    snap = sb.snapshot_filesystem(name="survivor")
    sb.terminate()
    daemon.restart()
    assert make_sandbox(image=snap).run("sh", "-c", CHECK).stdout == EXPECT
    assert make_sandbox(image=hutch.Image.from_name("survivor")).run("cat", "/root/only").stdout == "new\n"


def test_export_import_round_trip_and_damaged_archives(make_sandbox, base, tmp_path):
    sb = make_sandbox()
    sb.run("sh", "-c", WRITE, check=True)
    snap = sb.snapshot_filesystem()
    stacked = hutch.Image(snap.ref).env({"FROM": "export"}).run_commands("echo top > /top")
    built = stacked.build(quiet=True)
    archive = tmp_path / "img.tar"
    built.export(archive)
    with tarfile.open(archive) as tar:
        names = tar.getnames()
        manifest = json.loads(tar.extractfile("hutch-image.json").read())
    assert len(manifest["layers"]) == 2 and any(n.startswith("layers/") for n in names)
    # remove it all from the store, then import it back: the same image, the same content
    sb.terminate()
    hutch_rm = CliRunner().invoke(cli, ["image", "rm", snap.ref, "--force"])
    assert hutch_rm.exit_code == 0, hutch_rm.output
    CliRunner().invoke(cli, ["image", "prune"])
    with pytest.raises(hutch.NotFoundError):
        make_sandbox(image=built)
    r = CliRunner().invoke(cli, ["image", "import", str(archive)])   # its base is a directory: named, or refused
    assert r.exit_code == 1 and "--base " + base.ref in r.output, r.output
    r = CliRunner().invoke(cli, ["image", "import", str(archive), "--base", base.ref])
    assert r.exit_code == 0, r.output
    assert r.output.strip() == built.ref
    sb2 = make_sandbox(image=built)
    assert sb2.run("sh", "-c", CHECK + "; cat /top; echo $FROM").stdout == EXPECT + "top\nexport\n"

    # a layer whose bytes do not match its digest is refused, and nothing of it is stored
    bad = tmp_path / "bad.tar"
    with tarfile.open(archive) as src, tarfile.open(bad, "w") as dst:
        for m in src.getmembers():
            data = src.extractfile(m).read() if m.isfile() else None
            if m.isfile() and m.name.endswith("/top"):
                data = b"TOP\n"   # the same size as the real /top: only the digest can tell
                m.size = len(data)
            dst.addfile(m, io.BytesIO(data) if data is not None else None)
    hutch.Image.from_name(built.ref)   # still there from the good import
    with pytest.raises(hutch.ImageError, match="does not match its digest"):
        hutch.Image.import_(bad, base=base)
    # the attacks on import (links, duplicates, bombs, forged manifests): test_img_archive.py


def test_image_rm_and_prune(base, daemon, make_sandbox):
    runner = CliRunner()
    parent = base.run_commands("echo p > /p")
    child = parent.run_commands("echo c > /c")
    built_child = child.build(quiet=True)
    built_parent = parent.build(quiet=True)
    r = runner.invoke(cli, ["image", "rm", built_parent.ref])
    assert r.exit_code == 1 and "built on it" in r.output and "--force" in r.output
    sb = make_sandbox(image=built_child)
    r = runner.invoke(cli, ["image", "rm", built_parent.ref, "--force"])
    assert r.exit_code == 1 and "in use by a running sandbox" in r.output
    sb.terminate()
    r = runner.invoke(cli, ["image", "rm", built_parent.ref, "--force"])
    assert r.exit_code == 0 and r.output.count("removed") == 2
    with pytest.raises(hutch.NotFoundError):
        hutch.Image.from_name(built_child.ref)

    # prune: unnamed build cache goes with its layers; named images and snapshots stay
    named = base.run_commands("echo keep > /keep").build(name="keeper", quiet=True)
    cache = base.run_commands("echo scratch > /scratch").build(quiet=True)
    cache_layer = _layer_of(cache)
    assert (daemon.state_dir / "layers" / cache_layer).is_dir()
    r = runner.invoke(cli, ["image", "prune"])
    assert r.exit_code == 0 and "removed" in r.output
    assert not (daemon.state_dir / "layers" / cache_layer).exists()
    with pytest.raises(hutch.NotFoundError):
        hutch.Image.from_name(cache.ref)
    assert make_sandbox(image=hutch.Image.from_name("keeper")).run("cat", "/keep").stdout == "keep\n"
    ls = runner.invoke(cli, ["image", "ls"])
    assert "keeper" in ls.output and named.ref[6:18] in ls.output


def _layer_of(image) -> str:
    from hutch.sandbox import _client

    return _client.default_client().json("GET", f"/v1/images/{image.ref}")["layer"]
