"""Image, snapshot and layer-cache benchmarks through the public SDK.

    .venv/bin/python bench/images.py [--quick]

Measures (p50 and p99, ms; every figure next to its peer from the same run):
  create -> first exec of `true` done, from a cached 3-layer image vs from its base;
  snapshot_filesystem() of a sandbox that wrote 20 MB vs `cp -a` of the same 20 MB
  (from a tmpfs to the store's disk, as the snapshot does);
  create from a snapshot vs from a cached built image;
  a rebuild of a 5-step image with every step cached.
Targets (issue 4): +<= 2 ms over the base; snapshot <= 100 ms; snapshot start as fast as
any cached image; cached rebuild <= 200 ms. A private daemon with a private state dir
runs the sandboxes (busybox root as the base); everything is removed at the end.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _report import ms, pct  # bench/ is the script's directory

ROOT_DIR = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT_DIR))
sys.path.insert(0, str(ROOT_DIR / "tests"))

import hutch  # noqa: E402
from hutch_testing import make_busybox_root, start_daemon, stop_daemon  # noqa: E402

TAG = {"bench": f"images-{os.getpid()}"}


def line(label, xs, peer=None, peer_label=""):
    p50, p99 = statistics.median(xs), pct(xs, 99)
    s = f"{label:<46} p50 {p50:7.2f} ms  p99 {p99:7.2f} ms  (n={len(xs)})"
    if peer:
        q50 = statistics.median(peer)
        s += f"   vs {peer_label} p50 {q50:7.2f} ms: diff {p50 - q50:+6.2f} ms, ratio {p50 / q50:.2f}"
    print(s, flush=True)
    return p50


def start_to_true(image) -> float:
    t0 = time.perf_counter()
    sb = hutch.Sandbox.create(image=image, tags=TAG, timeout=60)
    sb.run("true")
    dt = ms(t0)
    sb.terminate()
    return dt


def interleaved(images: dict, n: int) -> dict:
    out = {k: [] for k in images}
    for name, img in images.items():   # warm-up: first use of each image (idmap views, page cache)
        start_to_true(img)
    for _ in range(n):
        for name, img in images.items():
            out[name].append(start_to_true(img))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer rounds")
    args = ap.parse_args()
    n = 15 if args.quick else 60
    tmp = Path(tempfile.mkdtemp(prefix="hutch-bench-img-"))
    run_dir, state = tmp / "run", tmp / "state"
    run_dir.mkdir()
    state.mkdir()
    os.environ.update(HUTCH_RUN_DIR=str(run_dir), HUTCH_SOCKET=str(run_dir / "hutch.sock"), HUTCH_STATE_DIR=str(state))
    os.environ.pop("HUTCH_URL", None)
    proc = None
    try:
        root = make_busybox_root(tmp / "root", shutil.which("busybox"))
        proc = start_daemon(run_dir)
        print(f"hutch images benchmark, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f}", flush=True)
        base = hutch.Image.from_directory(root)
        three = (base.run_commands("mkdir -p /opt/a && seq 1 2000 > /opt/a/n")
                 .run_commands("mkdir -p /opt/b && echo b > /opt/b/f")
                 .run_commands("echo c > /etc/c")).build(name="bench-three", quiet=True)

        # 1. create from a cached 3-layer image vs its base
        r = interleaved({"base": base, "three": three}, n)
        line("create->exec true, base (1 lower dir)", r["base"])
        three50 = line("create->exec true, 3-layer image", r["three"], r["base"], "base")
        three_diff = three50 - statistics.median(r["base"])

        # 2. snapshot of a sandbox that wrote 20 MB vs a plain copy of those 20 MB
        from hutch.sandbox import _client

        client = _client.default_client()
        snaps, copies = [], []
        sb = hutch.Sandbox.create(image=base, tags=TAG, timeout=600, memory="1G")
        try:
            for i in range(max(5, n // 3)):
                sb.run("sh", "-c", "rm -rf /data; mkdir /data && for i in $(seq 1 20); do "
                                   "head -c 1048576 /dev/urandom > /data/f$i; done", check=True)
                t0 = time.perf_counter()
                snap = sb.snapshot_filesystem()
                snaps.append(ms(t0))
                # both sides drop their copy before the next round (outside the timing), so neither
                # pays for the other's writeback
                client.json("DELETE", f"/v1/images/{snap.ref}")
                client.json("POST", "/v1/images/prune")
                # the peer: the same 20 MB, from a tmpfs to the store's disk
                src = Path("/dev/shm") / f"hutch-bench-{os.getpid()}"
                dst = state / f"copy-{i}"
                src.mkdir()
                try:
                    for j in range(20):
                        (src / f"f{j}").write_bytes(os.urandom(1 << 20))
                    t0 = time.perf_counter()
                    subprocess.run(["cp", "-a", str(src), str(dst)], check=True)
                    copies.append(ms(t0))
                finally:
                    shutil.rmtree(src, ignore_errors=True)
                    shutil.rmtree(dst, ignore_errors=True)
        finally:
            sb.terminate()
        snap50 = line("snapshot_filesystem() after writing 20 MB", snaps, copies, "cp -a 20 MB")
        line("cp -a of 20 MB (tmpfs -> store disk, a process)", copies)

        # 3. start from a snapshot vs from a cached built image
        sb = hutch.Sandbox.create(image=base, tags=TAG, timeout=600, memory="1G")
        sb.run("sh", "-c", "mkdir /data && for i in $(seq 1 20); do head -c 1048576 /dev/urandom > /data/f$i; done",
               check=True)
        snap = sb.snapshot_filesystem()
        sb.terminate()
        r = interleaved({"three": three, "snap": snap}, n)
        line("create->exec true, cached 3-layer image", r["three"])
        snapstart50 = line("create->exec true, snapshot (20 MB layer)", r["snap"], r["three"], "3-layer image")

        # 4. a rebuild with every step cached
        five = base.run_commands("echo 1 > /1").run_commands("echo 2 > /2").env({"A": "1"}).workdir("/w") \
            .run_commands("echo 5 > /5")
        five.build(quiet=True)
        rebuilds = []
        for _ in range(n):
            t0 = time.perf_counter()
            five.build(quiet=True)
            rebuilds.append(ms(t0))
        rebuild50 = line("build() of a 5-step image, all cached", rebuilds)

        print("\ntargets:")
        print(f"  create from 3-layer image p50 +{three_diff:.2f} ms over the base <= 2 ms: "
              f"{'ok' if three_diff <= 2 else 'MISSED'}")
        print(f"  snapshot 20 MB p50 {snap50:.1f} ms <= 100 ms: {'ok' if snap50 <= 100 else 'MISSED'}")
        print(f"  start from snapshot p50 {snapstart50:.1f} ms vs cached image p50 "
              f"{statistics.median(r['three']):.1f} ms")
        print(f"  cached rebuild p50 {rebuild50:.1f} ms <= 200 ms: {'ok' if rebuild50 <= 200 else 'MISSED'}")
    finally:
        try:
            for s in hutch.Sandbox.list(tags=TAG):
                s.terminate()
        except Exception:  # noqa: BLE001 - the daemon may be gone already
            pass
        if proc is not None:
            stop_daemon(proc)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
