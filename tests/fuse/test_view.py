"""The FUSE view of a store, through a real mount: the tree, writes as commits, search, as-of, profile, errno."""

from __future__ import annotations

import errno
import os
import subprocess
import time


import hutch


def _errno(fn, *a, **kw) -> int:
    try:
        fn(*a, **kw)
    except OSError as e:
        return e.errno
    raise AssertionError(f"{fn.__name__}{a} did not fail")


def _write(path: str, data: str, mode: str = "w") -> None:
    with open(path, mode) as f:
        f.write(data)


def test_tree_shows_the_store_and_the_views(mounted):
    top = sorted(os.listdir(mounted.path))
    assert top == ["actors", "as-of", "orgs", "profile.md", "search", "topics"]  # no .git, .hutch, .gitignore
    assert sorted(os.listdir(mounted.p("actors"))) == ["alice-chen.links", "alice-chen.md"]
    with open(mounted.p("actors", "alice-chen.md"), "rb") as f:
        assert f.read() == (mounted.mem.root / "actors" / "alice-chen.md").read_bytes()
    link = mounted.p("actors", "alice-chen.links", "works_at", "acme.md")
    assert os.readlink(link) == "../../../orgs/acme.md"
    with open(link) as f:  # the relative link resolves inside the mount
        assert "customer churn" in f.read()
    assert _errno(os.stat, mounted.p(".git")) == errno.ENOENT
    assert _errno(open, mounted.p("actors", "nobody.md")) == errno.ENOENT


def test_writes_commit_with_the_mounts_provenance(mounted):
    mem = mounted.mem
    _write(mounted.p("actors", "alice-chen.md"), "- likes tea\n", "a")
    e = mem.get("actors/alice-chen")
    assert e.text.endswith("- prefers weekly reports\n- likes tea\n")
    v = mem.history("actors/alice-chen")[0]
    assert v.source == f"fuse:{mounted.path}" and v.op == "update"

    # a new file without front matter becomes a new entity; with front matter, the bytes are kept exactly
    _write(mounted.p("topics", "churn.md"), "Customers leave when onboarding is slow.\n")
    churn = mem.get("topics/churn")
    assert churn.body.strip() == "Customers leave when onboarding is slow." and churn.source == f"fuse:{mounted.path}"
    hand = "---\r\ntitle: Hand Made   # a comment\r\nid: topics/hand\r\n---\r\nbody *as is*\r\n"
    with open(mounted.p("topics", "hand.md"), "wb") as f:
        f.write(hand.encode())
    assert (mem.root / "topics" / "hand.md").read_bytes() == hand.encode()
    assert mem.get("topics/hand").title == "Hand Made"
    assert mem.history("topics/hand")[0].op == "put"
    # a shell redirect: one commit, not an empty one first
    n = len(mem.git.log())
    subprocess.run(["sh", "-c", f"echo 'Tiered pricing, revised.' > '{mounted.p('topics', 'pricing.md')}'"], check=True)
    assert len(mem.git.log()) == n + 1
    assert mem.get("topics/pricing").body.strip() == "Tiered pricing, revised."
    assert mem.check().ok


def test_sed_in_place_and_links_by_ln_and_rm(mounted):
    mem = mounted.mem
    subprocess.run(["sed", "-i", "s/November/December/", mounted.p("topics", "pricing.md")], check=True)
    assert "December" in mem.get("topics/pricing").body
    assert not [n for n in os.listdir(mounted.p("topics")) if n.startswith("sed")]
    d = mounted.p("topics", "pricing.links", "decided_by")
    os.makedirs(d)
    os.symlink("../../../actors/alice-chen.md", os.path.join(d, "alice-chen.md"))
    assert mem.get("topics/pricing").link_ids["decided_by"] == ("actors/alice-chen",)
    assert _errno(os.symlink, "/etc/passwd", os.path.join(d, "x.md")) == errno.EINVAL
    os.unlink(os.path.join(d, "alice-chen.md"))
    assert "decided_by" not in mem.get("topics/pricing").link_ids
    os.unlink(mounted.p("topics", "pricing.md"))
    assert not mem.exists("topics/pricing")
    assert mem.history("topics/pricing")[0].op == "forget"


def test_errors_map_to_errno(mounted):
    p = mounted.p
    bad_yaml = "---\ntitle: [unclosed\n---\nbody\n"
    f = open(p("actors", "alice-chen.md"), "w")
    f.write(bad_yaml)
    assert _errno(f.close) == errno.EINVAL
    assert "Head of data" in mounted.mem.get("actors/alice-chen").body  # nothing half-written
    f = open(p("actors", "alice-chen.md"), "w")
    f.write("---\nid: orgs/alice-chen\n---\n")
    assert _errno(f.close) == errno.EINVAL
    assert _errno(_write, p("profile.md"), "x") == errno.EROFS
    assert _errno(_write, p("search", "churn", "01-x.md"), "x") in (errno.EROFS, errno.ENOENT)
    assert _errno(os.unlink, p("profile.md")) == errno.EROFS
    assert _errno(_write, p("notes.txt"), "x") == errno.EACCES  # nothing but class directories at the top
    assert _errno(os.rename, p("topics", "pricing.md"), p("topics", "prices.md")) == errno.EPERM
    assert _errno(os.mkdir, p("Bad Class")) == errno.EINVAL
    assert _errno(os.listdir, p("as-of", "not-a-date")) == errno.ENOENT
    assert _errno(os.listdir, p("nope")) == errno.ENOENT


def test_read_only_mount_refuses_every_write(mounted_ro):
    p = mounted_ro.p
    with open(p("actors", "alice-chen.md")) as f:
        assert "Alice Chen" in f.read()
    assert os.stat(p("actors", "alice-chen.md")).st_mode & 0o222 == 0
    assert _errno(_write, p("actors", "alice-chen.md"), "x", "a") == errno.EROFS
    assert _errno(_write, p("topics", "new.md"), "x") == errno.EROFS
    assert _errno(os.unlink, p("topics", "pricing.md")) == errno.EROFS
    assert _errno(os.mkdir, p("newclass")) == errno.EROFS
    assert len(mounted_ro.mem.history("actors/alice-chen")) == 2  # put + link, nothing more


def test_search_directory_lists_hits_best_first(mounted):
    mem = mounted.mem
    q = "customer churn"
    names = sorted(os.listdir(mounted.p("search", q)))
    hits = mem.search(q, k=10)
    want = [f"{i:02d}-{h.entity_id.replace('/', '-')}.md" for i, h in enumerate(hits, 1)]
    assert [n for n in names if n != ".explain"] == want
    assert want[0] == "01-orgs-acme.md"
    with open(mounted.p("search", q, want[0]), "rb") as f:
        assert f.read() == (mem.root / "orgs" / "acme.md").read_bytes()
    with open(mounted.p("search", q, ".explain")) as f:
        explain = f.read()
    assert explain.splitlines()[2].startswith("01-orgs-acme.md") and "bm25" in explain
    assert _errno(open, mounted.p("search", q, "99-orgs-acme.md")) == errno.ENOENT
    assert q in os.listdir(mounted.p("search"))  # recent queries show


def test_search_folders_with_bytes_that_are_not_utf8_and_a_malformed_file(mounted):
    # issue 16: a file with bytes that are not UTF-8 made every search folder EINVAL; a query whose name is not
    # UTF-8 reached SQLite as surrogates; a file with malformed front matter was listed as a hit
    root = mounted.mem.root
    (root / "topics" / "latin.md").write_bytes(b"---\ntitle: Caf\xe9\n---\nThe caf\xe9 walrus \xff talks churn.\n")
    (root / "topics" / "broken.md").write_text("---\ntitle: [unclosed\n---\nA walrus walrus walrus file.\n")
    names = os.listdir(mounted.p("search", "walrus"))
    assert sorted(names)[1] == "01-topics-latin.md" and not [n for n in names if "broken" in n]  # never the bad file
    with open(mounted.p("search", "walrus", "01-topics-latin.md"), "rb") as f:
        assert f.read() == (root / "topics" / "latin.md").read_bytes()  # the file, byte for byte
    query = os.path.join(os.fsencode(mounted.path), b"search", b"caf\xe9 walrus")  # a name that is not UTF-8
    assert b"01-topics-latin.md" in os.listdir(query)
    with open(os.path.join(query, b".explain"), "rb") as f:
        assert b"01-topics-latin.md" in f.read()


def test_as_of_shows_the_past_and_profile_is_live(mounted):
    mem = mounted.mem
    mem.update("topics/pricing", valid_from="2026-01-01")
    mem.supersede("topics/pricing", valid_from="2026-06-01", body="Flat pricing from June.")
    with open(mounted.p("as-of", "2026-03-01", "topics", "pricing.md")) as f:
        assert "Tiered pricing" in f.read()
    with open(mounted.p("topics", "pricing.md")) as f:
        assert "Flat pricing" in f.read()
    assert "pricing.md" in os.listdir(mounted.p("as-of", "2026-03-01", "topics"))
    assert _errno(_write, mounted.p("as-of", "2026-03-01", "topics", "pricing.md"), "x") == errno.EROFS

    with open(mounted.p("profile.md")) as f:
        before = f.read()
    assert "3 entities" in before and "- works_at: 1" in before
    mem.put("actors", "Bob Stone")
    time.sleep(1.1)  # the profile is cached for a second
    with open(mounted.p("profile.md")) as f:
        after = f.read()
    assert "4 entities" in after and "put actors/bob-stone" in after


def test_hutch_memory_reads_what_the_mount_wrote_at_once(mounted):
    _write(mounted.p("orgs", "globex.md"), "Globex buys widgets.\n")
    assert hutch.Memory(mounted.mem.root).get("orgs/globex").title == "globex"


def test_reads_are_fresh_after_changes_behind_the_mount(mounted):
    """A file read through the mount, then changed through the API (same size, and longer), reads new at once."""
    mem = mounted.mem
    p = mounted.p("orgs", "acme.md")
    for body in ("Acme worries about customer churn: clients cancel after onboardinG.",   # same size
                 "Acme has a much longer story now. " * 20):
        with open(p) as f:
            before = f.read()
        mem.update("orgs/acme", body=body)
        with open(p) as f:
            after = f.read()
        assert after != before and after == (mem.root / "orgs" / "acme.md").read_text()
        r = subprocess.run(["busybox", "cat", p], capture_output=True, text=True)  # sendfile reader
        assert r.stdout == after


def _busybox_cat(path: str) -> str:
    return subprocess.run(["busybox", "cat", path], capture_output=True, text=True, check=True).stdout


def test_kernel_cache_is_exact_after_edits_behind_the_mount(mounted):
    """The kernel keeps names, sizes and pages (cache_seconds=60), yet an edit behind the mount reads new
    at once, whole, also by a sendfile reader: atomic rewrites, appends in place, same-size edits in place."""
    mem = mounted.mem
    p = mounted.p("topics", "pricing.md")
    disk = mem.root / "topics" / "pricing.md"
    edits = [
        lambda: disk.write_text(disk.read_text() + "Grown in place, same inode. " * 30 + "\n"),
        lambda: disk.write_text(disk.read_text().replace("Grown", "GROWN")),        # same size, same inode
        lambda: mem.update("topics/pricing", body="Atomic rewrite, longer still. " * 40),
        lambda: disk.write_text(disk.read_text()[:120] + "\n"),                   # shrunk in place
    ]
    for i, edit in enumerate(edits):
        for _ in range(2):  # the kernel now holds this version's size and pages
            with open(p) as f:
                f.read()
            os.stat(p)
        edit()
        want = disk.read_text()
        with open(p) as f:
            assert f.read() == want, f"edit {i}: stale read"
        edit_again = want + f"edit {i} once more\n"
        disk.write_text(edit_again)
        assert _busybox_cat(p) == edit_again, f"edit {i}: sendfile reader read a stale or short file"
        grown = edit_again + "read by two at once\n"
        disk.write_text(grown)
        readers = [subprocess.Popen(["busybox", "cat", p], stdout=subprocess.PIPE, text=True) for _ in range(2)]
        assert [r.communicate()[0] for r in readers] == [grown, grown], f"edit {i}: concurrent readers"


def test_stat_sees_a_change_behind_the_mount_without_an_open(mounted):
    """stat never opens the file: the store's inotify watch invalidates what the kernel holds of it."""
    p = mounted.p("orgs", "acme.md")
    before = os.stat(p).st_size
    mounted.mem.update("orgs/acme", body="A much longer story about Acme. " * 20)
    want = (mounted.mem.root / "orgs" / "acme.md").stat().st_size
    assert want != before
    deadline = time.monotonic() + 5
    while os.stat(p).st_size != want and time.monotonic() < deadline:
        time.sleep(0.01)
    assert os.stat(p).st_size == want  # the kernel's own cache would have kept the old size for 60 s
    mounted.mem.forget("orgs/acme", reason="gone")
    deadline = time.monotonic() + 5
    while os.path.exists(p) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not os.path.exists(p) and not os.path.exists(mounted.p("orgs"))  # its last entity: the class goes too
    new = mounted.p("orgs", "globex.md")  # a name looked up in vain (here the class too) is not remembered as missing
    assert not os.path.exists(new)
    mounted.mem.put("orgs", "Globex", body="Globex buys widgets.")
    with open(new) as f:
        assert "Globex buys widgets." in f.read()


def test_written_and_generated_files_read_whole_by_sendfile(mounted):
    """A file written through the mount grows on commit (front matter); profile.md changes size as the store
    does: a sendfile reader right after gets all of it."""
    p = mounted.p("topics", "churn.md")
    r = subprocess.run(["sh", "-c", f"printf 'Notes on churn.\\n' > '{p}' && busybox cat '{p}'"],
                       capture_output=True, text=True, check=True)
    assert r.stdout == (mounted.mem.root / "topics" / "churn.md").read_text() and r.stdout.startswith("---\n")
    first = _busybox_cat(mounted.p("profile.md"))
    for i in range(3):
        mounted.mem.put("actors", f"Person {i}", body="x " * 50)
        time.sleep(1.05)  # the profile is cached for a second
        out = _busybox_cat(mounted.p("profile.md"))
        assert f"{5 + i} entities" in out and out.endswith("\n") and f"put actors/person-{i}" in out
    assert len(out) > len(first)


def test_concurrent_sendfile_readers_after_changes_behind_the_mount(mounted):
    """Readers racing each other's re-lookups after a change (in place or atomic) all read it whole."""
    p = mounted.p("topics", "pricing.md")
    disk = mounted.mem.root / "topics" / "pricing.md"
    base = disk.read_text()
    bad = []
    for i in range(40):
        text = base + f"line {i}\n" * (1 + i % 7)
        if i % 2:
            disk.write_text(text)
        else:
            tmp = disk.with_name(".tmp-test")
            tmp.write_text(text)
            os.rename(tmp, disk)
        readers = [subprocess.Popen(["busybox", "cat", p], stdout=subprocess.PIPE, text=True) for _ in range(3)]
        bad += [(i, len(out), len(text)) for out in (r.communicate()[0] for r in readers) if out != text]
    assert not bad, f"stale or short reads (round, got, want): {bad}"
