"""The basic contract of hutch.Memory: put/get/link on real files, symlinks and git."""

import os
import subprocess

import pytest

import hutch


def git_log(path):
    return subprocess.run(["git", "-C", str(path), "log", "--format=%s"], capture_output=True, text=True,
                          check=True).stdout.splitlines()


def test_put_get_link_matches_the_issue_example(mem, store_dir):
    alice = mem.put("actors", "Alice Chen", body="Head of data at Acme.",
                    facts=["prefers weekly reports"], source="chat:2026-11-02#14")
    acme = mem.put("orgs", "Acme")
    mem.link(alice, "works_at", acme)
    got = mem.get("actors/alice-chen")
    assert [e.id for e in got.links["works_at"]] == ["orgs/acme"]
    assert got.facts == ["prefers weekly reports"]
    assert got.source == "chat:2026-11-02#14"
    assert got.meta["class"] == "actors" and got.meta["id"] == "actors/alice-chen"
    link = store_dir / "actors" / "alice-chen.links" / "works_at" / "acme.md"
    assert os.readlink(link) == "../../../orgs/acme.md"
    assert link.resolve() == (store_dir / "orgs" / "acme.md").resolve()
    assert [(n.relation, n.direction, n.id) for n in mem.neighbors("orgs/acme")] == [
        ("works_at", "in", "actors/alice-chen")]
    assert git_log(store_dir) == [
        "link actors/alice-chen -[works_at]-> orgs/acme", "put orgs/acme", "put actors/alice-chen", "init store"]
    assert "prefers weekly reports" in (store_dir / "actors" / "alice-chen.md").read_text()


def test_put_twice_is_an_error_naming_the_fix(mem):
    mem.put("actors", "Bob")
    with pytest.raises(hutch.EntityExistsError, match="update"):
        mem.put("actors", "bob")
    assert mem.put("actors", "Bob", exist_ok=True, facts=["likes tea"]).facts == ["likes tea"]


def test_slug_collision_with_a_different_title_gets_a_suffix(mem):
    a = mem.put("topics", "C++")
    b = mem.put("topics", "C")
    assert (a.slug, b.slug) == ("c", "c-2")


def test_link_to_missing_entity_names_it_and_writes_nothing(mem, store_dir):
    a = mem.put("actors", "Alice")
    with pytest.raises(hutch.EntityNotFoundError, match="orgs/nowhere"):
        mem.link(a, "works_at", "orgs/nowhere")
    assert not (store_dir / "actors" / "alice.links").exists()


@pytest.mark.parametrize("bad", ["../etc/passwd", "actors/../../x", "/abs/x", "actors/.hidden", ".hutch/x", "a/b/c"])
def test_paths_that_escape_the_store_are_refused(mem, bad):
    with pytest.raises(hutch.StorePathError):
        mem.get(bad)


def test_get_missing_is_not_found(mem):
    with pytest.raises(hutch.EntityNotFoundError, match="put"):
        mem.get("actors/nobody")
    assert isinstance(hutch.EntityNotFoundError("x"), hutch.NotFoundError)


def test_store_works_without_any_git_config(store_dir, monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("GIT_CONFIG_NOSYSTEM", "1")
    monkeypatch.delenv("HUTCH_AUTHOR", raising=False)
    mem = hutch.Memory(store_dir, author="Agent Smith <smith@example.org>")
    mem.put("actors", "Neo")
    out = subprocess.run(["git", "-C", str(store_dir), "log", "-1", "--format=%an <%ae>|%cn"],
                         capture_output=True, text=True, check=True).stdout.strip()
    assert out == "Agent Smith <smith@example.org>|Agent Smith"


def test_an_existing_git_repository_becomes_a_store(store_dir):
    store_dir.mkdir(parents=True)
    subprocess.run(["git", "init", "-q", str(store_dir)], check=True)
    (store_dir / "README.md").write_text("mine\n")
    subprocess.run(["git", "-C", str(store_dir), "add", "README.md"], check=True)
    subprocess.run(["git", "-C", str(store_dir), "-c", "user.name=u", "-c", "user.email=u@x", "commit", "-qm", "r"],
                   check=True)
    mem = hutch.Memory(store_dir)
    mem.put("actors", "A")
    assert "/.hutch/" in (store_dir / ".gitignore").read_text().splitlines()
    assert mem.git.run("status", "--porcelain") == ""  # .hutch/ (the lock) is ignored
    assert (store_dir / "README.md").read_text() == "mine\n"
    assert git_log(store_dir) == ["put actors/a", "init store", "r"]
