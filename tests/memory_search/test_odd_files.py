"""Files a new user's editor or shell makes (issue 16): a byte order mark, CRLF line ends, front matter of
megabytes, a name with a newline in it, a class directory whose name is no class. Each is read, or is named by
check() and doctor() with a fix that works, and never a search hit whose entity cannot be read. Real store,
real SQLite, the real CLI (click's runner)."""

import os
import subprocess
import sys

import pytest
from click.testing import CliRunner

import hutch

from hutch.cli import cli
from hutch.memory import _format


def run(store, *args):
    return CliRunner().invoke(cli, ["mem", "--store", str(store), *args], catch_exceptions=False)


def test_a_byte_order_mark_and_crlf_are_read_and_kept(mem, store_dir):
    mem.put("notes", "Plain", body="plain quokka")
    (store_dir / "notes" / "bom.md").write_bytes(b"\xef\xbb\xbf---\ntitle: Bom\n---\nbom quokka\n")
    (store_dir / "notes" / "crlf.md").write_bytes(b"---\r\ntitle: Crlf\r\n---\r\ncrlf quokka\r\n")
    assert mem.get("notes/bom").title == "Bom" and mem.get("notes/crlf").title == "Crlf"
    hits = {h.entity_id: h for h in mem.search("quokka", k=10)}
    assert set(hits) == {"notes/plain", "notes/bom", "notes/crlf"} and hits["notes/bom"].title == "Bom"
    assert not mem.check().errors and mem.doctor().ok
    mem.update("notes/bom", title="Bom two")   # the mark and the line ends stay as the editor wrote them
    mem.update("notes/crlf", title="Crlf two")
    assert (store_dir / "notes" / "bom.md").read_bytes().startswith(b"\xef\xbb\xbf---\ntitle: Bom two\n")
    assert b"title: Crlf two\r\n" in (store_dir / "notes" / "crlf.md").read_bytes()


def test_front_matter_of_megabytes_is_one_clear_error_for_every_reader(mem, store_dir):
    mem.put("notes", "Plain", body="plain quokka")
    huge = "---\ntitle: Huge\n" + "".join(f"k{i}: value {i}\n" for i in range(300_000)) + "---\nhuge quokka\n"
    (store_dir / "notes" / "huge.md").write_text(huge)   # ~5 MB: the closing line is past what search reads
    (store_dir / "notes" / "open.md").write_text("---\ntitle: Never closed\nopen quokka\n")
    r = run(store_dir, "show", "notes/huge")
    assert r.exit_code == 1 and "front matter longer than 256 KiB" in r.output   # show read it all, and agrees
    assert "Traceback" not in r.output
    issues = {i.path: i for i in mem.check().errors}
    assert "front matter longer than 256 KiB" in issues["notes/huge.md"].message   # was: 'has no front matter'
    assert "never ends: no closing '---' line" in issues["notes/open.md"].message
    with pytest.warns(hutch.MalformedEntityWarning, match="longer than 256 KiB"):
        assert {h.entity_id for h in mem.search("quokka")} == {"notes/plain"}
    report = mem.doctor()
    assert [p.split(":", 1)[0] for p in report.problems] == ["notes/huge.md", "notes/open.md"]
    assert "longer than 256 KiB" in report.problems[0] and "never ends" in report.problems[1]
    # as the message says: the long values go into the body
    (store_dir / "notes" / "huge.md").write_text(huge.replace("---\nhuge", "\nhuge").replace(
        "title: Huge\n", "title: Huge\n---\n", 1))
    assert mem.get("notes/huge").title == "Huge" and len(mem.get("notes/huge").meta) == 1
    assert _format.MAX_FRONT_MATTER * 4 <= 1 << 20   # any front matter allowed closes within the MiB search reads


def test_a_name_that_is_no_slug_is_no_entity_and_check_says_how_to_rename_it(mem, store_dir):
    mem.put("notes", "Plain", body="plain quokka")
    for name in ("new\nline.md", " leading.md", "tab\there.md"):
        (store_dir / "notes" / name).write_text("---\ntitle: Odd\n---\nodd quokka\n")
    os.mkdir(store_dir / "My Notes")
    (store_dir / "My Notes" / "x.md").write_text("---\ntitle: X\n---\nclassless quokka\n")
    hits = mem.search("quokka", k=10)
    assert [h.entity_id for h in hits] == ["notes/plain"] and all(h.text for h in hits)   # a hit raised before
    assert mem.ls() == ["notes/plain"]
    issues = [i for i in mem.check().errors if i.code == "bad-entity-name"]
    assert sorted(i.path for i in issues) == ["notes/ leading.md", "notes/new\\nline.md", "notes/tab\\there.md"]
    for i in issues:
        assert "\n" not in str(i) and "\t" not in str(i)   # one line each, whatever the name holds
    fix = next(i.fix for i in issues if "new" in i.path)
    assert fix == "rename it to a valid slug, e.g. mv $'notes/new\\nline.md' notes/new-line.md"
    r = run(store_dir, "check")
    assert r.exit_code == 3 and "bad-class-name" not in r.output and "My Notes/: is not a valid class name" in r.output
    # the fix, pasted into a shell, works
    subprocess.run(["bash", "-c", fix.split("e.g. ", 1)[1]], cwd=store_dir, check=True)
    assert "notes/new-line" in mem.ls() and "notes/new-line" in {h.entity_id for h in mem.search("odd quokka")}


def test_a_name_that_shows_as_another_is_no_entity(mem, store_dir):
    """Names a sandbox or an archive may write to make a file look like another in ls, git or a terminal: a
    right-to-left override ("report\u202efdp.md" shows as "reportdm.pdf"), the other bidirectional controls, DEL
    and C1 controls (\x9b starts a terminal escape), the line separator. None is an entity's name: search and
    ls leave them out, check() names each on one printable line, and no caller can make one."""
    mem.put("notes", "Plain", body="plain quokka")
    odd = ["report\u202efdp.md", "iso\u2067late.md", "mark\u200fx.md", "del\x7fete.md", "csi\x9b31m.md",
           "line\u2028sep.md"]
    for name in odd:
        (store_dir / "notes" / name).write_text("---\ntitle: Odd\n---\nodd quokka\n")
    assert [h.entity_id for h in mem.search("quokka", k=10)] == ["notes/plain"]
    assert mem.ls() == ["notes/plain"]
    issues = [i for i in mem.check().errors if i.code == "bad-entity-name"]
    assert len(issues) == len(odd), issues
    for i in issues:
        assert str(i).isprintable(), str(i)
    for name in odd:
        with pytest.raises(hutch.StorePathError, match="not a valid slug"):
            mem.put("notes", "Odd", slug=name[:-3])
    assert mem.put("notes", "Persian", slug="pers\u200cian").id == "notes/pers\u200cian"   # ZWNJ: a letter's


def test_names_that_are_not_utf8_or_need_quoting_get_fixes_that_work_when_pasted(mem, store_dir):
    """A file or class directory whose name holds bytes that are not UTF-8 (a latin-1 shell, an archive), and odd
    things whose names hold a space or a quote: check() names each on one line of valid text and its fix, pasted
    into bash as it is, does what it says (it printed the lone surrogate as \\udcff, which bash cannot read
    back, and `rm notes/my link's.md` unquoted)."""
    mem.put("notes", "Plain", body="plain quokka")
    raw = os.fsencode(store_dir)
    (store_dir / "notes").joinpath(os.fsdecode(b"caf\xe9.md")).write_bytes(b"---\ntitle: Cafe\n---\ncafe quokka\n")
    os.mkdir(raw + b"/cl\xe9s")
    (store_dir / os.fsdecode(b"cl\xe9s") / "a.md").write_text("---\ntitle: A\n---\nclassless quokka\n")
    os.symlink("plain.md", store_dir / "notes" / "my link's.md")
    os.mkdir(store_dir / "notes" / "a dir $(x).md")
    hits = mem.search("quokka", k=10)
    assert [h.entity_id for h in hits] == ["notes/plain"]
    issues = {i.code: i for i in mem.check().issues if i.code != "orphan"}
    assert sorted(issues) == ["bad-class-name", "bad-entity-name", "not-a-file", "symlink-entity"]
    assert issues["bad-entity-name"].path == "notes/caf\\xe9.md"
    assert "not UTF-8" in issues["bad-entity-name"].message
    assert issues["bad-class-name"].path == "cl\\xe9s/"
    for i in issues.values():
        str(i).encode("utf-8")  # valid text (a lone surrogate cannot be written to a UTF-8 terminal or JSON)
        assert str(i).isprintable()
    r = run(store_dir, "check")
    assert r.exit_code == 3 and "\\udc" not in r.output
    for code in ("bad-entity-name", "bad-class-name"):
        subprocess.run(["bash", "-c", issues[code].fix.split("e.g. ", 1)[1]], cwd=store_dir, check=True)
    for code in ("symlink-entity", "not-a-file"):
        subprocess.run(["bash", "-c", "rm " + issues[code].fix.split(": rm ", 1)[1]], cwd=store_dir, check=True)
    assert sorted(os.listdir(raw + b"/notes")) == [b"caf.md", b"plain.md"]
    assert sorted(mem.ls()) == ["cl-s/a", "notes/caf", "notes/plain"]
    assert [i.code for i in mem.check().issues if i.code != "orphan"] == []


def test_an_index_made_under_the_old_front_matter_rule_reads_such_files_again(mem, store_dir):
    """An index that a hutch without the byte order mark rule made holds the BOM file as malformed, and the file
    does not change: the index of this version reads it again (it stayed left out of search until touched)."""
    import sqlite3

    mem.put("notes", "Plain", body="plain quokka")
    (store_dir / "notes" / "bom.md").write_bytes(b"\xef\xbb\xbf---\ntitle: Bom\n---\nbom quokka\n")
    assert mem.reindex().ok
    path = mem.doctor().path
    mem.index.close()
    db = sqlite3.connect(path)
    try:   # what the old rule left: the file's row says malformed, the meta says nothing of the parser
        db.execute("update files set error='has no front matter' where entity_id='notes/bom'")
        db.execute("delete from meta where key='parser'")
        db.commit()
    finally:
        db.close()
    again = hutch.Memory(store_dir)
    try:
        assert {h.entity_id for h in again.search("quokka")} == {"notes/plain", "notes/bom"}
        assert again.doctor().ok and again.doctor().unreadable == ()
    finally:
        again.index.close()


def test_a_link_whose_name_is_not_utf8_is_named_by_check(mem, store_dir):
    """Links, neighbors and the index leave out a link named with bytes that are not UTF-8; check() said the
    store was fine and counted it as a good link. Now it names it, and the fix, pasted, removes that link."""
    a = mem.put("notes", "Alpha", body="alpha quokka")
    b = mem.put("notes", "Beta", body="beta quokka")
    mem.link(a, "knows", b)
    rdir = os.fsencode(store_dir / "notes" / "alpha.links" / "knows")
    os.symlink(b"../../../notes/beta.md", rdir + b"/b\xe9ta.md")
    assert [n.id for n in mem.neighbors(a)] == ["notes/beta"]
    issues = [i for i in mem.check().errors]
    assert [(i.code, i.path) for i in issues] == [("bad-link-name", "notes/alpha.links/knows/b\\xe9ta.md")]
    subprocess.run(["bash", "-c", issues[0].fix.split("(rm ", 1)[1].split(")", 1)[0].join(["rm ", ""])],
                   cwd=store_dir, check=True)
    assert os.listdir(rdir) == [b"beta.md"] and mem.check().ok


def test_a_link_to_a_name_that_is_not_utf8_is_named_in_valid_json(mem, store_dir):
    """A link whose target's name holds bytes that are not UTF-8: check() called it dangling and printed the
    raw byte, so `hutch mem check --json` wrote JSON that is not UTF-8; it is a link that leads to no entity."""
    import json

    a = mem.put("notes", "Alpha", body="alpha quokka")
    mem.put("notes", "Beta", body="beta quokka")
    mem.link(a, "knows", "notes/beta")
    os.symlink(b"../../../notes/b\xffta.md", os.fsencode(store_dir / "notes" / "alpha.links" / "knows") + b"/x.md")
    assert [n.id for n in mem.neighbors(a)] == ["notes/beta"]
    r = subprocess.run([sys.executable, "-m", "hutch", "mem", "--store", str(store_dir), "check", "--json"],
                       capture_output=True, timeout=120)
    assert r.returncode == 3 and b"Traceback" not in r.stderr
    issues = [i for i in json.loads(r.stdout.decode("utf-8")).get("issues") if i["severity"] == "error"]
    assert [(i["code"], i["path"]) for i in issues] == [("link-escapes", "notes/alpha.links/knows/x.md")]
    assert "points to '../../../notes/b\\xffta.md'" in issues[0]["message"]
