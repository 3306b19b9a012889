"""Commits built from the changed trees alone: exactly the operation's paths, valid git objects, a clean index."""

import multiprocessing
import os
import subprocess

import hutch
from hutch.memory import _commits


def git(root, *args, check=True):
    env = dict(os.environ, GIT_AUTHOR_NAME="u", GIT_AUTHOR_EMAIL="u@x", GIT_COMMITTER_NAME="u",
               GIT_COMMITTER_EMAIL="u@x")
    return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, check=check, env=env).stdout


def test_a_commit_holds_only_its_paths_and_a_staged_hand_edit_stays_staged(mem, store_dir):
    mem.put("notes", "Mine", body="hutch wrote this\n")
    (store_dir / "notes" / "mine.md").write_text(mem.get("notes/mine").text + "a hand edit\n")
    (store_dir / "README.md").write_text("staged by hand\n")
    git(store_dir, "add", "notes/mine.md", "README.md")
    mem.put("actors", "A")
    assert git(store_dir, "show", "--name-only", "--format=", "HEAD").split() == ["actors/a.md"]
    assert git(store_dir, "diff", "--cached", "--name-only").split() == ["README.md", "notes/mine.md"]
    assert "a hand edit" not in mem.git.show("HEAD", "notes/mine.md")


def test_commits_are_valid_objects_and_match_the_files(mem, store_dir):
    a = mem.put("actors", "Alice", body="x", facts=["f"])
    b = mem.put("orgs", "Acme")
    mem.link(a, "works_at", b)
    mem.link(b, "employs", a)
    mem.update(a, add_facts=["g"])
    mem.unlink(b, "employs", a)       # orgs/acme.links/ empties: its trees leave the commit
    mem.put("tmp", "Gone")
    mem.forget("tmp/gone", reason="the class empties: its tree leaves the commit")
    assert git(store_dir, "fsck", "--strict", "--no-dangling") == ""
    assert git(store_dir, "status", "--porcelain", "--untracked-files=all") == ""
    assert git(store_dir, "diff", "HEAD", "--stat") == ""
    tree = git(store_dir, "ls-tree", "-r", "--name-only", "HEAD").split()
    assert tree == [".gitignore", "actors/alice.links/works_at/acme.md", "actors/alice.md", "orgs/acme.md"]
    assert git(store_dir, "ls-tree", "HEAD", "actors/alice.links/works_at/acme.md").startswith("120000 blob")
    c = mem.git.log(limit=1)[0]
    assert c.subject == "forget tmp/gone" and c.trailer("Hutch-Reason").startswith("the class empties")
    assert c.author == "hutch" and c.email == "hutch@localhost"


def test_hand_commits_between_writes_and_an_author_with_odd_characters(store_dir):
    mem = hutch.Memory(store_dir, author="Eve <ev\nil> <eve@example.org>")
    mem.put("notes", "One")
    (store_dir / "notes" / "hand.md").write_text("---\ntitle: Hand\n---\nby hand\n")
    git(store_dir, "add", "notes/hand.md")
    git(store_dir, "commit", "-qm", "by hand")
    mem.put("notes", "Two")       # HEAD moved behind hutch's back: the commit builds on it
    assert git(store_dir, "log", "--format=%s").split("\n")[:3] == ["put notes/two", "by hand", "put notes/one"]
    assert git(store_dir, "ls-tree", "--name-only", "HEAD", "notes/").split() == [
        "notes/hand.md", "notes/one.md", "notes/two.md"]
    assert git(store_dir, "fsck", "--strict", "--no-dangling") == ""
    assert git(store_dir, "status", "--porcelain") == ""
    assert git(store_dir, "log", "-1", "--format=%an|%ae") == "Eve evil|eve@example.org\n"


def test_a_big_index_is_split_and_git_still_reads_it(mem, store_dir, monkeypatch):
    """Above _SPLIT_INDEX_BYTES each write writes only the changed entries of git's index (core.splitIndex)."""
    with mem.transaction():
        for i in range(40):
            mem.put("notes", f"n{i}")
    monkeypatch.setattr(_commits, "_SPLIT_INDEX_BYTES", 1000)
    mem.put("notes", "After the split")
    assert list((store_dir / ".git").glob("sharedindex.*")), "the index was not split"
    assert git(store_dir, "status", "--porcelain") == ""
    git(store_dir, "rm", "-q", "--cached", "notes/n3.md")   # a user's git writes the split index too
    git(store_dir, "commit", "-qm", "untrack n3")
    mem.update("notes/n4", body="changed\n")
    assert git(store_dir, "status", "--porcelain") == "?? notes/n3.md\n"
    assert "changed" in mem.git.show("HEAD", "notes/n4.md")
    assert git(store_dir, "fsck", "--strict", "--no-dangling") == ""


def _child_writes(mem):
    mem.put("notes", "From the child")
    mem.put("notes", "From the child again")


def test_a_forked_child_writes_with_the_same_memory_object(mem, store_dir):
    """A child forked after the parent committed never talks to the parent's git processes."""
    mem.put("notes", "Before the fork")
    ctx = multiprocessing.get_context("fork")
    p = ctx.Process(target=_child_writes, args=(mem,))
    p.start()
    p.join(60)
    assert p.exitcode == 0
    mem.put("notes", "After the fork")
    assert sorted(mem.ls("notes")) == ["notes/after-the-fork", "notes/before-the-fork", "notes/from-the-child",
                                       "notes/from-the-child-again"]
    assert len(mem.git.log("notes")) == 4
    assert git(store_dir, "status", "--porcelain") == ""
    assert git(store_dir, "fsck", "--strict", "--no-dangling") == ""


def test_a_class_swapped_for_a_link_before_the_commit_never_puts_what_it_points_to_in_history(mem, store_dir,
                                                                                              tmp_path):
    """A transaction commits the bytes it wrote, never a file read back through a link: a class directory
    swapped for a symbolic link to a host directory (with a file of the same name) mid-transaction."""
    outside = tmp_path / "host"
    outside.mkdir()
    (outside / "a.md").write_text("---\ntitle: host secret\n---\nHOST-SECRET\n")
    try:
        with mem.transaction("swap"):
            for i in range(3):
                mem.put("notes", f"n{i}")
            mem.put("notes", "A", body="what hutch wrote\n")
            os.rename(store_dir / "notes", store_dir / "notes-real")
            os.symlink(outside, store_dir / "notes")
    except hutch.Error:
        pass   # refusing the commit is fine too; what must not happen is below
    history = git(store_dir, "log", "-p", "--all", "--format=%H")
    assert "HOST-SECRET" not in history
    assert (outside / "a.md").read_text().endswith("HOST-SECRET\n")
    assert git(store_dir, "fsck", "--no-dangling") == ""


def test_a_write_that_cannot_stage_commits_nothing(mem, store_dir):
    """HEAD moves while the paths are staged; when staging fails (another git holds index.lock), HEAD is put
    back: the write raises, and neither the files nor the history keep anything of it."""
    mem.put("notes", "Keep", body="original\n")
    head = git(store_dir, "rev-parse", "HEAD")
    (store_dir / ".git" / "index.lock").write_text("")
    try:
        for write in (lambda: mem.update("notes/keep", body="changed\n"), lambda: mem.put("notes", "New")):
            try:
                write()
            except hutch.MemoryStoreError as e:
                assert "index.lock" in str(e)
            else:
                raise AssertionError("the write did not fail")
            assert git(store_dir, "rev-parse", "HEAD") == head
    finally:
        (store_dir / ".git" / "index.lock").unlink()
    assert (store_dir / "notes" / "keep.md").read_text().endswith("original\n")
    assert not (store_dir / "notes" / "new.md").exists()
    assert git(store_dir, "status", "--porcelain") == ""
    mem.put("notes", "New")
    assert git(store_dir, "log", "--format=%s").split("\n")[:2] == ["put notes/new", "put notes/keep"]
