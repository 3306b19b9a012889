"""Sandbox.run_code against real sandboxes of the code-interpreter image: a real ipykernel in each."""

from __future__ import annotations

import struct
import threading
import time
import zlib

import pytest

import hutch
from hutch.sandbox.interpreter import CELL_STREAM


def png_size(data: bytes) -> tuple[int, int]:
    """Width and height of a PNG, after checking it decodes: the signature, every chunk's CRC, the IDAT
    stream inflating to height rows of the declared width (stdlib only)."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", data[:8]
    pos, idat, ihdr = 8, b"", None
    while pos < len(data):
        (n,) = struct.unpack(">I", data[pos:pos + 4])
        kind, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + n]
        (crc,) = struct.unpack(">I", data[pos + 8 + n:pos + 12 + n])
        assert zlib.crc32(kind + body) == crc, kind
        if kind == b"IHDR":
            ihdr = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat += body
        pos += 12 + n
        if kind == b"IEND":
            break
    w, h, depth, color = ihdr[:4]
    channels = {0: 1, 2: 3, 3: 1, 4: 2, 6: 4}[color]
    raw = zlib.decompress(idat)
    assert len(raw) == h * (1 + w * channels * depth // 8)
    return w, h


def test_state_persists_and_values_come_back_as_text(sb):
    ex = sb.run_code("import pandas as pd; df = pd.DataFrame({'x': range(5)})")
    assert ex.error is None and ex.text is None and ex.execution_count == 1
    ex = sb.run_code("df['x'].sum()")
    assert ex.text == "10" and ex.execution_count == 2 and not ex.restarted
    ex = sb.run_code("print('hi'); df.shape")
    assert ex.logs.stdout == ["hi\n"] and ex.text == "(5, 1)"
    ex = sb.run_code("df")
    assert ex.results[0].is_main_result and "html" in ex.results[0].formats() and "<table" in ex.results[0].html


def test_a_chart_comes_back_as_a_png_of_the_expected_size(sb):
    ex = sb.run_code("%config InlineBackend.print_figure_kwargs = {'bbox_inches': None}\n"
                     "import matplotlib.pyplot as plt\n"
                     "fig = plt.figure(figsize=(4, 3), dpi=100); plt.plot([1, 3, 2]); plt.show()")
    assert ex.error is None, ex.error
    (r,) = ex.results
    assert r.formats() == ["png", "text"] and not r.is_main_result
    assert png_size(r.png) == (400, 300)
    ex = sb.run_code("plt.figure(figsize=(2, 1), dpi=50); plt.plot([1])")   # left at the end of the cell: shown too
    assert [png_size(x.png) for x in ex.results if x.png] == [(100, 50)]


def test_an_error_is_a_result_not_an_exception(sb):
    ex = sb.run_code("x = 1\n1/0")
    assert ex.error.name == "ZeroDivisionError" and ex.error.value == "division by zero"
    assert "----> 2 1/0" in ex.error.traceback and "\x1b[" not in ex.error.traceback   # plain text, no colours
    assert sb.run_code("x").text == "1"


def test_an_infinite_loop_is_interrupted_by_timeout_and_state_survives(sb):
    sb.run_code("kept = [1, 2, 3]")
    t = time.monotonic()
    ex = sb.run_code("while True: pass", timeout=2)
    took = time.monotonic() - t
    assert ex.error.name == "TimeoutError" and "timeout=2" in ex.error.value, ex.error
    assert "KeyboardInterrupt" in ex.error.traceback
    assert took > 1.9, took   # not before the timeout; and well before a wedged bridge's kill (+18 s), under load too
    assert took < 60, took
    ex = sb.run_code("sum(kept)")
    assert ex.text == "6" and not ex.restarted


def test_a_cell_that_ignores_the_interrupt_loses_its_kernel_and_says_so(sb):
    sb.run_code("kept = 1")
    # the timeout counts from the request to the kernel: it must outlast the kernel's start of the cell on a
    # loaded machine, or the interrupt lands before the cell ignores it (a KeyboardInterrupt, the kernel kept)
    ex = sb.run_code("import signal, time\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\nprint('ignoring', flush=True)\n"
                     "while True: time.sleep(0.1)", timeout=4)
    assert "".join(ex.logs.stdout) == "ignoring\n", ex   # the interrupt came after the cell ignored it
    assert ex.error.name == "TimeoutError" and "restarted" in ex.error.value, ex.error
    ex = sb.run_code("kept")
    assert ex.restarted and ex.error.name == "NameError"


def test_a_kernel_crash_is_reported_and_the_next_call_has_a_fresh_kernel(sb):
    sb.run_code("lost = 1")
    ex = sb.run_code("import os; os._exit(1)")
    assert ex.error.name == "KernelDied" and "exited with code 1" in ex.error.value and "lost" in ex.error.value
    ex = sb.run_code("lost")
    assert ex.restarted and ex.error.name == "NameError"
    ex = sb.run_code("2 + 2")
    assert ex.text == "4" and not ex.restarted and ex.execution_count == 2


def test_a_kernel_killed_for_memory_is_reported(make):
    sb = make(memory="300M")
    ex = sb.run_code("b = bytearray(1 << 30)")
    assert ex.error.name in ("KernelDied", "MemoryError"), ex.error
    if ex.error.name == "KernelDied":
        assert "SIGKILL" in ex.error.value and "memory" in ex.error.value
    assert sb.run_code("1 + 1").text == "2"


def test_the_bridge_killed_from_a_cell_is_reported_and_replaced(sb):
    sb.run_code("v = 1")
    ex = sb.run_code("import os, signal; os.kill(os.getppid(), signal.SIGKILL)")
    assert ex.error.name == "KernelDied", ex.error
    ex = sb.run_code("v")
    assert ex.restarted and ex.error.name == "NameError"
    assert sb.run_code("'back'").text == "'back'"


def test_stdout_streams_before_the_cell_ends(sb):
    """The cell cannot end before this side has seen its first line: it waits for a file the on_stdout callback
    writes on seeing it (a cell whose output came only at its end would wait out its 120 s guard and say False)."""
    got = []

    def on_stdout(c):
        got.append(c)
        if c == "first\n":
            sb.files.write("/tmp/seen-first", b"")

    ex = sb.run_code("import os, sys, time\nprint('first', flush=True)\n"
                     "sys.stderr.write('warn\\n'); sys.stderr.flush()\n"
                     "deadline = time.monotonic() + 120\n"
                     "while not os.path.exists('/tmp/seen-first') and time.monotonic() < deadline:\n"
                     "    time.sleep(0.02)\n"
                     "print('second', os.path.exists('/tmp/seen-first'))", on_stdout=on_stdout,
                     on_stderr=got.append, timeout=240)
    assert got == ["first\n", "warn\n", "second True\n"], got
    assert ex.logs.stdout == ["first\n", "second True\n"] and ex.logs.stderr == ["warn\n"]


def test_results_and_errors_reach_their_callbacks(sb):
    results, errors = [], []
    ex = sb.run_code("import matplotlib.pyplot as plt\nplt.plot([1]); plt.show()\nraise ValueError('bad')",
                     on_result=results.append, on_error=errors.append)
    assert results == ex.results and results[0].png and errors == [ex.error] and ex.error.value == "bad"


def test_what_a_cell_sends_back_is_bounded_and_says_what_was_cut(sb):
    ex = sb.run_code("print('x' * (3 << 20))\n'y' * (20 << 20)")
    out = "".join(ex.logs.stdout)
    assert len(out) == CELL_STREAM and ex.dropped["stdout"] == (3 << 20) + 1 - CELL_STREAM
    assert ex.truncated and ex.dropped["results"] > 0
    assert len(ex.text or "") <= 4096
    assert sb.run_code("'still here'").text == "'still here'"


def test_contexts_are_independent_kernels_with_their_own_directory(sb):
    ctx = sb.create_code_context(cwd="/srv/analysis")
    assert isinstance(ctx, hutch.CodeContext) and ctx.cwd == "/srv/analysis"
    sb.run_code("x = 'in ctx'", context=ctx)
    sb.run_code("x = 'default'")
    assert sb.run_code("x", context=ctx).text == "'in ctx'"
    assert sb.run_code("x", context=ctx.id).text == "'in ctx'"
    assert sb.run_code("import os; os.getcwd()", context=ctx).text == "'/srv/analysis'"
    assert sb.run_code("x").text == "'default'"
    assert [c.id for c in sb.list_code_contexts()] == ["default", ctx.id]
    sb.remove_code_context(ctx)
    assert [c.id for c in sb.list_code_contexts()] == ["default"]
    with pytest.raises(hutch.NotFoundError, match="create_code_context"):
        sb.run_code("x", context=ctx)


def test_contexts_run_at_the_same_time(sb):
    """Each context's cell marks that it runs, then waits for the other's mark: both can see the other's only
    if they run at once (one after the other, the first waits out its 120 s guard and says False). No wall-time
    bound: on a loaded machine the two kernels' start alone may take longer than any such bound."""
    a = sb.create_code_context()
    out = {}
    cell = ("import os, time\n"
            "open('/tmp/ctx-{me}', 'w').close()\n"
            "deadline = time.monotonic() + 120\n"
            "while not os.path.exists('/tmp/ctx-{other}') and time.monotonic() < deadline:\n"
            "    time.sleep(0.02)\n"
            "os.path.exists('/tmp/ctx-{other}')")

    def both(name, other, ctx):
        out[name] = sb.run_code(cell.format(me=name, other=other), context=ctx, timeout=240).text

    threads = [threading.Thread(target=both, args=(n, o, c)) for n, o, c in (("a", "default", a),
                                                                           ("default", "a", None))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert out == {"a": "True", "default": "True"}, f"the two contexts' cells ran one after the other: {out}"


def test_bad_input_gets_a_clear_error(sb):
    with pytest.raises(hutch.ConfigError, match="code must be a str"):
        sb.run_code(b"1 + 1")
    with pytest.raises(hutch.ConfigError, match="code must be a str"):
        sb.run_code(None)
    for t in (0, -1, "5", True, float("nan")):
        with pytest.raises(hutch.ConfigError, match="positive number of seconds"):
            sb.run_code("1", timeout=t)
    with pytest.raises(hutch.NotFoundError, match="no code context 'nope'"):
        sb.run_code("1", context="nope")
    with pytest.raises(hutch.ConfigError, match="CodeContext"):
        sb.run_code("1", context=42)
    with pytest.raises(hutch.ConfigError, match="callable"):
        sb.run_code("1", on_stdout="print")
    with pytest.raises(hutch.ConfigError, match="not supported"):
        sb.create_code_context(language="r")
    with pytest.raises(hutch.InvalidSpecError, match="absolute path"):
        sb.create_code_context(cwd="relative/dir")
    with pytest.raises(hutch.ConfigError, match="default code context cannot be removed"):
        sb.remove_code_context("default")
    assert sb.run_code("'fine'").text == "'fine'"


def test_an_image_without_the_interpreter_says_how_to_get_one(make):
    sb = make(image=hutch.Image.debian_slim())
    with pytest.raises(hutch.ImageError, match=r"Image\.code_interpreter\(\)"):
        sb.run_code("1")


def test_run_code_on_an_ended_sandbox_is_a_state_error(make):
    sb = make()
    sb.run_code("1")
    sb.terminate()
    with pytest.raises(hutch.StateError, match="has ended"):
        sb.run_code("1")


def test_the_interpreter_runs_as_the_sandboxs_unprivileged_user(sb):
    assert sb.run_code("import os; (os.getresuid(), os.getresgid(), os.getcwd())").text == \
        "((1000, 1000, 1000), (1000, 1000, 1000), '/home/user')"
    ex = sb.run_code("open('/etc/planted', 'w')")
    assert ex.error.name == "PermissionError"
    # the bridge (the kernel's parent, the same user) is not dumpable: its protocol pipe cannot be reached
    ex = sb.run_code("import os; open(f'/proc/{os.getppid()}/fd/1', 'w')")
    assert ex.error.name == "PermissionError", ex.error
    assert sb.run("id", "-u").stdout == "0\n"   # exec stays root's unless told


def test_without_a_user_namespace_the_interpreter_runs_as_the_sandboxs_root(image, tmp_path):
    from hutch_testing import sdk_pointed_at, start_daemon, stop_daemon

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    proc = None
    with sdk_pointed_at(run_dir):
        try:
            proc = start_daemon(run_dir, extra_env={"HUTCH_USERNS": "0"})
            with hutch.Sandbox.create(image=image, timeout=120) as sb:
                with pytest.raises(hutch.ConfigError, match="host's uid 1000"):
                    sb.run("id", user="user")
                assert sb.run_code("import os; os.getuid()").text == "0"
                assert sb.run_code("6 * 7").text == "42"
        finally:
            if proc is not None:
                stop_daemon(proc)
