"""The same SDK on runtime="gvisor": streams and stdin, pause/resume, snapshot_memory/restore/fork (sync and
async), and the CLI's pause, resume, snapshot, restore and fork."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys
import time

import pytest

import hutch

pytestmark = pytest.mark.skipif(shutil.which("runsc") is None, reason="runsc is not installed (scripts/setup.sh)")


def hutch_cli(*args):
    return subprocess.run([sys.executable, "-m", "hutch", *args], capture_output=True, text=True, timeout=120)


def test_streams_stdin_and_the_counter_across_pause_snapshot_restore_fork(make_sandbox):
    # the counter is renamed into place: a read never sees the file truncated and not yet written
    sb = make_sandbox("sh", "-c", "i=0; while :; do i=$((i+1)); echo $i > /c.new; mv /c.new /c; sleep 0.02; done",
                      runtime="gvisor")
    p = sb.exec("sh", "-c", "while read x; do echo got:$x; done")
    p.stdin.write("one\n")
    assert p.stdout.readline() == "got:one\n"   # stdin and stdout stream while the command runs
    p.stdin.close()
    assert p.wait() == 0
    time.sleep(0.3)
    sb.pause()
    assert sb.status == "paused"
    sb.resume()
    snap = sb.snapshot_memory()
    assert isinstance(snap, hutch.Snapshot) and snap.source == sb.id and snap.memory_bytes > 0
    copy = hutch.Sandbox.restore(snap)
    try:
        a = int(copy.files.read("/c"))
        time.sleep(0.3)
        assert int(copy.files.read("/c")) > a   # the counter the copy carried on with
        assert copy.run("hostname").stdout.strip() == f"hutch-{copy.id}"
    finally:
        copy.terminate()
    kids = sb.fork(2)
    try:
        kids[0].files.write("/only-in-0", "x")
        for other in (kids[1], sb):
            assert other.run("test", "-e", "/only-in-0").returncode == 1
        assert all(int(k.files.read("/c")) > 0 for k in kids)
    finally:
        for k in kids:
            k.terminate()
    assert snap.id in {s.id for s in hutch.Snapshot.list()}
    snap.delete()
    assert snap.id not in {s.id for s in hutch.Snapshot.list()}


def test_async_snapshot_restore_fork(daemon, busybox_root):
    async def go():
        sb = await hutch.AsyncSandbox.create(image=f"dir:{busybox_root}", runtime="gvisor")
        try:
            await sb.files.write("/mark", b"m")
            await sb.pause()
            await sb.resume()
            snap = await sb.snapshot_memory()
            copy = await hutch.AsyncSandbox.restore(snap)
            kids = await sb.fork(2)
            try:
                assert (await copy.files.read("/mark")) == b"m"
                assert [await k.files.read("/mark") for k in kids] == [b"m", b"m"]
            finally:
                for s in [copy, *kids]:
                    await s.terminate()
                snap.delete()
        finally:
            await sb.terminate()

    asyncio.run(go())


def test_a_snapshot_while_an_exec_runs_is_refused_naming_the_fix(make_sandbox):
    sb = make_sandbox(runtime="gvisor")
    p = sb.exec("sleep", "30")
    with pytest.raises(hutch.StateError, match="command="):
        sb.snapshot_memory()
    p.kill()


def test_native_sandboxes_pause_but_have_no_memory_snapshot(make_sandbox):
    sb = make_sandbox()
    sb.pause()
    assert sb.status == "paused"
    assert sb.run("echo", "hi").stdout == "hi\n" and sb.status == "running"   # a call resumes it
    with pytest.raises(hutch.UnsupportedError, match='runtime="gvisor"'):
        sb.snapshot_memory()


def test_cli_pause_resume_snapshot_restore_fork(daemon, busybox_root):
    r = hutch_cli("sandbox", "create", "--detach", "--runtime", "gvisor", "--image", f"dir:{busybox_root}")
    assert r.returncode == 0, r.stderr
    sid = r.stdout.strip()
    made = [sid]
    try:
        assert hutch_cli("sandbox", "pause", sid).returncode == 0
        assert hutch.Sandbox.from_id(sid).status == "paused"
        assert hutch_cli("sandbox", "resume", sid).returncode == 0
        r = hutch_cli("sandbox", "snapshot", sid)
        assert r.returncode == 0, r.stderr
        snap = r.stdout.strip()
        r = hutch_cli("sandbox", "restore", snap)
        assert r.returncode == 0, r.stderr
        made.append(r.stdout.strip())
        r = hutch_cli("sandbox", "fork", sid, "-n", "2")
        assert r.returncode == 0, r.stderr
        made += r.stdout.split()
        assert len(made) == 4 and all(hutch.Sandbox.from_id(s).status == "running" for s in made)
        hutch.Snapshot(snap).delete()
    finally:
        hutch_cli("sandbox", "kill", *made)


def test_sdk_and_cli_export_import_a_snapshot(make_sandbox, busybox_root, tmp_path):
    sb = make_sandbox("sh", "-c", "echo kept > /f; i=0; while :; do i=$((i+1)); echo $i > /c.new; mv /c.new /c; "
                      "sleep 0.02; done", runtime="gvisor")
    time.sleep(0.2)
    snap = sb.snapshot_memory()
    made = []
    try:
        snap.export(tmp_path / "s.tar")
        with pytest.raises(hutch.InvalidArchiveError, match="may not choose a host directory"):
            hutch.Snapshot.import_(tmp_path / "s.tar")   # its filesystem sits on a directory: named, or refused
        back = hutch.Snapshot.import_(tmp_path / "s.tar", base=hutch.Image.from_directory(busybox_root))
        assert back.id != snap.id and back.memory_bytes == snap.memory_bytes and back.image == snap.image
        r = hutch_cli("snapshot", "export", snap.id, str(tmp_path / "c.tar"))
        assert r.returncode == 0, r.stderr
        r = hutch_cli("snapshot", "import", str(tmp_path / "c.tar"), "--base", f"dir:{busybox_root}")
        assert r.returncode == 0, r.stderr
        cli_id = r.stdout.strip()
        made += [back.id, cli_id]
        assert {back.id, cli_id} <= {s.id for s in hutch.Snapshot.list()}
        assert cli_id in hutch_cli("snapshot", "ls").stdout
        copy = hutch.Sandbox.restore(cli_id)
        try:
            a = int(copy.files.read("/c"))
            time.sleep(0.3)
            assert int(copy.files.read("/c")) > a and copy.files.read("/f") == b"kept\n"
        finally:
            copy.terminate()
        (tmp_path / "bad.tar").write_bytes(b"x" * 2048)
        with pytest.raises(hutch.InvalidArchiveError, match="not a readable tar"):
            hutch.Snapshot.import_(tmp_path / "bad.tar")
        r = hutch_cli("snapshot", "import", str(tmp_path / "bad.tar"))
        assert r.returncode == 1 and "hutch: error:" in r.stderr
        with pytest.raises(hutch.NotFoundError):
            hutch.Snapshot.import_(tmp_path / "missing.tar")
        assert hutch_cli("snapshot", "rm", *made).returncode == 0
        made.clear()
    finally:
        for s in made + [snap.id]:
            try:
                hutch.Snapshot(s).delete()
            except hutch.NotFoundError:
                pass
