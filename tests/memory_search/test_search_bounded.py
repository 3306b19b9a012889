"""What one large or odd entity may cost the index: bounded memory, whatever its size (docs/retrieval.md,
"Large entities"). The peak is read from /proc (VmHWM) of a fresh process that runs one search."""

from __future__ import annotations

import os
import random
import sqlite3
import subprocess
import sys
import textwrap

import pytest

import hutch
from hutch.memory._index import _db, _units
from hutch.memory._index._embed import MiniLMProvider

MiB = 1 << 20
#: What indexing one large entity may add to the peak of a process that searches (the model's own ~280 MiB
#: are measured in the same way on a small store and taken off); the unbounded code took 3 GB for 16 MiB.
EXTRA_PEAK_MIB = 120

_SEARCH = textwrap.dedent("""
    import sys, hutch
    def hwm():
        return int(open("/proc/self/status").read().split("VmHWM:")[1].split()[0]) // 1024
    m = hutch.Memory(sys.argv[1], create=False)
    hits = {q: [h.entity_id for h in m.search(q, k=5)] for q in sys.argv[2:]}
    print(hwm())
    print(repr(hits))
""")


def _words(rnd: random.Random, n: int) -> str:
    """`n` characters of lines of random words (a block of up to 1 MiB, repeated)."""
    vocab = ["".join(rnd.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rnd.randint(2, 9))) for _ in range(5000)]
    out, size = [], 0
    while size < min(n, MiB):
        line = " ".join(rnd.choice(vocab) for _ in range(12)) + "\n"
        out.append(line)
        size += len(line)
    block = "".join(out)
    return (block * (n // len(block) + 1))[:n]


def _fts(store_dir, table: str, word: str) -> int:
    db = sqlite3.connect(store_dir / ".hutch" / "index.sqlite")
    try:
        return db.execute(f"select count(*) from {table} where {table} match ?", (word,)).fetchone()[0]
    finally:
        db.close()


def _peak_and_hits(store, *queries: str) -> tuple[int, dict]:
    p = subprocess.run([sys.executable, "-c", _SEARCH, str(store), *queries], capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    peak, hits = p.stdout.splitlines()[-2:]
    return int(peak), eval(hits)


@pytest.mark.parametrize("size_mib", [16, 100])
def test_a_large_entity_is_indexed_in_bounded_memory(store_dir, size_mib):
    mem = hutch.Memory(store_dir)
    mem.put("notes", "seed", body="customer churn in the spring")
    baseline, _ = _peak_and_hits(store_dir, "customer churn")
    rnd = random.Random(size_mib)
    body = _words(rnd, 10 * MiB)
    with open(store_dir / "notes" / "big.md", "w") as f:  # as a program writing the store by hand would
        f.write("---\ntitle: big\n---\nquarterly zebrafish census\n")
        f.write(body)
        f.write("\nthe marmalade ledger\n")  # past the units (1 MiB), within the words (64 MiB)
        f.write(_words(rnd, size_mib * MiB - len(body) - 1000))
        f.write("\nthe pumpernickel ledger\n")  # past LEXICAL_BYTES for the 100 MiB entity
    del body
    peak, hits = _peak_and_hits(store_dir, "zebrafish census", "marmalade ledger", "pumpernickel ledger",
                                "customer churn")
    assert peak - baseline < EXTRA_PEAK_MIB, f"indexing a {size_mib} MiB entity peaked at {peak} MiB ({baseline} without)"
    assert hits["zebrafish census"][0] == "notes/big"
    assert hits["marmalade ledger"][0] == "notes/big", "the words past the units are searchable"
    assert hits["customer churn"][0] == "notes/seed"
    assert _fts(store_dir, "units_fts", "marmalade") == 0 and _fts(store_dir, "chunks_fts", "marmalade") == 1
    if size_mib * MiB > _units.LEXICAL_BYTES:
        assert _fts(store_dir, "chunks_fts", "pumpernickel") == 0, "past LEXICAL_BYTES nothing is indexed"
    else:
        assert hits["pumpernickel ledger"][0] == "notes/big"
    report = mem.doctor()
    assert report.partial == ("notes/big",) and report.ok
    assert any(line.startswith("partly indexed: 1: notes/big") for line in report.lines())
    db = sqlite3.connect(store_dir / ".hutch" / "index.sqlite")
    try:
        longest = db.execute("select max(length(body)) from chunks_fts").fetchone()[0]
        unit = db.execute("select max(length(body)) from units_fts").fetchone()[0]
        pending = db.execute("select max(length(text)) from pending").fetchone()[0] or 0
    finally:
        db.close()
    assert longest <= _units.CHUNK_BYTES and unit <= _units.UNIT_BYTES and pending <= _units.DENSE_CHARS


def test_limits_cut_at_white_space_and_words_past_them_are_left_out(mem, store_dir, monkeypatch):
    monkeypatch.setattr(_units, "UNIT_BYTES", 4096)
    monkeypatch.setattr(_units, "CHUNK_BYTES", 1024)
    monkeypatch.setattr(_units, "LEXICAL_BYTES", 16384)
    mem.put("notes", "seed", body="nothing much here")
    filler = "".join(f"word{i} · é " for i in range(3000))  # multi-byte characters at every possible cut
    text = f"---\ntitle: long\n---\nalpha {filler[:3000]} bravo {filler[:6000]} charlie {filler} delta\n"
    (store_dir / "notes" / "long.md").write_text(text)
    assert mem.search("charlie")[0].entity_id == "notes/long"
    assert _fts(store_dir, "units_fts", "alpha") == 1 and _fts(store_dir, "units_fts", "bravo") == 1
    assert _fts(store_dir, "units_fts", "charlie") == 0 and _fts(store_dir, "chunks_fts", "charlie") == 1
    assert _fts(store_dir, "chunks_fts", "delta") == 0 and _fts(store_dir, "units_fts", "delta") == 0
    db = mem.index.idx.db
    pieces = [r[0] for r in db.execute("select body from chunks_fts order by rowid")]
    assert pieces and all(len(p.encode()) <= 1024 for p in pieces)
    assert "\ufffd" not in "".join(pieces), "a cut split a character"
    assert all(p.endswith((" ", "\n")) for p in pieces[:-1]), "a cut split a word"
    mem.update("notes/long", body="short now")
    mem.search("charlie")
    assert db.execute("select count(*) from chunks").fetchone()[0] == 0 and _fts(store_dir, "chunks_fts", "charlie") == 0
    (store_dir / "notes" / "long.md").write_text(text)
    mem.search("charlie")
    assert _fts(store_dir, "chunks_fts", "charlie") == 1
    os.unlink(store_dir / "notes" / "long.md")
    mem.search("charlie")
    assert db.execute("select count(*) from chunks_fts").fetchone()[0] == 0


def test_bytes_that_are_not_utf8_do_not_break_search(mem, store_dir):
    mem.put("notes", "fine", body="customer churn")
    (store_dir / "notes" / "binary.md").write_bytes(b"---\ntitle: binary\n---\nchurn \xff\xfe\xc3 here\n")
    assert {h.entity_id for h in mem.search("churn")} == {"notes/fine", "notes/binary"}


def test_embedding_a_huge_text_costs_a_bounded_tokenizer_input():
    p = MiniLMProvider()
    long = _words(random.Random(3), 4 * MiB)
    code = textwrap.dedent(f"""
        import sys
        from hutch.memory._index._embed import MiniLMProvider
        def hwm():
            return int(open("/proc/self/status").read().split("VmHWM:")[1].split()[0]) // 1024
        p = MiniLMProvider()
        p.embed(["warm up"])
        base = hwm()
        text = open({str(_write_tmp(long))!r}).read()
        p.embed([text, text[:1000]])
        print(hwm() - base - len(text) // (1 << 20))
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert int(r.stdout.split()[-1]) < 60, "the tokenizer was given the whole text (~100 bytes a character)"
    a, b = p.embed([long, long[:2000]])
    assert float(a @ b) > 0.9999, "128 tokens of the text: what is embedded is its start"


def _write_tmp(text: str):
    import tempfile

    fd, path = tempfile.mkstemp(prefix="hutch-embed-test-", suffix=".txt")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    import atexit

    atexit.register(lambda: os.path.exists(path) and os.unlink(path))
    return path


def test_an_index_of_schema_4_is_upgraded_in_place_keeping_its_vectors(store_dir):
    m = hutch.Memory(store_dir)
    m.put("notes", "small", body="customer churn")
    m.put("notes", "large", body="pricing " * 3000)  # more than DENSE_CHARS: embedded as its first DENSE_CHARS now
    m.reindex()
    m.index.close()
    con = sqlite3.connect(store_dir / ".hutch" / "index.sqlite")
    con.execute("drop table chunks")
    con.execute("drop table chunks_fts")
    con.execute("update meta set value='4' where key='schema'")
    vectors = {r[0] for r in con.execute("select dense_hash from vectors")}
    con.commit()
    con.close()
    m2 = hutch.Memory(store_dir)
    try:
        assert [h.entity_id for h in m2.search("customer churn")][0] == "notes/small"
        db = m2.index.idx.db
        assert m2.index.idx.meta("schema") == _db.SCHEMA_VERSION
        assert not any("schema" in r for r in m2.doctor().recovered), "upgraded, not rebuilt"
        kept = {r[0] for r in db.execute("select dense_hash from vectors")}
        small = db.execute("select u.dense_hash from units u join files f on f.eid = u.eid "
                           "where f.entity_id = 'notes/small'").fetchone()[0]
        assert small in vectors and small in kept, "the vector of an unchanged unit was kept"
        assert max(len(r[0]) for r in db.execute("select text from pending")) <= _units.DENSE_CHARS \
            if db.execute("select count(*) from pending").fetchone()[0] else True
    finally:
        m2.index.close()


_HITS = textwrap.dedent("""
    import resource, sys, hutch
    def peak():
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
    m = hutch.Memory(sys.argv[1], create=False)
    m.search("warm up the model and the index")
    before = peak()
    shown = [(h.entity_id, h.anchor, h.title, h.speaker, len(h.text), h.text[:40]) for h in m.search(sys.argv[2], k=5)]
    print(before, peak())
    print(repr(shown))
""")


def test_a_hit_on_a_huge_file_reads_only_its_head(store_dir):
    """Hit.text, .title and .speaker read the file's first MiB (where every unit is), not all 200 MB of it: they
    read the whole file and split all of it into sections, which took its size several times over."""
    mem = hutch.Memory(store_dir)
    mem.put("notes", "seed", body="customer churn in the spring")
    rnd = random.Random(7)
    with open(store_dir / "notes" / "huge.md", "w") as f:
        f.write("---\ntitle: The huge talk\n---\n")
        for i in range(1, 6):  # a few long turns in the head
            said = "the pelican harmonica recital" if i == 3 else "weather and tea"
            f.write(f"### D1:{i} · {'Melanie' if i == 3 else 'Caroline'}\n\n{said}. {_words(rnd, 100_000)}\n\n")
        words = _words(rnd, 4 * MiB)
        while f.tell() < 200 * MiB:  # then 200 MB of lines without headings, and one more turn at the very end
            f.write(words)
        f.write("\n### D9:1 · Zed\n\nthe last word\n")
    del words
    assert mem.reindex().ok
    p = subprocess.run([sys.executable, "-c", _HITS, str(store_dir), "pelican harmonica"], capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    peaks, shown = p.stdout.splitlines()[-2:]
    before, after = map(int, peaks.split())
    shown = eval(shown)
    assert shown[0][:4] == ("notes/huge", "D1:3", "The huge talk", "Melanie")
    assert shown[0][5].startswith("the pelican harmonica recital") and shown[0][4] < MiB
    assert after - before < 100, f"the hits' text took the process from {before} to {after} MiB (the file: 200 MiB)"
    e = mem.head("notes/huge")
    assert e.title == "The huge talk" and "D1:5 · Caroline" in e.sections and len(e.text) <= MiB
    assert not any(k.startswith("D9:1") for k in e.sections)  # past the head
    assert mem.get("notes/huge").section("D9:1") == "the last word"  # the entity itself is all of it
