"""LoCoMo evidence recall of `Memory.search` (judge-free), index time and query latency.

Each conversation is ingested through the public API (`Memory.ingest_conversation`)
into its own store; every question of categories 1-4 is asked with
`mem.search(question, k=20, classes=["interactions"])`, and turn-level
evidence recall@k is the share of the question's evidence turns (dia_ids)
among the anchors of the top k hits, averaged over questions.

    .venv/bin/python bench/locomo.py [--data DIR] [--fusion weighted|rrf] [--now last-session|clock] [--json out.json]

Prints recall@1/5/10/20 per category and overall, MRR, index build rate and
query latency p50/p99, side by side with the BM25-only peer (the `bm25`
channel's own ranking from the same hits is not enough, so the peer is FTS5
BM25 over the same turn texts, computed from the same index).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shutil
import sqlite3
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import hutch  # noqa: E402
from hutch.memory._index import _units  # noqa: E402
from hutch.memory._ingest import _parse_locomo_time, _session_numbers  # noqa: E402

CATS = {1: "multi-hop", 2: "temporal", 3: "open-domain", 4: "single-hop"}
KS = (1, 5, 10, 20)
DEFAULT_DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "locomo-dev"


def questions(path: str) -> list[dict]:
    d = json.load(open(path))
    out = []
    for q in d["qa"]:
        if q.get("category") not in CATS:
            continue
        ev = {x for e in q.get("evidence", []) for x in re.split(r"[;,\s]+", e) if re.fullmatch(r"D\d+:\d+", x)}
        if ev:
            out.append({"q": q["question"], "cat": q["category"], "ev": ev})
    return out


def last_session_time(path: str) -> str:
    """When the conversation's last session took place (ISO): the moment its questions are asked."""
    d = json.load(open(path))
    n = _session_numbers(d)[-1]
    return _parse_locomo_time(d[f"session_{n}_date_time"], path).isoformat()


def bm25_peer(mem, question: str, k: int) -> list[str]:
    """Plain FTS5 BM25 over the turn texts (no context, no fusion): the peer the method is compared with."""
    fq = _units.fts_query(question)
    if not fq:
        return []
    db = sqlite3.connect(mem.index.idx.path)
    try:
        rows = db.execute("select u.anchor from units_fts join units u on u.uid = units_fts.rowid "
                          "join files f on f.eid = u.eid where units_fts match ? and f.cls = 'interactions' "
                          "and u.anchor is not null order by bm25(units_fts, 1.0, 0.0) limit ?", (fq, k)).fetchall()
    finally:
        db.close()
    return [r[0] for r in rows]


def score(ranked: list[list[str]], qs: list[dict]) -> dict:
    res = {c: {k: [] for k in KS} for c in list(CATS) + ["all"]}
    mrr = []
    for r, q in zip(ranked, qs):
        for k in KS:
            v = len(set(r[:k]) & q["ev"]) / len(q["ev"])
            res[q["cat"]][k].append(v)
            res["all"][k].append(v)
        mrr.append(next((1 / (i + 1) for i, a in enumerate(r) if a in q["ev"]), 0.0))
    out = {("all" if c == "all" else CATS[c]): {k: 100 * statistics.fmean(v[k]) if v[k] else float("nan") for k in KS}
           for c, v in res.items()}
    out["mrr"] = statistics.fmean(mrr)
    out["n"] = len(qs)
    return out


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default=str(DEFAULT_DATA))
    ap.add_argument("--fusion", default="weighted", choices=["weighted", "rrf"])
    ap.add_argument("--now", default="last-session", choices=["last-session", "clock"],
                    help="what relative time words in a question are read against")
    ap.add_argument("--json", help="write the results here too")
    args = ap.parse_args()
    files = sorted(glob.glob(os.path.join(args.data, "*.json")))
    if not files:
        sys.exit(f"no LoCoMo JSON files in {args.data}")
    ranked, peer, qs, lat = [], [], [], []
    ingest_s = index_s = 0.0
    n_entities = n_units = 0
    tmp = tempfile.mkdtemp(prefix="hutch-locomo-")
    try:
        for f in files:
            mem = hutch.Memory(os.path.join(tmp, Path(f).stem))
            t0 = time.perf_counter()
            mem.ingest_conversation(f)
            t1 = time.perf_counter()
            rep = mem.reindex()
            t2 = time.perf_counter()
            ingest_s += t1 - t0
            index_s += t2 - t1
            n_entities += rep.entities
            n_units += rep.units
            now = last_session_time(f) if args.now == "last-session" else None
            for q in questions(f):
                t = time.perf_counter()
                hits = mem.search(q["q"], k=20, classes=["interactions"], fusion=args.fusion, now=now)
                lat.append(1000 * (time.perf_counter() - t))
                ranked.append([h.anchor for h in hits])
                peer.append(bm25_peer(mem, q["q"], 20))
                qs.append(q)
            mem.index.close()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    ours, base = score(ranked, qs), score(peer, qs)
    print(f"LoCoMo turn-level evidence recall, {len(files)} conversations, {len(qs)} questions (categories 1-4), "
          f"fusion={args.fusion}, now={args.now}")
    print(f"{'':14s} {'hutch search':>42s}   {'peer: FTS5 BM25':>42s}")
    print(f"{'':14s} " + " ".join(f"{'R@' + str(k):>7s}" for k in KS) + f" {'MRR':>6s}   "
          + " ".join(f"{'R@' + str(k):>7s}" for k in KS) + f" {'MRR':>6s}")
    for c in ["all", *CATS.values()]:
        a, b = ours[c], base[c]
        extra = (f" {ours['mrr']:6.3f}   " if c == "all" else f" {'':6s}   ")
        extra_b = (f" {base['mrr']:6.3f}" if c == "all" else "")
        print(f"{c:14s} " + " ".join(f"{a[k]:7.1f}" for k in KS) + extra + " ".join(f"{b[k]:7.1f}" for k in KS) + extra_b)
    print(f"index: {n_entities} entities ({n_units} units) ingested in {ingest_s:.2f} s, indexed in {index_s:.2f} s "
          f"= {n_entities / index_s:.0f} entities/s, {n_units / index_s:.0f} units/s")
    print(f"query latency (incl. freshness check and query embedding): p50 {statistics.median(lat):.1f} ms, "
          f"p99 {pct(lat, 99):.1f} ms")
    if args.json:
        Path(args.json).write_text(json.dumps({"ours": ours, "peer": base, "latency_ms": {
            "p50": statistics.median(lat), "p99": pct(lat, 99)}, "index_s": index_s, "entities": n_entities,
            "units": n_units}, indent=1, default=str))


if __name__ == "__main__":
    main()
