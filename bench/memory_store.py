"""Benchmark of the SMF store (hutch.Memory): writes, reads, check() and ingest, each beside a peer.

    .venv/bin/python bench/memory_store.py            # 100,000-entity synthetic store (a few minutes)
    .venv/bin/python bench/memory_store.py --n 20000  # smaller
    .venv/bin/python bench/memory_store.py --write docs/benchmarks.md   # also write its section there

Peers (run side by side, same machine, same bytes):
- writes in one transaction: the same entity files written with hutch._core.atomic, an fsync each (what
  "a durable file per entity" costs), and the floor: no fsync at all, one `sync` at the end;
- one commit per write: an atomic write plus `git add` + `git commit` run directly in a copy of the same
  store's repository, interleaved with hutch's puts, at 1,000 / 10,000 / 100,000 entities;
- get: open + read + yaml.CSafeLoader of the same file (what a plain front-matter reader costs);
- check: walking the store and reading every file, without parsing.
Aims (issue 16): >= 2,000 entity writes/s inside one transaction; a single put p50 <= 30 ms at 100,000
entities; get p50 <= 1 ms.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

from _report import pct, write_section  # bench/ is the script's directory

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import yaml  # noqa: E402

import hutch  # noqa: E402
from hutch._core import settings  # noqa: E402
from hutch._core.atomic import atomic_write  # noqa: E402
from hutch.memory import _format as fmt  # noqa: E402

LOCOMO = settings.LOCOMO_DIR.get()


def uptime() -> str:
    """`uptime`'s line (load averages: the machine is shared, so every figure is printed beside it)."""
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return "load average " + ", ".join(f"{x:.2f}" for x in os.getloadavg())


def row(name: str, ours: list[float] | float, peer: list[float] | float | None, unit: str = "ms") -> None:
    """Print median / p99 of ours and the peer, and the ratio of the medians."""
    o = ours if isinstance(ours, list) else [ours]
    m, p99 = statistics.median(o), pct(o, 99)
    line = f"  {name:<44} median {m:10.3f} {unit}  p99 {p99:10.3f} {unit}"
    if peer is not None:
        pe = peer if isinstance(peer, list) else [peer]
        pm = statistics.median(pe)
        line += f"   peer {pm:10.3f} {unit}  ratio {m / pm if pm else float('nan'):6.2f}x"
    print(line, flush=True)


def du(path: Path, exclude_git: bool = False) -> tuple[int, int]:
    """(apparent bytes, allocated bytes) under path."""
    apparent = blocks = 0
    for dirpath, dirnames, filenames in os.walk(path):
        if exclude_git:
            dirnames[:] = [d for d in dirnames if d not in (".git", ".hutch")]
        for n in filenames:
            st = os.lstat(os.path.join(dirpath, n))
            apparent += st.st_size
            blocks += st.st_blocks * 512
    return apparent, blocks


def mb(n: int) -> str:
    return f"{n / 1e6:8.2f} MB"


def synthetic_entity(i: int) -> tuple[str, str, str, list[str]]:
    rnd = random.Random(i)
    words = ["customer", "churn", "report", "weekly", "budget", "model", "latency", "index", "memory", "agent"]
    title = f"entity {i} {rnd.choice(words)}"
    body = " ".join(rnd.choice(words) for _ in range(40)) + ".\n"
    facts = [" ".join(rnd.choice(words) for _ in range(6)) for _ in range(3)]
    return f"class{i % 20}", title, body, facts


def bulk_load(store: Path, n: int) -> float:
    """n synthetic entities (a link every 10th) in ONE transaction; the seconds it took."""
    mem = hutch.Memory(store)
    ents = [synthetic_entity(i) for i in range(n)]
    t0 = time.perf_counter()
    with mem.transaction("bench: bulk load", source="bench"):
        last = None
        for i, (cls, title, body, facts) in enumerate(ents):
            e = mem.put(cls, title, body=body, facts=facts, source=f"bench#{i}")
            if i % 10 == 0 and last is not None:
                mem.link(e, "related", last)
            last = e
    return time.perf_counter() - t0


def bench_writes(root: Path, n: int, results: dict) -> Path:
    print(f"\n== writes: {n:,} synthetic entities in ONE transaction (one commit)")
    store = root / "synthetic"
    ours = bulk_load(store, n)
    texts = [p.read_bytes() for p in sorted((store / "class0").glob("*.md"))[:1000]]
    # peer: the same bytes as plain atomic files with an fsync each (a durable file per entity)
    pn = min(n, 20_000)
    peer_dir = root / "peer-fsync"
    t0 = time.perf_counter()
    for k in range(pn):
        d = peer_dir / f"class{k % 20}"
        if k < 20:
            d.mkdir(parents=True, exist_ok=True)
        atomic_write(d / f"{k}.md", texts[k % len(texts)], fsync_dir=False, fsync_file=True)
    fsync_peer = time.perf_counter() - t0
    shutil.rmtree(peer_dir)
    # floor: the same files, no fsync at all, one sync at the end
    floor_dir = root / "peer-nosync"
    t0 = time.perf_counter()
    for k in range(n):
        d = floor_dir / f"class{k % 20}"
        if k < 20:
            d.mkdir(parents=True, exist_ok=True)
        atomic_write(d / f"{k}.md", texts[k % len(texts)], fsync_dir=False, fsync_file=False)
    subprocess.run(["sync"], check=True)
    floor = time.perf_counter() - t0
    shutil.rmtree(floor_dir)
    rate, prate, frate = n / ours, pn / fsync_peer, n / floor
    results["tx"] = (rate, prate, frate, pn, uptime())
    print(f"  entity writes/s (incl. links, one sync, the commit): {rate:10,.0f}   "
          f"peer (plain files, an fsync each, {pn:,} files): {prate:10,.0f}   ratio {rate / prate:5.2f}x   "
          f"floor (no fsync, one sync): {frate:10,.0f}   aim >= 2,000/s: {'MET' if rate >= 2000 else 'NOT MET'}")
    print(f"  {results['tx'][4]}")
    return store


def bench_single_commits(root: Path, big: Path, n: int, sizes: list[int], m: int, results: dict) -> None:
    """One commit per write at each store size; beside it, plain `git add` + `git commit` in the same repository,
    interleaved so both see the same load."""
    env = dict(os.environ, GIT_AUTHOR_NAME="p", GIT_AUTHOR_EMAIL="p@x", GIT_COMMITTER_NAME="p",
               GIT_COMMITTER_EMAIL="p@x")
    for size in sizes:
        store = big if size == n else root / f"store-{size}"
        if size != n:
            bulk_load(store, size)
        # the peer works in a copy of the same repository: its `git commit` rewrites git's index its own way
        # (adding the cache-tree hutch does not keep), which would otherwise change what hutch's writes cost
        peer = root / f"peer-{size}"
        shutil.copytree(store, peer, symlinks=True)
        mem = hutch.Memory(store)
        print(f"\n== writes: {m} entities, ONE COMMIT PER WRITE, in a {len(mem.ls()):,}-entity store")
        data = mem.get(mem.ls()[0]).text.encode()
        (peer / "peer").mkdir(exist_ok=True)
        lat, plat = [], []
        for i in range(m):
            t = time.perf_counter()
            mem.put("single", f"single {i}", body="one commit each\n", facts=["x"])
            lat.append((time.perf_counter() - t) * 1000)
            t = time.perf_counter()
            atomic_write(peer / "peer" / f"{i}.md", data)
            subprocess.run(["git", "-C", str(peer), "add", "--", f"peer/{i}.md"], check=True, env=env)
            subprocess.run(["git", "-C", str(peer), "commit", "-qm", f"{i}"], check=True, env=env)
            plat.append((time.perf_counter() - t) * 1000)
        shutil.rmtree(peer)
        row(f"put, one commit each ({size:,} entities)", lat, plat)
        results.setdefault("single", []).append((size, lat, plat, uptime()))
        print(f"  {results['single'][-1][3]}")
        if size == max(sizes):
            ok = statistics.median(lat) <= 30
            print(f"  put p50 {statistics.median(lat):.1f} ms at {size:,} entities   aim <= 30 ms: "
                  f"{'MET' if ok else 'NOT MET'}")


def bench_get(store: Path, results: dict, samples: int = 3000) -> None:
    mem = hutch.Memory(store)
    ids = mem.ls()
    print(f"\n== get: {samples} random reads from {len(ids):,} entities")
    rnd = random.Random(7)
    pick = [rnd.choice(ids) for _ in range(samples)]
    for i in pick[:200]:  # warm the page cache for both
        mem.get(i)
    ours, peer = [], []
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    for i in pick:
        t = time.perf_counter()
        mem.get(i)
        ours.append((time.perf_counter() - t) * 1000)
        t = time.perf_counter()
        with open(store / f"{i}.md", "rb") as f:
            text = f.read().decode()
        yaml.load(text.split("---\n", 2)[1], Loader=loader)
        peer.append((time.perf_counter() - t) * 1000)
    row("mem.get", ours, peer)
    results["get"] = (ours, peer)
    print(f"  get p50 {statistics.median(ours):.3f} ms   aim <= 1 ms: {'MET' if statistics.median(ours) <= 1 else 'NOT MET'}")


def bench_check(store: Path) -> None:
    mem = hutch.Memory(store)
    print("\n== check()")
    t = time.perf_counter()
    r = mem.check()
    ours = time.perf_counter() - t
    t = time.perf_counter()
    for dirpath, dirnames, filenames in os.walk(store):
        dirnames[:] = [d for d in dirnames if d not in (".git", ".hutch")]
        for n in filenames:
            p = os.path.join(dirpath, n)
            if not os.path.islink(p):
                with open(p, "rb") as f:
                    f.read()
    peer = time.perf_counter() - t
    row(f"check() on {r.entities:,} entities, {r.links:,} links", ours, peer, unit="s ")
    print(f"  errors {len(r.errors)}, warnings {len(r.warnings)} (orphans are expected in a synthetic store)")
    app, blk = du(store, exclude_git=True)
    gapp, gblk = du(store / ".git")
    print(f"  size: files {mb(app)} apparent, {mb(blk)} allocated; .git {mb(gblk)}")


def bench_ingest(root: Path) -> None:
    files = sorted(LOCOMO.glob("conv-*.json"))
    if not files:
        print(f"\n== ingest: skipped, no LoCoMo files in {LOCOMO}")
        return
    print(f"\n== ingest: {len(files)} LoCoMo dev conversations, one commit each")
    store = root / "locomo"
    mem = hutch.Memory(store)
    raw = 0
    total_entities = 0
    total_t = 0.0
    for f in files:
        raw += f.stat().st_size
        t = time.perf_counter()
        r = mem.ingest_conversation(f)
        dt = time.perf_counter() - t
        total_t += dt
        total_entities += r.count
        turns = sum(e.body.count("\n### ") for e in (mem.get(i) for i in r.entities.get("interactions", [])))
        print(f"  {f.name}: {r.count:4d} entities ({turns} turns), {r.links:4d} links in {dt * 1000:7.1f} ms"
              f"  = {r.count / dt:7.0f} entities/s")
    t = time.perf_counter()
    again = [mem.ingest_conversation(f).commit for f in files]
    print(f"  re-ingest (no change, no commit: {again == [None] * len(files)}): {(time.perf_counter() - t) * 1000:.1f} ms")
    app, blk = du(store, exclude_git=True)
    gapp, gblk = du(store / ".git")
    print(f"  raw JSON input {mb(raw)};  store files {mb(app)} apparent ({app / raw:4.2f}x raw),"
          f" {mb(blk)} allocated;  .git {mb(gblk)}")
    print("  note: raw JSON includes qa/observations/summaries that are not ingested")
    r = mem.check()
    print(f"  check: {r.entities} entities, {r.links} links, {len(r.errors)} errors, {len(r.warnings)} warnings")


def markdown(results: dict, n: int, load: tuple[float, float]) -> str:
    """The benchmark's section of docs/benchmarks.md."""
    when = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    out = [f"Machine: {os.cpu_count()} cores; {when}; load average {load[0]:.1f} at the start, {load[1]:.1f} at the "
           "end (other work shares the machine: compare the ratios to the peers run side by side).", ""]
    if "tx" in results:
        rate, prate, frate, pn, up = results["tx"]
        out += ["| writes in ONE transaction (one commit) | entity writes/s | hutch / peer | aim |",
                "|---|---|---|---|",
                f"| hutch: {n:,} puts + {n // 10:,} links, one sync, one commit | {rate:,.0f} | | >= 2,000: "
                f"{'met' if rate >= 2000 else 'not met'} |",
                f"| peer: plain files, an fsync each ({pn:,}) | {prate:,.0f} | {rate / prate:.2f}x | |",
                f"| floor: plain files, no fsync, one `sync` | {frate:,.0f} | {rate / frate:.2f}x | |", "",
                f"Right after: `{up}`.", ""]
    if "single" in results:
        out += ["| one commit per write, ms p50 / p99 | hutch `put` | peer: `git add` + `git commit` | hutch / peer "
                "(p50) | aim |", "|---|---|---|---|---|"]
        for size, lat, plat, _up in results["single"]:
            p50 = statistics.median(lat)
            aim = f"<= 30: {'met' if p50 <= 30 else 'not met'}" if size >= 100_000 else ""
            out.append(f"| {size:,} entities (n={len(lat)}) | {p50:.1f} / {pct(lat, 99):.1f} | "
                       f"{statistics.median(plat):.1f} / {pct(plat, 99):.1f} | "
                       f"{p50 / statistics.median(plat):.2f} | {aim} |")
        out += ["", "Right after each: " + "; ".join(f"{size:,}: `{up}`" for size, _, _, up in results["single"]) + ".",
                ""]
    if "get" in results:
        ours, peer = results["get"]
        out += [f"`mem.get` p50 {statistics.median(ours):.3f} ms (open + read + YAML of the same file: "
                f"{statistics.median(peer):.3f} ms); aim <= 1 ms."]
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=100_000, help="synthetic entities (default 100,000)")
    ap.add_argument("--m", type=int, default=100, help="single puts per store size (default 100)")
    ap.add_argument("--sizes", default="1000,10000,100000",
                    help="store sizes of the one-commit-per-write runs (default 1000,10000,100000; capped at --n)")
    ap.add_argument("--dir", help="work directory (default: a temp dir, removed afterwards)")
    ap.add_argument("--skip-ingest", action="store_true", help="leave out the LoCoMo ingest")
    ap.add_argument("--write", metavar="MD", help="also write the results as Markdown to this file")
    args = ap.parse_args()
    sizes = sorted({min(int(x), args.n) for x in args.sizes.split(",")})
    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="hutch-bench-mem-"))
    print(f"hutch memory store benchmark ({os.cpu_count()} CPUs; {fmt.__name__}); work dir {root}")
    print(f"  {uptime()}")
    load0 = os.getloadavg()[0]
    results: dict = {}
    try:
        if not args.skip_ingest:
            bench_ingest(root)
        store = bench_writes(root, args.n, results)
        bench_get(store, results)
        bench_check(store)
        bench_single_commits(root, store, args.n, sizes, args.m, results)
    finally:
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)
    text = markdown(results, args.n, (load0, os.getloadavg()[0]))
    print("\n" + text)
    if args.write:
        write_section(Path(args.write), "memory_store.py", "The memory store", text)


if __name__ == "__main__":
    main()
