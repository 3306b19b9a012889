"""Sandbox benchmarks through the public SDK, side by side with bwrap and podman on the same root.

    .venv/bin/python bench/sandbox.py [--quick] [--write docs/benchmarks.md]

Measures (p50 and p99, ms; ratio hutch/peer, below 1 means hutch is faster):
  create -> first exec of `true` done (alone, and with 50 concurrent creators);
  exec of `true` in a running sandbox; terminate until every resource is gone;
  500 idle sandboxes: memory used, teardown time, leftovers.
Peers: `bwrap` (Debian's bubblewrap: all namespaces, tmp overlay on the root, fresh
/proc and /dev, capabilities dropped) and `podman run --rm --rootfs ROOT:O`.
Its setup step installs scripts/bench-packages.txt (the peers) when missing.
The sandboxes run on a private daemon started (and stopped) by this script.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import ctypes
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _report import ms, start_daemon, stop_daemon, summary, write_section  # bench/ is the script's directory

ROOT_DIR = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT_DIR))

import hutch  # noqa: E402

TAG = {"bench": f"sandbox-{os.getpid()}"}


# ------------------------------------------------------------------ helpers


def setup_peers():
    pkgs = [ln.strip() for ln in (ROOT_DIR / "scripts/bench-packages.txt").read_text().splitlines()
            if ln.strip() and not ln.startswith("#")]
    missing = [p for p in pkgs if subprocess.run(["dpkg-query", "-W", "-f=${Status}", p], capture_output=True,
                                                 text=True).stdout != "install ok installed"]
    if missing:
        print(f"setup: apt-get install {' '.join(missing)}", file=sys.stderr)
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        subprocess.run(["apt-get", "install", "-y", "-qq", "--no-install-recommends", *missing], env=env,
                       check=True, stdout=subprocess.DEVNULL)


def mem_used_mib() -> float:
    info = dict(ln.split(":", 1) for ln in Path("/proc/meminfo").read_text().splitlines())
    kib = lambda k: int(info[k].split()[0])  # noqa: E731
    return (kib("MemTotal") - kib("MemAvailable")) / 1024


def leftovers(run_dir: Path, ids=None) -> list[str]:
    """Mounts under the benchmark daemon's run directory and cgroups under its cgroup parent: of the
    sandboxes `ids` (the daemon keeps a few warm, unused ones ready), or all of them when `ids` is None."""
    from hutch.sandbox._host.daemon import cgroup_parent_for

    def ours(name: str) -> bool:
        return any(i in name for i in ids) if ids is not None else True

    prefix = str(run_dir.resolve()) + "/"
    found = [f"mount {ln.split()[4]}" for ln in Path("/proc/self/mountinfo").read_text().splitlines()
             if ln.split()[4].startswith(prefix) and ours(ln.split()[4])]
    parent = cgroup_parent_for(run_dir)
    for ctrl in Path("/sys/fs/cgroup").iterdir():
        base = ctrl / parent
        if base.is_dir():
            found += [f"cgroup {c}" for c in base.iterdir() if c.is_dir() and ours(c.name)]
    return found


# ------------------------------------------------------------------ hutch


def hutch_create_first_exec(image, n):
    lat = []
    for _ in range(n):
        t0 = time.perf_counter()
        sb = hutch.Sandbox.create(image=image, tags=TAG)
        sb.run("true")
        lat.append(ms(t0))
        sb.terminate()
    return lat


def hutch_concurrent(image, creators, rounds):
    lat = []

    def one():
        t0 = time.perf_counter()
        sb = hutch.Sandbox.create(image=image, tags=TAG)
        sb.run("true")
        d = ms(t0)
        return d, sb

    with cf.ThreadPoolExecutor(creators) as ex:
        for _ in range(rounds):
            results = list(ex.map(lambda _: one(), range(creators)))
            lat += [d for d, _ in results]
            list(ex.map(lambda r: r[1].terminate(), results))
    return lat


def hutch_exec(image, n):
    with hutch.Sandbox.create(image=image, tags=TAG) as sb:
        for _ in range(20):
            sb.run("true")
        lat = []
        for _ in range(n):
            t0 = time.perf_counter()
            sb.run("true")
            lat.append(ms(t0))
    return lat


def hutch_terminate(image, n):
    lat = []
    for _ in range(n):
        sb = hutch.Sandbox.create(image=image, tags=TAG)
        sb.run("true")
        t0 = time.perf_counter()
        sb.terminate()   # returns once every resource of the sandbox is gone (docs/api.md)
        lat.append(ms(t0))
    return lat


def rss_mib(pid="self") -> float:
    for ln in Path(f"/proc/{pid}/status").read_text().splitlines():
        if ln.startswith("VmRSS:"):
            return int(ln.split()[1]) / 1024
    return 0.0


def hutch_idle(image, count, run_dir):
    from hutch.sandbox._client import default_client

    dpid = default_client().json("GET", "/v1/health")["pid"]
    m0, c0, d0 = mem_used_mib(), rss_mib(), rss_mib(dpid)
    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(8) as ex:
        sbs = list(ex.map(lambda _: hutch.Sandbox.create(image=image, tags=TAG, timeout=600), range(count)))
    start_s = ms(t0) / 1000
    time.sleep(1.0)
    m1, c1, d1 = mem_used_mib(), rss_mib(), rss_mib(dpid)
    own = sandbox_memory(run_dir, [sb.id for sb in sbs])
    alive = sum(1 for s in hutch.Sandbox.list(tags=TAG) if s.status == "running")
    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(16) as ex:
        list(ex.map(lambda s: s.terminate(), sbs))
    down_s = ms(t0) / 1000
    return {"start_s": start_s, "mem_mib": m1 - m0, "alive": alive, "teardown_s": down_s, "leftovers": leftovers(run_dir, [sb.id for sb in sbs]),
            "client_mib": c1 - c0, "daemon_mib": d1 - d0, **own}


def sandbox_memory(run_dir: Path, ids) -> dict:
    """What the sandboxes themselves hold, independent of other work on the machine: the PSS of their
    processes (the inits' copied-on-write pages, shares of the zygote's) and what their memory cgroups
    were charged (kernel objects and pages first touched inside the sandbox)."""
    from hutch.sandbox._host.daemon import cgroup_parent_for

    base = Path("/sys/fs/cgroup/memory") / cgroup_parent_for(run_dir)
    pss_kib = charged = 0
    for sid in ids:
        try:
            charged += int((base / sid / "memory.usage_in_bytes").read_text())
            pids = (base / sid / "cgroup.procs").read_text().split()
        except OSError:
            continue
        for pid in pids:
            try:
                for ln in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                    if ln.startswith("Pss:"):
                        pss_kib += int(ln.split()[1])
            except OSError:
                pass
    return {"pss_mib": pss_kib / 1024, "charged_mib": charged / 1024**2}


# ------------------------------------------------------------------ peers


_libc = ctypes.CDLL(None, use_errno=True)
_MNT_DETACH = 2


class Overlay:
    """A throw-away overlay over `root` for one bwrap run (Debian's bwrap 0.8 has no --overlay option):
    the same writable-layer-over-the-image that hutch gives each sandbox, set up and torn down per run."""

    def __init__(self, root: Path) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="bench-bwrap-"))
        for d in ("upper", "work", "merged"):
            (self.dir / d).mkdir()
        opts = f"lowerdir={root},upperdir={self.dir}/upper,workdir={self.dir}/work".encode()
        if _libc.mount(b"overlay", str(self.dir / "merged").encode(), b"overlay", 0, opts) != 0:
            raise OSError(ctypes.get_errno(), "mount overlay")
        self.merged = self.dir / "merged"

    def close(self) -> None:
        _libc.umount2(str(self.merged).encode(), _MNT_DETACH)
        shutil.rmtree(self.dir, ignore_errors=True)


def bwrap_argv(merged, cmd):
    return ["bwrap", "--unshare-all", "--die-with-parent", "--new-session", "--cap-drop", "ALL",
            "--bind", str(merged), "/", "--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp", "--chdir", "/", *cmd]


def bwrap_true(root):
    ov = Overlay(root)
    try:
        subprocess.run(bwrap_argv(ov.merged, ["true"]), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                       check=True)
    finally:
        ov.close()


def podman_argv(*args):
    # crun refuses cgroup hybrid mode: hide the cgroup2 tree in a private mount namespace (measurements.md);
    # the ulimits stay at this host's (raising them needs CAP_SYS_RESOURCE, which this machine lacks)
    return ["unshare", "-m", "--propagation", "private", "sh", "-c",
            'umount -l /sys/fs/cgroup/unified 2>/dev/null; exec "$@"', "sh", "podman", *args]


def podman_true(root):
    subprocess.run(podman_argv("run", "--rm", "--network=none", *PODMAN_LIMITS, "--rootfs", f"{root}:O", "true"),
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)


PODMAN_LIMITS = ("--ulimit", "nofile=1024:1024", "--ulimit", "nproc=4096:4096")


def peer_runs(fn, n):
    lat = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        lat.append(ms(t0))
    return lat


def peer_concurrent(fn, creators, rounds):
    def one(_):
        t0 = time.perf_counter()
        fn()
        return ms(t0)

    lat = []
    with cf.ThreadPoolExecutor(creators) as ex:
        for _ in range(rounds):
            lat += list(ex.map(one, range(creators)))
    return lat


def bwrap_idle(root, count):
    m0 = mem_used_mib()
    t0 = time.perf_counter()
    ovs, procs = [], []
    try:
        for _ in range(count):
            ovs.append(Overlay(root))
            procs.append(subprocess.Popen(bwrap_argv(ovs[-1].merged, ["sleep", "600"]), stdin=subprocess.DEVNULL))
        start_s = ms(t0) / 1000
        time.sleep(1.0)
        m1 = mem_used_mib()
        alive = sum(p.poll() is None for p in procs)
        t0 = time.perf_counter()
    finally:
        for p in procs:
            p.kill()   # --die-with-parent: the sandboxed sleep follows bwrap
        for p in procs:
            p.wait()
        for ov in ovs:
            ov.close()
    return {"start_s": start_s, "mem_mib": m1 - m0, "alive": alive, "teardown_s": ms(t0) / 1000, "leftovers": []}


def podman(*args, check=True):
    return subprocess.run(podman_argv(*args), capture_output=True, text=True, check=check)


def podman_exec(root, n):
    cid = podman("run", "-d", "--rm", "--network=none", *PODMAN_LIMITS, "--rootfs", f"{root}:O", "sleep", "600").stdout.strip()
    try:
        lat = []
        for _ in range(n):
            t0 = time.perf_counter()
            podman("exec", cid, "true")
            lat.append(ms(t0))
        return lat
    finally:
        podman("rm", "-f", "-t", "0", cid, check=False)


def podman_terminate(root, n):
    lat = []
    for _ in range(n):
        cid = podman("run", "-d", "--rm", "--network=none", *PODMAN_LIMITS, "--rootfs", f"{root}:O", "sleep", "600").stdout.strip()
        t0 = time.perf_counter()
        podman("rm", "-f", "-t", "0", cid)
        lat.append(ms(t0))
    return lat


# ------------------------------------------------------------------ main


def fmt_row(name, h, peers):
    cells = [f"{h['p50']:.1f} / {h['p99']:.1f}"]
    for p in peers:
        if p is None:
            cells += ["n/a", "n/a"]
        else:
            cells += [f"{p['p50']:.1f} / {p['p99']:.1f}", f"{h['p50'] / p['p50']:.2f} / {h['p99'] / p['p99']:.2f}"]
    return f"| {name} | " + " | ".join(cells) + " |"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer runs (a smoke test of the benchmark)")
    ap.add_argument("--write", metavar="MD", help="also write the results as Markdown to this file")
    ap.add_argument("--image", default="debian-slim", help="hutch image ref whose root all peers use too")
    a = ap.parse_args()
    q = a.quick
    N, NC, ROUNDS, IDLE = (20, 50, 1, 100) if q else (100, 50, 3, 500)

    setup_peers()
    load0 = os.getloadavg()[0]
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))   # 500 leases + pooled connections
    run_dir = Path(tempfile.mkdtemp(prefix="hutch-bench-"))
    daemon = start_daemon(run_dir)
    results = {}
    try:
        image = hutch.Image.of(a.image)
        from hutch.sandbox._host.images import ensure_image

        root = ensure_image(image.ref).lowerdirs[0]
        # warm up: image ensured, zygote and caches hot, as in steady use
        hutch_create_first_exec(image, 5)
        bw = lambda: bwrap_true(root)  # noqa: E731
        pm = lambda: podman_true(root)  # noqa: E731
        peer_runs(bw, 5)
        try:
            peer_runs(pm, 2)
            have_podman = True
        except (OSError, subprocess.CalledProcessError) as e:
            print(f"podman does not run here ({e}); its columns stay n/a", file=sys.stderr)
            have_podman = False

        print(f"create -> first exec of true ({N} runs)", file=sys.stderr)
        results["create"] = [summary(hutch_create_first_exec(image, N)), summary(peer_runs(bw, N)),
                             summary(peer_runs(pm, max(10, N // 5))) if have_podman else None]
        print(f"same, {NC} concurrent creators x {ROUNDS}", file=sys.stderr)
        results["concurrent"] = [summary(hutch_concurrent(image, NC, ROUNDS)), summary(peer_concurrent(bw, NC, ROUNDS)),
                                 summary(peer_concurrent(pm, NC, 1)) if have_podman else None]
        print(f"exec of true in a running sandbox ({N * 3} runs)", file=sys.stderr)
        results["exec"] = [summary(hutch_exec(image, N * 3)), None,
                           summary(podman_exec(root, max(10, N // 5))) if have_podman else None]
        print(f"terminate until gone ({N} runs)", file=sys.stderr)
        results["terminate"] = [summary(hutch_terminate(image, N)), None,
                                summary(podman_terminate(root, max(10, N // 5))) if have_podman else None]
        print(f"{IDLE} idle sandboxes", file=sys.stderr)
        results["idle"] = [hutch_idle(image, IDLE, run_dir), bwrap_idle(root, IDLE)]
    finally:
        for sb in hutch.Sandbox.list(tags=TAG):
            sb.terminate()
        stop_daemon(daemon, 20)
        after_stop = leftovers(run_dir)
        shutil.rmtree(run_dir, ignore_errors=True)

    names = {"create": "create -> first exec of `true` done", "concurrent": f"same, {NC} concurrent creators",
             "exec": "exec of `true` in a running sandbox", "terminate": "terminate until every resource is gone"}
    lines = [
        f"Machine: {os.cpu_count()} cores, {os.uname().release}; image `{a.image}` ({root}); "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}{' (quick run)' if q else ''}; "
        f"load average {load0:.1f} at the start, {os.getloadavg()[0]:.1f} at the end (other work shares the "
        "machine: compare the ratios, which come from peers run side by side, more than absolute figures).",
        "",
        "| ms, p50 / p99 | hutch | bwrap | hutch/bwrap | podman | hutch/podman |",
        "|---|---|---|---|---|---|",
    ]
    for k in ("create", "concurrent", "exec", "terminate"):
        h, *peers = results[k]
        lines.append(fmt_row(f"{names[k]} (n={h['n']})", h, peers))
    hi, bi = results["idle"]
    lines += [
        "",
        f"| {IDLE} idle sandboxes | hutch | bwrap (`sleep 600`) |",
        "|---|---|---|",
        f"| all started in | {hi['start_s']:.2f} s | {bi['start_s']:.2f} s |",
        f"| alive at once | {hi['alive']} | {bi['alive']} |",
        f"| system memory used | {hi['mem_mib']:.0f} MiB | {bi['mem_mib']:.0f} MiB |",
        f"| the sandboxes' processes (sum of PSS) / their memory cgroups' charge (two views, they overlap) | {hi['pss_mib']:.0f} / "
        f"{hi['charged_mib']:.0f} MiB | - |",
        f"| of which the daemon's / this client's growth | {hi['daemon_mib']:.0f} / {hi['client_mib']:.0f} MiB | - |",
        f"| all torn down in | {hi['teardown_s']:.2f} s | {bi['teardown_s']:.2f} s |",
        f"| leftovers after teardown (mounts, cgroups) | {len(hi['leftovers'])} {hi['leftovers'][:3]} | - |",
        "",
        f"After the daemon stopped: {len(after_stop)} mounts or cgroups left {after_stop[:3]}.",
        "n/a: bwrap has no exec into a running sandbox, and its teardown is a process kill.",
    ]
    text = "\n".join(lines)
    print(text)
    if a.write:
        write_section(Path(a.write), "sandbox.py", "Sandboxes", text)


if __name__ == "__main__":
    main()
