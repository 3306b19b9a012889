"""Benchmark of the SMF store (hutch.Memory): writes, reads, check() and ingest, each beside a peer.

    .venv/bin/python bench/memory_store.py            # 100,000-entity synthetic store (about 2 minutes)
    .venv/bin/python bench/memory_store.py --n 20000  # smaller

Peers (run side by side, same machine, same bytes):
- writes: the same entity files written with hutch._core.atomic and no git
  (the floor of "a file per entity"); for one commit per write, an atomic
  write plus `git add` + `git commit` run directly in the same big repository;
- get: open + read + yaml.CSafeLoader of the same file (what a plain
  front-matter reader costs);
- check: walking the store and reading every file, without parsing.
Aims (issue 5): >= 2,000 entity writes/s inside one transaction; get p50 <= 1 ms.
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
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import yaml  # noqa: E402

import hutch  # noqa: E402
from hutch._core.atomic import atomic_write  # noqa: E402
from hutch.memory import _format as fmt  # noqa: E402

LOCOMO = Path(os.environ.get("HUTCH_LOCOMO_DIR", Path(__file__).resolve().parents[2] / "shared" / "data" / "locomo-dev"))


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


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


def bench_writes(root: Path, n: int) -> Path:
    print(f"\n== writes: {n:,} synthetic entities in ONE transaction (one commit)")
    store = root / "synthetic"
    mem = hutch.Memory(store)
    t0 = time.perf_counter()
    with mem.transaction("bench: bulk load", source="bench"):
        for i in range(n):
            cls, title, body, facts = synthetic_entity(i)
            e = mem.put(cls, title, body=body, facts=facts, source=f"bench#{i}")
            if i and i % 10 == 0:
                mem.link(e, "related", last)
            last = e
    ours = time.perf_counter() - t0
    # peer: the same bytes as plain atomic files, no git, no fsync (the file-per-entity floor)
    peer_dir = root / "peer-files"
    texts = [(p, p.read_bytes()) for p in (store / "class0").glob("*.md")]
    t0 = time.perf_counter()
    for k in range(n):
        p, data = texts[k % len(texts)]
        d = peer_dir / f"class{k % 20}"
        if k < 20:
            d.mkdir(parents=True, exist_ok=True)
        atomic_write(d / f"{k}.md", data, fsync_dir=False, fsync_file=False)
    subprocess.run(["sync"], check=True)
    peer = time.perf_counter() - t0
    shutil.rmtree(peer_dir)
    print(f"  entity writes/s (incl. links, fsync, commit): {n / ours:10,.0f}   peer (plain files): {n / peer:10,.0f}"
          f"   ratio {ours / peer:5.2f}x the peer's time   aim >= 2,000/s: {'MET' if n / ours >= 2000 else 'NOT MET'}")

    return store


def bench_single_commits(store: Path, m: int = 100) -> None:
    """One commit per write, on the big store; the peer is plain `git add` + `git commit` in the same repo."""
    mem = hutch.Memory(store)
    print(f"\n== writes: {m} entities, ONE COMMIT PER WRITE, in the {len(mem.ls()):,}-entity store")
    lat = []
    for i in range(m):
        t = time.perf_counter()
        mem.put("single", f"single {i}", body="one commit each\n", facts=["x"])
        lat.append((time.perf_counter() - t) * 1000)
    env = dict(os.environ, GIT_AUTHOR_NAME="p", GIT_AUTHOR_EMAIL="p@x", GIT_COMMITTER_NAME="p",
               GIT_COMMITTER_EMAIL="p@x")
    plat = []
    data = (store / "single" / "single-0.md").read_bytes()
    (store / "peer").mkdir()
    for i in range(m):
        t = time.perf_counter()
        atomic_write(store / "peer" / f"{i}.md", data)
        subprocess.run(["git", "-C", str(store), "add", "--", f"peer/{i}.md"], check=True, env=env)
        subprocess.run(["git", "-C", str(store), "commit", "-qm", f"{i}"], check=True, env=env)
        plat.append((time.perf_counter() - t) * 1000)
    row("put (one commit each)", lat, plat)
    print(f"  entity writes/s, one commit per write: {1000 / statistics.median(lat):8.0f}"
          "   (a single write's cost grows with the store: git reads and writes its whole index)")
    small = hutch.Memory(store.parent / "small")
    lat = []
    for i in range(m):
        t = time.perf_counter()
        small.put("single", f"single {i}", body="one commit each\n", facts=["x"])
        lat.append((time.perf_counter() - t) * 1000)
    row("put (one commit each), fresh small store", lat, None)


def bench_get(store: Path, samples: int = 3000) -> None:
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
    print(f"  note: raw JSON includes qa/observations/summaries that are not ingested")
    r = mem.check()
    print(f"  check: {r.entities} entities, {r.links} links, {len(r.errors)} errors, {len(r.warnings)} warnings")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=100_000, help="synthetic entities (default 100,000)")
    ap.add_argument("--dir", help="work directory (default: a temp dir, removed afterwards)")
    args = ap.parse_args()
    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="hutch-bench-mem-"))
    print(f"hutch memory store benchmark ({os.cpu_count()} CPUs; {fmt.__name__}); work dir {root}")
    try:
        bench_ingest(root)
        store = bench_writes(root, args.n)
        bench_get(store)
        bench_check(store)
        bench_single_commits(store)
    finally:
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
