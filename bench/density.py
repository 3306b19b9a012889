"""Density: N live idle sandboxes on one host, side by side with bwrap running the same idle process.

    .venv/bin/python bench/density.py [--n 2000] [--python-n 500] [--quick] [--write docs/benchmarks.md]

Issue 18's one-host target: 2,000 live idle sandboxes within 2.5 GiB of system memory, all torn down in
<= 5 s with nothing left. Each sandbox runs `sleep 3600` as its command (as each bwrap does), from the same
root (`--image`, default debian-slim). Measured for each: the time to start all N (8 creating threads), the
system memory they use (MemTotal - MemAvailable, before and after, so the daemon's growth counts too), the
sum of the PSS of their processes (the inits, the sleeps) per sandbox, the time to tear all down (16 threads,
each terminate returns once every resource of its sandbox is gone) and what is left after (mounts, cgroups).
hutch runs twice: with the C init (the default, native/initd.c) at --n, and with the Python init
(HUTCH_NATIVE_INIT=0) at --python-n (0 skips it). The sandboxes run on private daemons this script starts
and stops; its setup step installs scripts/bench-packages.txt (bwrap) when missing.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _report import write_section  # bench/ is the script's directory
from sandbox import Overlay, bwrap_argv, leftovers, mem_used_mib, setup_peers

ROOT_DIR = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT_DIR))

import hutch  # noqa: E402

TAG = {"bench": f"density-{os.getpid()}"}
IDLE = ("sleep", "3600")


def pss_kib(pids) -> int:
    total = 0
    for pid in pids:
        try:
            for ln in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if ln.startswith("Pss:"):
                    total += int(ln.split()[1])
        except OSError:
            pass
    return total


def start_daemon(run_dir: Path, env: dict) -> subprocess.Popen:
    from hutch.sandbox._client import Endpoint, _ping

    os.environ.update(HUTCH_RUN_DIR=str(run_dir), HUTCH_SOCKET=str(run_dir / "hutch.sock"))
    os.environ.pop("HUTCH_URL", None)
    log = open(run_dir / "daemon.log", "ab")
    proc = subprocess.Popen([sys.executable, "-m", "hutch", "serve"], stdout=log, stderr=log, env={**os.environ, **env},
                            stdin=subprocess.DEVNULL, start_new_session=True)
    for _ in range(600):
        if _ping(Endpoint(), 1.0):
            return proc
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    raise SystemExit(f"the daemon did not start; see {run_dir / 'daemon.log'}")


def stop_daemon(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def hutch_density(image, n: int, native: bool) -> dict:
    """N idle sandboxes on a daemon of their own (the C init, or the Python one)."""
    from hutch.sandbox._client import default_client
    from hutch.sandbox._host.daemon import cgroup_parent_for

    run_dir = Path(tempfile.mkdtemp(prefix="hutch-density-"))
    daemon = start_daemon(run_dir, {"HUTCH_NATIVE_INIT": "1" if native else "0"})
    sbs = []
    try:
        hutch.Sandbox.create(*IDLE, image=image, tags=TAG, detach=True).terminate()   # image, zygote, caches hot
        time.sleep(1.0)
        dpid = default_client().json("GET", "/v1/health")["pid"]
        m0 = mem_used_mib()
        t0 = time.perf_counter()
        with cf.ThreadPoolExecutor(8) as ex:
            sbs = list(ex.map(lambda _: hutch.Sandbox.create(*IDLE, image=image, tags=TAG, detach=True, timeout=3600),
                              range(n)))
        start_s = time.perf_counter() - t0
        time.sleep(2.0)
        m1 = mem_used_mib()
        base = Path("/sys/fs/cgroup/pids") / cgroup_parent_for(run_dir)
        pids = []
        for sb in sbs:
            try:
                pids += (base / sb.id / "cgroup.procs").read_text().split()
            except OSError:
                pass
        pss = pss_kib(pids) / 1024
        daemon_pss = pss_kib([dpid]) / 1024
        alive = sum(1 for s in hutch.Sandbox.list(tags=TAG) if s.status == "running")
        ids = [sb.id for sb in sbs]
        t0 = time.perf_counter()
        with cf.ThreadPoolExecutor(16) as ex:
            list(ex.map(lambda s: s.terminate(), sbs))
        down_s = time.perf_counter() - t0
        left = leftovers(run_dir, ids)
        sbs = []
    finally:
        for sb in sbs:
            try:
                sb.terminate()
            except hutch.Error:
                pass
        stop_daemon(daemon)
        after_stop = leftovers(run_dir)
        shutil.rmtree(run_dir, ignore_errors=True)
    return {"n": n, "start_s": start_s, "mem_mib": m1 - m0, "alive": alive, "pss_mib": pss, "procs": len(pids),
            "daemon_pss_mib": daemon_pss, "teardown_s": down_s, "leftovers": left, "after_stop": after_stop}


def bwrap_density(root: Path, n: int) -> dict:
    """N bwraps, each with an overlay of the same root (what hutch gives each sandbox), running `sleep 3600`."""
    m0 = mem_used_mib()
    ovs, procs = [], []
    t0 = time.perf_counter()
    try:
        for _ in range(n):
            ovs.append(Overlay(root))
            procs.append(subprocess.Popen(bwrap_argv(ovs[-1].merged, list(IDLE)), stdin=subprocess.DEVNULL))
        start_s = time.perf_counter() - t0
        time.sleep(2.0)
        m1 = mem_used_mib()
        alive = sum(p.poll() is None for p in procs)
        pids = []
        for p in procs:   # bwrap, its pid 1 (bwrap again) and the sleep
            todo = [p.pid]
            while todo:
                pid = todo.pop()
                pids.append(pid)
                try:
                    todo += [int(c) for t in os.listdir(f"/proc/{pid}/task")
                             for c in Path(f"/proc/{pid}/task/{t}/children").read_text().split()]
                except OSError:
                    pass
        pss = pss_kib(pids) / 1024
        t0 = time.perf_counter()
    finally:
        for p in procs:
            p.kill()   # --die-with-parent: the sandboxed sleep follows bwrap
        for p in procs:
            p.wait()
        for ov in ovs:
            ov.close()
    return {"n": n, "start_s": start_s, "mem_mib": m1 - m0, "alive": alive, "pss_mib": pss, "procs": len(pids),
            "teardown_s": time.perf_counter() - t0, "leftovers": []}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=2000, help="idle sandboxes (default 2000)")
    ap.add_argument("--python-n", type=int, default=500, help="idle sandboxes on the Python init (0: skip it)")
    ap.add_argument("--quick", action="store_true", help="100 of each (a smoke test of the benchmark)")
    ap.add_argument("--write", metavar="MD", help="also write the results as Markdown to this file")
    ap.add_argument("--image", default="debian-slim", help="hutch image ref whose root bwrap uses too")
    a = ap.parse_args()
    if a.quick:
        a.n, a.python_n = 100, min(a.python_n, 100)
    setup_peers()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    load0 = os.getloadavg()[0]
    image = hutch.Image.of(a.image)
    from hutch.sandbox._host.images import ensure_image

    root = ensure_image(image.ref).lowerdirs[0]
    print(f"{a.n} idle sandboxes on the C init", file=sys.stderr)
    native = hutch_density(image, a.n, True)
    print(f"{a.n} idle bwraps", file=sys.stderr)
    bw = bwrap_density(root, a.n)
    py = None
    if a.python_n:
        print(f"{a.python_n} idle sandboxes on the Python init", file=sys.stderr)
        py = hutch_density(image, a.python_n, False)

    def col(r, peer=False):
        if r is None:
            return ["-"] * 8
        return [f"{r['n']}", f"{r['alive']}", f"{r['start_s']:.2f} s",
                f"{r['mem_mib']:.0f} MiB ({r['mem_mib'] / r['n']:.2f} MiB each)",
                f"{r['pss_mib'] / r['n'] * 1024:.0f} KiB ({r['procs']} processes)",
                "-" if peer else f"{r['daemon_pss_mib']:.0f} MiB",
                f"{r['teardown_s']:.2f} s", "-" if peer else f"{len(r['leftovers'])} {r['leftovers'][:2]}"]

    rows = ["sandboxes", "alive at once", "all started in", "system memory used (MemAvailable)",
            "PSS per sandbox (its processes)", "the daemon's PSS", "all torn down in", "leftovers (mounts, cgroups)"]
    cols = [col(native), col(bw, True), col(py)]
    lines = [
        f"Machine: {os.cpu_count()} cores, {os.uname().release}; image `{a.image}`; each sandbox runs "
        f"`{' '.join(IDLE)}`; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}{' (quick run)' if a.quick else ''}; "
        f"load average {load0:.1f} at the start, {os.getloadavg()[0]:.1f} at the end (other work shares the machine "
        "and moves MemAvailable: PSS is the sandboxes' own).",
        "",
        "| | hutch, C init | bwrap | hutch, Python init (HUTCH_NATIVE_INIT=0) |",
        "|---|---|---|---|",
    ]
    lines += [f"| {name} | " + " | ".join(c[i] for c in cols) + " |" for i, name in enumerate(rows)]
    ok = native["mem_mib"] <= 2.5 * 1024 and native["teardown_s"] <= 5 and not native["leftovers"]
    lines += ["", f"Target (issue 18; at {a.n}, the target's 2,000 when run without --n/--quick): within 2.5 GiB, "
              f"down in <= 5 s, nothing left: {'met' if ok else 'not met'}. After the daemons stopped: "
              f"{len(native['after_stop']) + (len(py['after_stop']) if py else 0)} mounts or cgroups left."]
    text = "\n".join(lines)
    print(text)
    if a.write:
        write_section(Path(a.write), "density.py", "Density: idle sandboxes on one host", text)


if __name__ == "__main__":
    main()
