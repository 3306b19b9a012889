"""Code-interpreter benchmarks (Sandbox.run_code), side by side with a Jupyter kernel on the host.

    .venv/bin/python bench/interpreter.py [--quick] [--write docs/benchmarks.md]

Measures (p50 and p99, ms):
  create -> first run_code("1+1") result, a cold kernel (Sandbox.create + the bridge + ipykernel's start);
  the same with a pooled sandbox (hutch.SandboxPool.create -> the result);
  run_code("1+1") in a running context;
  a chart of ~100 KB (a matplotlib PNG) round trip, and the kernel's own time for it (rendering included);
  20 concurrent interpreters, each creating its sandbox and running a pandas cell (all must succeed).
Peer, in the same run: an ipykernel started on the host with jupyter_client (KernelManager, the
same ipykernel and jupyter_client versions as the image), spoken to with a BlockingKernelClient.
The sandboxes run on a private daemon started (and stopped) by this script.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from _report import ms, start_daemon, stop_daemon, summary, write_section  # bench/ is the script's directory

ROOT_DIR = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT_DIR))

import hutch  # noqa: E402

TAG = {"bench": f"interpreter-{os.getpid()}"}
# a chart whose PNG is ~100 KB (noise does not compress) with the inline backend's defaults
CHART = ("import numpy as np, matplotlib.pyplot as plt, time\n"
         "_t = time.perf_counter()\n"
         "plt.figure(figsize=(4, 3), dpi=100); plt.imshow(np.random.default_rng(0).random((135, 180)), "
         "interpolation='nearest'); plt.axis('off'); plt.show()\n"
         "_own = (time.perf_counter() - _t) * 1000")
PANDAS = ("import pandas as pd, numpy as np\n"
          "df = pd.DataFrame({'k': np.arange(100_000) % 100, 'v': np.arange(100_000)})\n"
          "int(df.groupby('k')['v'].sum().max())")
PANDAS_ANSWER = str(sum(range(99, 100_000, 100)))


# ------------------------------------------------------------------ hutch


def cold(image, n):
    lat = []
    for _ in range(n):
        t0 = time.perf_counter()
        sb = hutch.Sandbox.create(image=image, timeout=120, tags=TAG)
        try:
            ex = sb.run_code("1+1")
            lat.append(ms(t0))
            assert ex.text == "2", ex
        finally:
            sb.terminate()
    return lat


def pooled(image, n):
    lat = []
    with hutch.SandboxPool(size=2, image=image, timeout=300, tags=TAG) as pool:
        for _ in range(n):
            deadline = time.monotonic() + 60
            while pool.available < 1 and time.monotonic() < deadline:   # the refill is not measured
                time.sleep(0.02)
            time.sleep(0.2)   # and is not running meanwhile
            t0 = time.perf_counter()
            sb = pool.create()
            ex = sb.run_code("1+1")
            lat.append(ms(t0))
            assert ex.text == "2", ex
            sb.terminate()
    return lat


def warm(sb, n):
    sb.run_code("1+1")
    lat = []
    for _ in range(n):
        t0 = time.perf_counter()
        ex = sb.run_code("1+1")
        lat.append(ms(t0))
        assert ex.text == "2"
    return lat


def chart(sb, n):
    sb.run_code(CHART)   # the imports and the first figure
    rt, own, sizes = [], [], []
    for _ in range(n):
        t0 = time.perf_counter()
        ex = sb.run_code(CHART)
        rt.append(ms(t0))
        own.append(float(sb.run_code("_own").text))
        sizes.append(len(ex.results[0].png))
    return rt, own, sizes


def concurrent(image, n):
    def one(_):
        t0 = time.perf_counter()
        sb = hutch.Sandbox.create(image=image, timeout=300, tags=TAG)
        try:
            ex = sb.run_code(PANDAS, timeout=240)
            return ms(t0), ex.text == PANDAS_ANSWER and ex.error is None, ex.error
        finally:
            sb.terminate()

    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(n) as pool:
        out = list(pool.map(one, range(n)))
    return [o[0] for o in out], sum(1 for o in out if o[1]), [o[2] for o in out if not o[1]], ms(t0)


# ------------------------------------------------------------------ the peer: a kernel on the host


def peer(n_cold, n_warm, n_chart):
    from jupyter_client import KernelManager

    def run(kc, code):
        msg_id = kc.execute(code)
        text = None
        while True:
            m = kc.get_iopub_msg(timeout=60)
            if m["parent_header"].get("msg_id") != msg_id:
                continue
            if m["msg_type"] in ("execute_result", "display_data"):
                text = m["content"]["data"].get("text/plain"), m["content"]["data"].get("image/png")
            if m["msg_type"] == "status" and m["content"]["execution_state"] == "idle":
                return text

    cold_lat, warm_lat, chart_rt, chart_own = [], [], [], []
    for i in range(n_cold):
        t0 = time.perf_counter()
        km = KernelManager(kernel_name="python3")
        km.start_kernel(extra_arguments=["--HistoryManager.hist_file=:memory:"])
        kc = km.client()
        kc.start_channels()
        kc.wait_for_ready(timeout=60)
        assert run(kc, "1+1")[0] == "2"
        cold_lat.append(ms(t0))
        if i == n_cold - 1:
            for _ in range(n_warm):
                t = time.perf_counter()
                run(kc, "1+1")
                warm_lat.append(ms(t))
            run(kc, CHART)
            for _ in range(n_chart):
                t = time.perf_counter()
                run(kc, CHART)
                chart_rt.append(ms(t))
                chart_own.append(float(run(kc, "_own")[0]))
        kc.stop_channels()
        km.shutdown_kernel(now=True)
    return cold_lat, warm_lat, chart_rt, chart_own


# ------------------------------------------------------------------ main


def row(name, h, p=None, target=""):
    hp = f"{h['p50']:.1f} / {h['p99']:.1f}"
    pp = f"{p['p50']:.1f} / {p['p99']:.1f}" if p else "n/a"
    ratio = f"{h['p50'] / p['p50']:.2f}" if p else "n/a"
    return f"| {name} (n={h['n']}) | {hp} | {pp} | {ratio} | {target} |"


def met(value, limit):
    return f"{limit:g}: {'met' if value <= limit else 'NOT met'}"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer repetitions")
    ap.add_argument("--write", metavar="MD", help="also write the results as Markdown to this file")
    a = ap.parse_args()
    n_cold, n_pool, n_warm, n_chart, n_conc = (5, 5, 50, 5, 20) if a.quick else (20, 20, 300, 20, 20)

    run_dir = Path(tempfile.mkdtemp(prefix="hutch-bench-interp-"))
    daemon = start_daemon(run_dir)
    try:
        print("building (or finding) the code-interpreter image ...", file=sys.stderr)
        image = hutch.Image.code_interpreter().build(quiet=True)
        load0 = os.getloadavg()[0]
        started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        cold(image, 1)   # the first start warms the page cache of the image's files
        r_cold = cold(image, n_cold)
        r_pool = pooled(image, n_pool)
        with hutch.Sandbox.create(image=image, timeout=600, tags=TAG) as sb:
            r_warm = warm(sb, n_warm)
            c_rt, c_own, c_sizes = chart(sb, n_chart)
        c_lat, c_ok, c_err, c_wall = concurrent(image, n_conc)
        p_cold, p_warm, p_rt, p_own = peer(max(3, n_cold // 2), n_warm, n_chart)
        load1 = os.getloadavg()[0]
    finally:
        for sb in hutch.Sandbox.list(tags=TAG):
            sb.terminate()
        stop_daemon(daemon, 20)
        shutil.rmtree(run_dir, ignore_errors=True)

    h_cold, h_pool, h_warm = summary(r_cold), summary(r_pool), summary(r_warm)
    over = [r - o for r, o in zip(c_rt, c_own)]
    p_over = [r - o for r, o in zip(p_rt, p_own)]
    cs = summary(c_lat)
    lines = [
        f"Run of {started} ({os.cpu_count()} cores, load average {load0:.1f} at the start, {load1:.1f} at the end). "
        "p50 / p99 in ms; the peer is an ipykernel started on the host with jupyter_client in the same run "
        "(ratio: hutch p50 / peer p50).",
        "",
        "| | hutch | host kernel (jupyter_client) | ratio | target (p50) |",
        "|---|---|---|---|---|",
        row("create -> first `run_code(\"1+1\")` result, cold kernel", h_cold, summary(p_cold),
            met(h_cold["p50"], 400)),
        row("same, a sandbox from `hutch.SandboxPool`", h_pool, None, met(h_pool["p50"], 30)),
        row("`run_code(\"1+1\")` in a running context", h_warm, summary(p_warm), met(h_warm["p50"], 5)),
        row(f"a chart round trip (PNG {statistics.median(c_sizes) / 1000:.0f} KB)", summary(c_rt), summary(p_rt)),
        row("  of which the kernel's own time (rendering)", summary(c_own), summary(p_own)),
        row("  round trip over the kernel's own time", summary(over), summary(p_over), met(statistics.median(over), 50)),
        f"| {n_conc} concurrent interpreters, create -> a pandas cell's result (n={cs['n']}) | "
        f"{cs['p50']:.0f} / {cs['p99']:.0f} | n/a | n/a | all succeed: {c_ok}/{n_conc} "
        f"{'met' if c_ok == n_conc else 'NOT met ' + str(c_err[:2])} |",
        "",
        f"The {n_conc} concurrent interpreters took {c_wall / 1000:.1f} s in all on {os.cpu_count()} cores "
        "(each cell imports pandas and numpy in a fresh kernel: CPU-bound).",
    ]
    text = "\n".join(lines)
    print(text)
    if a.write:
        write_section(Path(a.write), "interpreter.py", "Code interpreter", text)


if __name__ == "__main__":
    main()
