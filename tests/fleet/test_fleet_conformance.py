"""One conformance suite, run against a single daemon and against a 3-node fleet (README, "Sandboxes").

Every test here is written once, against `target`: a private `hutch serve` (its own run directory and socket),
then the session's real 3-node Ray cluster with `hutch fleet up` on it (tests/fleet/fleet_support.py, loopback
only). What README's sandbox section promises must hold on both, unchanged: create with an image, limits and a
network policy, exec with streamed output and stdin, run and its errors, files, a pty, list by tags, from_id by
id and name, a filesystem snapshot a new sandbox starts from, terminate, status and reasons, the clear errors,
the async surface. The network tests resolve only names the policy refuses (the gateway answers NXDOMAIN
without asking anyone upstream), so nothing leaves the host.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import time
import uuid
from pathlib import Path

import pytest
from fleet_support import GUARD, RUN_TAG
from hutch_testing import restore_env, sandbox_maker, start_daemon, stop_daemon

import hutch

ENDED = {"exited", "terminated", "timeout", "idle_timeout", "oom", "failed"}
#: busybox has no python: a shell variable of 200 MiB is far above a 32M limit
HOG = ("sh", "-c", "a=$(head -c 209715200 /dev/zero | tr '\\0' x); echo ${#a}")


class Target:
    """Where the SDK points for one kind of deployment: `kind` is "daemon" or "fleet"."""

    def __init__(self, kind: str, point, fleet=None):
        self.kind, self._point, self.fleet = kind, point, fleet

    def __enter__(self):
        self._point()
        return self

    def __exit__(self, *exc):
        from hutch.sandbox import _client

        try:
            for sb in hutch.Sandbox.list(tags=RUN_TAG):
                sb.terminate()
        finally:
            _client._connected.clear()


@pytest.fixture(scope="module")
def single_daemon():
    """A private daemon (own run directory and socket; the default state directory, as the fleet's nodes)."""
    run_dir = Path(tempfile.mkdtemp(prefix="hutch-conf-run-"))
    proc = start_daemon(run_dir)
    try:
        yield run_dir
    finally:
        stop_daemon(proc)
        shutil.rmtree(run_dir, ignore_errors=True)


@pytest.fixture(params=["daemon", "fleet"])
def target(request):
    """The SDK pointed at a single daemon, or at the fleet, for one test; its RUN_TAG sandboxes end after it."""
    import os

    from hutch.sandbox import _client

    if request.param == "daemon":
        run_dir = request.getfixturevalue("single_daemon")
        saved = {k: os.environ.get(k) for k in ("HUTCH_RUN_DIR", "HUTCH_SOCKET", "HUTCH_URL", "HUTCH_TOKEN")}

        def point():
            os.environ.update(HUTCH_RUN_DIR=str(run_dir), HUTCH_SOCKET=str(run_dir / "hutch.sock"))
            os.environ.pop("HUTCH_URL", None)
            os.environ.pop("HUTCH_TOKEN", None)
            _client.connect(f"unix:{run_dir / 'hutch.sock'}")
        try:
            with Target("daemon", point) as t:
                yield t
        finally:
            restore_env(saved)
    else:
        fleet = request.getfixturevalue("ray_fleet")
        with Target("fleet", fleet.sdk, fleet) as t:
            yield t


@pytest.fixture(scope="module")
def image(fleet_busybox):
    return hutch.Image.from_directory(fleet_busybox)


@pytest.fixture
def make(target, fleet_busybox):
    """make(*command, **create_kwargs) -> a Sandbox of the busybox image tagged RUN_TAG, ended after the test."""
    with sandbox_maker(fleet_busybox, RUN_TAG) as make:
        yield make


def test_create_with_limits_exec_streams_and_ends_with_the_block(target, image):
    with hutch.Sandbox.create(image=image, timeout=120, memory="32M", cpu=0.5, pids=64, tags=RUN_TAG) as sb:
        assert sb.status == "running" and sb.reason is None
        p = sb.exec("sh", "-c", "echo first; read go; echo second")
        assert p.stdout.readline() == "first\n"
        assert p.poll() is None                                      # streamed while it runs (it waits for us)
        p.stdin.write("go\n")
        p.stdin.close()
        assert list(p.stdout) == ["second\n"]
        assert p.wait() == 0 and p.reason == "exited"
        r = sb.run(*HOG)                                             # the memory limit holds, the sandbox lives
        assert (r.returncode, r.reason) == (-9, "oom"), r
        with pytest.raises(hutch.OutOfMemoryError, match="32 MiB"):
            sb.run(*HOG, check=True)
        r = sb.run("sh", "-c", "for i in $(seq 80); do sleep 5 & done; wait", timeout=20)   # pids=64
        assert r.returncode != 0 and ("fork" in r.stderr.lower() or "resource" in r.stderr.lower()), r
        assert sb.run("echo", "alive", check=True).stdout == "alive\n"
        sid = sb.id
    assert sb.status == "terminated"
    assert sid not in {s.id for s in hutch.Sandbox.list(tags=RUN_TAG)}


def test_exec_stdin_bytes_env_workdir_exit_codes_and_kill(make):
    sb = make()
    p = sb.exec("cat")
    p.stdin.write("hello\n")
    assert p.stdout.readline() == "hello\n"      # answered while stdin is still open
    p.stdin.close()
    assert p.wait() == 0
    assert sb.run("cat", stdin="fed\n").stdout == "fed\n"
    r = sb.run("sh", "-c", "printf 'o\\377'; echo e >&2; exit 3", text=False)
    assert (r.stdout, r.stderr, r.returncode) == (b"o\xff", b"e\n", 3)
    with pytest.raises(hutch.ExecError) as ei:
        sb.run("sh", "-c", "echo out; echo boom >&2; exit 4", check=True)
    assert (ei.value.returncode, ei.value.stdout, ei.value.stderr) == (4, "out\n", "boom\n")
    assert sb.run("sh", "-c", 'echo "$A $PWD"', env={"A": "x"}, workdir="/tmp").stdout == "x /tmp\n"
    t0 = time.monotonic()
    p = sb.exec("sleep", "30", timeout=0.5)
    assert p.wait() != 0 and p.reason == "timeout" and time.monotonic() - t0 < 25   # hang guard: before sleep's end
    p = sb.exec("sleep", "30")
    time.sleep(0.2)
    p.kill()
    assert p.wait() != 0 and p.reason in ("killed", "signaled")
    r = sb.run("sh", "-c", "head -c 100000 /dev/zero | tr '\\0' y", max_output=1000)
    assert len(r.stdout) == 1000 and r.stdout_dropped == 99000 and r.truncated
    assert sb.poll() is None and sb.status == "running"


def test_files_read_write_list_stat_remove(make):
    f = make().files
    f.mkdir("/home/user/d/e", parents=True)
    f.write("/home/user/d/e/a.txt", "héllo")
    f.write("/home/user/d/run.sh", b"#!/bin/sh\necho ran\n", mode=0o755)
    assert f.read("/home/user/d/e/a.txt") == "héllo".encode()
    names = {e.name: e for e in f.list("/home/user/d")}
    assert set(names) == {"e", "run.sh"} and names["e"].type == "dir"
    st = f.stat("/home/user/d/run.sh")
    assert st.type == "file" and st.size == 19 and st.mode & 0o777 == 0o755
    big = bytes(range(256)) * 8192                      # 2 MiB, binary
    f.write("/tmp/big", big)
    assert f.read("/tmp/big") == big
    f.remove("/home/user/d/run.sh")
    with pytest.raises(hutch.NotFoundError):
        f.stat("/home/user/d/run.sh")
    f.remove("/home/user/d", recursive=True)
    assert [e.name for e in f.list("/home/user")] == []
    with pytest.raises(hutch.InvalidSpecError):
        f.read("relative/path")


def test_a_pty_exec(make):
    sb = make()
    t = sb.exec("sh", pty=(24, 80))
    t.write(b"echo $((6*7)); stty size\r")
    out = t.read_until(b"24 80", timeout=20)
    assert b"42" in out
    t.write(b"exit 5\r")
    assert t.wait() == 5


def test_list_by_tags_from_id_by_id_and_name(make):
    job = uuid.uuid4().hex[:8]
    name = f"conf-{job}"
    a = make(tags={"job": job, "role": "a"}, name=name)
    bs = [make(tags={"job": job, "role": "b"}) for _ in range(5)]
    assert [s.id for s in hutch.Sandbox.list(tags={**RUN_TAG, "job": job, "role": "a"})] == [a.id]
    assert sorted(s.id for s in hutch.Sandbox.list(tags={"job": job})) == sorted([a.id] + [b.id for b in bs])
    again = hutch.Sandbox.from_id(a.id)
    assert again.tags["role"] == "a" and again.run("echo", "hi").stdout == "hi\n"
    assert hutch.Sandbox.from_id(name).id == a.id
    assert hutch.Sandbox.from_id(bs[3].id).run("hostname").stdout.strip() == f"hutch-{bs[3].id}"
    for b in bs:
        b.terminate()
    assert [s.id for s in hutch.Sandbox.list(tags={"job": job})] == [a.id]


def test_a_filesystem_snapshot_starts_new_sandboxes(make):
    sb = make()
    sb.run("sh", "-c", "echo state > /home/user/progress.txt && rm /etc/passwd", check=True)
    snap = sb.snapshot_filesystem()
    assert isinstance(snap, hutch.Image)
    sb.terminate()
    # several, so that on a fleet some land on other nodes than the one that took the snapshot
    kids = [make(image=snap) for _ in range(4)]
    for k in kids:
        assert k.run("cat", "/home/user/progress.txt").stdout == "state\n"
        assert k.run("test", "-e", "/etc/passwd").returncode == 1       # a deletion is part of the snapshot


def test_network_policies_none_and_allow(make):
    closed = make()
    links = closed.run("cat", "/proc/net/dev").stdout
    assert [ln.split(":")[0].strip() for ln in links.splitlines()[2:]] == ["lo"], links   # Network.none()
    sb = make(network=hutch.Network.allow(domains=["api.example.test"]))
    links = sb.run("cat", "/proc/net/dev").stdout
    assert len(links.splitlines()[2:]) == 2, links                     # lo and its link to the gateway
    r = sb.run("nslookup", "refused.example.test", timeout=20)
    assert r.returncode != 0, r
    log = sb.network_log()
    assert any(d["name"] == "refused.example.test" and d["verdict"] == "deny" for d in log), log
    sb.set_network(hutch.Network.none())
    assert [ln.split(":")[0].strip() for ln in sb.run("cat", "/proc/net/dev").stdout.splitlines()[2:]] == ["lo"]


def test_terminate_status_reasons_and_the_errors_that_name_the_fix(make, image, tmp_path):
    sb = make("sh", "-c", "sleep 0.3; exit 7")
    assert sb.wait(timeout=30) == 7
    assert sb.status == "exited" and sb.returncode == 7
    sb = make()
    sb.terminate()
    sb.terminate()                                   # harmless twice
    assert sb.status == "terminated"
    with pytest.raises(hutch.StateError, match="Sandbox.create"):
        sb.exec("true")
    timed = make(timeout=1)
    deadline = time.monotonic() + GUARD
    while timed.status not in ENDED and time.monotonic() < deadline:
        time.sleep(0.2)
    assert timed.status == "timeout" and timed.reason == "timeout"
    before = {s.id for s in hutch.Sandbox.list(tags=RUN_TAG)}
    with pytest.raises(hutch.InvalidSpecError, match="memory='lots'"):
        hutch.Sandbox.create(image=image, memory="lots", tags=RUN_TAG)
    with pytest.raises(hutch.InvalidSpecError, match="does not exist"):
        hutch.Sandbox.create(image=image, mounts=[hutch.Mount.bind(tmp_path / "missing", "/data")], tags=RUN_TAG)
    with pytest.raises(hutch.NotFoundError, match="image 'no-such-image'"):
        hutch.Sandbox.create(image="no-such-image", tags=RUN_TAG)
    with pytest.raises(hutch.NotFoundError):
        hutch.Sandbox.from_id("no-such-sandbox")
    assert {s.id for s in hutch.Sandbox.list(tags=RUN_TAG)} == before   # nothing was half-made


def test_the_async_surface(target, image):
    async def main():
        sbs = [await hutch.AsyncSandbox.create(image=image, timeout=120, tags={**RUN_TAG, "t": "async"})
               for _ in range(3)]
        try:
            p = await sbs[0].exec("sh", "-c", "echo a; sleep 1; echo b")
            assert [line async for line in p.stdout] == ["a\n", "b\n"]
            assert await p.wait() == 0
            for sb in sbs:
                assert (await sb.run("hostname")).stdout.strip() == f"hutch-{sb.id}"
            await sbs[1].files.write("/tmp/x", b"async")
            assert await sbs[1].files.read("/tmp/x") == b"async"
            listed = await hutch.AsyncSandbox.list(tags={**RUN_TAG, "t": "async"})
            assert sorted(s.id for s in listed) == sorted(s.id for s in sbs)
            again = await hutch.AsyncSandbox.from_id(sbs[-1].id)
            assert (await again.run("echo", "x")).stdout == "x\n"
        finally:
            for sb in sbs:
                await sb.terminate()
        assert sbs[0].status == "terminated"

    asyncio.run(main())
