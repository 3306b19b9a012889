"""LoCoMo evidence recall of `Memory.search` (judge-free), index time and query latency.

Each conversation is ingested through the public API (`Memory.ingest_conversation`)
into its own store; every question of categories 1-4 is asked with
`mem.search(question, k=20, classes=["interactions"])` (relative time words
read by search's own rule; `--now last-session` passes the last session's
time as now=), and turn-level
evidence recall@k is the share of the question's evidence turns (dia_ids)
among the anchors of the top k hits, averaged over questions.

    .venv/bin/python bench/locomo.py [--data DIR] [--fusion learned|weighted|rrf] [--now last-session|clock]
                                     [--fit ranker.json] [--json out.json]

Prints recall@1/5/10/20 per category and overall, MRR, index build rate and
query latency p50/p99, side by side with the BM25-only peer (the `bm25`
channel's own ranking from the same hits is not enough, so the peer is FTS5
BM25 over the same turn texts, computed from the same index); R@5 / R@10 with
the API's defaults (`mem.search(q, k=10)`: no classes, no now); and the learned
second stage by leave-one-conversation-out: fitted on the other conversations'
questions and scored on the held-out one, in turn ("rotated"), beside the
first stage alone and the in-sample fit, per category and per conversation,
with the bench's settings and with the API's defaults. Only the rotated
figures judge a change. `--fit` writes the second stage fitted on every
conversation given (what ships as hutch/memory/_index/ranker.json).
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
from datetime import datetime, timezone
from pathlib import Path

from _report import pct  # bench/ is the script's directory

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import hutch  # noqa: E402
from hutch._core import settings  # noqa: E402
from hutch.memory._index import _units  # noqa: E402
from hutch.memory._ingest import _parse_locomo_time, _session_numbers  # noqa: E402

CATS = {1: "multi-hop", 2: "temporal", 3: "open-domain", 4: "single-hop"}
KS = (1, 5, 10, 20)
# shared/data/locomo-dev beside the repository (/work/main) or beside the worktrees' folder (/work/wt/<name>)
DEFAULT_DATA = next((p / "shared" / "data" / "locomo-dev" for p in Path(__file__).resolve().parents
                     if (p / "shared" / "data" / "locomo-dev").is_dir()), Path("shared/data/locomo-dev"))


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


def recall_table(title: str, ranked: list[list[str]], qs: list[dict], convs: list[str] | None = None) -> dict:
    """Print one line per category (R@1/5/10/20, MRR on the first) and, with `convs`, R@5 / R@10 per conversation."""
    r = score(ranked, qs)
    print(f"  {title}")
    for c in ["all", *CATS.values()]:
        extra = f" {r['mrr']:6.3f}" if c == "all" else ""
        print(f"    {c:12s} " + " ".join(f"{r[c][k]:6.1f}" for k in KS) + extra)
    if convs:
        per = []
        for conv in sorted(set(convs)):
            idx = [i for i, c in enumerate(convs) if c == conv]
            sub = score([ranked[i] for i in idx], [qs[i] for i in idx])
            per.append(f"{conv} {sub['all'][5]:.1f} / {sub['all'][10]:.1f}")
        print("    R@5 / R@10 per conversation: " + ", ".join(per))
    return r


def rerank(pools: list[dict], model) -> list[list[str]]:
    """The anchors of each pool re-ordered by a second-stage model (a _rerank.Ranker)."""
    out = []
    for d in pools:
        if not len(d["X"]):
            out.append([])
            continue
        order = np.argsort(-model.score(d["X"]), kind="stable")
        out.append([d["anchors"][i] for i in order])
    return out


def rotated(pools: list[dict], qs: list[dict], convs: list[str], l2: float, names, also=None
            ) -> tuple[list[list[str]], list]:
    """Leave one conversation out: for each, the second stage fitted on the others' questions (their pools, and
    `also`'s: the other setting's) ranks its pools."""
    from hutch.memory._index import _rerank

    ranked: list[list[str] | None] = [None] * len(qs)
    models = []
    for held in sorted(set(convs)):
        train = [i for i, c in enumerate(convs) if c != held]
        X, y, g = training(pools, qs, train)
        if also is not None:
            X2, y2, g2 = training(also, qs, train)
            X, y, g = np.vstack([X, X2]), np.r_[y, y2], np.r_[g, g2 + len(qs)]
        model = _rerank.fit(X, y, g, l2=l2, names=names)
        models.append((held, model))
        test = [i for i, c in enumerate(convs) if c == held]
        for i, r in zip(test, rerank([pools[i] for i in test], model)):
            ranked[i] = r
    return ranked, models


def training(pools, qs, idx):
    X = np.vstack([pools[i]["X"] for i in idx if len(pools[i]["X"])])
    y = np.concatenate([[a in qs[i]["ev"] for a in pools[i]["anchors"]] for i in idx if len(pools[i]["X"])])
    g = np.concatenate([[i] * len(pools[i]["X"]) for i in idx if len(pools[i]["X"])])
    return X, y.astype(float), g


#: The first stage's channel weights searched by rotation: each weight on this grid, in turn, twice over.
WEIGHT_GRID = (0.0, 0.5, 1.0, 1.5, 2.0)


def first_stage(pools: list[dict], w: np.ndarray, idx) -> dict[int, list[str]]:
    """The anchors of the first stage's top 20 with channel weights `w` (`_rerank.CHANNELS` order; every weight 1 is
    the shipped fused score: a row of the contributions sums to it), for the questions `idx`."""
    from hutch.memory._index import _rank

    out = {}
    for i in idx:
        d = pools[i]
        if "contributions" not in d:
            out[i] = []
            continue
        score = d["contributions"] @ w
        out[i] = [d["anchors_all"][p] for p in _rank.top_k(score, d["mask"], 20)]
    return out


def _objective(ranked: dict[int, list[str]], qs: list[dict]) -> float:
    """What a choice is made by: the mean of R@5 and R@10 over the questions."""
    r = score([ranked[i] for i in sorted(ranked)], [qs[i] for i in sorted(ranked)])
    return (r["all"][5] + r["all"][10]) / 2


def choose_weights(pools: list[dict], qs: list[dict], idx) -> np.ndarray:
    """Channel weights by coordinate search on the questions `idx` (start: every weight 1; a weight moves only when
    the objective strictly improves, so a tie keeps the shipped 1)."""
    from hutch.memory._index import _rerank

    w = np.ones(len(_rerank.CHANNELS))
    best = _objective(first_stage(pools, w, idx), qs)
    for _ in range(2):
        for c in range(len(w)):
            for v in WEIGHT_GRID:
                if v == w[c]:
                    continue
                trial = w.copy()
                trial[c] = v
                got = _objective(first_stage(pools, trial, idx), qs)
                if got > best + 1e-9:
                    best, w = got, trial
    return w


def weights_rotated(pools: list[dict], qs: list[dict], convs: list[str]) -> tuple[list[list[str]], list]:
    """Leave one conversation out for the first stage's channel weights: chosen on the other conversations'
    questions, scored on the held-out one, in turn."""
    ranked: list[list[str]] = [[] for _ in qs]
    chosen = []
    for held in sorted(set(convs)):
        w = choose_weights(pools, qs, [i for i, c in enumerate(convs) if c != held])
        chosen.append((held, w))
        for i, r in first_stage(pools, w, [i for i, c in enumerate(convs) if c == held]).items():
            ranked[i] = r
    return ranked, chosen


def build(files: list[str], where: str) -> tuple[list[tuple[str, "hutch.Memory"]], dict]:
    """One store per conversation under `where` (a store already there is reused: its index, vectors included,
    is brought up to date, not rebuilt), with the ingest and index times of the stores made here."""
    stores, cost = [], {"ingest_s": 0.0, "index_s": 0.0, "entities": 0, "units": 0}
    for f in files:
        root = os.path.join(where, Path(f).stem)
        fresh = not os.path.isdir(root)
        mem = hutch.Memory(root)
        t0 = time.perf_counter()
        if fresh:
            mem.ingest_conversation(f)
        t1 = time.perf_counter()
        rep = mem.reindex()
        t2 = time.perf_counter()
        if fresh:
            cost["ingest_s"] += t1 - t0
            cost["index_s"] += t2 - t1
            cost["entities"] += rep.entities
            cost["units"] += rep.units
        stores.append((f, mem))
    return stores, cost


def ask(stores, fusion: str = "learned", now_rule: str = "rule") -> dict:
    """Every question of every store, asked as shipped (bench settings and API defaults), as the first stage
    alone with the second stage's pool and features (both settings), and by the BM25 peer."""
    r: dict = {k: [] for k in ("ranked", "peer", "qs", "lat", "convs", "defaults", "first_b", "first_d",
                               "pools_b", "pools_d")}
    for f, mem in stores:
        now = (last_session_time(f) if now_rule == "last-session" else
               datetime.now(timezone.utc).isoformat() if now_rule == "clock" else None)
        for q in questions(f):
            t = time.perf_counter()
            hits = mem.search(q["q"], k=20, classes=["interactions"], fusion=fusion, now=now)
            r["lat"].append(1000 * (time.perf_counter() - t))
            r["ranked"].append([h.anchor for h in hits])
            # the API's defaults: no classes, no now, k=10
            r["defaults"].append([h.anchor for h in mem.search(q["q"], k=10)])
            # the first stage alone, with the second stage's pool and features (for leave-one-out)
            for kw, first, pools in (({"classes": ["interactions"], "now": now}, "first_b", "pools_b"),
                                     ({}, "first_d", "pools_d")):
                got: dict = {}
                hits = mem.index.search(q["q"], k=20, fusion="weighted", collect=got, **kw)
                if got:
                    got["anchors_all"] = mem.index.snap.anchor[:len(got["mask"])]
                r[first].append([h.anchor for h in hits])
                r[pools].append(got or {"X": np.zeros((0, 1)), "anchors": []})
            r["peer"].append(bm25_peer(mem, q["q"], 20))
            r["qs"].append(q)
            r["convs"].append(Path(f).stem)
    return r


def ask_reasoner(stores, now_rule: str = "rule") -> dict | None:
    """When $HUTCH_REASONER_URL names an endpoint: every question asked again with the bench's settings through a
    Memory with `OpenAIReasoner.from_settings()` (ret-reasoner's part; ask() is unchanged); else None."""
    if settings.REASONER_URL.get() is None:
        return None
    import warnings

    out: dict = {"ranked": [], "lat": [], "failed": 0, "errors": []}
    reasoner = hutch.OpenAIReasoner.from_settings()
    for f, plain in stores:
        now = (last_session_time(f) if now_rule == "last-session" else
               datetime.now(timezone.utc).isoformat() if now_rule == "clock" else None)
        mem = hutch.Memory(plain.root, reasoner=reasoner)
        try:
            for q in questions(f):
                t = time.perf_counter()
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", hutch.ReasonerWarning)
                    hits = mem.search(q["q"], k=20, classes=["interactions"], now=now)
                out["lat"].append(1000 * (time.perf_counter() - t))
                out["ranked"].append([h.anchor for h in hits])
                if hits and "reasoner" not in hits[0].channels:
                    out["failed"] += 1
                    if mem.index.reasoner_error and len(out["errors"]) < 3:
                        out["errors"].append(mem.index.reasoner_error)
        finally:
            mem.index.close()
    return out


def print_reasoner(reasoned: dict | None, ours: dict, qs: list[dict]) -> None:
    """Recall with and without the reasoner, per category (see ask_reasoner)."""
    if reasoned is None:
        print("reasoner: none configured (set HUTCH_REASONER_URL, HUTCH_REASONER_MODEL and OPENAI_API_KEY or "
              "HUTCH_REASONER_KEY_FILE for an OpenAI-compatible endpoint to report with and without it)")
        return
    rz = score(reasoned["ranked"], qs)
    print(f"with the reasoner ({settings.REASONER_URL.get()}, model {settings.REASONER_MODEL.get()}), bench "
          f"settings; R@5 / R@10 without -> with:")
    for c in ["all", *CATS.values()]:
        print(f"  {c:14s} {ours[c][5]:5.1f} -> {rz[c][5]:5.1f}   {ours[c][10]:5.1f} -> {rz[c][10]:5.1f}")
    print(f"  query latency with the reasoner: p50 {statistics.median(reasoned['lat']):.0f} ms, p99 "
          f"{pct(reasoned['lat'], 99):.0f} ms; answered without it (endpoint failed or skipped): "
          f"{reasoned['failed']} of {len(qs)}")
    for e in reasoned["errors"]:
        print(f"  reasoner failure: {e}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default=str(DEFAULT_DATA))
    ap.add_argument("--fusion", default="learned", choices=["learned", "weighted", "rrf"],
                    help="the shipped pipeline's fusion (learned: the weighted sum, then the shipped second stage)")
    ap.add_argument("--now", default="rule", choices=["rule", "last-session", "clock"],
                    help="what relative time words in a question are read against: rule = no now= (search's own "
                         "rule: the newest time among the candidates, at most the clock), last-session = now= "
                         "the conversation's last session, clock = now= the current time")
    ap.add_argument("--l2", type=float, default=1.0, help="the second stage's L2 penalty (standardised features)")
    ap.add_argument("--fit", help="fit the second stage on every conversation given and write it here "
                                  "(hutch/memory/_index/ranker.json ships it)")
    ap.add_argument("--json", help="write the results here too")
    ap.add_argument("--pools", help="write the questions, first-stage lists and second-stage pools (pickle) here: "
                                    "fit and score variants offline in seconds")
    ap.add_argument("--stores", help="keep the conversations' stores in this directory and reuse them on the next "
                                     "run (no ingest, no embedding; the build figures are then not measured)")
    args = ap.parse_args()
    files = sorted(glob.glob(os.path.join(args.data, "*.json")))
    if not files:
        sys.exit(f"no LoCoMo JSON files in {args.data}")
    tmp = args.stores or tempfile.mkdtemp(prefix="hutch-locomo-")
    try:
        stores, cost = build(files, tmp)
        r = ask(stores, args.fusion, args.now)
        reasoned = ask_reasoner(stores, args.now)
        for _, mem in stores:
            mem.index.close()
    finally:
        if not args.stores:
            shutil.rmtree(tmp, ignore_errors=True)
    ranked, peer, qs, lat, convs = r["ranked"], r["peer"], r["qs"], r["lat"], r["convs"]
    defaults, first_b, first_d, pools_b, pools_d = (r[k] for k in (
        "defaults", "first_b", "first_d", "pools_b", "pools_d"))
    ingest_s, index_s, n_entities, n_units = cost["ingest_s"], cost["index_s"], cost["entities"], cost["units"]
    if args.pools:
        import pickle

        Path(args.pools).write_bytes(pickle.dumps({"qs": qs, "convs": convs, "first_b": first_b, "first_d": first_d,
                                                   "pools_b": pools_b, "pools_d": pools_d}))
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
    d = score(defaults, qs)
    print(f"the API's defaults (mem.search(q, k=10): no classes, no now): R@5 {d['all'][5]:.1f}, R@10 {d['all'][10]:.1f}")
    print_reasoner(reasoned, ours, qs)
    if index_s:
        print(f"index: {n_entities} entities ({n_units} units) ingested in {ingest_s:.2f} s, indexed in {index_s:.2f} "
              f"s = {n_entities / index_s:.0f} entities/s, {n_units / index_s:.0f} units/s")
    else:
        print("index: the stores were reused (--stores): no build figures")
    print(f"query latency (incl. freshness check and query embedding): p50 {statistics.median(lat):.1f} ms, "
          f"p99 {pct(lat, 99):.1f} ms")

    # Leave one conversation out: everything fitted is fitted on the other conversations and scored on this one.
    from hutch.memory._index import _rerank

    out = {"ours": ours, "peer": base, "defaults": d}
    print("\nsecond stage, leave-one-conversation-out (fitted on two conversations, scored on the third, rotated) "
          "beside in-sample (fitted and scored on all); both fitted on the pools of both settings; "
          "R@1 / R@5 / R@10 / R@20")
    everything = list(range(len(qs)))
    if len(set(convs)) < 2:
        print("(leave-one-conversation-out needs two conversations or more)")
    for label, first, pools, other in ([] if len(set(convs)) < 2 else (
            (f"bench settings (k=20, classes=interactions, now={args.now})", first_b, pools_b, pools_d),
            ("API defaults (no classes, no now)", first_d, pools_d, pools_b))):
        print(f"{label}:")
        rows = {"first": recall_table("first stage (weighted sum)", first, qs, convs)}
        for tag, names in (("shipped features", _rerank.SHIPPED), ("all features", _rerank.FEATURES)):
            rot, _ = rotated(pools, qs, convs, args.l2, names, other)
            rows[f"rotated, {tag}"] = recall_table(f"second stage, {tag}, ROTATED (held-out conversation)", rot, qs,
                                                   convs)
            X, y, g = training(pools, qs, everything)
            X2, y2, g2 = training(other, qs, everything)
            full = _rerank.fit(np.vstack([X, X2]), np.r_[y, y2], np.r_[g, g2 + len(qs)], l2=args.l2, names=names)
            rows[f"in-sample, {tag}"] = recall_table(f"second stage, {tag}, in-sample (fitted on all)",
                                                     rerank(pools, full), qs, convs)
        out[label.split(" (")[0]] = rows
    # The first stage's channel weights (every one 1, not tuned) against weights chosen by rotation.
    if len(set(convs)) >= 2:
        print("\nfirst stage: channel weights chosen on two conversations (coordinate search over "
              f"{WEIGHT_GRID}, by the mean of R@5 and R@10), scored on the third (ROTATED), beside every weight 1 "
              "(shipped) and weights chosen on all three (in-sample); order " + ", ".join(_rerank.CHANNELS))
        for label, pools in (("bench settings", pools_b), ("API defaults", pools_d)):
            print(f"{label}:")
            ones = first_stage(pools, np.ones(len(_rerank.CHANNELS)), everything)
            rows = {"every weight 1": recall_table("every weight 1 (shipped)", [ones[i] for i in everything], qs,
                                                   convs)}
            rot, chosen = weights_rotated(pools, qs, convs)
            rows["rotated"] = recall_table("weights chosen on the other two, ROTATED", rot, qs, convs)
            print("    chosen: " + "; ".join(f"without {h}: " + " ".join(f"{v:g}" for v in w) for h, w in chosen))
            w_all = choose_weights(pools, qs, everything)
            mine = first_stage(pools, w_all, everything)
            rows["in-sample"] = recall_table("weights chosen on all three (in-sample)", [mine[i] for i in everything],
                                             qs, convs)
            print("    chosen: " + " ".join(f"{v:g}" for v in w_all))
            out[f"first stage weights, {label}"] = {**rows, "chosen_rotated": {h: list(w) for h, w in chosen},
                                                     "chosen_in_sample": list(w_all)}
    if args.fit:
        X1, y1, g1 = training(pools_b, qs, everything)
        X2, y2, g2 = training(pools_d, qs, everything)
        model = _rerank.fit(np.vstack([X1, X2]), np.r_[y1, y2], np.r_[g1, g2 + len(qs)], l2=args.l2, meta={
            "fitted_on": [Path(f).stem for f in files], "questions": len(qs), "l2": args.l2,
            "how": "bench/locomo.py --fit: logistic regression, each question weighs the same, the pools of the "
                   "bench settings and of the API defaults"})
        Path(args.fit).write_text(model.to_json())
        print(f"wrote the second stage fitted on {len(files)} conversations to {args.fit}")
        for name, w in sorted(zip(model.names, model.weights), key=lambda t: -abs(t[1])):
            print(f"  {name:16s} {w:+.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps({**out, "latency_ms": {
            "p50": statistics.median(lat), "p99": pct(lat, 99)}, "index_s": index_s, "entities": n_entities,
            "units": n_units}, indent=1, default=str))


if __name__ == "__main__":
    main()
