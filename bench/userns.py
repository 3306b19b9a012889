"""What the user namespace costs: create -> first exec of `true`, with and without one, side by side.

    .venv/bin/python bench/userns.py [--runs N] [--image REF]

Two private daemons run at once on the same image, one with HUTCH_USERNS=0 and one with the
default (a user namespace per sandbox); creates alternate between them through the public SDK
(the machine is shared and noisy: interleaving puts both under the same load). Prints p50 and
p99 in ms and the ratio userns/plain (above 1: the user namespace costs that much more).
The default image is a static busybox root made here (the runtime's own cost, not the image's).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from _report import pct  # bench/ is the script's directory

ROOT_DIR = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT_DIR))
sys.path.insert(0, str(ROOT_DIR / "tests"))

import hutch  # noqa: E402
from hutch_testing import make_busybox_root, start_daemon, stop_daemon  # noqa: E402

TAG = {"bench": f"userns-{os.getpid()}"}


def create_first_exec(sock: Path, image) -> tuple[float, str]:
    os.environ["HUTCH_SOCKET"] = str(sock)   # the SDK's client follows the environment
    t0 = time.perf_counter()
    sb = hutch.Sandbox.create(image=image, tags=TAG)
    sb.run("true")
    dt = (time.perf_counter() - t0) * 1000
    uid_map = sb.run("cat", "/proc/self/uid_map").stdout.split()
    sb.terminate()
    return dt, " ".join(uid_map)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=100, help="creates per mode (default 100)")
    ap.add_argument("--image", help="an image ref (default: a busybox root made here)")
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="hutch-bench-userns-"))
    daemons = {}
    try:
        image = hutch.Image.of(a.image) if a.image else hutch.Image.from_directory(make_busybox_root(tmp / "root"))
        for mode, flag in (("plain", "0"), ("userns", "1")):
            (tmp / mode).mkdir()
            daemons[mode] = start_daemon(tmp / mode, {"HUTCH_USERNS": flag})
        lat: dict[str, list[float]] = {m: [] for m in daemons}
        maps = {}
        for i in range(a.runs + 5):
            for mode in (daemons if i % 2 else reversed(list(daemons))):
                dt, maps[mode] = create_first_exec(tmp / mode / "hutch.sock", image)
                if i >= 5:   # the first few warm each daemon's caches
                    lat[mode].append(dt)
        for mode in daemons:
            print(f"{mode:7s} uid_map: {maps[mode]}")
        p = {m: (statistics.median(xs), pct(xs, 99)) for m, xs in lat.items()}
        print(f"create -> first exec of true, {a.runs} runs each, load {os.getloadavg()[0]:.2f}")
        print("| mode | p50 ms | p99 ms |")
        for m, (p50, p99) in p.items():
            print(f"| {m} | {p50:.2f} | {p99:.2f} |")
        print(f"| ratio userns/plain | {p['userns'][0] / p['plain'][0]:.2f} | {p['userns'][1] / p['plain'][1]:.2f} |")
    finally:
        for proc in daemons.values():
            stop_daemon(proc)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
