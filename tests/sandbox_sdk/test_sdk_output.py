"""Output is flow-controlled end to end and what run() collects is capped (real daemon, real sandboxes).

A handle keeps at most OUTPUT_BUFFER unread bytes per stream and the daemon a bounded window, so a
command whose output nobody reads blocks in its pipe instead of filling the host's memory; run() keeps
max_output bytes per stream, drains the rest while the command runs on, and says how much it dropped.
"""

from __future__ import annotations

import asyncio
import gc
import hashlib
import json
import subprocess
import sys
import time

import pytest

import hutch
from hutch.sandbox._client import default_client
from hutch.sandbox._api import DEFAULT_MAX_OUTPUT, OUTPUT_BUFFER
from hutch_testing import sdk_pointed_at, start_daemon, stop_daemon
from sdk_support import RUN_TAG, blocked_writer_then_kill, slow_read_of_random_bytes

MB = 1 << 20

_WAITER = """
import asyncio, json, sys
import hutch
root, tag, mode = sys.argv[1:4]
kw = dict(image=hutch.Image.from_directory(root), tags={"suite": tag}, timeout=120)
if mode == "sync":
    with hutch.Sandbox.create(**kw) as sb:
        p = sb.exec("cat", "/dev/zero", timeout=6, text=False)
        print("ready", flush=True)
        rc = p.wait()                    # never reads: the command must block, not this process grow
        print(json.dumps([rc, p.reason]), flush=True)
else:
    async def main():
        async with await hutch.AsyncSandbox.create(**kw) as sb:
            p = await sb.exec("cat", "/dev/zero", timeout=6, text=False)
            print("ready", flush=True)
            rc = await p.wait()
            print(json.dumps([rc, p.reason]), flush=True)
    asyncio.run(main())
"""


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for {pid}")


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_host_that_only_waits_on_a_flood_stays_small(daemon, busybox_root, mode):
    """`cat /dev/zero` and a host that only calls wait(): neither it nor the daemon grows; wait() still
    returns when the exec's timeout ends the blocked command."""
    daemon_pid = default_client().json("GET", "/v1/health")["pid"]
    child = subprocess.Popen([sys.executable, "-c", _WAITER, str(busybox_root), RUN_TAG["suite"], mode],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline() == "ready\n", child.stderr.read()
        base, dbase = _rss_mb(child.pid), _rss_mb(daemon_pid)
        deadline = time.monotonic() + 4
        while time.monotonic() < deadline:   # fails at the first sample past the bound (the old SDK grew 300 MB/s)
            grew, dgrew = _rss_mb(child.pid) - base, _rss_mb(daemon_pid) - dbase
            assert grew < 100, f"the host process grew by {grew:.0f} MB while only waiting"
            assert dgrew < 100, f"the daemon grew by {dgrew:.0f} MB"
            time.sleep(0.1)
        out, err = child.communicate(timeout=30)
        assert json.loads(out) == [-9, "timeout"], err
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def test_run_caps_what_it_collects_and_reports_the_rest(sb):
    r = sb.run("sh", "-c", "head -c 50000000 /dev/zero | tr '\\0' x; echo end >&2; echo done > /tmp/finished")
    assert r.returncode == 0 and r.stderr == "end\n"
    assert r.stdout == "x" * DEFAULT_MAX_OUTPUT
    assert (r.stdout_dropped, r.stderr_dropped, r.truncated) == (50_000_000 - DEFAULT_MAX_OUTPUT, 0, True)
    assert sb.files.read("/tmp/finished") == b"done\n"   # returned once the command had run to its end

    r = sb.run("sh", "-c", "head -c 3000 /dev/zero; echo oops >&2; exit 4", max_output=1000, text=False)
    assert (r.stdout, r.stdout_dropped, r.stderr, r.stderr_dropped) == (b"\0" * 1000, 2000, b"oops\n", 0)
    with pytest.raises(hutch.ExecError) as ei:
        sb.run("sh", "-c", "seq 1 100000; exit 3", max_output=10, check=True)
    e = ei.value
    assert (e.returncode, e.stdout, e.truncated, e.stdout_dropped) == (3, "1\n2\n3\n4\n5\n", True, 588885)
    assert "truncated" in str(e)

    r = sb.run("sh", "-c", "head -c 6000000 /dev/zero", max_output=None, text=False)   # None keeps everything
    assert len(r.stdout) == 6_000_000 and not r.truncated
    assert not sb.run("echo", "hi").truncated


@pytest.mark.parametrize("bad", [0, -1, True, 1.5, "4M"])
def test_max_output_is_validated(sb, bad):
    with pytest.raises(hutch.InvalidSpecError, match="max_output=.*positive number of bytes.*None"):
        sb.run("true", max_output=bad)


def test_a_slow_reader_gets_every_byte_in_order(sb):
    slow_read_of_random_bytes(sb)


def test_unread_output_blocks_the_command_and_wait_sees_it_killed(sb):
    blocked_writer_then_kill(sb)


def test_a_line_longer_than_the_buffer_comes_in_pieces(sb):
    p = sb.exec("sh", "-c", "head -c 7000000 /dev/zero | tr '\\0' x; echo; echo next", text=False)
    pieces = []
    while (piece := p.stdout.readline()) != b"next\n":
        assert piece, "the stream ended early"
        pieces.append(piece)
    assert len(pieces) >= 2 and max(map(len, pieces)) < OUTPUT_BUFFER + 2 * MB   # never all 7 MB at once
    assert b"".join(pieces) == b"x" * 7_000_000 + b"\n" and p.wait() == 0


def test_a_discarded_stream_goes_to_dev_null(sb):
    p = sb.exec("sh", "-c", "exec 3>&1; readlink /proc/self/fd/3 >&2; head -c 50000000 /dev/zero; echo err >&2", stdout=False)
    assert p.wait() == 0    # nothing to read on stdout, so nothing holds the command back
    assert (p.stdout.read(), p.stderr.read()) == ("", "/dev/null\nerr\n")
    q = sb.exec("sh", "-c", "head -c 30000000 /dev/zero >&2; echo out", stderr=False)
    assert q.stdout.read() == "out\n" and q.wait() == 0    # reading stdout alone: stderr cannot fill up
    with pytest.raises(hutch.InvalidSpecError, match="stdout="):
        sb.exec("true", stdout="discard")


def test_async_sandbox_flow_control_and_cap(daemon, busybox_root):
    async def main():
        sb = await hutch.AsyncSandbox.create(image=hutch.Image.from_directory(busybox_root), tags=RUN_TAG)
        async with sb:
            r = await sb.run("sh", "-c", "head -c 50000000 /dev/zero; echo end >&2", text=False)
            assert (len(r.stdout), r.stdout_dropped, r.stderr) == (DEFAULT_MAX_OUTPUT, 50_000_000 - DEFAULT_MAX_OUTPUT,
                                                                    b"end\n")
            with pytest.raises(hutch.InvalidSpecError, match="max_output"):
                await sb.run("true", max_output=0)

            p = await sb.exec("sh", "-c", "head -c 20000000 /dev/urandom | tee /tmp/data", text=False)
            first = await p.stdout.readline()
            await asyncio.sleep(1.0)
            size = int((await sb.run("stat", "-c", "%s", "/tmp/data")).stdout)
            assert size < 12 * MB, f"the command wrote {size} bytes while the reader slept: nothing held it back"
            digest = hashlib.sha256(first)
            n = len(first)
            while chunk := await p.stdout.readline():
                digest.update(chunk)
                n += len(chunk)
                if n % (4 * MB) < len(chunk):
                    await asyncio.sleep(0.05)
            assert await p.wait() == 0 and n == 20_000_000
            want = (await sb.run("sha256sum", "/tmp/data")).stdout.split()[0]
            assert digest.hexdigest() == want

            q = await sb.exec("cat", "/dev/zero", text=False)
            await asyncio.sleep(0.5)
            await q.kill()
            assert await asyncio.wait_for(q.wait(), 10) == -9 and q.reason == "killed"

    asyncio.run(main())


def _running(sb, name: str) -> bool:
    return name in sb.run("ps", "-o", "comm").stdout.split()


def test_a_dropped_handle_hangs_up_once_its_output_fills_up(sb):
    """Nobody can read a dropped handle's output: once it fills the buffer the SDK closes the stream, as a
    closed pipe would, and the daemon ends the command instead of it blocking (or the host buffering) forever."""
    p = sb.exec("sh", "-c", "while :; do head -c 100000 /dev/zero; sleep 0.01; done")
    time.sleep(0.3)
    assert _running(sb, "sh")
    del p
    gc.collect()
    deadline = time.monotonic() + 10
    while _running(sb, "sh"):
        assert time.monotonic() < deadline, "the command of a dropped handle still runs after 10 s"
        time.sleep(0.2)
    assert sb.run("true").returncode == 0   # the sandbox itself lives on


def test_the_daemon_stops_promptly_while_a_client_holds_unread_output(busybox_root, tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    with sdk_pointed_at(run_dir):
        proc = start_daemon(run_dir)
        try:
            sb = hutch.Sandbox.create(image=hutch.Image.from_directory(busybox_root), tags=RUN_TAG, timeout=60)
            p = sb.exec("cat", "/dev/zero", text=False)
            time.sleep(0.5)
            t0 = time.monotonic()
            stop_daemon(proc, timeout=90)
            # waiting on the client, the daemon would end only at aiohttp's 60 s shutdown timeout: 40 s is well
            # below that and well above a stop on a loaded 2-core machine (12.7 s seen at load 55)
            took = time.monotonic() - t0
            assert proc.returncode == 0 and took < 40, f"the daemon waited on a client that never reads ({took:.1f} s)"
            del p
            gc.collect()
        finally:
            stop_daemon(proc)
