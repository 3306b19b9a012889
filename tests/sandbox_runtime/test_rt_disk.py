"""The writable layer is disk-backed: `disk=` is the limit a sandbox hits (EDQUOT inside, the sandbox lives),
not `memory=`, and the store of layers leaves nothing behind (loop device, mount, image file).

Each sandbox's layer is a btrfs subvolume with a quota of its disk=, in one store per zygote
(hutch/sandbox/_host/native/disk.py). The first test runs against both kinds of daemon.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import time
from pathlib import Path

import pytest

from rt_support import Api, Daemon

PY = "/usr/bin/python3"
MiB = 1 << 20

FILL = """
import errno, json, os, sys
path, mib = sys.argv[1], int(sys.argv[2])
chunk = b"x" * (1 << 20)
n, err = 0, 0
try:
    with open(path, "wb") as f:
        for _ in range(mib):
            f.write(chunk)
            n += 1
        f.flush()
        os.fsync(f.fileno())
except OSError as e:
    err = e.errno
print(json.dumps({"mib": n, "errno": err}))
"""


def _fill(api, sid, path, mib) -> dict:
    out, err, res = api.exec(sid, PY, "-S", "-c", FILL, path, str(mib))
    assert res == {"returncode": 0, "reason": "exited"}, (res, err.decode()[-2000:])
    return json.loads(out)


def _limits(memory, disk) -> dict:
    return {"memory": memory, "disk": disk, "cpu": 1.0, "pids": 512}


def _oom_kills(daemon: Daemon, sid: str) -> int:
    for d in daemon.cgroup_dirs(sid):
        for name in ("memory.oom_control", "memory.events"):
            f = d / name
            if f.exists():
                for line in f.read_text().splitlines():
                    if line.startswith("oom_kill "):
                        return int(line.split()[1])
    return 0


def _zygote(daemon: Daemon) -> int:
    """The host pid of the daemon's zygote."""
    for d in daemon.cgroup_dirs("_zygote"):
        for pid in (d / "cgroup.procs").read_text().split():
            try:
                if int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1]) == daemon.proc.pid:
                    return int(pid)
            except (FileNotFoundError, ProcessLookupError):
                continue
    raise AssertionError("no zygote")


def _store(daemon: Daemon) -> Path:
    """The store of writable layers, as the host reaches it (it is mounted in the zygote's namespace only)."""
    return Path(f"/proc/{_zygote(daemon)}/root{daemon.run_dir}/disk")


def _layers_gone(daemon: Daemon, sids, within: float = 3.0) -> bool:
    """Whether the subvolumes of `sids` are destroyed (the store queues that as their sandboxes end)."""
    deadline = time.monotonic() + within
    while set(sids) & set(os.listdir(_store(daemon))):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def _our_loops(state_dir: Path) -> list[str]:
    """Loop devices whose backing file lies in `state_dir` (deleted or not)."""
    out = []
    for dev in Path("/sys/block").glob("loop*"):
        try:
            backing = (dev / "loop" / "backing_file").read_text().strip()
        except OSError:
            continue
        if backing.startswith(str(state_dir) + "/"):
            out.append(f"{dev.name}: {backing}")
    return out


@pytest.fixture(scope="module", params=["userns", "host-root"])
def ddaemon(request, tmp_path_factory):
    base = tmp_path_factory.mktemp(f"disk-{request.param}")
    env = {"HUTCH_STATE_DIR": str(base / "state")}
    if request.param == "host-root":
        env["HUTCH_USERNS"] = "0"
    d = Daemon(base / "run", env=env)
    d.state_dir = base / "state"
    try:
        yield d.start()
    finally:
        d.stop()
        d.cleanup_cgroups()
    deadline = time.monotonic() + 5
    while _our_loops(d.state_dir) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _our_loops(d.state_dir) == [], "the store's loop device outlived its daemon"


@pytest.fixture
def dapi(ddaemon):
    a = Api(ddaemon.sock, ddaemon.run_dir)
    try:
        yield a
    finally:
        a.close()


def test_disk_not_memory_is_the_limit_of_the_writable_layer(dapi, ddaemon, image, py_mounts):
    sid = dapi.create(image, mounts=py_mounts, limits=_limits(64 * MiB, 256 * MiB))["id"]
    # 200 MB through a 64 MB memory limit: page cache, reclaimed as it is written back
    assert _fill(dapi, sid, "/first", 200) == {"mib": 200, "errno": 0}
    got = _fill(dapi, sid, "/second", 200)
    assert got["errno"] in (errno.EDQUOT, errno.ENOSPC) and 40 <= got["mib"] < 60, got
    out, err, res = dapi.sh(sid, "echo alive; rm /first /second")
    assert out == "alive\n" and res["returncode"] == 0, err
    assert dapi.info(sid)["status"] == "running" and _oom_kills(ddaemon, sid) == 0
    # what was removed is free again
    assert _fill(dapi, sid, "/third", 200) == {"mib": 200, "errno": 0}
    # the files API writes count against disk= as well
    r = dapi.http.put(f"/v1/sandboxes/{sid}/files/write", params={"path": "/api.bin"}, content=b"y" * (80 * MiB))
    assert r.status_code == 409 and r.json()["error"] == "StateError" and "disk" in r.json()["message"], r.text
    assert dapi.sh(sid, "ls /api.bin* /.hutch* 2>&1 | grep -v 'No such' || echo none")[0] == "none\n"   # no part left
    assert dapi.sh(sid, "echo alive")[0] == "alive\n"


def test_filling_the_default_disk_does_not_oom_kill(dapi, ddaemon, image, py_mounts):
    if ddaemon.extra_env.get("HUTCH_USERNS") == "0":
        pytest.skip("once is enough: 1 GiB of writes")
    sid = dapi.create(image, mounts=py_mounts)["id"]   # the defaults: memory 512M, disk 1G
    got = _fill(dapi, sid, "/fill", 2048)
    assert got["errno"] in (errno.EDQUOT, errno.ENOSPC) and 900 <= got["mib"] < 1024, got
    out, _, _ = dapi.sh(sid, "echo alive")
    assert out == "alive\n" and dapi.info(sid)["status"] == "running" and _oom_kills(ddaemon, sid) == 0


def test_layers_are_subvolumes_nobody_else_reaches(dapi, ddaemon, image):
    a = dapi.create(image)["id"]
    b = dapi.create(image)["id"]
    store = _store(ddaemon)
    assert {a, b} <= set(os.listdir(store))
    assert oct(os.stat(store / a).st_mode & 0o777) == "0o700" and oct(os.stat(store).st_mode & 0o777) == "0o711"
    # inside: no trace of the store, and the working directory of pid 1 is not in it
    out, _, _ = dapi.sh(a, "grep -c btrfs /proc/self/mountinfo; ls /proc/1/cwd/ 2>&1 | head -3; echo end")
    assert out.split("\n")[0] == "0" and b not in out, out
    # nothing of it is mounted on the host
    assert str(ddaemon.run_dir) not in Path("/proc/self/mountinfo").read_text()
    dapi.terminate(a)
    dapi.terminate(b)
    assert _layers_gone(ddaemon, {a, b}), "the layers outlived their sandboxes"


def test_many_layers_go_at_once(dapi, ddaemon, image):
    import concurrent.futures as cf

    sids = [dapi.create(image)["id"] for _ in range(30)]
    for sid in sids[:5]:
        dapi.sh(sid, "dd if=/dev/zero of=/f bs=1M count=20 2>/dev/null; mkdir -p /d && touch /d/a /d/b")
    with cf.ThreadPoolExecutor(10) as pool:
        list(pool.map(dapi.terminate, sids))
    # a hang guard; how fast sandboxes go is bench/sandbox.py's ("terminate until every resource is gone")
    assert _layers_gone(ddaemon, sids, within=60)


def test_the_store_grows_for_a_larger_disk_and_refuses_what_the_host_cannot_hold(dapi, ddaemon, image):
    store = _store(ddaemon)
    st = os.statvfs(store)
    size = st.f_blocks * st.f_frsize
    sid = dapi.create(image, limits=_limits(256 * MiB, size + (1 << 30)))["id"]
    st = os.statvfs(store)
    assert st.f_bavail * st.f_frsize >= size + (1 << 30), "the store did not grow for the new sandbox's disk="
    assert dapi.sh(sid, "echo alive")[0] == "alive\n"
    before = {x["id"] for x in dapi.http.get("/v1/sandboxes").json()["sandboxes"]}
    code, body = dapi.create_error(image, limits=_limits(256 * MiB, 1 << 50))   # a petabyte
    assert code == 400 and body["error"] == "ConfigError", body
    assert "does not fit" in body["message"] and "MiB free" in body["message"] and "at most" in body["message"], body
    assert {x["id"] for x in dapi.http.get("/v1/sandboxes").json()["sandboxes"]} <= before   # nothing half-made is left
    assert dapi.sh(dapi.create(image)["id"], "echo alive")[0] == "alive\n"


def test_a_crashed_daemon_leaves_no_store_and_the_next_makes_a_new_one(tmp_path, image):
    d = Daemon(tmp_path / "run", env={"HUTCH_STATE_DIR": str(tmp_path / "state")})
    d.start()
    api = Api(d.sock, d.run_dir)
    try:
        sid = api.create(image)["id"]
        api.sh(sid, "dd if=/dev/zero of=/f bs=1M count=50 2>/dev/null")
        assert len(_our_loops(tmp_path / "state")) == 1
        d.kill9()
        deadline = time.monotonic() + 5
        while _our_loops(tmp_path / "state") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _our_loops(tmp_path / "state") == [], "the store outlived the crashed daemon"
        assert [p for p in (tmp_path / "state").iterdir() if p.name.startswith(".layers")] == []
        d.start()
        sid = api.create(image)["id"]
        assert api.sh(sid, "echo x > /f && cat /f")[0] == "x\n"
    finally:
        api.close()
        d.stop()
        d.cleanup_cgroups()
    assert _our_loops(tmp_path / "state") == []


def test_the_zygote_dying_takes_its_store_and_the_next_one_serves(tmp_path, image):
    d = Daemon(tmp_path / "run", env={"HUTCH_STATE_DIR": str(tmp_path / "state")})
    d.start()
    api = Api(d.sock, d.run_dir)
    try:
        api.create(image)
        first = _our_loops(tmp_path / "state")
        os.kill(_zygote(d), signal.SIGKILL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            left = _our_loops(tmp_path / "state")
            if left and left != first:
                break
            time.sleep(0.05)
        assert len(left) == 1 and left != first, (first, left)
        for _ in range(100):
            r = api.http.post("/v1/sandboxes", json={"spec": {"image": image, "detach": True}})
            if r.status_code == 201:
                break
            time.sleep(0.1)
        api.created.append(r.json()["id"])
        assert api.sh(r.json()["id"], "echo x > /f && cat /f")[0] == "x\n"
    finally:
        api.close()
        d.stop()
        d.cleanup_cgroups()
