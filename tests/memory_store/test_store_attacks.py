"""Files planted in a store (by hand, a hostile agent on the host, or a hostile clone) never make hutch read or
write outside the store, run a program, or hang. Real git, real SQLite; every secret is a canary of the test's.
"""

from __future__ import annotations

import os
import subprocess
import threading
import warnings

import pytest

import hutch
from hutch._core.errors import MalformedEntityError, StorePathError
from hutch.memory._index._db import INDEX_NAME

SECRET = "SECRET-CANARY-7f3a"


@pytest.fixture
def outside(store_dir):
    """A directory of the test's next to the store (not in it), holding a canary file with a secret."""
    d = store_dir.parent / "outside"
    d.mkdir()
    (d / "canary.txt").write_text(SECRET + "\n")
    return d


@pytest.fixture
def seeded(mem):
    mem.put("topics", "Pricing", body="Tiered pricing was decided in November.")
    mem.put("orgs", "Acme", body="Acme worries about customer churn.")
    mem.put("actors", "Alice Chen", body="Head of data at Acme.")
    mem.link("actors/alice-chen", "works_at", "orgs/acme")
    return mem


def _listing(d):
    return sorted(str(p.relative_to(d)) for p in d.rglob("*"))


def _in_time(fn, seconds=30.0):
    """fn() run in a thread; fails (instead of hanging the suite) if it has not returned in `seconds`."""
    out = {}

    def go():
        try:
            out["value"] = fn()
        except BaseException as e:  # handed to the caller
            out["error"] = e

    t = threading.Thread(target=go, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"{fn} still running after {seconds} s"
    if "error" in out:
        raise out["error"]
    return out["value"]


def _everything_readable(mem) -> str:
    """What hutch hands out of the store: every entity, link, search hit, check issue and profile-like listing."""
    parts = [repr(mem.ls()), repr(list(mem.iter_links())), repr(mem.check())]
    for eid in mem.ls():
        try:
            e = mem.get(eid)
            parts += [e.text, repr(e.link_ids)]
        except hutch.Error as err:
            parts.append(str(err))
    for q in ("SECRET CANARY", SECRET, "pricing", "canary"):
        for h in mem.search(q, k=20):
            parts += [h.entity_id, repr(h.channels), mem.get(h.entity_id).text]
    return "\n".join(parts)


def test_a_dot_hutch_symlink_is_refused_and_nothing_is_written_through_it(seeded, outside):
    before = _listing(outside)
    mem = hutch.Memory(seeded.root)
    subprocess.run(["rm", "-rf", str(mem.root / ".hutch")], check=True)
    os.symlink(outside, mem.root / ".hutch")
    with pytest.raises(StorePathError, match="symbolic link"):
        mem.put("topics", "Churn", body="churn words")
    with pytest.raises(StorePathError, match="symbolic link"):
        hutch.Memory(mem.root).search("pricing")
    assert _listing(outside) == before, "hutch wrote its lock or index through a planted .hutch link"
    assert not (mem.root / "topics" / "churn.md").exists()


def test_an_index_file_symlink_is_replaced_not_written_through(seeded, outside):
    seeded.search("pricing")  # the index exists
    mem = hutch.Memory(seeded.root)
    idx = mem.root / ".hutch" / INDEX_NAME
    for suffix in ("", "-wal", "-shm"):
        p = f"{idx}{suffix}"
        if os.path.lexists(p):
            os.unlink(p)
    os.symlink(outside / "planted.db", idx)               # dangling: SQLite would create it
    os.symlink(outside / "canary.txt", f"{idx}-wal")      # SQLite would write its log into the canary
    assert [h.entity_id for h in mem.search("pricing")][:1] == ["topics/pricing"]
    assert _listing(outside) == ["canary.txt"]
    assert (outside / "canary.txt").read_text() == SECRET + "\n"
    assert not idx.is_symlink() and idx.is_file()
    assert any("symbolic link" in r for r in mem.index.idx.recovered)


def test_entity_and_relation_symlinks_to_host_files_are_never_read(seeded, outside):
    root = seeded.root
    canary = outside / "canary.txt"
    os.symlink(canary, root / "topics" / "evil.md")                          # an entity file that is a link
    os.symlink(os.path.relpath(canary, root / "topics"), root / "topics" / "evil2.md")
    os.symlink(outside, root / "evilclass")                                  # a class directory that is a link
    (outside / "planted.md").write_text(f"---\ntitle: Planted\n---\n{SECRET}\n")
    rdir = root / "actors" / "alice-chen.links" / "knows"
    rdir.mkdir()
    os.symlink(canary, rdir / "abs.md")                                      # a relation link pointing outside
    os.symlink("../../../../" * 8 + str(canary).lstrip("/"), rdir / "dotdot.md")
    os.symlink(outside, root / "actors" / "alice-chen.links" / "reads")     # a relation directory that is a link
    mem = hutch.Memory(root)
    with pytest.raises(StorePathError):
        mem.get("topics/evil")
    with pytest.raises(StorePathError):
        mem.get("evilclass/planted")
    seen = _everything_readable(mem)
    assert SECRET not in seen
    assert "topics/evil" not in mem.ls() and "evilclass/planted" not in mem.ls()
    assert mem.get("actors/alice-chen").links.keys() == {"works_at"}
    with pytest.raises(StorePathError):  # writes refuse the link too (and never write through it)
        mem.update("topics/evil", body="x")
    assert canary.read_text() == SECRET + "\n"


def test_a_links_directory_symlink_is_refused_before_writing(seeded, outside):
    root = seeded.root
    os.symlink(outside, root / "topics" / "pricing.links")
    with pytest.raises(StorePathError, match="symbolic link"):
        seeded.link("topics/pricing", "about", "orgs/acme")
    (root / "orgs" / "acme.links").mkdir()
    os.symlink(outside, root / "orgs" / "acme.links" / "about")
    with pytest.raises(StorePathError, match="symbolic link"):
        seeded.link("orgs/acme", "about", "topics/pricing")
    with pytest.raises(StorePathError, match="symbolic link"):
        seeded.unlink("orgs/acme", "about", "topics/pricing")
    assert _listing(outside) == ["canary.txt"]


def test_fifos_and_device_nodes_in_the_store_never_block(seeded):
    root = seeded.root
    fifo = root / "topics" / "fifo.md"
    os.mkfifo(fifo)
    os.mknod(root / "topics" / "zero.md", 0o644 | 0o020000, os.makedev(1, 5))  # /dev/zero: reads never end
    try:
        mem = hutch.Memory(root)
        for eid in ("topics/fifo", "topics/zero"):
            with pytest.raises(StorePathError, match="not a regular file"):
                _in_time(lambda: mem.get(eid))
        with pytest.raises(StorePathError):
            _in_time(lambda: mem.put("topics", "Fifo", body="x"))
        hits = _in_time(lambda: [h.entity_id for h in mem.search("pricing")])
        assert hits[0] == "topics/pricing" and "topics/fifo" not in hits
        _in_time(lambda: mem.check())
        _in_time(lambda: mem.update("topics/pricing", add_facts=["still writable"]))
    finally:
        # if a read did block on the FIFO, a writer end unblocks it so no thread is left waiting
        try:
            fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
            os.close(fd)
        except OSError:
            pass


def _bomb(depth: int = 8) -> str:
    lines = ['a0: &a0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    lines += [f"a{i}: &a{i} [" + ",".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, depth + 1)]
    return "---\n" + "\n".join(lines) + f"\ntitle: *a{depth}\ntags: *a{depth}\n---\nlaughing words\n"


def test_a_yaml_alias_bomb_is_malformed_not_a_hang(seeded):
    """9^9 values from a 600-byte file: str() of its title alone would not end. Refused as malformed at once."""
    (seeded.root / "topics" / "bomb.md").write_text(_bomb())
    (seeded.root / "topics" / "loop.md").write_text("---\ntitle: &t [*t]\n---\nloop words\n")
    mem = hutch.Memory(seeded.root)
    for eid in ("topics/bomb", "topics/loop"):
        with pytest.raises(MalformedEntityError, match="expands to more than"):
            _in_time(lambda: mem.get(eid))
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        hits = _in_time(lambda: [h.entity_id for h in mem.search("laughing words")])
    # never a hit (its entity cannot be read, issue 16), but named, so that it can be found and fixed
    assert "topics/bomb" not in hits
    assert any(issubclass(w.category, hutch.MalformedEntityWarning) and "topics/bomb" in str(w.message) for w in said)
    assert "topics/bomb" in mem.doctor().unreadable
    report = _in_time(lambda: mem.check())
    assert any(i.path == "topics/bomb.md" for i in report.issues)
    with pytest.raises(MalformedEntityError):  # and never written by hutch
        from hutch.fuse._write import commit_bytes
        commit_bytes(mem, "topics/bomb2", _bomb().encode(), "test")
    assert not (seeded.root / "topics" / "bomb2.md").exists()


def test_a_hard_link_to_a_host_file_is_never_written_through(seeded, outside):
    canary = outside / "canary.txt"
    os.link(canary, seeded.root / "topics" / "hard.md")  # needs host access to plant; hutch cannot tell it apart
    canary.write_text(f"---\ntitle: Hard\n---\n{SECRET}\n")
    seeded.update("topics/hard", body="replaced")
    seeded.forget("topics/pricing", reason="test")
    assert canary.read_text() == f"---\ntitle: Hard\n---\n{SECRET}\n"  # the update replaced the file, not wrote it


def _git(mem, *args):
    subprocess.run(["git", "-C", str(mem.root), *args], check=True, capture_output=True)


def _exercise(mem):
    """Every git-backed operation of the store API."""
    before = mem.git.run("rev-parse", "HEAD").strip()
    mem.update("orgs/acme", body="changed by the test")
    mem.put("topics", "Churn", body="churn")
    mem.link("topics/churn", "about", "orgs/acme")
    mem.unlink("topics/churn", "about", "orgs/acme")
    with mem.transaction("many") as tx:
        tx.kind = "test"
        for i in range(70):  # > the bulk threshold: git fast-import
            mem.put("notes", f"Note {i}", body="n")
    mem.forget("topics/churn", reason="test")
    mem.history("orgs/acme")
    mem.as_of("2020-01-01").ls()
    assert "changed by the test" in mem.diff("orgs/acme", since=before)
    mem.check()


@pytest.mark.parametrize("attack", ["fsmonitor", "filter", "diff-external", "textconv", "include"])
def test_git_config_in_the_store_runs_no_program(seeded, outside, attack):
    marker = outside / f"ran-{attack}"
    cmd = f"touch {marker}; cat"
    if attack == "fsmonitor":
        _git(seeded, "config", "core.fsmonitor", f"touch {marker}; false")
    elif attack == "filter":
        _git(seeded, "config", "filter.x.clean", cmd)
        _git(seeded, "config", "filter.x.smudge", cmd)
        _git(seeded, "config", "filter.x.process", f"touch {marker}")
        (seeded.root / ".gitattributes").write_text("* filter=x\n")
        (seeded.root / "orgs" / ".gitattributes").write_text("*.md filter=x\n")
    elif attack == "diff-external":
        _git(seeded, "config", "diff.external", f"touch {marker}")
    elif attack == "textconv":
        _git(seeded, "config", "diff.x.textconv", f"sh -c 'touch {marker}; cat \"$0\"'")
        (seeded.root / ".gitattributes").write_text("*.md diff=x\n")
    elif attack == "include":
        (outside / "inc.cfg").write_text(f"[core]\n\tfsmonitor = touch {marker}; false\n"
                                         f"[filter \"y\"]\n\tclean = {cmd}\n")
        (seeded.root / ".gitattributes").write_text("* filter=y\n")
        _git(seeded, "config", "include.path", str(outside / "inc.cfg"))
    _exercise(hutch.Memory(seeded.root))
    assert not marker.exists(), f"a git command hutch ran executed the store's {attack} configuration"
    # the filter never changed what was committed either
    assert seeded.git.show("HEAD", "orgs/acme.md") == (seeded.root / "orgs" / "acme.md").read_text()


def test_core_worktree_cannot_pull_host_files_into_history(seeded, outside):
    (outside / "topics").mkdir()
    (outside / "topics" / "stolen.md").write_text(f"---\ntitle: Stolen\n---\n{SECRET}\n")
    _git(seeded, "config", "core.worktree", str(outside))
    mem = hutch.Memory(seeded.root)
    mem.put("topics", "Stolen", body="mine")
    assert SECRET not in (mem.git.show("HEAD", "topics/stolen.md") or "")
    assert "mine" in mem.git.show("HEAD", "topics/stolen.md")
    assert SECRET not in mem.git.run("log", "-p", "HEAD")


def test_a_file_name_that_is_not_utf8_breaks_no_search(seeded):
    """A hostile clone can hold any bytes as a name; SQLite cannot store such a name, and one of them made
    every search of the store raise UnicodeEncodeError. It is skipped; the API refuses to make one."""
    root = os.fsencode(str(seeded.root))
    with open(os.path.join(root, b"topics", b"bad\xff.md"), "wb") as f:
        f.write(b"---\ntitle: Bad\n---\npricing in a badly named file\n")
    os.makedirs(os.path.join(root, b"cl\xfeass"))
    with open(os.path.join(root, b"cl\xfeass", b"x.md"), "wb") as f:
        f.write(b"---\ntitle: X\n---\npricing again\n")
    rdir = os.path.join(root, b"orgs", b"acme.links", b"knows")
    os.makedirs(rdir)
    os.symlink(b"../../../topics/bad\xff.md", os.path.join(rdir, b"bad\xff.md"))
    mem = hutch.Memory(seeded.root)
    assert _in_time(lambda: [h.entity_id for h in mem.search("pricing")])[0] == "topics/pricing"
    mem.update("topics/pricing", add_facts=["searched again after a write"])
    assert "topics/pricing" in [h.entity_id for h in mem.search("searched again")]
    mem.check()
    with pytest.raises(StorePathError, match="UTF-8"):
        mem.put("topics", "Whatever", slug=os.fsdecode(b"new\xfe"))


def test_a_relation_directory_whose_name_is_not_utf8_breaks_no_search(seeded):
    """A relation directory named by hand with bytes that are not UTF-8 made every search raise
    UnicodeEncodeError (the links directory's fingerprint holds the names). Search answers; the relation is no
    link anywhere (search, entity.links, neighbors) and check() names it once."""
    root = os.fsencode(str(seeded.root))
    rdir = os.path.join(root, b"orgs", b"acme.links", b"kn\xffows")
    os.makedirs(rdir)
    os.symlink(b"../../../topics/pricing.md", os.path.join(rdir, b"pricing.md"))
    mem = hutch.Memory(seeded.root)
    assert _in_time(lambda: [h.entity_id for h in mem.search("customer churn")])[0] == "orgs/acme"
    acme = mem.get("orgs/acme")
    assert dict(acme.link_ids) == {} and dict(acme.links) == {}
    assert [n for n in mem.neighbors("topics/pricing") if n.id == "orgs/acme"] == []
    assert [h.entity_id for h in mem.search("tiered pricing", k=1, expand=1)] == ["topics/pricing"]
    named = [i for i in mem.check().issues if i.code == "bad-relation-name"]
    assert len(named) == 1 and named[0].path.startswith("orgs/acme.links/kn")


def test_a_links_directory_that_is_a_symlink_is_not_followed_and_check_names_it(seeded, outside):
    """`<slug>.links` as a link to a directory outside the store that holds well-formed relative links: the
    entity's links, neighbors and search read nothing through it (the index never did), check() reports it."""
    rdir = outside / "rel"
    rdir.mkdir()
    os.symlink("../../../actors/alice-chen.md", rdir / "alice-chen.md")  # resolves into the store from there
    os.symlink(outside, seeded.root / "topics" / "pricing.links")
    os.symlink(rdir, seeded.root / "actors" / "alice-chen.links" / "knows")  # a relation directory that is a link
    mem = hutch.Memory(seeded.root)
    assert dict(mem.get("topics/pricing").link_ids) == {}
    assert dict(mem.get("actors/alice-chen").link_ids) == {"works_at": ("orgs/acme",)}
    assert [(n.relation, n.direction, n.id) for n in mem.neighbors("actors/alice-chen")] == [
        ("works_at", "out", "orgs/acme")]
    report = mem.check()
    assert [i.path for i in report.by_code("symlink-links-dir")] == ["topics/pricing.links"]
    assert [i.path for i in report.by_code("bad-link-entry")] == ["actors/alice-chen.links/knows"]
    assert mem.search("tiered pricing")[0].entity_id == "topics/pricing"


def test_put_never_writes_through_a_symlinked_class_directory(seeded, outside):
    """put() of a new entity into a class directory that is a link: refused, nothing lands where it points."""
    os.symlink(outside, seeded.root / "evilclass")
    with pytest.raises(StorePathError, match="symbolic link"):
        seeded.put("evilclass", "Planted", body="would land outside")
    from hutch.fuse._write import commit_bytes
    with pytest.raises(StorePathError, match="symbolic link"):
        commit_bytes(seeded, "evilclass/planted2", b"through the mount", "test")
    assert _listing(outside) == ["canary.txt"]
    assert not list((seeded.root / ".hutch").glob("journal"))


@pytest.mark.parametrize("where", ["class", "links", "relation"])
def test_no_write_of_a_transaction_follows_a_link_swapped_in_after_the_checks(seeded, outside, where):
    """The write path itself refuses every link below the store's root (the checks before it are only the
    friendlier error): a directory swapped for a link between a check and the write is never written through."""
    root = seeded.root
    (root / "orgs" / "acme.links").mkdir(exist_ok=True)
    target = {"class": root / "topics" / "new.md",
              "links": root / "orgs" / "acme.links" / "about" / "topics--pricing.md",
              "relation": root / "orgs" / "acme.links" / "about" / "pricing.md"}[where]
    swap = {"class": root / "topics", "links": root / "orgs" / "acme.links",
            "relation": root / "orgs" / "acme.links" / "about"}[where]
    before = _listing(root)
    with pytest.raises(StorePathError, match="symbolic link"):
        with seeded.transaction("swapped") as tx:
            subprocess.run(["rm", "-rf", str(swap)], check=True)
            os.symlink(outside, swap)
            if where == "class":
                tx.write(target, "---\ntitle: New\n---\nlanded outside\n")
            else:
                tx.symlink(target, "../../../topics/pricing.md")
    assert _listing(outside) == ["canary.txt"]
    os.unlink(swap)
    subprocess.run(["git", "-C", str(root), "checkout", "--", "."], check=True, capture_output=True)
    assert not (root / ".hutch" / "journal").exists()
    assert set(_listing(root)) <= set(before) | {".hutch/write.lock"}


_CHILD = r"""
import sys, time
import hutch
from hutch.memory import _tx, _git

store, point, bulk = sys.argv[1], sys.argv[2], sys.argv[3] == "bulk"

def stop_here():
    print("ready", flush=True)
    time.sleep(600)

if point == "committing":
    real = _tx.Transaction.committing
    def committing(self, parent):
        real(self, parent)   # the journal says "HEAD may move from here" ...
        stop_here()          # ... and the writer dies before git moves it
    _tx.Transaction.committing = committing
elif point == "landed":
    def finish(self):        # the commit landed; the writer dies before it drops its journal
        stop_here()
    _tx.Transaction.finish = finish

mem = hutch.Memory(store)
with mem.transaction("killed midway"):
    mem.put("newclass", "Fresh", body="a new entity in a new class")
    mem.update("topics/pricing", body="rewritten by the killed writer")
    mem.link("orgs/acme", "about", "topics/pricing")
    mem.unlink("actors/alice-chen", "works_at", "orgs/acme")
    mem.forget("orgs/acme", reason="killed writer")
    for i in range(70 if bulk else 0):
        mem.put("notes", f"Note {i}", body="bulk")
    if point == "writing":
        stop_here()
print("not killed", flush=True)
"""


@pytest.mark.parametrize("bulk", ["single", "bulk"])
@pytest.mark.parametrize("point", ["writing", "committing", "landed"])
def test_a_writer_killed_mid_transaction_is_rolled_back_by_the_next_writer(seeded, point, bulk):
    """A real SIGKILL of a writing child process: the next writer to take the lock finds its journal and puts
    the store back as it was before that transaction (or keeps it, if its commit landed); no file it made
    stays, nothing is left staged, no temp file or empty directory remains."""
    import signal
    import sys

    root = seeded.root
    head_before = seeded.git.run("rev-parse", "HEAD").strip()
    files_before = {p: (root / p).read_bytes() if (root / p).is_file() or (root / p).is_symlink() else None
                    for p in _listing(root) if not p.startswith((".git/", ".hutch"))}
    child = subprocess.Popen([sys.executable, "-c", _CHILD, str(root), point, bulk], stdout=subprocess.PIPE,
                             text=True)
    try:
        assert child.stdout.readline() == "ready\n"
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.kill()
        child.wait()
        child.stdout.close()
    mem = hutch.Memory(root)
    mem.put("topics", "After", body="the next writer")
    landed = point == "landed"
    listing = [p for p in _listing(root) if not p.startswith((".git/", ".hutch"))]
    if not landed:
        assert "newclass" not in listing, "a file the killed writer made stayed in the store"
    assert mem.git.run("rev-list", "--count", f"{head_before}..HEAD").strip() == ("2" if landed else "1")
    assert mem.git.run("status", "--porcelain", "--untracked-files=all") == ""
    assert not (root / ".hutch" / "journal").exists()
    assert not [p for p in listing if ".tmp-" in p]
    if landed:
        assert mem.exists("newclass/fresh") and not mem.exists("orgs/acme")
        assert "rewritten by the killed writer" in mem.get("topics/pricing").body
        return
    assert "newclass" not in listing and not any(p.startswith("notes") for p in listing)
    assert set(listing) == set(files_before) | {"topics/after.md"}
    for p, data in files_before.items():
        if data is not None:
            assert (root / p).read_bytes() == data, f"{p} was not put back"
    assert mem.get("actors/alice-chen").links == {"works_at": [mem.get("orgs/acme")]}


def test_a_planted_journal_cannot_make_the_next_writer_touch_files_outside_the_store(seeded, outside):
    import json

    mem = hutch.Memory(seeded.root)
    rel = os.path.relpath(outside / "canary.txt", seeded.root)
    records = [{"v": 1, "tx": "abcd", "n": 0}, {"rel": rel, "kind": "none", "n": 0},
               {"rel": str(outside / "canary.txt"), "kind": "none", "n": 0},
               {"dir": os.path.relpath(outside, seeded.root), "n": 0}]
    (seeded.root / ".hutch" / "journal").write_text("".join(json.dumps(r) + "\n" for r in records))
    os.symlink(outside, seeded.root / "linkdir")
    (seeded.root / ".hutch" / "journal").write_text(
        (seeded.root / ".hutch" / "journal").read_text() + json.dumps({"rel": "linkdir/canary.txt", "kind": "none",
                                                                      "n": 0}) + "\n")
    mem.put("topics", "After", body="next writer")
    assert (outside / "canary.txt").read_text() == SECRET + "\n"
    assert not (seeded.root / ".hutch" / "journal").exists()


def test_a_dot_git_symlink_is_refused_by_every_write(seeded, outside):
    """git would write the store's objects and refs wherever a `.git` link points."""
    real = outside / "repo.git"
    os.rename(seeded.root / ".git", real)
    os.symlink(real, seeded.root / ".git")
    before = _listing(real)
    with pytest.raises(StorePathError, match=r"\.git is a symbolic link"):
        hutch.Memory(seeded.root).put("topics", "Churn", body="churn words")
    assert _listing(real) == before
    assert not (seeded.root / "topics" / "churn.md").exists()
