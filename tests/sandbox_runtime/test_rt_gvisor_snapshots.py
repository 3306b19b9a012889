"""Memory snapshots, restore and fork on runtime="gvisor": a counter carries on in every copy, copies diverge,
memory survives (hash), files of one copy are invisible to the others, a snapshot from outside is checked,
and nothing is left once a copy or its source ends."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest

from rt_support import private_state_daemon, Api, uds_client

pytestmark = pytest.mark.skipif(shutil.which("runsc") is None, reason="runsc is not installed (scripts/setup.sh)")

# a counter that holds 8 MiB of random bytes and prints its count and their hash to a file, every 20 ms
COUNTER = ("dd if=/dev/urandom of=/m bs=1M count=8 2>/dev/null; h=$(md5sum < /m | cut -c1-32); i=0; "
           "while :; do i=$((i+1)); echo \"$i $h $(hostname)\" > /n.tmp; mv /n.tmp /n; sleep 0.02; done")


@pytest.fixture(scope="module")
def gvd(tmp_path_factory):
    with private_state_daemon(tmp_path_factory.mktemp("gvsnap")) as d:
        yield d


@pytest.fixture
def gapi(gvd):
    a = Api(gvd.sock, gvd.run_dir)
    try:
        yield a
    finally:
        a.close()


def _read(api, sid) -> tuple[int, str, str]:
    r = api.http.get(f"/v1/sandboxes/{sid}/files/read", params={"path": "/n"})
    assert r.status_code == 200, r.text
    n, h, host = r.content.decode().split()
    return int(n), h, host


def _counts_on(api, sid, past: int, what: str) -> tuple[int, str, str]:
    """The counter of `sid` once it is past `past` (it counts every 20 ms; a loaded machine may take longer)."""
    deadline = time.monotonic() + 20
    while (got := _read(api, sid))[0] <= past:
        assert time.monotonic() < deadline, f"{what}: the count stayed at {got[0]} for 20 s"
        time.sleep(0.05)
    return got


def _counter(api, image) -> str:
    sid = api.create(image, runtime="gvisor", command=["sh", "-c", COUNTER])["id"]
    deadline = time.monotonic() + 20
    while api.http.get(f"/v1/sandboxes/{sid}/files/stat", params={"path": "/n"}).status_code != 200:
        assert time.monotonic() < deadline, "the counter never started"
        time.sleep(0.05)
    return sid


def test_snapshot_restore_carries_on_with_the_same_memory(gapi, gvd, image):
    sid = _counter(gapi, image)
    time.sleep(0.3)
    r = gapi.http.post(f"/v1/sandboxes/{sid}/snapshot-memory")
    assert r.status_code == 201, r.text
    snap = r.json()
    n_at, h_src, _ = _read(gapi, sid)
    _counts_on(gapi, sid, n_at, "the source stopped after the snapshot")
    r = gapi.http.post(f"/v1/memory-snapshots/{snap['id']}/restore", json={"detach": True})
    assert r.status_code == 201, r.text
    copy = r.json()["id"]
    gapi.created.append(copy)
    n1, h1, host1 = _counts_on(gapi, copy, 0, "the restored copy")
    n2, _, host2 = _counts_on(gapi, copy, n1, "the restored copy")
    assert n2 > n1 > 0 and h1 == h_src, (n1, n2, h1, h_src)      # it counts on, with the source's memory
    assert host2 == f"hutch-{copy}", host2                          # its own hostname
    out, _, res = gapi.sh(copy, "echo alive")
    assert out == "alive\n"
    assert {s["id"] for s in gapi.http.get("/v1/memory-snapshots").json()["snapshots"]} >= {snap["id"]}
    assert gapi.http.delete(f"/v1/memory-snapshots/{snap['id']}").status_code == 204
    assert gapi.http.get(f"/v1/memory-snapshots/{snap['id']}").status_code == 404


def _cached_fraction(path: Path) -> float:
    """How much of `path` is in the page cache (mincore over a private mapping nobody touches)."""
    import ctypes
    import mmap

    size = path.stat().st_size
    if not size:
        return 1.0
    libc = ctypes.CDLL(None, use_errno=True)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY) as m:
        addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
        pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
        vec = (ctypes.c_ubyte * pages)()
        assert libc.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(size), vec) == 0, ctypes.get_errno()
        return sum(v & 1 for v in vec) / pages


def test_a_snapshot_image_is_cached_outside_the_sandboxs_limits_which_come_back(gapi, gvd, image):
    """The checkpoint writes through the page cache from a memory cgroup of its own (cgroups.set_aside): the
    image is cached for a restore, not charged to the sandbox, and the sentry, its memory cgroup and its cpu
    quota are the sandbox's again once the snapshot is taken."""
    sid = gapi.create(image, runtime="gvisor", limits={"memory": 256 * 1024**2, "cpu": 0.5},
                      command=["sh", "-c", "dd if=/dev/urandom of=/dev/held bs=1M count=64 2>/dev/null; "
                                           "exec sleep 1000"])["id"]
    cgroups = gapi.info(sid)["cgroups"]
    mem_dir = Path(next((d for d in cgroups if "/memory/" in d), cgroups[0]))
    if not (mem_dir / "memory.usage_in_bytes").exists():
        pytest.skip("cgroup v2: the checkpoint writes O_DIRECT there (no memory cgroup aside)")
    cpu_dir = Path(next(d for d in cgroups if "/cpu/" in d))
    deadline = time.monotonic() + 20
    while int((mem_dir / "memory.usage_in_bytes").read_text()) < 64 * 1024**2:
        assert time.monotonic() < deadline, "the sandbox never held its 64 MiB"
        time.sleep(0.1)
    time.sleep(0.3)
    procs = set((mem_dir / "cgroup.procs").read_text().split())
    before = int((mem_dir / "memory.usage_in_bytes").read_text())
    r = gapi.http.post(f"/v1/sandboxes/{sid}/snapshot-memory")
    assert r.status_code == 201, r.text
    snap = r.json()
    pages = Path(gvd.state_dir) / "memory-snapshots" / snap["id"] / "mem" / "pages.img"
    assert pages.stat().st_size >= 64 * 1024**2
    assert _cached_fraction(pages) > 0.9          # a restore reads it from memory
    after = int((mem_dir / "memory.usage_in_bytes").read_text())
    assert after - before < 32 * 1024**2, (before, after)     # the image's 64+ MiB were not charged here
    assert set((mem_dir / "cgroup.procs").read_text().split()) == procs        # the sentry is back
    assert not (mem_dir.parent / f"{sid}.image").exists()
    assert (cpu_dir / "cpu.cfs_quota_us").read_text().strip() == "50000"      # cpu=0.5 again
    # and the limit holds for it as before: 256 MiB more in the sandbox ends it (the sentry is OOM-killed)
    gapi.sh(sid, "dd if=/dev/urandom of=/dev/more bs=1M count=256 2>/dev/null; echo done", timeout=60)
    deadline = time.monotonic() + 20
    while gapi.info(sid)["status"] not in ("oom", "exited", "failed"):
        assert time.monotonic() < deadline, gapi.info(sid)
        time.sleep(0.1)
    assert gapi.http.delete(f"/v1/memory-snapshots/{snap['id']}").status_code == 204


def test_fork_makes_copies_that_diverge(gapi, image):
    sid = _counter(gapi, image)
    r = gapi.http.post(f"/v1/sandboxes/{sid}/fork", json={"n": 3, "detach": True})
    assert r.status_code == 201, r.text
    kids = [k["id"] for k in r.json()["sandboxes"]]
    gapi.created.extend(kids)
    assert len(set(kids)) == 3 and sid not in kids
    gapi.sh(kids[0], "echo mine > /home-of-0")
    for k in kids[1:]:
        out, _, res = gapi.sh(k, "test -e /home-of-0 && echo seen || echo unseen")
        assert out == "unseen\n", k
    out, _, _ = gapi.sh(sid, "test -e /home-of-0 && echo seen || echo unseen")
    assert out == "unseen\n"
    time.sleep(0.2)
    hashes = {_read(gapi, k)[1] for k in kids} | {_read(gapi, sid)[1]}
    assert len(hashes) == 1, hashes
    gapi.terminate(kids[1])   # one copy ends: the others and the source go on
    _counts_on(gapi, kids[2], _read(gapi, kids[2])[0], "a copy after another one ended")
    assert gapi.http.get("/v1/memory-snapshots").json()["snapshots"] == [] or all(
        s["source"] != sid for s in gapi.http.get("/v1/memory-snapshots").json()["snapshots"])   # fork's own is gone


def test_a_native_sandbox_has_no_memory_snapshot(gapi, image):
    sid = gapi.create(image)["id"]
    r = gapi.http.post(f"/v1/sandboxes/{sid}/snapshot-memory")
    assert r.status_code == 400 and r.json()["error"] == "UnsupportedError", r.text
    assert 'runtime="gvisor"' in r.json()["message"]
    r = gapi.http.post(f"/v1/sandboxes/{sid}/fork", json={"n": 2})
    assert r.status_code == 400 and r.json()["error"] == "UnsupportedError", r.text


def test_a_tampered_snapshot_is_refused_before_runsc_sees_it(gapi, gvd, image):
    sid = gapi.create(image, runtime="gvisor")["id"]
    snap = gapi.http.post(f"/v1/sandboxes/{sid}/snapshot-memory").json()
    d = Path(gvd.state_dir) / "memory-snapshots" / snap["id"]
    meta = json.loads((d / "meta.json").read_text())
    (d / "meta.json").write_text(json.dumps({**meta, "runsc": "runsc version 0.0~20221219.0"}))
    r = gapi.http.post(f"/v1/memory-snapshots/{snap['id']}/restore", json={"detach": True})
    assert r.status_code == 409 and "same runsc build" in r.json()["message"], r.text
    (d / "meta.json").write_text(json.dumps({**meta, "format": 1}))   # an older hutch's: another bundle
    r = gapi.http.post(f"/v1/memory-snapshots/{snap['id']}/restore", json={"detach": True})
    assert r.status_code == 409 and "format 1" in r.json()["message"] and "take a new snapshot" in r.json()["message"]
    assert meta["format"] == 2 and meta["bundle"] and meta["base"], meta
    (d / "meta.json").write_text(json.dumps(meta))
    (d / "mem" / "extra").write_bytes(b"x")
    r = gapi.http.post(f"/v1/memory-snapshots/{snap['id']}/restore", json={"detach": True})
    assert r.status_code == 400 and "extra" in r.json()["message"], r.text
    (d / "mem" / "extra").unlink()
    (d / "mem" / "link").symlink_to("/etc/shadow")
    r = gapi.http.post(f"/v1/memory-snapshots/{snap['id']}/restore", json={"detach": True})
    assert r.status_code == 400, r.text
    (d / "mem" / "link").unlink()
    r = gapi.http.post("/v1/memory-snapshots/..%2f..%2fetc/restore", json={})
    assert r.status_code in (400, 404), r.text
    gapi.http.delete(f"/v1/memory-snapshots/{snap['id']}")


def test_a_snapshot_while_an_exec_runs_is_refused_and_an_exec_during_one_waits(gapi, image):
    """An exec's stdio are the host's pipes, which gVisor cannot restore: a snapshot while one runs is a 409
    naming the fix, and the sandbox runs on. An exec (or file call) arriving while a snapshot is taken waits
    for it, then runs; the snapshot does not hold it."""
    import threading

    sid = gapi.create(image, runtime="gvisor", limits={"memory": 256 * 1024**2},
                      command=["sh", "-c", "dd if=/dev/urandom of=/dev/shm/held bs=1M count=48 2>/dev/null; "
                                           "exec sleep 1000"])["id"]
    done: dict = {}
    t = threading.Thread(target=lambda: done.update(r=gapi.sh(sid, "touch /started; sleep 2; echo slept")))
    t.start()
    deadline = time.monotonic() + 10
    while gapi.http.get(f"/v1/sandboxes/{sid}/files/stat", params={"path": "/started"}).status_code != 200:
        assert time.monotonic() < deadline, "the exec never started"
        time.sleep(0.02)
    r = gapi.http.post(f"/v1/sandboxes/{sid}/snapshot-memory")
    assert r.status_code == 409 and r.json()["error"] == "StateError", r.text
    assert "exec" in r.json()["message"] and "</dev/null" in r.json()["message"], r.text
    t.join(20)
    assert done["r"][0] == "slept\n", done   # the refused snapshot did not disturb it

    results: dict = {}
    snap_t = threading.Thread(target=lambda: results.update(snap=gapi.http.post(f"/v1/sandboxes/{sid}/snapshot-memory")))
    snap_t.start()
    time.sleep(0.03)   # the snapshot of 48 MiB takes ~150 ms: the exec arrives while it runs (or just before)
    out, err, res = gapi.sh(sid, "echo after")
    snap_t.join(30)
    assert out == "after\n" and res["returncode"] == 0, (out, err, res)
    r = results["snap"]
    assert r.status_code in (201, 409), r.text   # 409 only if the exec came first (then it names the exec)
    if r.status_code == 409:
        assert "exec" in r.json()["message"], r.text
    else:
        snap = r.json()
        r = gapi.http.post(f"/v1/memory-snapshots/{snap['id']}/restore", json={"detach": True})
        assert r.status_code == 201, r.text
        gapi.created.append(r.json()["id"])
        assert gapi.sh(r.json()["id"], "echo copy")[0] == "copy\n"
        gapi.http.delete(f"/v1/memory-snapshots/{snap['id']}")
    assert gapi.sh(sid, "echo source")[0] == "source\n"


def test_a_client_gone_mid_snapshot_leaves_nothing(gapi, gvd, image):
    import httpx

    sid = gapi.create(image, runtime="gvisor", limits={"memory": 256 * 1024**2},
                      command=["sh", "-c", "dd if=/dev/urandom of=/dev/held bs=1M count=64 2>/dev/null; exec sleep 1000"])["id"]
    time.sleep(1.5)
    short = uds_client(gvd.sock, timeout=0.05)
    with pytest.raises(httpx.TimeoutException):
        short.post(f"/v1/sandboxes/{sid}/snapshot-memory")
    short.close()
    store = Path(gvd.state_dir) / "memory-snapshots"
    deadline = time.monotonic() + 90   # a hang guard: a loaded CI machine once took over 20 s
    while True:   # the daemon lets runsc finish, then deletes what it made
        left = [p.name for p in store.iterdir()] if store.exists() else []
        if not left and not gapi.http.get("/v1/memory-snapshots").json()["snapshots"]:
            break
        assert time.monotonic() < deadline, f"left behind: {left}"
        time.sleep(0.1)
    out, _, res = gapi.sh(sid, "echo still running")   # and the source runs on
    assert out == "still running\n"


def test_a_snapshot_with_a_bind_and_a_tmpfs_restores_with_both(gapi, image, tmp_path):
    """The bind is the host's (not in the snapshot: the copy sees it as it is now, and writes to it); the
    tmpfs is the sandbox's memory (in the snapshot: the copy has it as it was); neither can be exported."""
    share = tmp_path / "share"
    share.mkdir()
    share.chmod(0o777)
    tmp_path.chmod(0o755)
    sid = gapi.create(image, runtime="gvisor", mounts=[
        {"kind": "bind", "source": str(share), "target": "/share", "readonly": False},
        {"kind": "tmpfs", "target": "/t", "size": 1 << 20, "readonly": False, "source": None}])["id"]
    out, err, _ = gapi.sh(sid, "echo before > /share/f && echo mem > /t/m && echo ok")
    assert out == "ok\n", err
    snap = gapi.http.post(f"/v1/sandboxes/{sid}/snapshot-memory").json()
    (share / "f").write_text("after\n")
    r = gapi.http.post(f"/v1/memory-snapshots/{snap['id']}/restore", json={"detach": True})
    assert r.status_code == 201, r.text
    copy = r.json()["id"]
    gapi.created.append(copy)
    out, err, _ = gapi.sh(copy, "cat /share/f /t/m && echo copy > /share/g && echo ok")
    assert out == "after\nmem\nok\n", out + err
    assert (share / "g").read_text() == "copy\n"
    r = gapi.http.get(f"/v1/memory-snapshots/{snap['id']}/export")
    assert r.status_code == 409 and "bind" in r.json()["message"], r.text
    gapi.terminate(copy)
    gapi.terminate(sid)
    assert sorted(p.name for p in share.iterdir()) == ["f", "g"]   # the host's files outlive both
    gapi.http.delete(f"/v1/memory-snapshots/{snap['id']}")


def test_a_daemon_start_removes_only_the_partial_snapshots_of_daemons_gone(tmp_path, monkeypatch):
    """Daemons of several run directories may share a state directory: one starting must not delete the
    snapshot another is taking (it did: a restore then found its image gone)."""
    import os
    import subprocess

    from hutch.sandbox._host.gvisor import snapshots

    monkeypatch.setenv("HUTCH_STATE_DIR", str(tmp_path))
    live = subprocess.Popen(["sleep", "60"])
    dead = subprocess.Popen(["true"])
    dead.wait()
    try:
        store = snapshots.store_dir()
        store.mkdir(parents=True)
        names = {f"{'a' * 32}.{live.pid}.tmp": True, f"{'b' * 32}.{dead.pid}.tmp": False,
                 f".export-{live.pid}-x.tmp": True, f".import-{dead.pid}-y.tmp": False, f"{'c' * 32}.tmp": True}
        for n in names:
            (store / n).mkdir() if n[0] != "." else (store / n).write_bytes(b"x")
        old = store / f"{'d' * 32}.tmp"
        old.mkdir()
        os.utime(old, (time.time() - 7200,) * 2)
        snapshots.remove_partial()
        assert sorted(p.name for p in store.iterdir()) == sorted(n for n, kept in names.items() if kept)
    finally:
        live.kill()
        live.wait()
