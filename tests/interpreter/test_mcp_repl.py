"""The code interpreter through MCP (the official client over stdio) and through `hutch repl` (a real process)."""

from __future__ import annotations

import base64
import os
import signal
import subprocess
import sys
import time

import anyio
from mcp import Client
from mcp.client.stdio import StdioServerParameters

import hutch

from test_run_code import png_size


def test_mcp_run_code_returns_text_and_charts_as_image_content(daemon, image):
    params = StdioServerParameters(command=sys.executable, args=["-m", "hutch", "mcp"],
                                   env={**daemon, "PATH": os.environ["PATH"]})

    async def main():
        async with Client(params) as client:
            tools = {t.name: t for t in (await client.list_tools()).tools}
            assert "run_code" in tools and tools["run_code"].annotations.open_world_hint is True
            r = await client.call_tool("run_code", {"code": "import pandas as pd\ns = pd.Series([1, 2, 3])\n"
                                                            "print('sum is', s.sum())"})
            assert not r.is_error and "sum is 6" in r.content[0].text
            sid = r.content[0].text.rsplit("[sandbox_id ", 1)[1].split(",")[0]
            r = await client.call_tool("run_code", {"code": "import matplotlib.pyplot as plt\n"
                                                            "plt.figure(figsize=(3, 2), dpi=100)\n"
                                                            "plt.plot(s); plt.show()\ns.mean()"})
            assert not r.is_error
            kinds = [c.type for c in r.content]
            assert kinds == ["text", "image"] and r.content[1].mime_type == "image/png"
            w, h = png_size(base64.b64decode(r.content[1].data))
            assert 0 < w <= 300 and 0 < h <= 200
            assert "2.0" in r.content[0].text
            r = await client.call_tool("run_code", {"code": "1/0", "sandbox_id": sid})
            assert not r.is_error and "Error: ZeroDivisionError: division by zero" in r.content[0].text
            r = await client.call_tool("run_code", {"code": "s.sum()", "id": sid})   # the same interpreter
            assert "6" in r.content[0].text
            r = await client.call_tool("run_code", {"code": "1", "sandbox_id": "0123456789ab"})
            assert r.is_error and "not a sandbox of this MCP server" in r.content[0].text
            return sid

    sid = anyio.run(main)
    deadline = time.monotonic() + 20   # the server's sandboxes end with it
    while time.monotonic() < deadline and hutch.Sandbox.from_id(sid).status == "running":
        time.sleep(0.1)
    assert hutch.Sandbox.from_id(sid).status != "running"


def _repl(daemon, *args):
    return subprocess.Popen([sys.executable, "-m", "hutch", "repl", *args], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **daemon}, start_new_session=True)


def test_repl_runs_cells_keeps_state_and_ends_its_sandbox(daemon, image, tmp_path):
    p = _repl(daemon, "--image", image.ref, "--images", str(tmp_path))
    out, err = p.communicate("x = 2\nfor i in range(2):\n    print(i)\n\nprint(x * 21)\n"
                             "import matplotlib.pyplot as plt\nplt.plot([1, 2]); plt.show()\n1/0\n'end'\n",
                             timeout=120)
    assert p.returncode == 0, err
    lines = out.splitlines()
    assert lines[:3] == ["0", "1", "42"] and lines[-1] == "'end'", out
    assert "[image/png" in out and (tmp_path / "hutch-repl-1.png").read_bytes().startswith(b"\x89PNG")
    assert "ZeroDivisionError" in err
    running = [s for s in hutch.Sandbox.list() if s.status == "running" and s.info.get("spec", {}).get("image")
               == image.ref]
    assert not running, "the repl's sandbox outlived it"


def test_repl_ctrl_c_interrupts_the_cell_and_the_session_goes_on(daemon, image):
    p = _repl(daemon, "--image", image.ref)
    try:
        p.stdin.write("kept = 7\nprint('go', flush=True)\nwhile True: pass\n")
        p.stdin.flush()
        assert p.stdout.readline() == "go\n"
        time.sleep(1.0)
        os.killpg(p.pid, signal.SIGINT)   # Ctrl-C reaches the terminal's foreground process group
        out, err = p.communicate("print(kept * 6)\n", timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 0, err
    assert "KeyboardInterrupt" in err and out.splitlines()[-1] == "42", (out, err)
