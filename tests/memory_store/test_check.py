"""check() finds what is broken in a store and says where and how to fix it."""

import os


def codes(report):
    return {(i.code, i.path) for i in report.issues}


def test_clean_store_is_ok(mem):
    a = mem.put("actors", "A")
    mem.link(a, "knows", mem.put("actors", "B"))
    r = mem.check()
    assert r.ok and r.issues == () and (r.entities, r.links) == (2, 1)


def test_check_reports_each_problem_with_path_and_fix(mem, store_dir):
    a = mem.put("actors", "A")
    b = mem.put("actors", "B")
    mem.link(a, "knows", b)
    mem.put("actors", "Lonely")
    # a dangling link: the target file removed by hand
    os.unlink(store_dir / "actors" / "b.md")
    # malformed front matter
    (store_dir / "notes").mkdir()
    (store_dir / "notes" / "broken.md").write_text("---\ntitle: [oops\n---\n")
    # an id that disagrees with the file's place
    (store_dir / "notes" / "moved.md").write_text("---\nid: notes/original\ntitle: Moved\n---\n")
    # a link that escapes the store, and a regular file where a link belongs
    rel = store_dir / "actors" / "a.links" / "knows"
    os.symlink("/etc/passwd", rel / "passwd.md")
    (rel / "plain.md").write_text("not a link")
    # a links dir without its entity, a stray temp file, a bad date
    (store_dir / "actors" / "ghost.links" / "knows").mkdir(parents=True)
    (store_dir / "actors" / ".tmp-123").write_text("")
    (store_dir / "notes" / "when.md").write_text("---\ntitle: When\nvalid_from: last tuesday\n---\n")
    # derived state is never checked
    (store_dir / ".hutch" / "index.sqlite").write_text("not an entity")

    r = mem.check()
    assert not r.ok
    found = codes(r)
    assert ("dangling-link", "actors/a.links/knows/b.md") in found
    assert ("bad-front-matter", "notes/broken.md") in found
    assert ("id-mismatch", "notes/moved.md") in found
    assert ("link-escapes", "actors/a.links/knows/passwd.md") in found
    assert ("not-a-symlink", "actors/a.links/knows/plain.md") in found
    assert ("orphan-links-dir", "actors/ghost.links") in found
    assert ("stray-temp", "actors/.tmp-123") in found
    assert ("bad-date", "notes/when.md") in found
    assert ("orphan", "actors/lonely.md") in found
    assert not any(".hutch" in i.path for i in r.issues)
    dangling = r.by_code("dangling-link")[0]
    assert "actors/b" in dangling.message and "unlink" in dangling.fix
    assert all(i.fix for i in r.issues)


def test_check_sees_uncommitted_hand_edits(mem, store_dir):
    mem.put("notes", "N")
    (store_dir / "notes" / "n.md").write_text("no front matter any more\n")
    assert [i.code for i in mem.check().errors] == ["bad-front-matter"]


def test_check_warns_of_an_entity_larger_than_search_splits(mem, store_dir):
    a = mem.put("notes", "small", body="fine")
    b = mem.put("notes", "large", body="x")
    mem.link(a, "see", b)
    path = store_dir / "notes" / "large.md"
    with open(path, "a") as f:
        f.write(("some words here\n" * 4096) * 40)  # 2.5 MiB
    r = mem.check()
    assert r.ok and [(i.code, i.path) for i in r.warnings] == [("large-entity", "notes/large.md")]
    assert "2.5 MiB" in r.warnings[0].message and "split it" in r.warnings[0].fix
