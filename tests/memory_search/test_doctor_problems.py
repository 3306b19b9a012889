"""doctor() and the link graph on a store a new user edited by hand (issue 16): malformed files make the state say
what is wrong (the CLI exits non-zero), a link that dangles or leads out of the store is no neighbor, no link, no
search hit, and is named with its fix by check() and doctor(); nothing outside the store is ever opened through
such a link (inotify on the outside directory says so). Real store, real SQLite, the real CLI (click's runner)."""

import ctypes
import ctypes.util
import os
import shutil
import struct
import tempfile
from pathlib import Path

import pytest
from click.testing import CliRunner

from hutch.cli import cli
from hutch.cli._mem import EXIT_CHECK_FAILED
from hutch.cli._mem_search import EXIT_INDEX_STALE
from hutch.memory._entity import Neighbor

BAD_YAML = "---\ntitle: [unclosed\n---\nThe walrus garden.\n"
NO_FRONT_MATTER = "just text, no front matter, walrus\n"
IN_OPEN = 0x20


def run(store, *args):
    return CliRunner().invoke(cli, ["mem", "--store", str(store), *args], catch_exceptions=False)


def test_doctor_says_what_is_wrong_with_malformed_files_and_exits_non_zero(mem, store_dir):
    mem.put("notes", "Garden plan", body="Tomatoes in the walrus garden.")
    (store_dir / "notes" / "bad.md").write_text(BAD_YAML)
    (store_dir / "notes" / "nofm.md").write_text(NO_FRONT_MATTER)
    report = mem.reindex()
    assert report.fresh and not report.ok and report.unreadable == ("notes/bad", "notes/nofm")
    assert [p.split(":", 1)[0] for p in report.problems] == ["notes/bad.md", "notes/nofm.md"]
    for p, rel in zip(report.problems, ("notes/bad.md", "notes/nofm.md")):
        assert f"Fix: edit {rel} so it starts with '---'" in p and str(store_dir) not in p
    assert "front matter line 2" in report.problems[0] and "has no front matter" in report.problems[1]
    r = run(store_dir, "doctor")
    assert r.exit_code == EXIT_CHECK_FAILED, r.output
    lines = r.output.splitlines()
    assert "state: 2 problems in the store's files (each below, with its fix)" in lines
    assert "state: ok" not in r.output
    assert [ln.split(":", 2)[1].strip() for ln in lines if ln.startswith("problem: ")] == ["notes/bad.md",
                                                                                           "notes/nofm.md"]
    # stale and broken at once: the stale exit (4) wins, the state says both
    (store_dir / "notes" / "new.md").write_text("---\ntitle: New\n---\nnew\n")
    r = run(store_dir, "doctor")
    assert r.exit_code == EXIT_INDEX_STALE and "out of date" in r.output and "2 problems" in r.output
    # fixed by hand as the lines say: ok, exit 0
    (store_dir / "notes" / "bad.md").write_text(BAD_YAML.replace("[unclosed", "Bad no more"))
    (store_dir / "notes" / "nofm.md").write_text("---\ntitle: Has one now\n---\n" + NO_FRONT_MATTER)
    assert mem.reindex().ok
    r = run(store_dir, "doctor")
    assert r.exit_code == 0 and "state: ok" in r.output and "problem" not in r.output


class _Opens:
    """Every open of a file in `directory`, seen by a real inotify watch (IN_OPEN)."""

    def __init__(self, directory: Path):
        self.libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        self.fd = self.libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        assert self.fd >= 0
        assert self.libc.inotify_add_watch(self.fd, os.fsencode(directory), IN_OPEN) >= 0

    def names(self) -> list[str]:
        out = []
        while True:
            try:
                buf = os.read(self.fd, 65536)
            except BlockingIOError:
                return out
            pos = 0
            while pos < len(buf):
                _wd, mask, _cookie, n = struct.unpack_from("iIII", buf, pos)
                name = buf[pos + 16:pos + 16 + n].rstrip(b"\0").decode()
                if mask & IN_OPEN:
                    out.append(name or ".")
                pos += 16 + n

    def close(self):
        os.close(self.fd)


@pytest.fixture
def outside():
    d = Path(tempfile.mkdtemp(prefix="hutch-outside-"))
    (d / "secret.md").write_text("---\ntitle: SECRET zebra\n---\nzebra zebra outside the store\n")
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_dangling_and_escaping_links_are_no_neighbors_and_are_named_with_their_fix(mem, store_dir, outside):
    a = mem.put("notes", "Alpha", body="alpha zebra note")
    b = mem.put("notes", "Beta", body="beta note")
    c = mem.put("notes", "Gamma", body="gamma zebra note")
    ghost = mem.put("notes", "Ghost", body="it links to alpha, then its file goes")
    mem.link(a, "knows", b)
    mem.link(a, "knows", c)
    mem.link(ghost, "knows", a)
    knows = store_dir / "notes" / "alpha.links" / "knows"
    os.unlink(store_dir / "notes" / "gamma.md")         # deleted by hand: alpha's link to it dangles
    os.unlink(store_dir / "notes" / "ghost.md")         # its links directory outlives it
    os.symlink(outside, store_dir / "elsewhere")         # a "class" that is a link out of the store
    os.symlink(outside / "secret.md", store_dir / "notes" / "sneaky.md")   # an "entity" that is a link out
    hand = {"passwd": "../../etc/passwd", "up.md": "../../../../../../" + str(outside)[1:] + "/secret.md",
            "abs.md": str(outside / "secret.md"), "viaclass.md": "../../../elsewhere/secret.md",
            "sneaky.md": "../../../notes/sneaky.md"}
    for name, target in hand.items():
        os.symlink(target, knows / name)
    opens = _Opens(outside)
    try:
        assert mem.neighbors(a) == [Neighbor("knows", "out", "notes/beta")]
        assert mem.backlinks(a) == {} and mem.neighbors(b) == [Neighbor("knows", "in", "notes/alpha")]
        alpha = mem.get(a)
        assert alpha.link_ids == {"knows": ("notes/beta",)}
        assert {rel: [e.id for e in es] for rel, es in alpha.links.items()} == {"knows": ["notes/beta"]}
        hits = mem.search("zebra", k=10, expand=2)
        assert {h.entity_id for h in hits} <= {"notes/alpha", "notes/beta"} and "notes/alpha" in {h.entity_id
                                                                                                for h in hits}
        assert all("SECRET" not in h.text and "outside" not in h.text for h in hits)
        r = run(store_dir, "show", a.id)
        assert r.exit_code == 0 and "-> knows notes/beta" in r.output and "gamma" not in r.output
        issues = {i.path: (i.code, i.fix) for i in mem.check().errors}
        rel = "notes/alpha.links/knows/"
        assert issues[rel + "gamma.md"] == ("dangling-link", "remove it (hutch mem unlink notes/alpha knows "
                                            f"notes/gamma, or rm {rel}gamma.md) or create notes/gamma")
        for name in ("viaclass.md", "sneaky.md"):   # inside the store by name, but no entity file: dangling
            assert issues[rel + name][0] == "dangling-link", name
        for name in ("passwd", "up.md", "abs.md"):
            assert issues[rel + name] == ("link-escapes", f"remove it: rm {rel}{name}"), name
        report = mem.doctor()
        assert report.fresh and not report.ok
        named = {p.split(":", 1)[0]: p for p in report.problems}
        # and the "entity" that is a link out: search leaves it out, doctor names it
        assert set(named) == {rel + n for n in [*hand, "gamma.md"]} | {"notes/sneaky.md"}
        assert all(" Fix: remove it" in p or " Fix: replace it" in p for p in named.values())
        assert "hutch mem unlink notes/alpha knows notes/gamma" in named[rel + "gamma.md"]
        r = run(store_dir, "doctor")
        assert r.exit_code == EXIT_CHECK_FAILED and "state: 7 problems" in r.output
        assert opens.names() == [], "a file outside the store was opened through a link"
        # the fix each line names works: unlink the dangling one, remove the others
        assert run(store_dir, "unlink", a.id, "knows", "notes/gamma").exit_code == 0
        for name in hand:
            os.unlink(knows / name)
        os.unlink(store_dir / "elsewhere")
        os.unlink(store_dir / "notes" / "sneaky.md")
        shutil.rmtree(store_dir / "notes" / "ghost.links")
        mem.reindex()
        assert mem.doctor().ok and not mem.check().errors
        assert opens.names() == []
    finally:
        opens.close()


def test_doctor_names_what_search_leaves_out_that_is_no_entity_file(mem, store_dir, tmp_path):
    """A `*.md` in a class that is no entity file (a symbolic link, one in a loop, one to a file outside the
    store, a directory, a name that is not UTF-8 or holds a newline) is left out of search and named by doctor,
    as check() names it, by its path in the store with its fix; doctor said "ok" and exited 0."""
    mem.put("notes", "Garden plan", body="Tomatoes in the walrus garden.")
    outside = tmp_path / "outside.md"
    outside.write_text("---\ntitle: Outside\n---\nwalrus secrets\n")
    notes = store_dir / "notes"
    os.symlink("loop.md", notes / "loop.md")
    os.symlink(str(outside), notes / "out.md")
    os.symlink("garden-plan.md", notes / "alias.md")
    os.mkdir(notes / "dir.md")
    (notes / "new\nline.md").write_text("---\ntitle: Odd\n---\nwalrus\n")
    with open(os.fsencode(notes) + b"/caf\xe9.md", "wb") as f:
        f.write(b"---\ntitle: Cafe\n---\nwalrus\n")
    assert [h.entity_id for h in mem.search("walrus", k=10)] == ["notes/garden-plan"]
    report = mem.doctor()
    assert report.fresh and not report.ok
    named = sorted(p.split(": ", 1)[0] for p in report.problems)
    assert named == ["notes/alias.md", "notes/caf\\xe9.md", "notes/dir.md", "notes/loop.md", "notes/new\\nline.md",
                     "notes/out.md"]
    checked = {i.path: f"{i.path}: {i.message} Fix: {i.fix}" for i in mem.check().errors}
    for p in report.problems:
        assert p == checked[p.split(": ", 1)[0]] and str(store_dir) not in p and p.isprintable()
    r = run(store_dir, "doctor")
    assert r.exit_code == EXIT_CHECK_FAILED and r.output.count("problem: ") == 6
    assert "Traceback" not in r.output and "walrus secrets" not in r.output
    for name in ("loop.md", "out.md", "alias.md", "new\nline.md"):
        os.unlink(notes / name)
    os.rmdir(notes / "dir.md")
    os.unlink(os.fsencode(notes) + b"/caf\xe9.md")
    assert mem.doctor().ok and run(store_dir, "doctor").exit_code == 0
