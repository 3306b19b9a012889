"""The README's first sandbox examples run as written against a real daemon (README drift fails here)."""

from __future__ import annotations

import subprocess
import sys

from readme_examples import examples, workdir


def run(code: str, cwd) -> subprocess.CompletedProcess:
    # a process of its own: its sandboxes end with it, as the README's reader's do
    r = subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return r


def test_the_readme_sandbox_example_runs_as_written(daemon, tmp_path):
    (code,) = examples("## Sandboxes")
    assert run(code, workdir(tmp_path)).stdout == "45\nb'hi'\n"


def test_the_readme_memory_mount_example_runs_as_written(daemon, tmp_path):
    (code,) = examples("## Where agents meet hutch: the filesystem view and MCP")
    code = "import hutch\nmem = hutch.Memory('./agent-memory')\n" + code.replace(
        'mem.history("topics/churn")[0].source', 'print(mem.history("topics/churn")[0].source, sb.id)')
    source, sb_id = run(code, workdir(tmp_path)).stdout.split()
    assert source == f"sandbox:{sb_id}"
