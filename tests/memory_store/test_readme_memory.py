"""The README's memory examples run as written (README drift fails here): the store, then its search."""

from __future__ import annotations

import os
import subprocess
import sys

from readme_examples import examples, workdir


def test_the_readme_memory_and_search_examples_run_as_written(tmp_path):
    store, search = examples("## Memory (SMF)"), examples("### Search")
    assert len(store) == 1 and len(search) == 1, "the README's memory sections changed shape: update this test"
    code = store[0] + "\n" + search[0] + "\nprint('hits:', len(hits))\n"
    env = {k: v for k, v in os.environ.items() if k != "HUTCH_MEMORY"}
    r = subprocess.run([sys.executable, "-c", code], cwd=workdir(tmp_path), env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "hits: 10" in r.stdout
    assert (tmp_path / "agent-memory" / ".git").is_dir()
