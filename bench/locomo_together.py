"""LoCoMo evidence recall with every conversation in ONE store (bench/locomo.py gives each its own).

    .venv/bin/python bench/locomo_together.py [--data DIR] [--store DIR] [--json out.json]

All the conversations are ingested into one store (`Memory.ingest_conversation`, one after the other) and every
question of categories 1-4 is asked with bench/locomo.py's settings (`k=20, classes=["interactions"]`, no `now`)
and with the API's defaults (`mem.search(q, k=10)`). A hit counts for a question when it is a turn of the
question's own conversation with one of its evidence dia_ids (the dia_ids repeat across conversations). What it
checks beyond bench/locomo.py: a question about one conversation among others (the other people's turns compete),
and relative time words ("last week") read from each conversation's own end, not from the newest one's
(docs/retrieval.md, "Ninth round"). The second stage is the shipped one (fitted on these conversations:
in-sample); nothing is fitted here. `--store` keeps the store and reuses it on the next run (no embedding).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import hutch  # noqa: E402
import locomo  # noqa: E402
from hutch.memory._index import _time  # noqa: E402


def keyed(hits) -> list[str]:
    """conversation|dia_id of each hit (the conversation from its session's entity id)."""
    return [h.entity_id.rsplit("/", 1)[-1].split("-session")[0] + "|" + (h.anchor or "") for h in hits]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default=str(locomo.DEFAULT_DATA))
    ap.add_argument("--store", help="keep the store here and reuse it on the next run")
    ap.add_argument("--json", help="write every question's ranked hits here")
    args = ap.parse_args()
    files = sorted(glob.glob(os.path.join(args.data, "*.json")))
    if not files:
        sys.exit(f"no LoCoMo JSON files in {args.data}")
    root = args.store or tempfile.mkdtemp(prefix="hutch-locomo-together-")
    qs, convs, bench, defaults = [], [], [], []
    try:
        fresh = not os.path.isdir(os.path.join(root, "interactions"))
        mem = hutch.Memory(root)
        if fresh:
            for f in files:
                mem.ingest_conversation(f)
        mem.reindex()
        for f in files:
            c = Path(f).stem
            for q in locomo.questions(f):
                qs.append({**q, "ev": {f"{c}|{e}" for e in q["ev"]}})
                convs.append(c)
                bench.append(keyed(mem.search(q["q"], k=20, classes=["interactions"])))
                defaults.append(keyed(mem.search(q["q"], k=10)))
        mem.index.close()
    finally:
        if not args.store:
            shutil.rmtree(root, ignore_errors=True)
    print(f"LoCoMo, {len(files)} conversations in one store, {len(qs)} questions; R@5 / R@10, @10 per category, "
          "per conversation R@5 / R@10")
    for label, ranked in (("bench settings", bench), ("API defaults", defaults)):
        s = locomo.score(ranked, qs)
        per = []
        for c in sorted(set(convs)):
            ii = [i for i, x in enumerate(convs) if x == c]
            r = locomo.score([ranked[i] for i in ii], [qs[i] for i in ii])
            per.append(f"{c} {r['all'][5]:.1f} / {r['all'][10]:.1f}")
        print(f"  {label:15s} {s['all'][5]:5.1f} / {s['all'][10]:5.1f}  "
              + "  ".join(f"{k} {s[k][10]:.1f}" for k in locomo.CATS.values()) + "  | " + ", ".join(per))
    print("questions with a relative time word (rank of each evidence turn, bench settings):")
    for i, q in enumerate(qs):
        span = _time.find(q["q"], 0.0)
        if span is not None and span.relative:
            ranks = [bench[i].index(e) + 1 if e in bench[i] else "-" for e in sorted(q["ev"])]
            print(f"  {convs[i]} {q['q']} {ranks}")
    if args.json:
        Path(args.json).write_text(json.dumps({"bench": bench, "defaults": defaults}, indent=1))


if __name__ == "__main__":
    main()
