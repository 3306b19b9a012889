"""Speed of the search index at scale: build rate, query latency, one-file re-index, freshness scan.

    .venv/bin/python bench/search_speed.py [--n 100000] [--queries 200] [--questions natural] [--json out.json]

A synthetic store of N entities (notes/<i>.md, 20-word bodies drawn by Zipf's
law from a 20,000-word vocabulary, fixed seed) is written straight to disk (hand-written
files are valid SMF), indexed with `mem.reindex()`, then queried. The vocabulary
(`--words`) is English words (default: the whole words of the model's own word-piece
vocabulary, in its frequency order, ~25 tokens per entity) or the older pseudo-words
made of syllables (`--words pseudo`: each splits into several word pieces, ~51 tokens
per entity, which doubles the embedding work per entity). Each line
prints median and p99 with a peer measured side by side on the same machine:

- build: entities/s of `reindex()` vs. the embedding model alone on the same texts
  (the floor the index cannot beat);
- query: `mem.search(q, k=10)` (freshness check + query embedding + all channels + fusion)
  vs. a bare FTS5 BM25 query on the same index;
- with `--questions natural`, also 20 natural-language questions (4-7 content words: names, phrases,
  category words, time expressions read against a fixed `now=`), asked --queries / 20 times each
  on the same store: their first asking in the process (caches of new words and senses cold) and
  the askings after, with median, p90 and p99;
- one changed file: edit a file, then the next `search()` (it re-indexes that file first)
  vs. an unchanged `search()`;
- freshness without notifications: a full stat scan of the store (the fallback).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _report import pct  # bench/ is the script's directory

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import hutch  # noqa: E402
from hutch.memory._index import _units, default_provider  # noqa: E402

WORDS = ("customer churn pricing plan renewal invoice refund contract vendor meeting roadmap launch feature bug "
         "release deploy incident outage database migration backup latency budget forecast hiring interview "
         "offer salary review promotion travel flight hotel conference talk workshop garden recipe dinner "
         "marathon training injury doctor vacation beach mountain camping kayak river bicycle repair garage "
         "concert guitar piano painting museum library novel poetry puppy shelter adoption school homework "
         "exam teacher project deadline design sketch prototype feedback survey analytics dashboard metric "
         "quarterly revenue cost margin supplier shipping warehouse inventory support ticket escalation").split()


def vocabulary(rng: random.Random, size: int = 20_000, kind: str = "english") -> list[str]:
    """The words above first, then English words (the tokenizer's whole words, in its order, which roughly
    follows frequency) or pseudo-words from syllables: a vocabulary ranked by frequency."""
    syll = "ka lo mi nu se ta ri po ve du an el is or um bri tra glo fen dor".split()
    out = list(WORDS)
    seen = set(out)
    if kind == "english":
        vocab = json.loads(_units_tokenizer().read_text())["model"]["vocab"]
        for w, _ in sorted(vocab.items(), key=lambda kv: kv[1]):
            if len(out) >= size:
                break
            if len(w) >= 3 and w.isascii() and w.isalpha() and w.islower() and w not in seen:
                seen.add(w)
                out.append(w)
    while len(out) < size:
        w = "".join(rng.choice(syll) for _ in range(rng.randint(2, 4)))
        if w not in seen:
            seen.add(w)
            out.append(w)
    return out


def _units_tokenizer() -> Path:
    from hutch.memory._index import _embed

    return _embed._TOKENIZER


def sentence(rng: random.Random, vocab: list[str], weights: list[float], n: int) -> str:
    """n words drawn with Zipf's law (frequency ~ 1/rank), like natural text."""
    return " ".join(rng.choices(vocab, cum_weights=weights, k=n)).capitalize() + "."


#: Natural-language questions (written for this bench; none from LoCoMo): names the store does not know, adjacent
#: content words (phrases), category words ("instruments", "vegetables"), relative and absolute time words.
QUESTIONS = [
    "What musical instruments does Sarah play?",
    "Which sports did the team practice last summer?",
    "What books has Daniel read this year?",
    "How many dogs does Maria own?",
    "What did Peter cook for dinner last weekend?",
    "When did the database migration finish in March?",
    "Why was the product launch delayed after the security incident?",
    "What kind of fruit did Anna buy at the farmers market?",
    "Where did Tom go hiking with his brother two weeks ago?",
    "Which countries has Lisa visited since 2024?",
    "What vegetables grow in the community garden?",
    "How did the quarterly revenue forecast change after the pricing review?",
    "What did the support team decide about refund requests yesterday?",
    "Who gave the keynote talk at the design conference in May?",
    "What games did the children play at the birthday party?",
    "Which birds did Emma photograph near the river last month?",
    "What is the deadline for the mobile app prototype?",
    "How many cars does the family own now?",
    "What flowers did Grace plant in her backyard this spring?",
    "What happened at the hospital after the car accident on Friday?",
]
#: What the questions' time words are read against (the store's notes are dated in 2026).
NOW = "2026-06-15T12:00:00+00:00"


def row(name, ours, peer, unit="ms"):
    m1, m2 = statistics.median(ours), statistics.median(peer)
    print(f"{name:34s} median {m1:9.2f} {unit}  p99 {pct(ours, 99):9.2f} {unit} | peer median {m2:9.2f} {unit} "
          f"p99 {pct(peer, 99):9.2f} {unit} | ratio {m1 / m2 if m2 else float('inf'):6.2f}")


def row3(name, ours, peer, unit="ms"):
    """Like row(), with p90 too."""
    m1, m2 = statistics.median(ours), statistics.median(peer)
    print(f"{name:34s} median {m1:9.2f} {unit}  p90 {pct(ours, 90):9.2f} {unit}  p99 {pct(ours, 99):9.2f} {unit} | "
          f"peer median {m2:9.2f} {unit} p99 {pct(peer, 99):9.2f} {unit} | "
          f"ratio {m1 / m2 if m2 else float('inf'):6.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=100_000)
    ap.add_argument("--queries", type=int, default=200)
    ap.add_argument("--distinct", type=int, default=5000,
                    help="distinct (title, body) texts in the big store; vectors are keyed by text, so only these "
                         "are embedded (the query path still ranks all N units)")
    ap.add_argument("--build-n", type=int, default=2000, help="distinct entities for the build-rate measurement")
    ap.add_argument("--dir", help="where to build the store (default: a temp dir, removed at the end)")
    ap.add_argument("--words", choices=["english", "pseudo"], default="english",
                    help="vocabulary of the synthetic texts (pseudo: the first runs' syllable words)")
    ap.add_argument("--questions", choices=["words", "natural"], default="words",
                    help="natural: also time 20 natural-language questions (--queries / 20 askings each)")
    ap.add_argument("--json")
    args = ap.parse_args()
    rng = random.Random(7)
    vocab = vocabulary(rng, kind=args.words)
    cum, acc = [], 0.0
    for r in range(len(vocab)):
        acc += 1.0 / (r + 1)
        cum.append(acc)
    base = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="hutch-search-speed-"))
    out: dict = {"n": args.n}
    try:
        pool = [(f"Note {j}", sentence(rng, vocab, cum, 20)) for j in range(max(args.distinct, args.build_n))]

        def write(store: Path, n: int, distinct: int) -> None:
            (store / "notes").mkdir(exist_ok=True)
            for i in range(n):
                title, body = pool[i % distinct]
                (store / "notes" / f"n{i}.md").write_text(
                    f"---\ntitle: {title}\nvalid_from: 2026-{1 + i % 12:02d}-{1 + i % 28:02d}\n---\n{body}\n")

        # build rate: distinct entities, every one embedded
        small = hutch.Memory(base / "build")
        write(small.root, args.build_n, args.build_n)
        prov = default_provider()
        texts = [f"{t}\n{b}" for t, b in pool[:args.build_n]]
        prov.embed(texts[:64])
        tokens = statistics.fmean(len(e.ids) for e in prov._load()[1].encode_batch(texts))
        t0 = time.perf_counter()
        prov.embed(texts)
        embed_rate = len(texts) / (time.perf_counter() - t0)
        print(f"build texts ({args.words} words): {tokens:.1f} tokens per entity on average")
        out["tokens_per_entity"] = tokens
        t0 = time.perf_counter()
        rep = small.reindex()
        build_s = time.perf_counter() - t0
        rate = rep.entities / build_s
        print(f"build: {rep.entities} distinct entities in {build_s:.1f} s = {rate:.0f} entities/s "
              f"| peer (embedding alone): {embed_rate:.0f} texts/s | ratio {rate / embed_rate:.2f}")
        out["build_entities_per_s"] = rate
        out["embed_only_per_s"] = embed_rate
        small.index.close()

        store = base / "mem"
        mem = hutch.Memory(store)
        t0 = time.perf_counter()
        write(store, args.n, args.distinct)
        print(f"wrote {args.n} entity files ({args.distinct} distinct texts) in {time.perf_counter() - t0:.1f} s")
        t0 = time.perf_counter()
        rep = mem.reindex()
        print(f"indexed {rep.entities} entities ({rep.units} units, {rep.vectors} distinct vectors) in "
              f"{time.perf_counter() - t0:.1f} s")
        out["index_bytes"] = sum(p.stat().st_size for p in (store / ".hutch").glob("index.sqlite*"))

        # first query of a new process: full stat scan, watch set-up, snapshot (arrays + vectors) load
        code = ("import sys, time, hutch; m = hutch.Memory(sys.argv[1]); t = time.perf_counter(); "
                "m.search('warm up'); print((time.perf_counter() - t) * 1000)")
        colds = [float(subprocess.run([sys.executable, "-c", code, str(store)], capture_output=True, text=True,
                                      check=True).stdout) for _ in range(3)]
        print(f"first query of a new process (full scan + watch + snapshot load): median {statistics.median(colds):.0f} ms")
        out["first_query_ms"] = statistics.median(colds)
        mem.search("warm up")

        # queries: three content words of middle frequency (ranks 50-5000), as people search
        queries = [" ".join(rng.sample(vocab[50:5000], 3)) for _ in range(args.queries)]
        lat, peer = [], []
        db = sqlite3.connect(mem.index.idx.path)
        for q in queries:
            t = time.perf_counter()
            mem.search(q, k=10)
            lat.append((time.perf_counter() - t) * 1000)
            t = time.perf_counter()
            db.execute("select rowid from units_fts where units_fts match ? order by rank limit 10",
                       (_units.fts_query(q),)).fetchall()
            peer.append((time.perf_counter() - t) * 1000)
        row(f"query at {rep.entities} entities", lat, peer)
        out["query_ms"] = {"p50": statistics.median(lat), "p99": pct(lat, 99),
                           "peer_bm25_p50": statistics.median(peer)}
        if args.questions == "natural":
            first, again, npeer = [], [], []
            for r in range(max(2, args.queries // len(QUESTIONS))):
                for q in QUESTIONS:
                    t = time.perf_counter()
                    mem.search(q, k=10, now=NOW)
                    (again if r else first).append((time.perf_counter() - t) * 1000)
                    t = time.perf_counter()
                    db.execute("select rowid from units_fts where units_fts match ? order by rank limit 10",
                               (_units.fts_query(q),)).fetchall()
                    npeer.append((time.perf_counter() - t) * 1000)
            row3("natural questions, first asking", first, npeer)
            row3("natural questions, asked again", again, npeer)
            out["natural_ms"] = {"first": {"p50": statistics.median(first), "p90": pct(first, 90),
                                           "p99": pct(first, 99)},
                                 "again": {"p50": statistics.median(again), "p90": pct(again, 90),
                                           "p99": pct(again, 99)},
                                 "peer_bm25_p50": statistics.median(npeer), "load": os.getloadavg()}

        edit, same, reidx, idle = [], [], [], []
        for j in range(30):
            i = rng.randrange(args.n)
            p = store / "notes" / f"n{i}.md"
            p.write_text(p.read_text().replace("\n---\n", f"\n---\nEdited: zeppelin{j}marker.\n", 1))
            t = time.perf_counter()
            mem.index.refresh()  # re-index exactly that file (inotify named it)
            reidx.append((time.perf_counter() - t) * 1000)
            t = time.perf_counter()
            mem.index.refresh()  # nothing changed
            idle.append((time.perf_counter() - t) * 1000)
            p.write_text(p.read_text().replace(f"zeppelin{j}marker", f"zeppelin{j}marker again"))
            t = time.perf_counter()
            hits = mem.search(f"zeppelin{j}marker", k=3)
            edit.append((time.perf_counter() - t) * 1000)
            assert any(h.entity_id == f"notes/n{i}" for h in hits), f"the edited notes/n{i} was not found: {hits}"
            t = time.perf_counter()
            mem.search(f"zeppelin{j}marker", k=3)
            same.append((time.perf_counter() - t) * 1000)
        row("re-index one changed file", reidx, idle)
        row("search after editing one file", edit, same)
        out["reindex_one_ms"] = {"p50": statistics.median(reidx), "p99": pct(reidx, 99),
                                 "no_change_p50": statistics.median(idle)}
        out["one_file_ms"] = {"p50": statistics.median(edit), "p99": pct(edit, 99),
                              "unchanged_p50": statistics.median(same)}

        scans = []
        for _ in range(5):
            t = time.perf_counter()
            mem.index.idx.scan()
            scans.append((time.perf_counter() - t) * 1000)
        row("full stat scan (no-inotify fallback)", scans, lat)
        out["full_scan_ms"] = statistics.median(scans)
        mem.index.close()
        db.close()
    finally:
        if not args.dir:
            shutil.rmtree(base, ignore_errors=True)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
