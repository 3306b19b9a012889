"""The index never drifts from the files: edits by shell and by git are seen at once; a broken index is rebuilt."""

import os
import shutil
import sqlite3
import subprocess

import hutch
from _search_helpers import CONVERSATION, git


def _ids(hits):
    return [h.entity_id for h in hits]


def test_a_forgotten_entity_does_not_come_back_with_the_next_one(mem):
    """SQLite gives a deleted row's id to the next insert: the next entity must not take the forgotten one's name."""
    mem.put("notes", "Garden", body="Tomatoes and basil grow by the fence.")
    mem.put("vehicles", "Car", body="The car smells of tomatoes.")
    assert set(_ids(mem.search("tomatoes", k=5))) == {"notes/garden", "vehicles/car"}
    mem.forget("vehicles/car", reason="test")
    assert _ids(mem.search("tomatoes", k=5)) == ["notes/garden"]
    mem.put("vehicles", "Boat", body="The boat smells of tomatoes.")
    got = mem.search("tomatoes", k=5)
    assert set(_ids(got)) == {"notes/garden", "vehicles/boat"}, _ids(got)
    assert {h.entity.id for h in got} == {"notes/garden", "vehicles/boat"}   # each hit reads back
    assert mem.doctor().ok


def test_shell_edit_rename_delete_are_seen_at_once(mem, store_dir):
    mem.put("notes", "Garden", body="Tomatoes and basil grow by the fence.")
    mem.put("notes", "Car", body="The car needs new tyres.")
    assert _ids(mem.search("tomatoes basil", k=1)) == ["notes/garden"]
    path = store_dir / "notes" / "car.md"
    # edit in place by shell, same size class: the content hash decides
    subprocess.run(["sed", "-i", "s/new tyres/a zeppelin hangar/", str(path)], check=True)
    hits = mem.search("zeppelin hangar", k=1)
    assert _ids(hits) == ["notes/car"] and "bm25" in hits[0].channels
    assert "zeppelin" in hits[0].text
    assert not any("tyres" in h.text for h in mem.search("tyres", k=5))
    # rename by shell (the id follows the file name)
    os.rename(store_dir / "notes" / "garden.md", store_dir / "notes" / "allotment.md")
    assert _ids(mem.search("tomatoes basil", k=1)) == ["notes/allotment"]
    # a file a person wrote from scratch
    (store_dir / "notes" / "hand.md").write_text("---\ntitle: Handwritten\n---\nA note about quokkas.\n")
    assert _ids(mem.search("quokkas", k=1)) == ["notes/hand"]
    # delete by shell
    os.unlink(store_dir / "notes" / "allotment.md")
    assert "notes/allotment" not in _ids(mem.search("tomatoes basil", k=5))
    shutil.rmtree(store_dir / "notes")
    assert mem.search("quokkas zeppelin", k=5) == []
    assert mem.doctor().ok


def test_git_checkout_and_revert_are_seen_at_once(mem, store_dir):
    mem.put("notes", "Plan", body="We will migrate the database to Postgres.")
    first = git(store_dir, "rev-parse", "HEAD").strip()
    assert _ids(mem.search("postgres migration", k=1)) == ["notes/plan"]
    mem.update("notes/plan", body="We will keep SQLite and drop the migration idea.")
    mem.put("notes", "Budget", body="Spend less on cloud hosting.")
    assert "sqlite" in mem.search("sqlite", k=1)[0].text.lower()
    git(store_dir, "checkout", "-q", first)  # detached: files of the first commit; Budget disappears
    hits = mem.search("postgres sqlite", k=5)
    assert _ids(hits) == ["notes/plan"] and "Postgres" in hits[0].text
    assert "notes/budget" not in _ids(mem.search("cloud hosting", k=5))
    git(store_dir, "checkout", "-q", "-")
    assert "notes/budget" in _ids(mem.search("cloud hosting", k=5))
    assert "SQLite" in mem.search("sqlite", k=1)[0].text


def test_links_changed_by_shell_are_seen(mem, store_dir):
    a = mem.put("actors", "Ann", body="Engineer.")
    b = mem.put("orgs", "Umbrella", body="A company that makes umbrellas.")
    assert len(mem.search("umbrellas", k=1, expand=1)) == 1
    ldir = store_dir / "actors" / "ann.links" / "works_at"
    ldir.mkdir(parents=True)
    os.symlink("../../../orgs/umbrella.md", ldir / "umbrella.md")
    wide = mem.search("umbrellas", k=1, expand=1)
    assert [h.entity_id for h in wide] == [b.id, a.id]
    shutil.rmtree(store_dir / "actors" / "ann.links")
    assert len(mem.search("umbrellas", k=1, expand=1)) == 1


def test_deleting_the_index_loses_nothing(mem, store_dir):
    mem.ingest_conversation(CONVERSATION, conv_id="c1")
    before = [(h.entity_id, h.anchor) for h in mem.search("sailing boat", k=3)]
    mem.index.close()
    shutil.rmtree(store_dir / ".hutch")
    again = hutch.Memory(store_dir)
    assert [(h.entity_id, h.anchor) for h in again.search("sailing boat", k=3)] == before
    assert git(store_dir, "status", "--porcelain") == ""  # the index is ignored by git


def _corrupt_middle(path):
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.seek(size // 2)
        f.write(b"\xde\xad\xbe\xef" * 1024)


def test_corrupted_or_truncated_index_is_rebuilt(store_dir):
    mem = hutch.Memory(store_dir)
    mem.ingest_conversation(CONVERSATION, conv_id="c1")
    want = [(h.entity_id, h.anchor) for h in mem.search("marathon training", k=3)]
    mem.index.close()
    db = store_dir / ".hutch" / "index.sqlite"
    sqlite3.connect(db).execute("pragma wal_checkpoint(truncate)").close()
    for damage in ("middle", "truncate", "garbage"):
        if damage == "middle":
            _corrupt_middle(db)
        elif damage == "truncate":
            with open(db, "r+b") as f:
                f.truncate(db.stat().st_size // 3)
        else:
            db.write_bytes(b"this is not a database" * 100)
        m2 = hutch.Memory(store_dir)
        assert [(h.entity_id, h.anchor) for h in m2.search("marathon training", k=3)] == want, damage
        report = m2.doctor()
        assert report.ok and report.recovered and "rebuilt" in report.recovered[-1], damage
        m2.index.close()
        sqlite3.connect(db).execute("pragma wal_checkpoint(truncate)").close()


def test_doctor_reports_drift_without_fixing_it(mem, store_dir):
    mem.put("notes", "One", body="alpha")
    mem.put("notes", "Two", body="beta")
    assert mem.reindex().ok
    (store_dir / "notes" / "one.md").write_text("---\ntitle: One\n---\ngamma\n")
    os.unlink(store_dir / "notes" / "two.md")
    (store_dir / "notes" / "three.md").write_text("---\ntitle: Three\n---\ndelta\n")
    r = mem.doctor()
    assert not r.ok
    assert (r.stale, r.extra, r.missing) == (("notes/one",), ("notes/two",), ("notes/three",))
    assert r.entities == 2 and r.pending_vectors == 0
    mem.search("anything")
    r = mem.doctor()
    assert r.ok and r.entities == 2 and not (r.stale or r.extra or r.missing)


def test_same_size_edit_with_the_old_mtime_is_seen(mem, store_dir):
    """(mtime, size) alone would miss this edit; the inotify watch names the file, and its hash decides."""
    mem.put("notes", "Pet", body="The cat sleeps.")
    assert mem.search("cat", k=1)[0].entity_id == "notes/pet"
    assert mem.index.idx.watcher is not None  # after the first query, changes are notified, not scanned
    path = store_dir / "notes" / "pet.md"
    st = path.stat()
    path.write_text(path.read_text().replace("The cat sleeps.", "The owl sleeps."))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert path.stat().st_size == st.st_size
    hits = mem.search("owl", k=1)
    assert hits[0].entity_id == "notes/pet" and "owl" in hits[0].text and "bm25" in hits[0].channels


def test_without_notifications_a_full_scan_still_sees_changes(mem, store_dir):
    mem.put("notes", "Pet", body="The cat sleeps.")
    mem.search("cat")
    mem.index.idx.watcher.broken = True  # as after a queue overflow or a watch limit
    (store_dir / "notes" / "pet.md").write_text("---\ntitle: Pet\n---\nThe hamster runs.\n")
    assert "hamster" in mem.search("hamster", k=1)[0].text
    assert mem.index.idx.watcher is not None and not mem.index.idx.watcher.broken  # watching again


def test_git_checkout_that_removes_and_restores_a_whole_class(mem, store_dir):
    mem.put("notes", "Keep", body="an ordinary note")
    mem.search("ordinary")  # from here on the index follows notifications
    first = git(store_dir, "rev-parse", "HEAD").strip()
    mem.put("decisions", "Adopt Rust", body="We adopt Rust for the parser.")
    mem.link("decisions/adopt-rust", "about", "notes/keep")
    assert [h.entity_id for h in mem.search("rust parser", k=1)] == ["decisions/adopt-rust"]
    git(store_dir, "checkout", "-q", first)
    assert not (store_dir / "decisions").exists()
    assert "decisions/adopt-rust" not in [h.entity_id for h in mem.search("rust parser", k=5)]
    assert [h.entity_id for h in mem.search("ordinary", k=1, expand=1)] == ["notes/keep"]
    git(store_dir, "checkout", "-q", "-")
    assert [h.entity_id for h in mem.search("rust parser", k=1)] == ["decisions/adopt-rust"]
    wide = [h.entity_id for h in mem.search("ordinary note", k=1, expand=1)]
    assert wide == ["notes/keep", "decisions/adopt-rust"]
    assert mem.doctor().ok
