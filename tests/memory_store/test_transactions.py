"""Transactions group operations into one commit; failures write nothing; concurrent writers lose nothing."""

import multiprocessing
import os

import pytest

import hutch


def commits(mem):
    return int(mem.git.run("rev-list", "--count", "HEAD"))


def test_transaction_is_one_commit(mem):
    before = commits(mem)
    with mem.transaction("import people", source="crm:export-7"):
        for name in ["A", "B", "C"]:
            mem.put("actors", name)
        mem.link("actors/a", "knows", "actors/b")
        mem.update("actors/a", add_facts=["written twice in one transaction"])
    assert commits(mem) == before + 1
    assert mem.git.run("status", "--porcelain") == "" and mem.git.run("diff", "HEAD", "--stat") == ""
    assert "written twice" in mem.git.show("HEAD", "actors/a.md")
    c = mem.git.log(limit=1)[0]
    assert c.subject == "import people"
    assert c.trailers["Hutch-Entity"] == ["actors/a", "actors/b", "actors/c"]
    assert c.trailer("Hutch-Source") == "crm:export-7"


def test_failed_transaction_leaves_files_and_git_exactly_as_before(mem, store_dir):
    mem.put("actors", "Keep", body="original\n")
    original = (store_dir / "actors" / "keep.md").read_bytes()
    before = commits(mem)
    with pytest.raises(RuntimeError):
        with mem.transaction():
            mem.put("actors", "New One")
            mem.update("actors/keep", body="changed\n")
            mem.link("actors/keep", "knows", "actors/new-one")
            mem.put("brand_new_class", "Thing")
            raise RuntimeError("boom")
    assert (store_dir / "actors" / "keep.md").read_bytes() == original
    assert not (store_dir / "actors" / "new-one.md").exists()
    assert not (store_dir / "actors" / "keep.links").exists()
    assert not (store_dir / "brand_new_class").exists()
    assert commits(mem) == before
    git_dir = store_dir / ".git"
    assert not list(git_dir.glob("fast_import_crash*")) and not list(git_dir.glob("objects/pack/tmp_*"))
    assert mem.git.run("status", "--porcelain") == ""


def test_failed_single_op_writes_nothing(mem, store_dir):
    mem.put("actors", "X")
    before = sorted(p.relative_to(store_dir) for p in store_dir.rglob("*") if ".git" not in p.parts)
    with pytest.raises(hutch.ConfigError):
        mem.put("actors", "Y", valid_from="2026-02-01", valid_to="2026-01-01")
    after = sorted(p.relative_to(store_dir) for p in store_dir.rglob("*") if ".git" not in p.parts)
    assert before == after


def run_forked(target, arg_lists) -> None:
    """target(*args) in a forked process for each of `arg_lists`, all at once; each must exit 0 within 120 s
    (a hang guard); none outlives this, also when one failed."""
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=target, args=args) for args in arg_lists]
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.join(120)
            assert p.exitcode == 0
    finally:
        for p in procs:
            if p.is_alive():
                os.kill(p.pid, 9)
                p.join()


def _writer(path, w, m):
    mem = hutch.Memory(path)
    for i in range(m):
        e = mem.put("notes", f"writer {w} note {i}", facts=[f"w{w}-{i}"])
        if i:
            mem.link(e, "after", f"notes/writer-{w}-note-{i - 1}")


def test_concurrent_writers_lose_nothing(store_dir):
    hutch.Memory(store_dir)
    n, m = 4, 15
    run_forked(_writer, [(str(store_dir), w, m) for w in range(n)])
    mem = hutch.Memory(store_dir)
    assert len(mem.ls("notes")) == n * m
    assert commits(mem) == 1 + n * m + n * (m - 1)
    assert mem.git.run("status", "--porcelain") == ""
    for w in range(n):
        for i in range(1, m):
            assert mem.get(f"notes/writer-{w}-note-{i}").link_ids["after"] == (f"notes/writer-{w}-note-{i - 1}",)
    assert mem.check().errors == []


def test_no_stray_temp_files_after_many_writes(mem, store_dir):
    with mem.transaction():
        for i in range(50):
            mem.put("notes", f"n{i}")
    assert not [p for p in store_dir.rglob(".tmp-*")]


def test_big_transaction_commits_files_links_and_removals_exactly(mem, store_dir):
    """Above a threshold a transaction commits through one pack (fast-import); git must match the files."""
    with mem.transaction("bulk"):
        hub = mem.put("topics", "Hub")
        for i in range(120):
            e = mem.put("notes", f"n{i}", facts=[f"f{i}"])
            mem.link(e, "about", hub)
    assert mem.git.run("status", "--porcelain") == ""
    assert mem.git.run("diff", "HEAD", "--stat") == ""
    tree = mem.git.run("ls-tree", "-r", "HEAD", "--", "notes/n7.links")
    assert tree.startswith("120000 blob") and tree.rstrip().endswith("notes/n7.links/about/hub.md")
    assert mem.git.show("HEAD", "notes/n7.md") == (store_dir / "notes/n7.md").read_text()
    mem.forget("topics/hub", reason="bulk removal of 120 incoming links")
    assert mem.git.run("status", "--porcelain") == ""
    assert mem.git.run("ls-tree", "-r", "HEAD", "--", "notes/n7.links") == ""
    assert mem.git.ok("fsck", "--no-dangling")
    assert mem.check().errors == []


def test_git_failure_rolls_the_files_back(mem, store_dir):
    """If the commit fails (here: another tool holds git's index lock), the files are restored."""
    mem.put("actors", "Keep", body="original\n")
    original = (store_dir / "actors" / "keep.md").read_bytes()
    lock = store_dir / ".git" / "index.lock"
    lock.write_text("")
    try:
        with pytest.raises(hutch.MemoryStoreError, match="index.lock"):
            mem.update("actors/keep", body="changed\n")
        with pytest.raises(hutch.MemoryStoreError):
            mem.put("actors", "Other")
    finally:
        lock.unlink()
    assert (store_dir / "actors" / "keep.md").read_bytes() == original
    assert not (store_dir / "actors" / "other.md").exists()
    assert mem.git.run("status", "--porcelain") == ""
    mem.put("actors", "Other")  # and the store works again


def _tx_writer(path, w, batches, size):
    mem = hutch.Memory(path)
    for b in range(batches):
        with mem.transaction(f"writer {w} batch {b}"):
            for i in range(size):
                mem.put("notes", f"w{w} b{b} i{i}")


def test_concurrent_transactions_interleave_whole(store_dir):
    hutch.Memory(store_dir)
    n, batches, size = 3, 5, 4
    run_forked(_tx_writer, [(str(store_dir), w, batches, size) for w in range(n)])
    mem = hutch.Memory(store_dir)
    assert len(mem.ls("notes")) == n * batches * size
    log = mem.git.log()
    assert len(log) == 1 + n * batches
    for c in log[:-1]:  # every commit holds exactly one whole batch of one writer
        w, b = c.subject.split()[1], c.subject.split()[3]
        assert c.trailers["Hutch-Entity"] == [f"notes/w{w}-b{b}-i{i}" for i in range(size)]
