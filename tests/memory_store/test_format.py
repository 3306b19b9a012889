"""Hand-edited files read back exactly, and writes change only the bytes they mean to change."""

import os

import pytest

import hutch
from hutch.memory import _format as fmt

ODD = (
    "---\r\n"
    "# a comment the API must keep\r\n"
    "title:   'Odd  Entity'   # trailing comment\r\n"
    "tags: [b,   a]\r\n"
    "aliases:\r\n"
    "  - one\r\n"
    "  -   two\r\n"
    "\"quoted key\": yes\r\n"
    "nested: {x: 1, y: [2, 3]}\r\n"
    "multi: |\r\n"
    "  line one\r\n"
    "  line two\r\n"
    "created: 2020-01-01\r\n"
    "---\r\n"
    "Body with trailing spaces   \r\n"
    "\r\n"
    "## Facts\r\n"
    "\r\n"
    "* first fact\r\n"
    "- second fact\r\n"
    "\r\n"
    "## Notes\r\n"
    "\r\n"
    "keep me\r\n"
)


def write_raw(store, rel, text):
    p = store / rel
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(text.encode())
    return p


def test_hand_edited_file_reads_back_exactly(mem, store_dir):
    p = write_raw(store_dir, "notes/odd.md", ODD)
    e = mem.get("notes/odd")
    assert e.text == ODD
    assert e.meta["title"] == "Odd  Entity"
    assert e.meta["quoted key"] is True
    assert e.meta["created"] == "2020-01-01"  # timestamps stay the strings the file holds
    assert e.facts == ["first fact", "second fact"]
    assert p.read_bytes() == ODD.encode()


def test_adding_facts_changes_only_the_facts_section_and_updated(mem, store_dir):
    p = write_raw(store_dir, "notes/odd.md", ODD)
    mem.update("notes/odd", add_facts=["third fact"])
    after = p.read_bytes().decode()
    head, fm, _ = fmt.split_front_matter(after)
    assert after.count("\r\n") == after.count("\n"), "CRLF kept on every line"
    old_lines = ODD.split("\r\n")
    new_lines = after.split("\r\n")
    added = [ln for ln in new_lines if ln not in old_lines]
    assert sorted(added) == sorted(["- third fact", f"updated: {mem.get('notes/odd').meta['updated']}"])
    assert [ln for ln in old_lines if ln not in new_lines] == []
    assert mem.get("notes/odd").facts == ["first fact", "second fact", "third fact"]
    assert "keep me" in after.split("- third fact")[1]


def test_changing_one_key_keeps_every_other_front_matter_byte(mem, store_dir):
    write_raw(store_dir, "notes/odd.md", ODD)
    mem.update("notes/odd", source="manual:check")
    after = (store_dir / "notes/odd.md").read_bytes().decode()
    before_fm = fmt.split_front_matter(ODD)[1]
    after_fm = fmt.split_front_matter(after)[1]
    assert after_fm.startswith(before_fm)  # only appended lines
    assert after_fm[len(before_fm):].split("\r\n")[:2][0].startswith(("source:", "updated:"))
    assert after.endswith(fmt.split_front_matter(ODD)[2])  # body untouched


def test_replacing_a_multiline_key_removes_its_continuation_lines(mem, store_dir):
    write_raw(store_dir, "notes/odd.md", ODD)
    mem.update("notes/odd", meta={"aliases": ["three"], "multi": "flat"})
    e = mem.get("notes/odd")
    assert e.meta["aliases"] == ["three"] and e.meta["multi"] == "flat"
    assert e.meta["nested"] == {"x": 1, "y": [2, 3]}
    assert "# a comment the API must keep" in e.text


def test_body_change_keeps_front_matter_text(mem, store_dir):
    write_raw(store_dir, "notes/odd.md", ODD)
    mem.update("notes/odd", body="New body.\n")
    after = (store_dir / "notes/odd.md").read_bytes().decode()
    old_fm = fmt.split_front_matter(ODD)[1].split("\r\n")
    new_fm = fmt.split_front_matter(after)[1].split("\r\n")
    assert [ln for ln in new_fm if ln not in old_fm] == [f"updated: {mem.get('notes/odd').meta['updated']}"]
    assert mem.get("notes/odd").facts == ["first fact", "second fact"]  # facts carried over
    assert "New body." in after and "keep me" not in after


def test_link_and_get_never_touch_entity_files(mem, store_dir):
    a = write_raw(store_dir, "notes/odd.md", ODD)
    b = mem.put("topics", "Weather")
    before_b = (store_dir / "topics/weather.md").read_bytes()
    st = os.stat(a)
    mem.link("notes/odd", "about", b)
    mem.get("notes/odd")
    mem.unlink("notes/odd", "about", b)
    assert a.read_bytes() == ODD.encode() and os.stat(a).st_mtime_ns == st.st_mtime_ns
    assert (store_dir / "topics/weather.md").read_bytes() == before_b
    assert not (store_dir / "notes/odd.links").exists()


def test_update_with_no_change_makes_no_commit(mem, store_dir):
    mem.put("actors", "Ann", facts=["a"])
    head = mem.git.run("rev-parse", "HEAD")
    mem.update("actors/ann", add_facts=["a"])
    assert mem.git.run("rev-parse", "HEAD") == head


@pytest.mark.parametrize("bad", [
    "no front matter at all\n",
    "---\ntitle: [unclosed\n---\nbody\n",
    "---\n- a list\n- not a mapping\n---\n",
    "---\ntitle: never closed\n",
])
def test_malformed_front_matter_names_the_file_and_the_fix(mem, store_dir, bad):
    write_raw(store_dir, "notes/bad.md", bad)
    with pytest.raises(hutch.MalformedEntityError) as ei:
        mem.get("notes/bad")
    assert "notes/bad.md" in str(ei.value) and "---" in str(ei.value)
    assert ei.value.path.endswith("notes/bad.md")


def test_values_that_look_like_other_types_round_trip_as_strings(mem):
    for title in ["yes", "null", "1.5", "12:30", "a: b", "#hash", "- dash", "[x]", "ünïcödé ✓", "tab\there"]:
        e = mem.put("things", title)
        assert mem.get(e.id).title == " ".join(title.split())


def test_slugify():
    assert fmt.slugify("Alice Chen") == "alice-chen"
    assert fmt.slugify("  Crème Brûlée!! ") == "creme-brulee"
    assert fmt.slugify("東京 タワー") == "東京-タワー"
    assert fmt.slugify("???") == "untitled"
    assert len(fmt.slugify("x" * 300)) == fmt.MAX_SLUG


def test_reserved_class_names_are_refused(mem):
    for cls in [".hutch", ".git", "Actors", "a/b", "", "notes\n"]:   # `$` matched before a final newline
        with pytest.raises(hutch.StorePathError):
            mem.put(cls, "x")
    assert not fmt.is_name("notes\n")


def test_symlinked_entity_file_is_refused(mem, store_dir, tmp_path):
    outside = tmp_path / "secret.md"
    outside.write_text("---\ntitle: secret\n---\n")
    (store_dir / "notes").mkdir()
    os.symlink(outside, store_dir / "notes" / "leak.md")
    with pytest.raises(hutch.StorePathError, match="symbolic link"):
        mem.get("notes/leak")


FAST_CASES = [
    'id: actors/alice\ntitle: Alice Chen\ncreated: 2026-11-30T10:30:57Z\nvalid_from: null\ntags: []\n'
    'confidence: 0.5\nsource: "chat:2026-11-02#14"\n',
    'title: yes\n', 'title: 1.5\n', 'a: 12:30\n', 'a: "x\\ny"\n', 'tags: [a, b c, d-e]\n', 'tags: [1, 2]\n',
    'a: b # c\n', 'a: .5\n', 'a: -.5\n', 'a: 0x10\n', 'a: 010\n', 'a: 1e3\n', 'a: -1\n', 'a: +1\n', 'a: 1_000\n',
    'a: ~\n', 'a:\n', 'a: True\n', 'participants: [Caroline, Melanie]\nsession: 4\n',
    'a: 2023-05-08\n', 'a: x  \n', 'a: (x)\n', 'a: ./x\n', 'a: x:y\n', 'a: "a \\"q\\""\n', 'a: "ünï"\n',
    'a: 2001-12-14 21:59:43.10 -5\n', "a: 'x'\n", 'tags: [x, "y"]\n', 'a: 1.\n', 'a: NaN\n', 'a: .inf\n',
    'a: 1.5.3\n', 'a: 00\n', 'a: 0o7\n', 'a: 1,000\n', 'a: 190:20:30\n', 'a: on\n', 'tags: [y, n]\n', 'a: x\r\n',
    'a: 6.8523015e+5\n', 'dup: 1\ndup: 2\n', '# comment\na: 1\n', 'a: &x 1\nb: *x\n', 'a: !!str 1\n',
]


@pytest.mark.parametrize("fm", FAST_CASES)
def test_fast_front_matter_path_agrees_with_yaml(fm):
    """The YAML-free fast path either declines (None) or returns exactly what YAML returns."""
    import yaml

    fast = fmt.fast_meta(fm)
    if fast is not None:
        assert fast == yaml.load(fm, Loader=fmt._StrDatesLoader)


def test_fast_path_is_taken_for_what_hutch_writes(mem):
    e = mem.put("actors", "Alice Chen", facts=["x"], source="chat:1#2", tags=["a", "b"], confidence=0.5,
                valid_from="2026-01-01")
    fm = fmt.split_front_matter(e.text)[1]
    assert fmt.fast_meta(fm) == mem.get(e.id).meta
    assert fmt.fast_meta(fm) is not None
