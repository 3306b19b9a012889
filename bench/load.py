"""Load test of the daemon: many concurrent clients creating, execing and terminating sandboxes.

    .venv/bin/python bench/load.py [--cycles 1000] [--clients 50] [--procs 5] [--rounds 4] [--quick] [--write docs/benchmarks.md]

`--procs` client processes (one per future tenant: issue 17) of `--clients / --procs` threads each run
`--cycles` cycles in all through the public SDK: `Sandbox.create`, `run("true")`, `terminate()`. Reported:
throughput (cycles per second of wall time), p50 / p99 per operation, errors by kind (target 0), and
leftovers (sandboxes listed, mounts and cgroups of the daemon's) at the end and after the daemon stopped
(target 0). Run side by side, in the same run:
  - hutch over TCP with TLS and a bearer token (the remote clients of a platform);
  - hutch over the Unix socket (the same load without TLS: what the transport costs);
  - bwrap, 50 concurrent workers each running `bwrap ... true` on its own overlay of the same root per
    cycle (create, exec and terminate in one process: the floor of a sandbox without an API or a daemon);
  - hutch over TCP with TLS on a daemon with `--procs` tenants, each client process one of them with its own
    token (tenants on vs off, side by side: both daemons run at once, and the three hutch loads are taken in
    turn, `--rounds` rounds, so a shared machine's shifting load falls on each alike).
The daemons are private ones (their own run directories, certificates and tokens), started and stopped here.

    .venv/bin/python bench/load.py --tenants 5 [--phase-seconds 40] [--burst 24] [--steady 1] [--write ...]

is the fairness run instead (issue 17, docs/tenants.md): a daemon with 5 tenants, each client process one
tenant with its own token over TCP; tenants 1-4 steady (create -> run -> terminate back to back) for a phase
alone, then for a phase while tenant 0 bursts; each tenant's create p50 / p99 quiet and under the burst, the
ratio, errors, leftovers. The peer, in the same run: the same load on a daemon without tenants (every process
with the operator's token, no fair slots).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import resource
import secrets
import socket
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
sys.path.insert(0, str(ROOT_DIR / "bench"))

TAG_KEY = "bench-load"
OPS = ("create", "exec", "terminate", "cycle")


# ------------------------------------------------------------------ one client process


def worker(cycles: int, threads: int, image: str, tag: str, seconds: float = 0.0, start_at: float = 0.0) -> dict:
    """Run `cycles` cycles on `threads` threads (or, with `seconds`, cycles for that long from the wall-clock
    time `start_at`); the SDK finds the daemon from the environment."""
    import hutch

    lat = {op: [] for op in OPS}
    errors: Counter = Counter()
    left = [cycles]
    lock = threading.Lock()
    end = [0.0]

    def take() -> bool:
        if seconds:
            return time.time() < end[0]
        with lock:
            if left[0] <= 0:
                return False
            left[0] -= 1
            return True

    def loop():
        while take():
            t0 = time.perf_counter()
            sb = None
            try:
                sb = hutch.Sandbox.create(image=image, tags={TAG_KEY: tag})
                t1 = time.perf_counter()
                res = sb.run("true")
                if res.returncode != 0:
                    raise RuntimeError(f"true exited {res.returncode}")
                t2 = time.perf_counter()
                sb.terminate()
                t3 = time.perf_counter()
            except Exception as e:  # noqa: BLE001 - counted, the load goes on
                kind = f"{type(e).__name__}: {str(e)[:80]}"
                if not errors[kind]:   # where the first of each kind came from, for the daemon's log reader
                    print("".join(traceback.format_exception(e)[-6:]), file=sys.stderr)
                errors[kind] += 1
                if sb is not None:
                    try:
                        sb.terminate()
                    except Exception:  # noqa: BLE001
                        pass
                continue
            with lock:
                for op, d in zip(OPS, (t1 - t0, t2 - t1, t3 - t2, t3 - t0)):
                    lat[op].append(d * 1000)

    import hutch.sandbox._client  # noqa: F401 - imported before the clock starts
    if start_at:
        time.sleep(max(0.0, start_at - time.time()))
    start = time.time()
    end[0] = start + seconds
    with cf.ThreadPoolExecutor(threads) as ex:
        for f in [ex.submit(loop) for _ in range(threads)]:
            f.result()
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return {"lat": lat, "errors": dict(errors), "span": (start, time.time()), "cpu": ru.ru_utime + ru.ru_stime}


def run_clients(env, cycles: int, clients: int, procs: int, image: str, tag: str) -> dict:
    """Start `procs` client processes at once (process i with `env(i)`); merge what they measured."""
    per = [cycles // procs + (i < cycles % procs) for i in range(procs)]
    threads = max(1, clients // procs)
    ps = [subprocess.Popen([sys.executable, __file__, "--worker", str(n), "--threads", str(threads), "--image", image,
                            "--tag", tag], env=env(i), stdout=subprocess.PIPE, text=True) for i, n in enumerate(per)]
    outs = [json.loads(p.communicate()[0]) for p in ps]
    wall = max(o["span"][1] for o in outs) - min(o["span"][0] for o in outs)   # the load, not the imports
    lat = {op: [x for o in outs for x in o["lat"][op]] for op in OPS}
    client_cpu = sum(o["cpu"] for o in outs)
    errors: Counter = Counter()
    for o in outs:
        errors.update(o["errors"])
    return {"lat": lat, "errors": dict(errors), "wall": wall, "ok": len(lat["cycle"]), "client_cpu": client_cpu}


def tree_cpu(pid: int) -> float:
    """CPU seconds of `pid` and its reaped children (the zygote, and through it every init it reaped), and
    of its live children."""
    def of(p, children: bool) -> float:
        try:
            f = Path(f"/proc/{p}/stat").read_text().rpartition(")")[2].split()
        except OSError:
            return 0.0
        ticks = int(f[11]) + int(f[12]) + ((int(f[13]) + int(f[14])) if children else 0)
        return ticks / os.sysconf("SC_CLK_TCK")
    total = of(pid, True)
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            total += of(child, True)
    return total


# ------------------------------------------------------------------ the daemon and what it leaves


class PrivateDaemon:
    """`hutch serve` with its own run directory, listening on loopback TCP with a fresh certificate and token."""

    def __init__(self, base: Path, tenants: int = 0):
        """`tenants`: serve that many tenants (`--tenants`), their tokens' files in `self.tenant_tokens`."""
        self.base = base
        self.run_dir = base / "run"
        self.run_dir.mkdir()
        extra = []
        self.tenant_tokens: list[Path] = []
        if tenants:
            from hutch.sandbox._host.daemon import tenants as T

            tf = base / "tenants.json"
            for i in range(tenants):
                p = base / f"tenant{i}.token"
                p.write_text(T.add(tf, f"t{i}", T.Quotas()))
                p.chmod(0o600)
                self.tenant_tokens.append(p)
            extra = ["--tenants", str(tf)]
        tls_state = base / "tls-state"
        fp = subprocess.run([sys.executable, "-m", "hutch", "tls-fingerprint"], capture_output=True, text=True,
                            env=dict(os.environ, HUTCH_STATE_DIR=str(tls_state)), check=True, timeout=60).stdout
        self.fingerprint = fp.strip().split()[-1]
        self.token_file = base / "token"
        self.token_file.write_text(secrets.token_hex(24))
        self.token_file.chmod(0o600)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        env = dict(os.environ, HUTCH_RUN_DIR=str(self.run_dir), HUTCH_SOCKET=str(self.run_dir / "hutch.sock"))
        env.pop("HUTCH_URL", None)
        self.log = open(base / "daemon.log", "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "hutch", "serve", "--listen", f"127.0.0.1:{self.port}",
             "--token-file", str(self.token_file), "--tls-cert", str(tls_state / "tls" / "daemon.crt"),
             "--tls-key", str(tls_state / "tls" / "daemon.key"), *extra],
            env=env, stdout=self.log, stderr=self.log, stdin=subprocess.DEVNULL, start_new_session=True)
        self.unix_env = {k: v for k, v in env.items() if not k.startswith("HUTCH_TOKEN")}
        self.tcp_env = dict(self.unix_env, HUTCH_URL=f"https://127.0.0.1:{self.port}",
                            HUTCH_TOKEN_FILE=str(self.token_file), HUTCH_FINGERPRINT=self.fingerprint)
        import httpx

        self.http = httpx.Client(transport=httpx.HTTPTransport(uds=str(self.run_dir / "hutch.sock")),
                                 base_url="http://hutch", timeout=30)
        for _ in range(600):
            try:
                if self.http.get("/v1/health").status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        raise SystemExit(f"the daemon did not start; see {base / 'daemon.log'}")

    def tenant_env(self, i: int) -> dict:
        """The SDK's environment of tenant `i` (its token), or of the operator's token without tenants."""
        if not self.tenant_tokens:
            return self.tcp_env
        return dict(self.tcp_env, HUTCH_TOKEN_FILE=str(self.tenant_tokens[i]))

    def listed(self, tag: str) -> list[str]:
        return [s["id"] for s in self.http.get("/v1/sandboxes", params={"tag": f"{TAG_KEY}:{tag}"}).json()["sandboxes"]]

    def warm_target(self) -> int:
        return self.http.get("/v1/doctor").json()["warm_pool"]["target"]

    def stop(self) -> None:
        self.http.close()
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def resources(run_dir: Path) -> tuple[list[str], list[str]]:
    """Mounts under the daemon's run directory, and its sandboxes' cgroups (the zygote's leaf aside)."""
    from hutch.sandbox._host.daemon import cgroup_parent_for

    prefix = str(run_dir.resolve()) + "/"
    mounts = [ln.split()[4] for ln in Path("/proc/self/mountinfo").read_text().splitlines()
              if ln.split()[4].startswith(prefix)]
    parent = cgroup_parent_for(run_dir)
    cgroups = set()
    base = Path("/sys/fs/cgroup")
    for ctrl in [base, *[c for c in base.iterdir() if c.is_dir()]]:
        d = ctrl / parent
        if d.is_dir():
            cgroups |= {c.name for c in d.iterdir() if c.is_dir() and c.name != "_zygote"}
    return mounts, sorted(cgroups)


def leftovers(d: PrivateDaemon, tag: str) -> list[str]:
    """What the load left while the daemon runs: its sandboxes still listed, mounts of sandboxes, cgroups
    beyond the warm pool's (warm inits have a cgroup and no root); waits a little for the pool to settle."""
    deadline = time.monotonic() + 10
    while True:
        listed = d.listed(tag)
        mounts, cgroups = resources(d.run_dir)
        mounts = [m for m in mounts if "/mnt/" in m]
        extra = len(cgroups) - d.warm_target()
        if (not listed and not mounts and extra <= 0) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    return ([f"sandbox {i}" for i in listed] + [f"mount {m}" for m in mounts]
            + ([f"{extra} cgroups beyond the warm pool"] if extra > 0 else []))


# ------------------------------------------------------------------ the peer


def bwrap_load(root: Path, cycles: int, clients: int) -> dict:
    from sandbox import Overlay, bwrap_argv   # bench/sandbox.py's bwrap peer: same flags, same overlay

    lat, errors = [], Counter()

    def one(_):
        t0 = time.perf_counter()
        ov = Overlay(root)
        try:
            subprocess.run(bwrap_argv(ov.merged, ["true"]), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           check=True)
        except Exception as e:  # noqa: BLE001
            errors[type(e).__name__] += 1
            return None
        finally:
            ov.close()
        return (time.perf_counter() - t0) * 1000

    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(clients) as ex:
        lat = [x for x in ex.map(one, range(cycles)) if x is not None]
    return {"lat": {"cycle": lat}, "errors": dict(errors), "wall": time.perf_counter() - t0, "ok": len(lat)}


# ------------------------------------------------------------------ fairness between tenants


def phase(d: PrivateDaemon, who: list[tuple[int, int]], seconds: float, image: str, tag: str) -> dict:
    """Tenants `(i, clients)` at once for `seconds` (started together); each one's results by i."""
    start_at = time.time() + 3.0   # every process imported and connected first
    ps = {i: subprocess.Popen([sys.executable, __file__, "--worker", "0", "--threads", str(n), "--image", image,
                               "--tag", tag, "--seconds", str(seconds), "--start-at", str(start_at)],
                              env=d.tenant_env(i), stdout=subprocess.PIPE, text=True) for i, n in who}
    return {i: json.loads(p.communicate()[0]) for i, p in ps.items()}


def fairness(d: PrivateDaemon, n: int, a) -> dict:
    """Quiet: the steady tenants alone; burst: the same with tenant 0 bursting. Per tenant: creates' latencies."""
    steady = [(i, a.steady) for i in range(1, n)]
    out = {}
    for name, who in (("quiet", steady), ("burst", [(0, a.burst)] + steady)):
        tag = secrets.token_hex(4)
        print(f"  {name}: {who} for {a.phase_seconds:g} s ...", file=sys.stderr)
        out[name] = phase(d, who, a.phase_seconds, a.image, tag)
        out[name + "_left"] = leftovers(d, tag)
    return out


def tenants_main(a) -> None:
    n = a.tenants
    load0 = os.getloadavg()[0]
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    runs = {}
    for name, k in ((f"{n} tenants (fair create slots)", n), ("one operator token, no tenants (today)", 0)):
        with tempfile.TemporaryDirectory(prefix="hutch-load-") as tmp:
            print(f"{name}:", file=sys.stderr)
            d = PrivateDaemon(Path(tmp), tenants=k)
            try:
                runs[name] = fairness(d, n, a)
            finally:
                d.stop()
            runs[name]["after_stop"] = resources(d.run_dir)
    load1 = os.getloadavg()[0]
    lines = [
        f"Machine: {os.cpu_count()} cores, {os.uname().release}; image `{a.image}`; {started}; load average "
        f"{load0:.1f} at the start, {load1:.1f} at the end (other work shares the machine).",
        f"{n - 1} steady tenants ({a.steady} client(s) each, create -> `run(\"true\")` -> terminate back to back) "
        f"for {a.phase_seconds:g} s alone (quiet), then {a.phase_seconds:g} s while tenant 0 bursts with {a.burst} "
        "concurrent clients; over TCP + TLS, each tenant a process with its own token. Create p50 / p99 in ms; "
        "ratio: burst p99 / quiet p99 (target <= 2). The peer: the same load on a daemon without tenants, every "
        "process with the operator's token (no fair slots).",
        "",
        "| daemon | tenant | creates quiet | create quiet p50 / p99 | creates under burst | create under burst p50 / p99 | p99 ratio | errors | leftovers |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in runs.items():
        for i in range(n):
            q, b = r["quiet"].get(i), r["burst"].get(i)
            qc = q["lat"]["create"] if q else []
            bc = b["lat"]["create"]
            ratio = f"{pct(bc, 99) / pct(qc, 99):.2f}" if qc and bc else "-"
            errs = sum((q or {"errors": {}})["errors"].values()) + sum(b["errors"].values())
            left = len(r["quiet_left"]) + len(r["burst_left"]) if i == 0 else ""
            lines.append(f"| {name} | t{i}{' (bursts)' if i == 0 else ''} | {len(qc) if q else '-'} | "
                         f"{cell(q, 'create') if q else '-'} | {len(bc)} | {cell(b, 'create')} | {ratio} | {errs} | "
                         f"{left} |")
    for name, r in runs.items():
        worst = max((pct(r["burst"][i]["lat"]["create"], 99) / pct(r["quiet"][i]["lat"]["create"], 99)
                     for i in range(1, n) if r["quiet"][i]["lat"]["create"] and r["burst"][i]["lat"]["create"]),
                    default=float("nan"))
        m, c = r["after_stop"]
        lines.append(f"\n{name}: worst steady tenant's p99 ratio {worst:.2f}; after the daemon stopped {len(m)} "
                     f"mounts and {len(c)} cgroups left.")
        for ph in ("quiet", "burst"):
            for i, o in r[ph].items():
                if o["errors"]:
                    lines.append(f"Errors ({name}, {ph}, t{i}): " + "; ".join(f"{k} x{v}" for k, v in o["errors"].items()))
    text = "\n".join(lines)
    print(text)
    if a.write:
        write_section(Path(a.write), "load.py --tenants", "Load: fairness between tenants", text)


# ------------------------------------------------------------------ main


def cell(r: dict, op: str) -> str:
    xs = r["lat"].get(op) or []
    return f"{statistics.median(xs):.1f} / {pct(xs, 99):.1f}" if xs else "n/a"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cycles", type=int, default=1000)
    ap.add_argument("--clients", type=int, default=50)
    ap.add_argument("--procs", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=4, help="the hutch runs taken in turn, this many rounds")
    ap.add_argument("--image", default="debian-slim", help="hutch image ref (bwrap runs on its root too)")
    ap.add_argument("--quick", action="store_true", help="200 cycles (a smoke test of the benchmark)")
    ap.add_argument("--write", metavar="MD", help="also write the results as Markdown to this file")
    ap.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--threads", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--tag", help=argparse.SUPPRESS)
    ap.add_argument("--seconds", type=float, default=0.0, help=argparse.SUPPRESS)
    ap.add_argument("--start-at", type=float, default=0.0, help=argparse.SUPPRESS)
    ap.add_argument("--tenants", type=int, default=0, metavar="N",
                    help="the fairness run instead: N tenants, one bursting, the others steady (issue 17)")
    ap.add_argument("--phase-seconds", type=float, default=20.0, help="--tenants: seconds of each phase")
    ap.add_argument("--burst", type=int, default=24, help="--tenants: concurrent clients of the bursting tenant")
    ap.add_argument("--steady", type=int, default=1, help="--tenants: concurrent clients of each steady tenant")
    a = ap.parse_args()
    if a.worker is not None:
        print(json.dumps(worker(a.worker, a.threads, a.image, a.tag, a.seconds, a.start_at)))
        return
    if a.tenants:
        return tenants_main(a)
    if a.quick:
        a.cycles = 200
    from hutch.sandbox._host.images import resolve_image

    root = resolve_image(a.image).lowerdirs[-1]
    load0 = os.getloadavg()[0]
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    results, left, after_stop = {}, {}, []
    # the same load on a daemon without tenants (TCP, the Unix socket) and on one with a tenant per client process
    # (its own token over TCP: scoping, quota accounts, fair create slots); both daemons up at once and the three
    # taken in turn, `--rounds` rounds of cycles/rounds each, the order reversed every other round, so that a
    # load that shifts on a shared machine falls on each alike
    tenants_name = f"hutch, TCP + TLS, {a.procs} tenants"
    with tempfile.TemporaryDirectory(prefix="hutch-load-") as tmp0, tempfile.TemporaryDirectory(prefix="hutch-load-") as tmp1:
        plain = PrivateDaemon(Path(tmp0))
        ten = None
        try:
            ten = PrivateDaemon(Path(tmp1), tenants=a.procs)
            order = [("hutch, TCP + TLS", plain, lambda i: plain.tcp_env), ("hutch, Unix socket", plain, lambda i: plain.unix_env),
                     (tenants_name, ten, ten.tenant_env)]
            rounds = max(1, a.rounds)
            for r in range(rounds):
                n = a.cycles // rounds + (r < a.cycles % rounds)
                for name, d, env in (order if r % 2 == 0 else order[::-1]):
                    tag = secrets.token_hex(4)
                    print(f"{name}, round {r + 1}/{rounds}: {n} cycles, {a.clients} clients in {a.procs} processes ...",
                          file=sys.stderr)
                    cpu0 = tree_cpu(d.proc.pid)
                    got = run_clients(env, n, a.clients, a.procs, a.image, tag)
                    got["daemon_cpu"] = tree_cpu(d.proc.pid) - cpu0
                    acc = results.setdefault(name, {"lat": {op: [] for op in OPS}, "errors": {}, "wall": 0.0, "ok": 0,
                                                    "client_cpu": 0.0, "daemon_cpu": 0.0})
                    for op in OPS:
                        acc["lat"][op] += got["lat"][op]
                    acc["errors"] = dict(Counter(acc["errors"]) + Counter(got["errors"]))
                    for k in ("wall", "ok", "client_cpu", "daemon_cpu"):
                        acc[k] += got[k]
                    left.setdefault(name, []).extend(leftovers(d, tag))
        finally:
            for d in (plain, ten):
                if d is not None:
                    d.stop()
                    after_stop += [f"mount {m}" for m in resources(d.run_dir)[0]] + [f"cgroup {c}" for c in resources(d.run_dir)[1]]
    print(f"bwrap: {a.cycles} cycles, {a.clients} workers ...", file=sys.stderr)
    results["bwrap"] = bwrap_load(root, a.cycles, a.clients)
    left["bwrap"] = []
    load1 = os.getloadavg()[0]

    hutch_tcp = results["hutch, TCP + TLS"]
    lines = [
        f"Machine: {os.cpu_count()} cores, {os.uname().release}; image `{a.image}`; {started}; load average "
        f"{load0:.1f} at the start, {load1:.1f} at the end (other work shares the machine: compare the ratios).",
        f"{a.cycles} cycles of create -> `run(\"true\")` -> terminate, from {a.clients} concurrent clients "
        f"({a.procs} processes of {max(1, a.clients // a.procs)} threads; the peer: {a.clients} workers). "
        f"p50 / p99 in ms. The {a.procs} tenants row: a daemon with `--tenants`, each client process a tenant with "
        "its own token (no quotas set: what scoping, accounting and the fair create slots cost); the rows above "
        f"it: a daemon without tenants, the operator's token; both daemons up at once, the three hutch rows taken "
        f"in turn in {max(1, a.rounds)} rounds (order reversed every other round), then bwrap.",
        "",
        "| | cycles/s (= creates/s) | create | exec | terminate | whole cycle | errors | leftovers |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        errs = sum(r["errors"].values())
        lines.append(f"| {name} | {r['ok'] / r['wall']:.0f} | {cell(r, 'create')} | {cell(r, 'exec')} | "
                     f"{cell(r, 'terminate')} | {cell(r, 'cycle')} | {errs} | {len(left[name])} |")
    lines += ["", "CPU per cycle (ms): " + "; ".join(
        f"{name}: clients {1000 * r['client_cpu'] / max(1, r['ok']):.1f}, daemon with its zygote and inits "
        f"{1000 * r['daemon_cpu'] / max(1, r['ok']):.1f}" for name, r in results.items() if "daemon_cpu" in r) + "."]
    b = results["bwrap"]["lat"]["cycle"]
    h = hutch_tcp["lat"]["cycle"]
    if b and h:
        lines += ["", f"hutch over TCP / bwrap, whole cycle: p50 {statistics.median(h) / statistics.median(b):.2f}, "
                      f"p99 {pct(h, 99) / pct(b, 99):.2f}; throughput "
                      f"{(hutch_tcp['ok'] / hutch_tcp['wall']) / (results['bwrap']['ok'] / results['bwrap']['wall']):.2f}x."]
    tc, oc = results[tenants_name]["lat"]["create"], hutch_tcp["lat"]["create"]
    if tc and oc:
        lines += [f"Tenants on / off (TCP + TLS), create: p50 {statistics.median(tc) / statistics.median(oc):.2f}, "
                  f"p99 {pct(tc, 99) / pct(oc, 99):.2f}; throughput "
                  f"{(results[tenants_name]['ok'] / results[tenants_name]['wall']) / (hutch_tcp['ok'] / hutch_tcp['wall']):.2f}x."]
    for name, r in results.items():
        if r["errors"]:
            lines.append(f"Errors ({name}): " + "; ".join(f"{k} x{n}" for k, n in r["errors"].items()))
        if left[name]:
            lines.append(f"Left ({name}): {left[name][:5]}")
    lines.append(f"After the daemon stopped: {len(after_stop)} mounts or cgroups left {after_stop[:3]}.")
    text = "\n".join(lines)
    print(text)
    if a.write:
        write_section(Path(a.write), "load.py", "Load", text)


if __name__ == "__main__":
    main()
