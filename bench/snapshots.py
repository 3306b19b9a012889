"""Pause/resume, memory snapshots, restore and fork, side by side with issue 19's targets, through the SDK.

    .venv/bin/python bench/snapshots.py [--runs 5] [--sizes 0,64,256]

Per memory size (a gVisor sandbox holding N MiB of random bytes in its tmpfs /dev, so incompressible):
snapshot_memory, restore (a new sandbox answering; then a second restore of the same snapshot, whose image the
first read into the page cache: the difference is the disk's), fork(4), the first exec of a restored copy; pause
and resume for both runtimes (the cgroup freezer); per-MiB costs by least squares. p50 / p99 in ms. Runs on a
private daemon with a private state directory (started and removed by this script).

The peer, in the same runs: runsc itself, with no hutch (`RunscPeer`): a container of the same flags holding the
same N MiB, checkpointed the same way (--leave-running --compression=none, through the page cache), restored
with `runsc restore --detach` and exec'd into with `runsc exec true` once per run, right after hutch's restore;
`hutch / runsc` is the ratio of the p50s (what hutch adds: its set-up, the copy's hostname, the API).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
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
from hutch.sandbox._host.gvisor import runsc  # noqa: E402

TARGETS = {"pause gvisor": 25, "resume gvisor": 25, "pause native": 2, "resume native": 2,
           "snapshot 256": 600, "restore 256": 400, "fork4 256": 1300, "first exec": 50, "first exec of a fork": 50}
PEERS = "E2B (published): pause ~4 s per GiB, resume ~1 s"


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return (time.perf_counter() - t0) * 1000, out


def fit(points):
    """Least squares: ms = a + b * MiB."""
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    mx, my = statistics.mean(xs), statistics.mean(ys)
    var = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0
    return my - b * mx, b


class RunscPeer:
    """runsc without hutch: one container holding `mib` MiB (no network, no user namespace, a plain directory as
    its root), checkpointed once; `restore()` times a `runsc restore --detach` of it and the copy's first
    `runsc exec true`, then deletes the copy. Its own state directory and cgroup parent, removed by close()."""

    def __init__(self, tmp: Path, mib: int, hold: str):
        self.dir = tmp / f"runsc-peer-{mib}"
        self.bundle, self.image = self.dir / "bundle", self.dir / "image"
        self.bundle.mkdir(parents=True)
        self.flags = runsc.global_flags(str(self.dir / "state"), False)
        self.cgroup = f"hutch-bench-peer-{os.getpid()}-{mib}"
        self.config = runsc.bundle_config(
            args=["sh", "-c", hold], env={"PATH": "/bin"}, cwd="/", root=str(make_busybox_root(self.dir / "root")),
            hostname="runsc-peer", netns="", cgroups_path="", memory=(mib + 256) << 20, cpu=1.0, pids=256, uid_base=0)
        ns = self.config["linux"]["namespaces"]
        ns[:] = [n for n in ns if n["type"] != "network"] + [{"type": "network"}]   # runsc's own, empty
        self.ids: list[str] = []
        self.source = self._start("run", "--detach")

    def _runsc(self, *args: str, check: bool = True) -> None:
        subprocess.run([runsc.probe().path, *self.flags, *args], check=check, stdin=subprocess.DEVNULL,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=120)

    def _start(self, *args: str) -> str:
        cid = f"peer{os.getpid():08d}{len(self.ids):04d}"   # fixed length: runsc matches ids by prefix
        self.config["linux"]["cgroupsPath"] = f"/{self.cgroup}/{cid}"
        (self.bundle / "config.json").write_text(json.dumps(self.config))
        self.ids.append(cid)
        self._runsc(*args, f"--bundle={self.bundle}", cid)
        return cid

    def checkpoint(self) -> None:
        self._runsc("checkpoint", f"--image-path={self.image}", "--leave-running", "--compression=none", self.source)

    def restore(self) -> tuple[float, float]:
        """(ms of runsc restore, ms of the copy's first runsc exec)."""
        t0 = time.perf_counter()
        cid = self._start("restore", "--detach", f"--image-path={self.image}")
        t1 = time.perf_counter()
        self._runsc("exec", cid, "true")
        t2 = time.perf_counter()
        self._runsc("delete", "--force", cid, check=False)
        self.ids.remove(cid)
        return (t1 - t0) * 1000, (t2 - t1) * 1000

    def close(self) -> None:
        for cid in self.ids:
            self._runsc("delete", "--force", cid, check=False)
        for controller in Path("/sys/fs/cgroup").iterdir():
            parent = controller / self.cgroup
            if parent.is_dir():
                for d in sorted(parent.glob("*/"), reverse=True):
                    d.rmdir()
                parent.rmdir()
        shutil.rmtree(self.dir, ignore_errors=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--sizes", default="0,64,256")
    a = ap.parse_args()
    sizes = [int(s) for s in a.sizes.split(",")]
    tmp = Path(tempfile.mkdtemp(prefix="hutch-bench-snap-"))
    os.environ["HUTCH_STATE_DIR"] = str(tmp / "state")
    (tmp / "run").mkdir()
    proc = start_daemon(tmp / "run")
    os.environ.update(HUTCH_RUN_DIR=str(tmp / "run"), HUTCH_SOCKET=str(tmp / "run" / "hutch.sock"))
    load0 = os.getloadavg()[0]
    rows: dict[str, list[float]] = {}
    made = []
    peers: list[RunscPeer] = []
    failures: dict[str, int] = {}
    try:
        image = hutch.Image.from_directory(make_busybox_root(tmp / "root"))
        for runtime in ("native", "gvisor"):
            sb = hutch.Sandbox.create("sh", "-c", "while :; do sleep 0.01; done", image=image, runtime=runtime)
            made.append(sb)
            for _ in range(a.runs * 4):
                try:
                    rows.setdefault(f"pause {runtime}", []).append(timed(sb.pause)[0])
                except hutch.SandboxError as e:   # a freeze that did not complete in time: counted, not timed
                    failures[runtime] = failures.get(runtime, 0) + 1
                    print(f"{runtime}: {e}", file=sys.stderr)
                    continue
                time.sleep(0.02)
                rows.setdefault(f"resume {runtime}", []).append(timed(sb.resume)[0])
                time.sleep(0.02)
            sb.terminate()
        for n in sizes:
            hold = f"dd if=/dev/urandom of=/dev/held bs=1M count={n} 2>/dev/null; exec sleep 1000000"
            sb = hutch.Sandbox.create("sh", "-c", hold, image=image, runtime="gvisor", memory=f"{n + 256}M")
            made.append(sb)
            peer = RunscPeer(tmp, n, hold)
            peers.append(peer)
            time.sleep(0.5 + n / 100)
            peer.checkpoint()
            for _ in range(a.runs):
                dt, snap = timed(sb.snapshot_memory)
                rows.setdefault(f"snapshot {n}", []).append(dt)
                dt, copy = timed(lambda: hutch.Sandbox.restore(snap))
                rows.setdefault(f"restore {n}", []).append(dt)
                rows.setdefault("first exec", []).append(timed(lambda: copy.run("true"))[0])
                copy.terminate()
                # the same snapshot again: its image is in the page cache now (the checkpoint wrote it with
                # O_DIRECT, so the first restore read it from the disk): the difference is the disk's
                dt, copy = timed(lambda: hutch.Sandbox.restore(snap))
                rows.setdefault(f"restore {n} cached", []).append(dt)
                copy.terminate()
                snap.delete()
                dt, first = peer.restore()   # runsc alone, in the same run
                rows.setdefault(f"runsc restore {n}", []).append(dt)
                rows.setdefault("runsc first exec", []).append(first)
            for _ in range(max(1, a.runs // 2)):
                dt, kids = timed(lambda: sb.fork(4))
                rows.setdefault(f"fork4 {n}", []).append(dt)
                for k in kids:   # each copy's first exec, once fork has returned
                    rows.setdefault("first exec of a fork", []).append(timed(lambda: k.run("true"))[0])
                for k in kids:
                    k.terminate()
            sb.terminate()
    finally:
        for sb in made:
            try:
                sb.terminate()
            except hutch.Error:
                pass
        for peer in peers:
            peer.close()
        stop_daemon(proc)
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"load average {load0:.1f} at the start, {os.getloadavg()[0]:.1f} at the end; {a.runs} runs per size\n")
    print("| measure | p50 ms | p99 ms | target ms | met |\n|---|---|---|---|---|")
    for k, xs in rows.items():
        t = TARGETS.get(k)
        p50 = statistics.median(xs)
        print(f"| {k} | {p50:.1f} | {pct(xs, 99):.1f} | {t if t else ''} | {'' if t is None else ('yes' if p50 <= t else 'no')} |")
    for k in [k for k in rows if k.startswith("runsc restore ")] + ["runsc first exec"]:
        ours = rows.get(k.replace("runsc restore", "restore") if k != "runsc first exec" else "first exec")
        if ours and rows.get(k):
            print(f"hutch / runsc, {k.replace('runsc ', '')} (p50): "
                  f"{statistics.median(ours) / statistics.median(rows[k]):.2f}")
    fits = (("snapshot", "snapshot {}"), ("restore", "restore {}"), ("restore, image cached", "restore {} cached"),
            ("fork4", "fork4 {}"))
    for what, key in fits:
        pts = [(n, statistics.median(rows[key.format(n)])) for n in sizes if key.format(n) in rows]
        if len(pts) > 1:
            base, per = fit(pts)
            print(f"{what}: {base:.0f} ms + {per:.2f} ms per MiB")
    print(f"pauses that did not freeze within 5 s: {failures or 'none'}")
    print(f"\npeers: {PEERS}")


if __name__ == "__main__":
    main()
