"""What the benchmarks share (not a benchmark): a private daemon, and writing one benchmark's section of
docs/benchmarks.md."""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import hutch_testing  # noqa: E402  (stdlib only at import)

#: SIGTERM (the daemon ends its sandboxes), SIGKILL only past the timeout
stop_daemon = hutch_testing.stop_daemon


def pct(xs, q):
    """The q-th percentile of `xs`, nearest rank (nan for none)."""
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))] if xs else float("nan")


def summary(xs):
    return {"p50": statistics.median(xs), "p99": pct(xs, 99), "n": len(xs)}


def ms(t0):
    """Milliseconds since perf_counter() was `t0`."""
    return (time.perf_counter() - t0) * 1000


def start_daemon(run_dir: Path, env: dict | None = None) -> subprocess.Popen:
    """tests/hutch_testing.py's start_daemon (`env` added to the daemon's environment, its output in
    run_dir/daemon.log), and this process's SDK pointed at it (HUTCH_RUN_DIR, HUTCH_SOCKET; no HUTCH_URL)."""
    os.environ.update(HUTCH_RUN_DIR=str(run_dir), HUTCH_SOCKET=str(run_dir / "hutch.sock"))
    os.environ.pop("HUTCH_URL", None)
    return hutch_testing.start_daemon(run_dir, env, log=run_dir / "daemon.log")


def write_section(path: Path, bench: str, title: str, text: str) -> None:
    """Replace the section of `path` between bench/<bench>'s markers with `title` and `text` (other benchmarks
    keep theirs); append it if there is none yet."""
    begin, end = f"<!-- bench/{bench}: begin -->", f"<!-- bench/{bench}: end -->"
    section = f"{begin}\n## {title} (bench/{bench})\n\n{text}\n{end}"
    old = path.read_text() if path.exists() else "# Benchmarks\n"
    if begin in old and end in old:
        new = old[: old.index(begin)] + section + old[old.index(end) + len(end):]
    else:
        new = old.rstrip("\n") + "\n\n" + section + "\n"
    path.write_text(new)
