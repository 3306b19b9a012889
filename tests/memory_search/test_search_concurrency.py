"""Several processes search (and so index) one store at the same time: nothing is lost, nothing is discarded."""

import subprocess
import sys
import textwrap

import hutch

WORKER = textwrap.dedent("""
    import sys, hutch
    store, me = sys.argv[1], sys.argv[2]
    mem = hutch.Memory(store)
    found = 0
    for i in range(15):
        (mem.root / "notes" / f"{me}-{i}.md").write_text(f"---\\ntitle: {me} {i}\\n---\\nword{me}x{i} shared text\\n")
        hits = mem.search(f"word{me}x{i}", k=1)
        found += bool(hits) and hits[0].entity_id == f"notes/{me}-{i}"
        mem.search("shared text", k=5)
    print(found, len(mem.index.idx.recovered))
""")


def test_processes_indexing_one_store_at_once(store_dir):
    mem = hutch.Memory(store_dir)
    (store_dir / "notes").mkdir()
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, str(store_dir), f"p{n}"], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for n in range(3)]
    try:
        outs = [p.communicate(timeout=240) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err
        assert out.split() == ["15", "0"], (out, err)  # every own write found; the index never discarded
    report = mem.doctor()
    assert report.ok and report.entities == 45 and not report.recovered
    assert len(mem.search("shared text", k=50)) == 45
    mem.index.close()
