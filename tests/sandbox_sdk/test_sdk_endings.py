"""Why a command or a sandbox ended, said by the SDK (reason, the exported errors) and the CLI (one line,
documented exit codes); `status` as the daemon has it when read. Real daemon, real sandboxes."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import pytest

import hutch
from sdk_support import RUN_TAG

HOG = ("python3", "-c", "x = bytearray(300 << 20)")   # 300 MiB, far above 64M


def hutch_cli(*args, **kw):
    return subprocess.run([sys.executable, "-m", "hutch", *args], capture_output=True, text=True, timeout=120,
                          stdin=subprocess.DEVNULL, **kw)


def test_out_of_memory_is_said_and_raised(daemon):
    with hutch.Sandbox.create(memory="64M", timeout=120, tags=RUN_TAG) as sb:
        p = sb.exec(*HOG)
        assert p.wait() == -9 and p.reason == "oom"
        r = sb.run(*HOG)
        assert (r.returncode, r.reason) == (-9, "oom")
        with pytest.raises(hutch.OutOfMemoryError) as ei:
            sb.run(*HOG, check=True)
        e = ei.value
        assert isinstance(e, hutch.ExecError) and (e.returncode, e.reason, e.sandbox_id) == (-9, "oom", sb.id)
        assert "out of memory" in str(e) and "64 MiB" in str(e) and e.argv == HOG
        assert sb.status == "running" and sb.reason is None   # the command died, not the sandbox
    # a sandbox whose main process is killed at the limit ends with that reason
    sb = hutch.Sandbox.create(*HOG, memory="64M", timeout=120, tags=RUN_TAG)
    try:
        assert sb.wait(60) == -9 and sb.status == "oom" and sb.reason == "oom"
    finally:
        sb.terminate()


def test_timeouts_are_said_and_raised(daemon, make_sandbox):
    sb = make_sandbox()
    with pytest.raises(hutch.SandboxTimeout) as ei:
        sb.run("sleep", "30", timeout=0.5, check=True)
    assert ei.value.reason == "timeout" and "ran past its timeout" in str(ei.value)
    # the sandbox's own timeout ends the command it runs
    sb = make_sandbox(timeout=1.5)
    with pytest.raises(hutch.SandboxTimeout) as ei:
        sb.run("sleep", "30", check=True)
    e = ei.value
    assert (e.reason, e.sandbox_status) == ("sandbox_ended", "timeout") and "timeout of 1.5 s" in str(e)
    assert sb.reason == "timeout"
    with pytest.raises(hutch.StateError, match="ran past its timeout"):
        sb.run("true")
    # a plain non-zero exit stays an ExecError of reason "exited"
    with pytest.raises(hutch.ExecError) as ei:
        make_sandbox().run("sh", "-c", "exit 3", check=True)
    assert type(ei.value) is hutch.ExecError and (ei.value.returncode, ei.value.reason) == (3, "exited")


def test_status_is_the_daemons_when_read(daemon, make_sandbox):
    sb = make_sandbox(timeout=1)
    assert sb.status == "running" and sb.reason is None
    time.sleep(1.6)
    assert sb.status == "timeout" and sb.reason == "timeout"   # no poll() or wait() needed
    other = hutch.Sandbox.from_id(make_sandbox(idle_timeout=0.5).id)
    time.sleep(1.2)
    assert other.status == "idle_timeout"
    quick = make_sandbox("sh", "-c", "exit 4")
    deadline = time.monotonic() + 10
    while quick.status not in ("exited",) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert (quick.status, quick.returncode, quick.reason) == ("exited", 4, "exited")

    async def aio():
        asb = await hutch.AsyncSandbox.create(image=sb.info["spec"]["image"], timeout=1, tags=RUN_TAG)
        try:
            first = asb.status
            await asyncio.sleep(1.6)
            return first, asb.status, asb.reason
        finally:
            await asb.terminate()
    assert asyncio.run(aio()) == ("running", "timeout", "timeout")


def test_the_cli_says_why_in_one_line_with_documented_exit_codes(daemon, busybox_root):
    r = hutch_cli("run", "--memory", "64M", "--", *HOG)
    assert r.returncode == 137, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "out of memory" in lines[0] and "--memory" in lines[0], r.stderr
    r = hutch_cli("run", "--image", str(busybox_root), "--timeout", "1.5", "--", "sleep", "30")
    assert r.returncode == 124 and r.stderr.strip().splitlines() == [
        "hutch: the command was killed because the sandbox ran past its timeout of 1.5 s and was ended; "
        "give it a longer timeout (timeout=, --timeout)."], r.stderr
    r = hutch_cli("run", "--image", str(busybox_root), "--", "sh", "-c", "kill -TERM $$")
    assert r.returncode == 128 + 15 and r.stderr == "hutch: the command was killed by signal 15 (SIGTERM).\n"
    r = hutch_cli("run", "--image", str(busybox_root), "--", "sh", "-c", "echo out; exit 3")
    assert (r.returncode, r.stdout, r.stderr) == (3, "out\n", "")   # a command that exited: no line
    sid = hutch_cli("sandbox", "create", "--detach", "--image", str(busybox_root), "--tag",
                    f"suite={RUN_TAG['suite']}").stdout.strip()
    try:
        r = hutch_cli("sandbox", "exec", "--timeout", "0.5", sid, "--", "sleep", "30")
        assert r.returncode == 124 and "ran past its timeout and was killed" in r.stderr, r.stderr
    finally:
        hutch.Sandbox.from_id(sid).terminate()
    r = hutch_cli("sandbox", "create", "--image", str(busybox_root), "--idle-timeout", "0.5",
                  "--tag", f"suite={RUN_TAG['suite']}")
    assert r.returncode == 124 and "idle for 0.5 s" in r.stderr, r.stderr
