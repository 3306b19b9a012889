"""The fleet on Ray: N live sandboxes at once on a 3-node local Ray cluster, and the fleet's cost per call.

    .venv/bin/python bench/fleet.py [--sandboxes 3000] [--clients 50] [--procs 5] [--nodes 3] [--n 100]
                                    [--image debian-slim] [--write docs/benchmarks.md]

Starts its own Ray cluster on this host (`ray.cluster_utils.Cluster`: one GCS, `--nodes` raylets, every one on
127.0.0.2: loopback only) and `hutch fleet up` on it with its own run root, and ends both. Then, in order:

1. On the idle cluster, this process through the SDK (`hutch.connect("ray://auto")`), side by side with a
   direct daemon in the same run (the same node's daemon over its Unix socket, `hutch.connect("unix:...")`,
   the one-host client), the calls interleaved so that both see the same load: create -> first exec of
   `true` done (`--n` each), and per call on a running sandbox: `run("true")`, `poll()` (GET its state) and
   `from_id(id)` (routing by the id). The fleet's overhead per call is its p50 minus the direct daemon's.
2. `--sandboxes` live at once: `--clients` concurrent clients (`--procs` processes, each a Ray driver through
   the SDK, of clients/procs threads) create them and keep them (idle, network none); reported: creates/s over
   the wall time, create p50 / p99, errors, their spread over the nodes, what the fleet's table and
   `Sandbox.list()` count, the system memory they take (MemTotal - MemAvailable, so other work on the host
   counts too). Then every client terminates its own (the time until all are gone).
3. Leftovers: sandboxes still listed, mounts of sandboxes under the run root, cgroups beyond each node's warm
   pool; and, after `hutch fleet down` and the cluster's end, every mount and cgroup of the nodes' daemons.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import resource
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections import Counter
from pathlib import Path

from _report import pct, write_section  # bench/ is the script's directory

ROOT_DIR = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT_DIR))
sys.path.insert(0, str(ROOT_DIR / "tests" / "fleet"))
from fleet_support import LOOPBACK, node_args  # noqa: E402  (the test suite's cluster: loopback, chosen agent ports)

TAG_KEY = "bench-fleet"


def cell(xs) -> str:
    return f"{statistics.median(xs):.2f} / {pct(xs, 99):.2f}" if xs else "n/a"


def mem_used_mib() -> float:
    info = {ln.split(":")[0]: int(ln.split()[1]) for ln in Path("/proc/meminfo").read_text().splitlines()}
    return (info["MemTotal"] - info["MemAvailable"]) / 1024


def raise_nofile() -> None:
    """Every live non-detached sandbox holds a lease connection of its creator: allow the fds."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


# ------------------------------------------------------------------ one client process of the mass phase


def worker(count: int, threads: int, image: str, tag: str) -> None:
    """Create `count` sandboxes on `threads` threads once told to ("go" on stdin), keep them until "end", then
    terminate them; speaks one JSON line per step on stdout."""
    import hutch

    raise_nofile()
    hutch.connect("ray://auto")
    hutch.Sandbox.list(tags={TAG_KEY: "warm-up"})   # joins Ray, reads the table, opens each node's client
    print(json.dumps({"joined": True}), flush=True)
    sys.stdin.readline()
    lat: list[float] = []
    errors: Counter = Counter()
    made: list = []
    lock = threading.Lock()
    left = [count]

    def loop():
        while True:
            with lock:
                if left[0] <= 0:
                    return
                left[0] -= 1
            t0 = time.perf_counter()
            try:
                sb = hutch.Sandbox.create(image=image, timeout=3600, tags={TAG_KEY: tag})
            except Exception as e:  # noqa: BLE001 - counted, the load goes on
                kind = f"{type(e).__name__}: {str(e)[:100]}"
                if not errors[kind]:
                    print("".join(traceback.format_exception(e)[-6:]), file=sys.stderr)
                errors[kind] += 1
                continue
            d = (time.perf_counter() - t0) * 1000
            with lock:
                lat.append(d)
                made.append(sb)

    start = time.time()
    with cf.ThreadPoolExecutor(threads) as ex:
        for f in [ex.submit(loop) for _ in range(threads)]:
            f.result()
    print(json.dumps({"lat": lat, "errors": dict(errors), "span": (start, time.time()),
                      "nodes": dict(Counter(sb.id.split("-")[0] for sb in made)),
                      "ids": [sb.id for sb in made]}), flush=True)
    sys.stdin.readline()
    t0 = time.time()
    terr: Counter = Counter()

    def end(sb):
        try:
            sb.terminate()
        except Exception as e:  # noqa: BLE001
            terr[type(e).__name__] += 1
    with cf.ThreadPoolExecutor(threads) as ex:
        list(ex.map(end, made))
    print(json.dumps({"ended": (t0, time.time()), "errors": dict(terr)}), flush=True)


# ------------------------------------------------------------------ the cluster, the fleet and what they leave


def children() -> set[int]:
    me = str(os.getpid())
    out = set()
    for p in Path("/proc").iterdir():
        try:
            if p.name.isdigit() and (p / "stat").read_text().rsplit(")", 1)[1].split()[1] == me:
                out.add(int(p.name))
        except (OSError, IndexError):
            pass
    return out


def retried(start, attempts: int = 5):
    """start(), tried again when a Ray node did not register in Ray's fixed 30 s (its raylet gives up waiting for
    its agents' ports after ~15 s on a loaded host): the processes the failed try started (this process's new
    children, by pid) are ended first."""
    import signal

    for attempt in range(attempts):
        before = children()
        try:
            return start()
        except Exception as e:
            if "timed out during startup" not in str(e) or attempt == attempts - 1:
                raise
            print(f"a Ray node did not start ({e}); again", file=sys.stderr)
            for pid in children() - before:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)


class Cluster:
    """A Ray cluster of `nodes` raylets on loopback with `hutch fleet up` on it (own run root), this process
    its SDK's driver."""

    def __init__(self, nodes: int, max_per_node: int, base: Path):
        from ray.cluster_utils import Cluster as RayCluster

        self.base = base
        self.run_root = base / "run"
        self.cluster = None
        # Ray's own waits for a starting node, lengthened (hang guards only): the runs recorded used these
        for k in ("RAY_agent_register_timeout_ms", "RAY_raylet_start_wait_time_s"):
            os.environ.setdefault(k, "120000" if k.endswith("_ms") else "120")
        try:
            # every agent port chosen (node_args): Ray's default dashboard agent port, 52365, may be another
            # cluster's on a shared machine
            self.cluster = retried(lambda: RayCluster(initialize_head=True, head_node_args={
                "include_dashboard": False, **node_args()}))
            for _ in range(nodes - 1):
                retried(lambda: self.cluster.add_node(**node_args()))
            self.address = self.cluster.address
            self.env = dict(os.environ, RAY_ADDRESS=self.address)
            self.env.pop("HUTCH_URL", None)
            os.environ["RAY_ADDRESS"] = self.address
            self.rows = json.loads(self.cli("fleet", "up", "--ray", self.address, "--run-root", str(self.run_root),
                                            "--max-per-node", str(max_per_node), "--json"))
        except BaseException:   # a cluster that did not come up leaves nothing running either
            self.rows = []
            if self.cluster is not None:
                self.close()
            raise

    def cli(self, *args: str) -> str:
        r = subprocess.run([sys.executable, "-m", "hutch", *args], env=self.env, capture_output=True, text=True,
                           timeout=300, cwd="/")
        if r.returncode != 0:
            raise SystemExit(f"hutch {' '.join(args)} exited {r.returncode}: {r.stdout}\n{r.stderr[-3000:]}")
        return r.stdout

    def table(self) -> list[dict]:
        return json.loads(self.cli("fleet", "ls", "--ray", self.address, "--json"))

    def close(self) -> None:
        from hutch.sandbox import _client

        try:
            _client.disconnect()   # leave Ray before the cluster goes
            try:
                if hasattr(self, "env"):
                    subprocess.run([sys.executable, "-m", "hutch", "fleet", "down", "--ray", self.address],
                                   env=self.env, capture_output=True, timeout=300, cwd="/")
            finally:
                self.cluster.shutdown()
        finally:
            os.environ.pop("RAY_ADDRESS", None)


def node_resources(run_root: Path, rows: list[dict]) -> tuple[list[str], dict[str, int]]:
    """Mounts under the run root, and each node's sandbox cgroups (the zygote's aside), by node key."""
    prefix = str(run_root.resolve()) + "/"
    mounts = [ln.split()[4] for ln in Path("/proc/self/mountinfo").read_text().splitlines()
              if ln.split()[4].startswith(prefix)]
    cgroups = {}
    base = Path("/sys/fs/cgroup")
    for r in rows:
        inst = Path(r["run_dir"]) / "instance-id"
        parent = "hutch-" + inst.read_text().strip() if inst.exists() else None
        found = set()
        for ctrl in [base, *[c for c in base.iterdir() if c.is_dir()]]:
            d = ctrl / parent if parent else None
            if d is not None and d.is_dir():
                found |= {c.name for c in d.iterdir() if c.is_dir() and c.name != "_zygote"}
        cgroups[r["key"]] = len(found)
    return mounts, cgroups


def leftovers(c: Cluster, tag: str) -> list[str]:
    """What the mass phase left while the fleet runs (waits a little for the warm pools to settle)."""
    import hutch
    from hutch.sandbox import _client

    warm = {}
    for r in c.rows:
        d = _client.Client(_client.Endpoint(url="", socket_path=r["socket"])).json("GET", "/v1/doctor")
        warm[r["key"]] = d["warm_pool"]["target"]
    deadline = time.monotonic() + 15
    while True:
        listed = hutch.Sandbox.list(tags={TAG_KEY: tag})
        mounts, cgroups = node_resources(c.run_root, c.rows)
        mounts = [m for m in mounts if "/mnt/" in m]
        extra = {k: n - warm[k] for k, n in cgroups.items() if n > warm[k]}
        if (not listed and not mounts and not extra) or time.monotonic() > deadline:
            break
        time.sleep(0.3)
    return ([f"sandbox {s.id}" for s in listed] + [f"mount {m}" for m in mounts]
            + [f"{n} cgroups beyond node {k}'s warm pool" for k, n in extra.items()])


# ------------------------------------------------------------------ 1. the fleet against a direct daemon


def side_by_side(c: Cluster, image: str, n: int, tag: str) -> dict:
    """Interleaved: each measurement once through the fleet, once to the same kind of node's daemon directly."""
    import hutch
    from hutch.sandbox import _client

    fleet_url = "ray://auto"
    direct_row = c.rows[0]
    direct_url = f"unix:{direct_row['socket']}"
    tags = {TAG_KEY: tag}

    def via(url):
        hutch.connect(url)

    # warm up: every node's image ensured and its client made, both ways, the warm pools refilled
    via(fleet_url)
    for _ in range(24):
        hutch.Sandbox.create(image=image, tags=tags).terminate()
    via(direct_url)
    for _ in range(4):
        hutch.Sandbox.create(image=image, tags=tags).terminate()
    out: dict[str, dict[str, list[float]]] = {k: {"fleet": [], "direct": []}
                                              for k in ("create -> first exec", "run(\"true\")", "poll()", "from_id(id)")}
    for i in range(n):
        for side in (("fleet", "direct") if i % 2 else ("direct", "fleet")):
            via(fleet_url if side == "fleet" else direct_url)
            t0 = time.perf_counter()
            sb = hutch.Sandbox.create(image=image, tags=tags)
            r = sb.run("true")
            out["create -> first exec"][side].append((time.perf_counter() - t0) * 1000)
            assert r.returncode == 0, r
            sb.terminate()
            time.sleep(0.02)   # the warm pool refills between creates, as on an idle cluster
    # per call on one running sandbox, the same sandbox through both: the fleet's handle and a direct one
    via(fleet_url)
    sb_f = hutch.Sandbox.create(image=image, tags=tags)
    key = sb_f.id.split("-")[0]
    row = next(r for r in c.rows if r["key"] == key)
    direct = _client.Client(_client.Endpoint(url="", socket_path=row["socket"]))
    sb_d = hutch.Sandbox(direct, sb_f._info)
    try:
        for i in range(3 * n):
            for side in (("fleet", "direct") if i % 2 else ("direct", "fleet")):
                sb = sb_f if side == "fleet" else sb_d
                t0 = time.perf_counter()
                sb.run("true")
                t1 = time.perf_counter()
                sb.poll()
                t2 = time.perf_counter()
                via(fleet_url if side == "fleet" else f"unix:{row['socket']}")
                t3 = time.perf_counter()
                hutch.Sandbox.from_id(sb_f.id)
                t4 = time.perf_counter()
                out["run(\"true\")"][side].append((t1 - t0) * 1000)
                out["poll()"][side].append((t2 - t1) * 1000)
                out["from_id(id)"][side].append((t4 - t3) * 1000)
    finally:
        via(fleet_url)
        sb_f.terminate()
    return out


# ------------------------------------------------------------------ 2. N live at once


def mass(c: Cluster, image: str, count: int, clients: int, procs: int, tag: str) -> dict:
    import hutch

    per = [count // procs + (i < count % procs) for i in range(procs)]
    threads = max(1, clients // procs)
    ps = [subprocess.Popen([sys.executable, __file__, "--worker", str(k), "--threads", str(threads), "--image", image,
                            "--tag", tag], env=c.env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
          for k in per]

    def answer(p):
        line = p.stdout.readline()
        if not line:
            raise SystemExit(f"a client process ended early (exit {p.wait()}); its stderr is above")
        return json.loads(line)
    try:
        for p in ps:
            answer(p)            # joined Ray, has the table
        mem0 = mem_used_mib()
        for p in ps:
            p.stdin.write("go\n")
            p.stdin.flush()
        outs = [answer(p) for p in ps]
        mem1 = mem_used_mib()
        listed_ids = {sb.id for sb in hutch.Sandbox.list(tags={TAG_KEY: tag})}
        listed = len(listed_ids)
        # a sandbox created but not listed: what became of it (its status and reason, asked of its node)
        unlisted = []
        for sid in sorted({i for o in outs for i in o["ids"]} - listed_ids)[:10]:
            try:
                sb = hutch.Sandbox.from_id(sid)
                unlisted.append(f"{sid}: {sb.status} ({sb.reason or 'no reason'})")
            except Exception as e:  # noqa: BLE001 - reported
                unlisted.append(f"{sid}: {type(e).__name__}: {str(e)[:160]}")
        time.sleep(1.2)          # the table's live counts are the agents' last reports
        table_live = {r["key"]: r["live"] for r in c.table()}
        for p in ps:
            p.stdin.write("end\n")
            p.stdin.flush()
        ends = [answer(p) for p in ps]
        for p in ps:
            p.wait(60)
    finally:
        for p in ps:
            if p.poll() is None:
                p.kill()
                p.wait()
    lat = [x for o in outs for x in o["lat"]]
    errors: Counter = Counter()
    nodes: Counter = Counter()
    for o in outs:
        errors.update(o["errors"])
        nodes.update(o["nodes"])
    terr: Counter = Counter()
    for e in ends:
        terr.update(e["errors"])
    return {"lat": lat, "errors": dict(errors), "ok": len(lat),
            "wall": max(o["span"][1] for o in outs) - min(o["span"][0] for o in outs),
            "nodes": dict(nodes), "listed": listed, "unlisted": unlisted, "table_live": table_live,
            "mem": mem1 - mem0,
            "teardown": max(e["ended"][1] for e in ends) - min(e["ended"][0] for e in ends),
            "terminate_errors": dict(terr)}


# ------------------------------------------------------------------ main


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sandboxes", type=int, default=3000, help="live at once (issue 18's target: 3,000)")
    ap.add_argument("--clients", type=int, default=50, help="concurrent creating clients")
    ap.add_argument("--procs", type=int, default=5, help="client processes (each a Ray driver)")
    ap.add_argument("--nodes", type=int, default=3, help="Ray nodes, one hutch daemon each")
    ap.add_argument("--n", type=int, default=100, help="side-by-side creates per side (3x that per-call samples)")
    ap.add_argument("--image", default="debian-slim", help="hutch image ref")
    ap.add_argument("--write", metavar="MD", help="also write the results as Markdown to this file")
    ap.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--threads", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--tag", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker is not None:
        return worker(a.worker, a.threads, a.image, a.tag)
    raise_nofile()
    load0 = os.getloadavg()
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    tmp = Path(tempfile.mkdtemp(prefix="hutch-bench-fleet-"))
    # every node may take them all: the caps are not what this measures (placement balances them)
    cap = max(a.sandboxes, 100)
    tag = secrets.token_hex(4)
    after_stop: tuple = ([], {})
    t_up = time.monotonic()
    c = Cluster(a.nodes, cap, tmp)
    up_s = time.monotonic() - t_up
    try:
        print(f"fleet up: {len(c.rows)} nodes in {up_s:.0f} s; side by side, n={a.n} ...", file=sys.stderr)
        sbs = side_by_side(c, a.image, a.n, tag)
        load_idle = os.getloadavg()
        print(f"{a.sandboxes} sandboxes from {a.clients} clients in {a.procs} processes ...", file=sys.stderr)
        m = mass(c, a.image, a.sandboxes, a.clients, a.procs, tag)
        left = leftovers(c, tag)
        rows = c.rows
    finally:
        c.close()
        after_stop = node_resources(c.run_root, c.rows)
        shutil.rmtree(tmp, ignore_errors=True)
    load1 = os.getloadavg()
    uptime = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()

    over = {k: statistics.median(v["fleet"]) - statistics.median(v["direct"]) for k, v in sbs.items()}
    first = sbs["create -> first exec"]["fleet"]
    lines = [
        f"Machine: {os.cpu_count()} cores, {os.uname().release}, {Path('/proc/meminfo').read_text().split()[1]} kB; "
        f"image `{a.image}`; {started}; load average (1/5/15 min) {load0[0]:.1f}/{load0[1]:.1f}/{load0[2]:.1f} at "
        f"the start, {load_idle[0]:.1f} after the side-by-side part, {load1[0]:.1f}/{load1[1]:.1f}/{load1[2]:.1f} "
        f"at the end (`uptime`: {uptime}; other work shares the machine).",
        f"A {a.nodes}-node local Ray cluster (one GCS, {a.nodes} raylets on {LOOPBACK}), `hutch fleet up` in "
        f"{up_s:.0f} s (the cluster's start included).",
        "",
        "**Through the fleet against a direct daemon, side by side** (this process, one call at a time, the two "
        "interleaved; direct: a node's daemon over its Unix socket with the one-host client). p50 / p99 in ms.",
        "",
        "| call | fleet | direct daemon | fleet's overhead at p50 | target |",
        "|---|---|---|---|---|",
    ]
    for k, v in sbs.items():
        target = {"create -> first exec": "fleet p50 <= 25", "run(\"true\")": "overhead <= 2"}.get(k, "")
        met = ""
        if k == "create -> first exec":
            met = ": met" if statistics.median(first) <= 25 else ": missed"
        elif k == "run(\"true\")":
            met = ": met" if over[k] <= 2 else ": missed"
        lines.append(f"| {k} (n={len(v['fleet'])}) | {cell(v['fleet'])} | {cell(v['direct'])} | {over[k]:+.2f} | "
                     f"{target}{met} |")
    errs = sum(m["errors"].values())
    lines += [
        "",
        f"**{a.sandboxes} live at once**, created by {a.clients} concurrent clients ({a.procs} processes, each a Ray "
        f"driver, of {max(1, a.clients // a.procs)} threads), idle, network none:",
        "",
        "| creates/s | create p50 / p99 (ms) | errors | per node (ids) | live per the table | listed | "
        "system memory | all terminated in | leftovers |",
        "|---|---|---|---|---|---|---|---|---|",
        f"| {m['ok'] / m['wall']:.1f} | {cell(m['lat'])} | {errs} | "
        f"{' / '.join(str(m['nodes'].get(r['key'], 0)) for r in rows)} | "
        f"{' / '.join(str(m['table_live'].get(r['key'], '?')) for r in rows)} | {m['listed']} | "
        f"{m['mem']:.0f} MiB ({m['mem'] / max(1, m['ok']):.2f} per sandbox) | {m['teardown']:.1f} s | {len(left)} |",
        "",
        f"After `hutch fleet down` and the cluster's end: {len(after_stop[0])} mounts and "
        f"{sum(after_stop[1].values())} cgroups of the nodes' daemons left.",
    ]
    if m["errors"]:
        lines.append("Errors: " + "; ".join(f"{k} x{v}" for k, v in m["errors"].items()))
    if m["unlisted"]:
        lines.append("Created but not listed: " + "; ".join(m["unlisted"]))
    if m["terminate_errors"]:
        lines.append("Terminate errors: " + "; ".join(f"{k} x{v}" for k, v in m["terminate_errors"].items()))
    if left:
        lines.append(f"Left: {left[:5]}")
    text = "\n".join(lines)
    print(text)
    if a.write:
        write_section(Path(a.write), "fleet.py", "The fleet on Ray", text)


if __name__ == "__main__":
    main()
