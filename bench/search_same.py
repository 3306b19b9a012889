"""Do two versions of the search code answer the same? (for changes that must not change behaviour)

    .venv/bin/python bench/search_same.py run --code DIR --stores DIR --out A.json   # once per code version
    .venv/bin/python bench/search_same.py diff A.json B.json

`run` imports hutch from `--code` (a worktree or an unpacked `git archive` of the version to test), opens
the stores under `--stores` (made on the first run: the LoCoMo dev conversations ingested one per store, and
a synthetic store of `--n` notes, above the dense channel's approximate threshold by default), asks a fixed
set of queries -- every LoCoMo question with bench/locomo.py's settings and with the API's defaults, filters
(classes, since / until, as_of), `fusion="rrf"`, `expand`, three-word queries and natural questions on the
synthetic store, before and after 30 edits -- and writes every hit with its fused score and every channel's
rank and score. `diff` says which queries differ, and how. Scores are compared exactly (they are rounded
to 6 digits by the search itself). `run` fixes PYTHONHASHSEED (re-executing itself): the order in which
edited files are re-indexed follows a set's order, and with it the units' positions, which the approximate
dense channel's sample depends on.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT_DATA = HERE.parents[1] / "shared" / "data" / "locomo-dev"


def _hits(hits) -> list:
    return [[h.entity_id, h.anchor, h.score, {c: dict(v) for c, v in sorted(h.channels.items())}] for h in hits]


def _locomo_queries(path: str) -> list[tuple[str, dict]]:
    d = json.load(open(path))
    sys.path.insert(0, str(HERE))
    import locomo  # bench/locomo.py of the tree being run

    now = locomo.last_session_time(path)
    out = []
    for i, q in enumerate(d["qa"]):
        text = q["question"]
        out.append((text, {"k": 20, "classes": ["interactions"], "now": now}))
        out.append((text, {"k": 10}))
        if i % 10 == 0:
            out.append((text, {"k": 10, "fusion": "rrf", "now": now}))
            out.append((text, {"k": 5, "expand": 1}))
            out.append((text, {"k": 10, "since": "2023-05-01", "until": "2023-08-31"}))
            out.append((text, {"k": 10, "classes": "actors"}))
            out.append((text, {"k": 10, "as_of": now}))
    return out


def _synthetic(store: Path, n: int) -> None:
    sys.path.insert(0, str(HERE))
    import search_speed as sp

    rng = random.Random(7)
    vocab = sp.vocabulary(rng)
    cum, acc = [], 0.0
    for r in range(len(vocab)):
        acc += 1.0 / (r + 1)
        cum.append(acc)
    pool = [(f"Note {j}", sp.sentence(rng, vocab, cum, 20)) for j in range(2000)]
    (store / "notes").mkdir(parents=True, exist_ok=True)
    for i in range(n):
        title, body = pool[i % len(pool)]
        (store / "notes" / f"n{i}.md").write_text(
            f"---\ntitle: {title}\nvalid_from: 2026-{1 + i % 12:02d}-{1 + i % 28:02d}\n---\n{body}\n")


def run(args) -> None:
    if os.environ.get("PYTHONHASHSEED") != "0":
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, "PYTHONHASHSEED": "0"})
    sys.path.insert(0, str(Path(args.code).resolve()))
    import hutch

    print(f"hutch from {Path(hutch.__file__).parent}", file=sys.stderr)
    stores = Path(args.stores)
    stores.mkdir(parents=True, exist_ok=True)
    out: dict[str, list] = {}
    t0 = time.perf_counter()
    for f in sorted(glob.glob(os.path.join(args.data, "*.json"))):
        mem = hutch.Memory(stores / Path(f).stem)
        if not mem.ls():
            mem.ingest_conversation(f)
        mem.reindex()
        for j, (q, kw) in enumerate(_locomo_queries(f)):
            out[f"{Path(f).stem} {j} {q} {json.dumps(kw, sort_keys=True)}"] = _hits(mem.search(q, **kw))
        mem.index.close()
    print(f"locomo: {len(out)} queries, {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    # every run starts from the same copy of the synthetic store: the positions of its units (and so which ones
    # the approximate dense channel samples) depend on the order they were indexed in
    pristine, syn = stores / f"notes-{args.n}", stores / f"notes-{args.n}-work"
    if not pristine.exists():
        pristine.mkdir(parents=True)
        _synthetic(pristine, args.n)
        built = hutch.Memory(pristine)
        built.reindex()
        built.index.close()
    shutil.rmtree(syn, ignore_errors=True)
    subprocess.run(["cp", "-a", str(pristine), str(syn)], check=True)
    sys.path.insert(0, str(HERE))
    import search_speed as sp

    mem = hutch.Memory(syn)
    mem.reindex()
    rng = random.Random(11)
    vocab = sp.vocabulary(random.Random(7))
    words = [" ".join(rng.sample(vocab[50:5000], 3)) for _ in range(150)]
    queries = [(q, {"k": 10}) for q in words]
    queries += [(q, {"k": 10, "now": sp.NOW}) for q in sp.QUESTIONS]
    queries += [(q, {"k": 10, "since": "2026-03-01", "until": "2026-05-31"}) for q in words[:20]]
    queries += [(q, {"k": 10, "fusion": "rrf"}) for q in words[20:40]]
    queries += [(q, {"k": 5, "as_of": "2026-06-01"}) for q in words[40:50]]
    for q, kw in queries:
        out[f"notes before-edits {q} {json.dumps(kw, sort_keys=True)}"] = _hits(mem.search(q, **kw))
    # 30 edits (the same ones every run), then the same queries
    erng = random.Random(5)
    edited = sorted({erng.randrange(args.n) for _ in range(30)})
    for j, i in enumerate(edited):
        p = syn / "notes" / f"n{i}.md"
        p.write_text(p.read_text().replace("\n---\n", f"\n---\nEdited: {vocab[60 + j]} zeppelin{j}.\n", 1))
    for q, kw in queries[:60] + queries[150:170]:
        out[f"notes after-edits {q} {json.dumps(kw, sort_keys=True)}"] = _hits(mem.search(q, **kw))
    mem.index.close()
    shutil.rmtree(syn, ignore_errors=True)
    print(f"all: {len(out)} queries, {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    Path(args.out).write_text(json.dumps(out))


def diff(args) -> None:
    a, b = json.loads(Path(args.a).read_text()), json.loads(Path(args.b).read_text())
    if a.keys() != b.keys():
        print(f"different query sets: {len(a.keys() - b.keys())} only in {args.a}, {len(b.keys() - a.keys())} only in "
              f"{args.b}")
    same = differ = 0
    for key in sorted(a.keys() & b.keys()):
        if a[key] == b[key]:
            same += 1
            continue
        differ += 1
        if differ <= 10:
            print(f"DIFFERS: {key}")
            for i, (x, y) in enumerate(zip(a[key], b[key])):
                if x != y:
                    print(f"  hit {i}: {x}\n      vs {y}")
                    break
            else:
                print(f"  {len(a[key])} against {len(b[key])} hits")
    hits = sum(len(v) for v in a.values())
    print(f"{same} queries identical, {differ} differ ({len(a)} queries, {hits} hits in {args.a})")
    sys.exit(1 if differ or a.keys() != b.keys() else 0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--code", required=True)
    r.add_argument("--stores", required=True)
    r.add_argument("--out", required=True)
    r.add_argument("--data", default=str(DEFAULT_DATA))
    r.add_argument("--n", type=int, default=40_000, help="notes in the synthetic store (> 30,000: approximate dense)")
    d = sub.add_parser("diff")
    d.add_argument("a")
    d.add_argument("b")
    args = ap.parse_args()
    run(args) if args.cmd == "run" else diff(args)


if __name__ == "__main__":
    main()
