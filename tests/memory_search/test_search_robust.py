"""Search is never broken by one bad file or one bad query (issue 16): a file with malformed front matter, bytes
that are not UTF-8 in a file or in the query, a query of megabytes. Real store, real SQLite, the real CLI."""

import os
import resource
import subprocess
import sys
import warnings

import pytest

import hutch
from hutch.memory._index import _units

BROKEN = "---\ntitle: [unclosed\nfoo: : :\n---\nThe walrus garden has tomatoes, walrus walrus.\n"


def _searched(mem, q, **kw):
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        hits = mem.search(q, **kw)
    return hits, [w for w in said if issubclass(w.category, hutch.MalformedEntityWarning)]


def test_a_malformed_file_is_never_a_hit_and_is_named_once(mem, store_dir):
    mem.put("notes", "Garden plan", body="Tomatoes and beans in the walrus garden.")
    mem.put("notes", "Other", body="Nothing here about plants.")
    (store_dir / "notes" / "broken.md").write_text(BROKEN)  # by hand: the best match for the query below
    hits, said = _searched(mem, "walrus garden tomatoes", k=10)
    assert [h.entity_id for h in hits][:1] == ["notes/garden-plan"]
    assert "notes/broken" not in {h.entity_id for h in hits}
    assert all(h.entity.title and h.text is not None for h in hits)  # every hit's entity can be read
    assert len(said) == 1 and "notes/broken.md" in str(said[0].message) and "hutch mem check" in str(said[0].message)
    # named by its path in the store, as check() and doctor name it: the store's own place is no part of it
    assert str(store_dir) not in str(said[0].message) and "): notes/broken.md has malformed" in str(said[0].message)
    hits, said = _searched(mem, "walrus", k=1)  # in a small store the broken file matched every query
    assert [h.entity_id for h in hits] == ["notes/garden-plan"] and said == []  # named once, not per query
    assert mem.doctor().unreadable == ("notes/broken",)
    assert [i.code for i in mem.check().issues if i.path == "notes/broken.md"][0] == "bad-front-matter"
    # expand does not bring it in through a link either
    mem.link("notes/garden-plan", "see", "notes/other")
    os.symlink("../../broken.md", store_dir / "notes" / "garden-plan.links" / "see" / "broken.md")
    hits, _ = _searched(mem, "walrus garden", k=1, expand=1)
    assert {h.entity_id for h in hits} == {"notes/garden-plan", "notes/other"}
    # fixed: searchable at once; broken again: named again
    (store_dir / "notes" / "broken.md").write_text(BROKEN.replace("[unclosed\nfoo: : :", "Broken no more"))
    hits, said = _searched(mem, "walrus walrus", k=1)
    assert [h.entity_id for h in hits] == ["notes/broken"] and said == []
    (store_dir / "notes" / "broken.md").write_text(BROKEN)
    hits, said = _searched(mem, "walrus walrus", k=1)
    assert [h.entity_id for h in hits] == ["notes/garden-plan"] and len(said) == 1


def test_the_cli_names_a_malformed_file_on_stderr_and_lists_only_good_hits(mem, store_dir):
    mem.put("notes", "Garden plan", body="Tomatoes and beans in the walrus garden.")
    (store_dir / "notes" / "broken.md").write_text(BROKEN)
    r = subprocess.run([sys.executable, "-m", "hutch", "mem", "--store", str(store_dir), "search", "walrus",
                        "--explain"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "notes/garden-plan" in r.stdout and "broken" not in r.stdout
    assert r.stderr.count("hutch: warning: search leaves out 1 file") == 1 and "notes/broken.md" in r.stderr
    assert str(store_dir) not in r.stderr  # the path relative to the store, as check and doctor say it
    assert "Traceback" not in r.stderr


def test_a_query_past_the_limit_is_a_config_error_at_once(mem):
    mem.put("notes", "Garden plan", body="Tomatoes and beans in the garden.")
    mem.search("garden")
    huge = "garden tomatoes " * (10 * 1024 * 1024 // 16)  # 10 MB
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(hutch.ConfigError, match="at most 4,096"):
        mem.search(huge)
    # refused before any work: it took 1.5 GB (the peak of this process, a generous bound, not a timing)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 256 * 1024
    with pytest.raises(hutch.ConfigError):
        mem.search("g" * (_units.MAX_QUERY_CHARS + 1))
    longest = ("garden " * (_units.MAX_QUERY_CHARS // 7 + 1))[:_units.MAX_QUERY_CHARS]
    assert mem.search(longest)[0].entity_id == "notes/garden-plan"  # the limit itself is a query
    # the CLI: one line naming the limit, exit 1, no traceback; the limit itself answers
    cli = [sys.executable, "-m", "hutch", "mem", "--store", str(mem.root), "search"]
    r = subprocess.run(cli + ["g" * (_units.MAX_QUERY_CHARS + 1)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert r.stderr.startswith("hutch: error: The query is 4,097 characters long; search takes at most 4,096")
    r = subprocess.run(cli + [longest], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "notes/garden-plan" in r.stdout


def test_bad_k_and_classes_are_config_errors_naming_the_fix(mem):
    """k and classes= as a new user may get them wrong: each a ConfigError that says what to pass, refused before
    any work (a list of a million class names took a set and a scan per name, then answered nothing); a
    generator of classes is read once and still filters the hits that links bring in (expand)."""
    a = mem.put("notes", "Garden plan", body="Tomatoes and beans in the garden.")
    b = mem.put("actors", "Gardener", body="Looks after the beans.")
    mem.link(a, "tended_by", b)
    for k in (0, -1, True, False, 2.5, "5", None):
        with pytest.raises(hutch.ConfigError, match="positive integer"):
            mem.search("garden", k=k)
    assert {h.entity_id for h in mem.search("garden", k=10**9)} == {"notes/garden-plan", "actors/gardener"}
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for many in ([f"c{i}" for i in range(1_000_000)], (f"c{i}" for i in range(10**12)), ["notes"] * 2000):
        with pytest.raises(hutch.ConfigError, match="at most 1,024: name the few classes"):
            mem.search("garden", classes=many)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 256 * 1024  # KiB: the peak, not a timing
    for bad in (["../etc"], [1], ["no\x00tes"], ["Notes"], [None], [""]):
        with pytest.raises(hutch.ConfigError, match="not a class name"):
            mem.search("garden", classes=bad)
    with pytest.raises(hutch.ConfigError, match="not a list of class names"):
        mem.search("garden", classes=5)
    assert [h.entity_id for h in mem.search("garden", classes=["notes"] * 1024)] == ["notes/garden-plan"]
    assert [h.entity_id for h in mem.search("garden", classes=[])] == []   # no class named: no hit
    got = mem.search("tomatoes", k=1, expand=1, classes=(c for c in ["notes"]))
    assert [h.entity_id for h in got] == ["notes/garden-plan"]   # the linked actor is of another class
    assert {h.entity_id for h in mem.search("tomatoes", k=1, expand=1, classes=None)} == {
        "notes/garden-plan", "actors/gardener"}


def test_a_long_query_within_the_limit_answers(mem):
    # ~700 distinct words, each counted once against a store over MIN_UNITS_FOR_DF units
    with mem.transaction():
        for i in range(250):
            mem.put("notes", f"Note {i}", body=f"word{i} garden {'tomatoes' if i % 2 else 'beans'}")
    mem.search("warm up")
    q = " ".join(f"word{i}" for i in range(700))[:_units.MAX_QUERY_CHARS]
    hits = mem.search(q, k=5)
    assert len(hits) == 5 and all(h.text for h in hits)


NOT_UTF8 = b"---\ntitle: Caf\xe9 notes\n---\n### D1:1 \xb7 Ren\xe9\n\nThe caf\xe9 garden has tomatoes \xff\xfe.\n"


def test_bytes_that_are_not_utf8_in_a_file_or_the_query(mem, store_dir):
    mem.put("notes", "Fine", body="A garden of beans.")
    (store_dir / "notes" / "latin.md").write_bytes(NOT_UTF8)
    hits = mem.search("garden tomatoes", k=2)
    latin = next(h for h in hits if h.entity_id == "notes/latin")
    assert latin.text.encode("utf-8") and "\ufffd" in latin.text  # as the index reads them: U+FFFD, never surrogates
    assert mem.get("notes/latin").text.encode("utf-8", "surrogateescape") == NOT_UTF8  # the file itself: as it is
    # a query with such bytes (a command-line argument or a FUSE path, decoded with surrogateescape)
    q = b"caf\xe9 tomatoes".decode("utf-8", "surrogateescape")
    assert mem.search(q, k=1)[0].entity_id == "notes/latin"
    assert mem.search("garden \ud800", k=1)  # a lone surrogate that stands for no byte
    issue = next(i for i in mem.check().issues if i.path == "notes/latin.md")
    assert issue.code == "not-utf8" and issue.severity == "warning" and "byte 14" in issue.message
    r = subprocess.run([sys.executable, "-m", "hutch", "mem", "--store", str(store_dir), "search",
                        b"caf\xe9 garden", "--explain"], capture_output=True, timeout=120)
    assert r.returncode == 0, r.stderr.decode(errors="replace")
    assert b"notes/latin" in r.stdout and b"Traceback" not in r.stderr
    r = subprocess.run([sys.executable, "-m", "hutch", "mem", "--store", str(store_dir), "check"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "notes/latin.md: has bytes that are not UTF-8" in r.stdout


def test_odd_things_where_files_belong_break_nothing_and_check_names_each(mem, store_dir):
    """A FIFO, a socket, a device or a directory named like an entity, a `.links` that is a file, links that loop,
    dangle or are not links: search, doctor, reindex and check() answer (a FIFO once made check() block, a file
    gone between listing and reading made it raise), and check() names each path once, saying what it is."""
    import socket
    import stat

    a = mem.put("notes", "Garden plan", body="Tomatoes and beans in the walrus garden.")
    b = mem.put("notes", "Other", body="A walrus note.")
    mem.link(a, "see", b)
    notes, see = store_dir / "notes", store_dir / "notes" / "garden-plan.links" / "see"
    os.mkfifo(notes / "fifo.md")
    (notes / "dir.md").mkdir()
    os.mknod(notes / "null.md", 0o600 | stat.S_IFCHR, os.makedev(1, 3))
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(notes / "sock.md"))
    (notes / "other.links").write_text("not a directory\n")
    os.symlink("loop-b.md", see / "loop-a.md")
    os.symlink("loop-a.md", see / "loop-b.md")
    os.symlink("../../../notes/nothere.md", see / "nothere.md")
    (see / "sub.md").mkdir()
    os.mkfifo(see / "pipe.md")
    try:
        hits = mem.search("walrus garden", expand=1)
        assert {h.entity_id for h in hits} == {"notes/garden-plan", "notes/other"} and all(h.text for h in hits)
        see_rel = "notes/garden-plan.links/see/"
        for report in (mem.reindex(), mem.doctor()):   # fresh; the links that loop or dangle are its problems
            assert report.fresh and not report.ok
            # and what stands where an entity file belongs (search leaves it out, doctor names it)
            assert {p.split(":", 1)[0] for p in report.problems} == {see_rel + n for n in ("loop-a.md", "loop-b.md",
                                                                                          "nothere.md")} | {
                "notes/fifo.md", "notes/dir.md", "notes/null.md", "notes/sock.md"}
        assert mem.ls("notes") == ["notes/garden-plan", "notes/other"]
        assert [n.id for n in mem.neighbors(a) if n.direction == "out"].count("notes/other") == 1
        issues = {(i.path, i.code): i.message for i in mem.check().issues if i.code != "orphan"}
        want = {("notes/fifo.md", "not-a-file"): "is a FIFO", ("notes/dir.md", "not-a-file"): "is a directory",
                ("notes/null.md", "not-a-file"): "is a character device", ("notes/sock.md", "not-a-file"): "is a socket",
                ("notes/other.links", "links-not-dir"): "is a regular file",
                ("notes/garden-plan.links/see/loop-a.md", "link-escapes"): "points to 'loop-b.md'",
                ("notes/garden-plan.links/see/loop-b.md", "link-escapes"): "points to 'loop-a.md'",
                ("notes/garden-plan.links/see/nothere.md", "dangling-link"): "notes/nothere",
                ("notes/garden-plan.links/see/sub.md", "not-a-symlink"): "is a directory",
                ("notes/garden-plan.links/see/pipe.md", "not-a-symlink"): "is a FIFO"}
        assert set(issues) == set(want), sorted(set(issues) ^ set(want))
        for key, said in want.items():
            assert said in issues[key], (key, issues[key])
        r = subprocess.run([sys.executable, "-m", "hutch", "mem", "--store", str(store_dir), "check"],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 3 and "Traceback" not in r.stderr and "notes/fifo.md: is a FIFO" in r.stdout
    finally:
        sock.close()


_REWRITER = """
import os, sys, time
path, stop = sys.argv[1], sys.argv[2]
i = 0
while not os.path.exists(stop):
    i += 1
    body = ("---\\ntitle: Churning\\n---\\n" + f"version {i} " + "zebra " * (i % 5000)).encode()
    with open(path, "r+b") as f:          # in place, as an editor that does not rename would
        f.truncate(0)
        f.write(body[: len(body) // 2]); f.flush()   # half written when a reader may look
        f.write(body[len(body) // 2:])
    if i % 3 == 0:
        with open(path, "ab") as f:
            f.write(b" appended" * 1000)
final = b"---\\ntitle: Churning\\n---\\nthe final quokka text\\n"
with open(path, "r+b") as f:
    f.truncate(0); f.write(final)
print(i, flush=True)
"""


def test_a_file_rewritten_while_it_is_indexed(mem, store_dir, tmp_path):
    """A process rewrites a file in place (truncated, half written, appended to) while search, doctor and check
    read the store: none raises, and once it stops the index holds the file's last text."""
    mem.put("notes", "Steady", body="the zebra garden is steady")
    path = mem.put("notes", "Churning", body="first").path
    stop = tmp_path / "stop"
    w = subprocess.Popen([sys.executable, "-c", _REWRITER, str(path), str(stop)], stdout=subprocess.PIPE, text=True)
    try:
        for _ in range(30):
            hits, _ = _searched(mem, "zebra garden")  # a read of the file half written may find it malformed
            assert hits[0].entity_id in ("notes/steady", "notes/churning")
            mem.doctor()
            mem.check()
    finally:
        stop.touch()
        out = w.communicate(timeout=120)[0]
    assert w.returncode == 0 and int(out) > 0
    hits = mem.search("quokka")
    assert hits[0].entity_id == "notes/churning" and "the final quokka text" in hits[0].text
    assert mem.doctor().ok and mem.check().ok


_DELETER = """
import os, sys, time
root, stop = sys.argv[1], sys.argv[2]
i = 0
while not os.path.exists(stop):
    i += 1
    for n in range(40):   # each file and links directory gone for a moment, then back
        p = os.path.join(root, "notes", f"n{n}.md")
        data = open(p, "rb").read()
        os.unlink(p)
        with open(p + ".tmp", "wb") as f:
            f.write(data)
        os.rename(p + ".tmp", p)   # (a dot-less temp name: the scan sees it, then it is gone)
        ld = os.path.join(root, "notes", f"n{n}.links")
        if os.path.isdir(ld):
            os.rename(ld, ld + "-away")
            os.rename(ld + "-away", ld)
print(i, flush=True)
"""


def test_files_deleted_between_the_listing_and_the_read(mem, store_dir, tmp_path):
    """Files and links directories removed and put back while search, doctor() and check() run (an editor that
    deletes and rewrites, a sync tool): each answers from what is there; a file gone between the scan's listing
    and its stat made doctor() and search raise FileNotFoundError."""
    with mem.transaction():
        for n in range(40):
            mem.put("notes", f"N{n}", slug=f"n{n}", body=f"walrus number {n}")
        for n in range(1, 40):
            mem.link(f"notes/n{n}", "see", f"notes/n{n - 1}")
    mem.search("walrus")
    stop = tmp_path / "stop"
    child = subprocess.Popen([sys.executable, "-c", _DELETER, str(store_dir), str(stop)], stdout=subprocess.PIPE,
                             text=True)
    try:
        for _ in range(150):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                hits = mem.search("walrus number", k=5)
            assert all(h.entity_id.startswith("notes/n") for h in hits)
            mem.doctor()
            mem.check()
    finally:
        stop.touch()
        out, _ = child.communicate(timeout=120)
    assert child.returncode == 0 and int(out) > 0
    report = mem.reindex()
    assert report.fresh and report.entities == 40 and not report.problems
