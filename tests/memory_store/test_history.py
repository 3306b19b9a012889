"""History, supersede, as_of and forget, read back from real git history."""

import subprocess

import pytest

import hutch


def test_supersede_keeps_the_old_version_valid_until_the_new_valid_from(mem):
    mem.put("actors", "Alice Chen", facts=["prefers weekly reports"], source="chat:2026-11-02#14")
    mem.supersede("actors/alice-chen", facts=["prefers daily reports"], valid_from="2026-11-20",
                  source="chat:2026-11-20#3", reason="she said so")
    assert mem.get("actors/alice-chen").facts == ["prefers daily reports"]
    assert mem.as_of("2026-11-01").get("actors/alice-chen").facts == ["prefers weekly reports"]
    assert mem.as_of("2026-11-19T23:59:59Z").get("actors/alice-chen").facts == ["prefers weekly reports"]
    assert mem.as_of("2026-11-20").get("actors/alice-chen").facts == ["prefers daily reports"]
    hist = mem.history("actors/alice-chen")
    assert [v.op for v in hist] == ["supersede", "put"]
    assert hist[0].valid_from == "2026-11-20" and hist[0].reason == "she said so"
    assert hist[0].source == "chat:2026-11-20#3"
    assert hist[1].valid_to == "2026-11-20" and hist[1].facts == ["prefers weekly reports"]
    assert hist[1].source == "chat:2026-11-02#14" and hist[1].author == "hutch <hutch@localhost>"


def test_supersede_must_move_forward_in_time(mem):
    mem.put("actors", "Bo", valid_from="2026-01-01")
    with pytest.raises(hutch.ConfigError, match="update"):
        mem.supersede("actors/bo", valid_from="2025-06-01", facts=["x"])


def test_as_of_before_valid_from_is_not_found(mem):
    mem.put("events", "Launch", valid_from="2026-03-01")
    with pytest.raises(hutch.EntityNotFoundError, match="2026-02-01"):
        mem.as_of("2026-02-01").get("events/launch")
    assert mem.as_of("2026-03-02").ls() == ["events/launch"]


def test_known_at_reads_what_was_recorded_then(mem):
    mem.put("actors", "Cy", facts=["one"])
    first = mem.git.log(limit=1)[0].date
    subprocess.run(["sleep", "1.1"], check=True)
    mem.update("actors/cy", facts=["two"])
    assert mem.as_of("2030-01-01").get("actors/cy").facts == ["two"]
    assert mem.as_of("2030-01-01", known_at=first).get("actors/cy").facts == ["one"]


def test_forget_is_explicit_audited_and_removes_links_both_ways(mem, store_dir):
    a = mem.put("actors", "Dee")
    b = mem.put("orgs", "Org")
    mem.link(a, "works_at", b)
    mem.link(b, "employs", a)
    with pytest.raises(hutch.ConfigError, match="reason"):
        mem.forget("actors/dee", reason="  ")
    mem.forget("actors/dee", reason="asked to be removed")
    assert not mem.exists("actors/dee")
    assert not (store_dir / "actors" / "dee.links").exists()
    assert not (store_dir / "orgs" / "org.links").exists()
    assert mem.check().ok
    c = mem.git.log(limit=1)[0]
    assert c.trailer("Hutch-Op") == "forget" and c.trailer("Hutch-Reason") == "asked to be removed"
    assert mem.history("actors/dee")[0].op == "forget" and mem.history("actors/dee")[0].text is None
    with pytest.raises(hutch.EntityNotFoundError):
        mem.as_of("2030-01-01").get("actors/dee")
    with pytest.raises(hutch.EntityNotFoundError):
        mem.forget("actors/dee", reason="again")


def test_hand_edits_committed_outside_hutch_show_in_history(mem, store_dir):
    mem.put("notes", "N")
    p = store_dir / "notes" / "n.md"
    p.write_text(p.read_text() + "\nhand written\n")
    subprocess.run(["git", "-C", str(store_dir), "-c", "user.name=me", "-c", "user.email=me@x", "commit", "-qam",
                    "by hand"], check=True)
    h = mem.history("notes/n")
    assert h[0].op == "edit" and h[0].author == "me <me@x>" and "hand written" in h[0].text


def test_diff_shows_uncommitted_and_committed_changes(mem, store_dir):
    mem.put("notes", "D", body="first\n")
    mem.update("notes/d", body="second\n")
    out = mem.diff("notes/d")
    assert "-first" in out and "+second" in out


def test_forget_of_a_class_last_entity_leaves_no_class_directory(mem, store_dir):
    """The store on disk, git and the search index agree afterwards; the class comes back with its next entity."""
    mem.put("actors", "Alice")
    mem.put("orgs", "Acme", body="Acme sells anvils.")
    assert mem.search("anvils")[0].entity.id == "orgs/acme"
    mem.forget("orgs/acme", reason="asked to be removed")
    assert not (store_dir / "orgs").exists() and mem.classes() == ["actors"]
    git = lambda *a: subprocess.run(["git", "-C", str(store_dir), *a], capture_output=True, text=True,  # noqa: E731
                                    check=True).stdout
    assert git("status", "--porcelain", "--ignored=no") == ""
    assert "orgs/" not in git("ls-files")
    assert mem.check().ok and "orgs/acme" not in [h.entity.id for h in mem.search("anvils")]
    # the class comes back with its next entity, and the index sees it
    mem.put("orgs", "Globex", body="Globex sells anvils too.")
    assert [h.entity.id for h in mem.search("anvils")][0] == "orgs/globex"
    # a class directory that holds something else (an attachment) stays
    (store_dir / "orgs" / "logo.png").write_bytes(b"png")
    mem.forget("orgs/globex", reason="test")
    assert (store_dir / "orgs" / "logo.png").exists() and mem.ls("orgs") == []
