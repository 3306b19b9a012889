"""AsyncSandbox.run_code, the sandbox pools, and what is left when a client dies mid-cell (nothing)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import hutch

from interp_support import RUN_TAG


def test_async_sandbox_has_the_same_surface(image):
    async def main():
        sb = await hutch.AsyncSandbox.create(image=image, timeout=180, tags=RUN_TAG)
        async with sb:
            seen = []

            async def on_stdout(chunk):   # a coroutine callback is awaited
                seen.append(chunk)

            ex = await sb.run_code("import time\nprint('a', flush=True)\nx = 41", on_stdout=on_stdout)
            assert ex.error is None and seen == ["a\n"]
            assert (await sb.run_code("x + 1")).text == "42"
            ex = await sb.run_code("import matplotlib.pyplot as plt\nplt.plot([1, 2]); plt.show()")
            assert ex.results[0].png.startswith(b"\x89PNG")
            ex = await sb.run_code("1/0")
            assert ex.error.name == "ZeroDivisionError"
            ex = await sb.run_code("while True: pass", timeout=1)
            assert ex.error.name == "TimeoutError"
            assert (await sb.run_code("x")).text == "41"
            ctx = await sb.create_code_context(cwd="/tmp/c")
            await sb.run_code("x = 'c'", context=ctx)
            both = await asyncio.gather(sb.run_code("x", context=ctx), sb.run_code("x"))
            assert [e.text for e in both] == ["'c'", "41"]
            assert [c.id for c in await sb.list_code_contexts()] == ["default", ctx.id]
            await sb.remove_code_context(ctx)
            ex = await sb.run_code("import os; os._exit(3)")
            assert ex.error.name == "KernelDied"
            assert (await sb.run_code("1")).restarted
            with pytest.raises(hutch.ConfigError):
                await sb.run_code(3)
            # a caller that gives up interrupts the cell: the next one runs at once
            task = asyncio.ensure_future(sb.run_code("import time; time.sleep(30)"))
            await asyncio.sleep(1.5)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            t = time.monotonic()
            assert (await sb.run_code("'next'", timeout=20)).text == "'next'"
            assert time.monotonic() - t < 10

    asyncio.run(main())


def test_the_pool_hands_out_a_sandbox_whose_interpreter_is_up(image):
    with hutch.SandboxPool(size=2, image=image, timeout=180, tags=RUN_TAG) as pool:
        deadline = time.monotonic() + 120
        while pool.available < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert pool.available == 2
        sb = pool.create()
        ex = sb.run_code("1 + 1")
        with sb:
            assert ex.text == "2" and ex.error is None
            # its interpreter was up before it was handed out: the pool's warm-up cell ran in this same kernel
            # (a kernel started by this cell would count it 1, a restarted one would say so). How long the first
            # result takes is bench/interpreter.py's figure ("a sandbox from hutch.SandboxPool").
            assert ex.execution_count == 2 and not ex.restarted, (ex.execution_count, ex.restarted)
            ids = [s.id for s in hutch.Sandbox.list(tags=RUN_TAG) if s.status == "running"]
            assert sb.id in ids
        deadline = time.monotonic() + 120   # the pool makes another
        while pool.available < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert pool.available == 2
        pooled = [s.id for s in hutch.Sandbox.list(tags=RUN_TAG) if s.status == "running"]
    after = [s.id for s in hutch.Sandbox.list(tags=RUN_TAG) if s.status == "running"]
    assert pooled and not set(pooled) & set(after), "close() left pooled sandboxes running"


def test_the_pool_refuses_what_it_cannot_keep(image):
    with pytest.raises(hutch.ConfigError, match="detach"):
        hutch.SandboxPool(size=1, image=image, detach=True)
    with pytest.raises(hutch.ConfigError, match="size"):
        hutch.SandboxPool(size=0, image=image)


def test_async_pool(image):
    async def main():
        async with hutch.AsyncSandboxPool(size=1, image=image, timeout=180, tags=RUN_TAG) as pool:
            deadline = time.monotonic() + 120
            while pool.available < 1 and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            assert pool.available == 1
            sb = await pool.create()
            async with sb:
                assert (await sb.run_code("2 * 21")).text == "42"

    asyncio.run(main())


CLIENT = textwrap.dedent("""
    import sys, hutch
    mode = sys.argv[2]
    if mode == "cell":
        sb = hutch.Sandbox.create(image=sys.argv[1], timeout=300, tags={"suite": sys.argv[3]})
        sb.run_code("x = 1")
        print(sb.id, flush=True)
        sb.run_code("import time; time.sleep(600)")
    else:
        pool = hutch.SandboxPool(size=2, image=sys.argv[1], timeout=300, tags={"suite": sys.argv[3]})
        sb = pool.create()
        print(sb.id, flush=True)
        sb.run_code("import time; time.sleep(600)")
""")


def _processes_in(sandbox_id: str) -> list[int]:
    """Host pids whose cgroup names the sandbox (its init, bridge, kernels ...)."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if f"/{sandbox_id}" in (d / "cgroup").read_text():
                    out.append(int(d.name))
            except OSError:
                pass
    return out


@pytest.mark.parametrize("mode", ["cell", "pool"])
def test_a_client_killed_mid_cell_leaves_nothing(image, daemon, mode):
    tag = f"{RUN_TAG['suite']}-kill-{mode}"
    p = subprocess.Popen([sys.executable, "-c", CLIENT, image.ref, mode, tag], stdout=subprocess.PIPE,
                         env={**os.environ, **daemon}, text=True)
    try:
        sid = p.stdout.readline().strip()
        assert sid, "the client did not start its sandbox"
        time.sleep(1.0)   # the cell is running now
        running = [s for s in hutch.Sandbox.list(tags={"suite": tag}) if s.status == "running"]
        assert sid in [s.id for s in running] and _processes_in(sid)
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
        p.stdout.close()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and (
            any(s.status == "running" for s in hutch.Sandbox.list(tags={"suite": tag})) or _processes_in(sid)):
        time.sleep(0.1)
    assert not [s.id for s in hutch.Sandbox.list(tags={"suite": tag}) if s.status == "running"]
    assert _processes_in(sid) == [], "processes of the sandbox (its kernel?) outlived it"
