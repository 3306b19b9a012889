"""A put in a store whose git index is split stages its path without git reading the shared index
(_gitindex): git status stays clean, git reads the index as hutch wrote it, hand edits are still seen."""

import os
import subprocess
import sys
import time

import pytest

import hutch
from hutch.memory import _commits, _gitindex


def git(root, *args, check=True):
    env = dict(os.environ, GIT_AUTHOR_NAME="u", GIT_AUTHOR_EMAIL="u@x", GIT_COMMITTER_NAME="u",
               GIT_COMMITTER_EMAIL="u@x")
    return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, check=check, env=env).stdout


def staged_is_head(root):
    """git's index holds exactly HEAD's tree (modes, blobs, paths)."""
    index = sorted(line.replace(" 0\t", "\t") for line in git(root, "ls-files", "-s").splitlines())
    head = sorted(line.replace(" blob ", " ") for line in git(root, "ls-tree", "-r", "HEAD").splitlines())
    return index == head


def shared(root):
    return sorted(p.name for p in (root / ".git").glob("sharedindex.*"))


@pytest.fixture
def split_mem(mem, store_dir, monkeypatch):
    with mem.transaction():
        for i in range(30):
            mem.put("notes", f"n{i}", body=f"note {i}\n")
    monkeypatch.setattr(_commits, "_SPLIT_INDEX_BYTES", 1000)
    mem.put("notes", "Split")    # git writes this one: the index is split from here
    assert shared(store_dir) and _gitindex.split(str(store_dir / ".git"))
    return mem


def test_puts_stage_directly_and_git_reads_the_index_as_clean(split_mem, store_dir):
    mem = split_mem
    before = shared(store_dir)
    stamp = os.stat(store_dir / ".git" / before[0]).st_mtime_ns
    a = mem.put("actors", "Alice", body="new class\n")
    mem.put("notes", "Beside", body="x\n", facts=["f"])
    mem.link(a, "knows", "notes/beside")   # a symlink, staged directly too
    mem.update("notes/n3", body="changed\n")   # a changed path: its entry replaces the shared one
    assert shared(store_dir) == before and os.stat(store_dir / ".git" / before[0]).st_mtime_ns == stamp
    assert git(store_dir, "status", "--porcelain", "--untracked-files=all") == ""
    assert git(store_dir, "diff", "--cached", "--name-only") == ""
    assert staged_is_head(store_dir)
    assert any(line.startswith("120000 ") for line in git(store_dir, "ls-files", "-s").splitlines())
    assert git(store_dir, "fsck", "--strict", "--no-dangling") == ""
    # a user's git reads and rewrites the index hutch wrote
    (store_dir / "README.md").write_text("by hand\n")
    git(store_dir, "add", "README.md")
    git(store_dir, "commit", "-qm", "readme")
    mem.put("notes", "After git")
    assert git(store_dir, "status", "--porcelain", "--untracked-files=all") == ""
    assert staged_is_head(store_dir)


def test_hand_edits_after_direct_staging_are_seen(split_mem, store_dir):
    mem = split_mem
    mem.put("notes", "Edited", body="original body\n")
    mem.put("notes", "Other")
    f = store_dir / "notes" / "edited.md"
    f.write_text(f.read_text().replace("original body", "ORIGINAL BODY"))   # same size
    assert git(store_dir, "status", "--porcelain") == " M notes/edited.md\n"
    mem.put("notes", "Third")   # the index is rewritten: the edit stays seen, and is not committed
    assert git(store_dir, "status", "--porcelain") == " M notes/edited.md\n"
    assert "original body" in mem.git.show("HEAD", "notes/edited.md")
    assert "ORIGINAL BODY" in mem.get("notes/edited").body
    mem.update("notes/edited", add_facts=["picked up"])   # the next write of it commits the hand edit
    assert "ORIGINAL BODY" in mem.git.show("HEAD", "notes/edited.md")
    assert git(store_dir, "status", "--porcelain") == "" and staged_is_head(store_dir)


def test_a_racily_clean_entry_is_smudged_when_the_index_is_rewritten(split_mem, store_dir):
    """git's racy-git rule: an entry whose mtime is not older than its index may hide an edit made in the same
    clock tick; the next rewrite checks it against the file. ctime is not trusted here, so only the mtime,
    size and inode git compares decide, as on a file system where the edit fell in the same tick."""
    mem = split_mem
    mem.put("notes", "Racy", body="aaaa\n")
    f = store_dir / "notes" / "racy.md"
    st = os.stat(f)
    with open(f, "r+b") as fh:   # same inode, same size, same mtime: only the bytes differ
        data = fh.read()
        fh.seek(0)
        fh.write(data.replace(b"aaaa", b"bbbb"))
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    os.utime(store_dir / ".git" / "index", ns=(st.st_mtime_ns, st.st_mtime_ns))   # written in the same tick
    mem.put("notes", "Later")   # rewrites the index: now later than the edit
    assert "size: 0\t" in git(store_dir, "ls-files", "--debug", "notes/racy.md")   # smudged: git re-reads it
    assert git(store_dir, "-c", "core.trustctime=false", "status", "--porcelain") == " M notes/racy.md\n"


def test_an_index_lock_held_by_git_fails_the_put_and_commits_nothing(split_mem, store_dir):
    mem = split_mem
    head = git(store_dir, "rev-parse", "HEAD")
    lock = store_dir / ".git" / "index.lock"
    lock.write_text("")
    try:
        with pytest.raises(hutch.MemoryStoreError, match="index.lock"):
            mem.put("notes", "Blocked")
        assert git(store_dir, "rev-parse", "HEAD") == head
    finally:
        lock.unlink()
    assert not (store_dir / "notes" / "blocked.md").exists()
    assert git(store_dir, "status", "--porcelain", "--untracked-files=all") == ""
    mem.put("notes", "Blocked")
    assert staged_is_head(store_dir)


def test_removals_go_through_git_and_a_crowded_index_is_folded(split_mem, store_dir, monkeypatch):
    mem = split_mem
    mem.forget("notes/n1", reason="a removal: git stages it")
    assert git(store_dir, "status", "--porcelain", "--untracked-files=all") == "" and staged_is_head(store_dir)
    before = shared(store_dir)
    monkeypatch.setattr(_gitindex, "_MAX_BYTES", 600)   # about 6 entries
    for i in range(12):
        mem.put("more", f"m{i}")
    assert shared(store_dir) != before, "the split part was never folded into a new shared index"
    # (how small git leaves the split part after the fold varies from run to run, 0.4-2.8 KB here: not asserted)
    assert git(store_dir, "status", "--porcelain", "--untracked-files=all") == "" and staged_is_head(store_dir)
    assert git(store_dir, "fsck", "--strict", "--no-dangling") == ""


# A writer that stops (SIGSTOP) or dies (SIGKILL) holding index.lock: between taking it and renaming it over the
# index, where a kill left the lock behind and every later write of the store failed with "File exists".
_HOLDER = """
import os, signal, sys, hutch
real = os.replace
def replace(src, dst, *a, **kw):
    if str(dst).endswith(os.path.join(".git", "index")) and str(src).endswith("index.lock"):
        print("holding", flush=True)
        os.kill(os.getpid(), signal.SIGSTOP)
    return real(src, dst, *a, **kw)
os.replace = replace
hutch.Memory(sys.argv[1]).put("notes", "Killed", body="the writer dies holding index.lock")
"""


def test_a_writer_killed_holding_index_lock_leaves_nothing_the_next_writer_cannot_recover(split_mem, store_dir):
    mem = split_mem
    git_dir = str(store_dir / ".git")
    lock = store_dir / ".git" / "index.lock"
    child = subprocess.Popen([sys.executable, "-c", _HOLDER, str(store_dir)], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline() == "holding\n"
        os.waitpid(child.pid, os.WUNTRACED)   # stopped, holding the lock
        assert lock.exists()
        assert _gitindex.recover_lock(git_dir) is False and lock.exists()   # its holder lives: left alone
        child.kill()
        assert child.wait(30) == -9
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(30)
        child.stdout.close()
    assert lock.exists()   # what a SIGKILL in that millisecond leaves
    mem.put("notes", "After", body="the next writer")   # recovers: the lock was the dead writer's own
    assert not lock.exists()
    assert git(store_dir, "status", "--porcelain", "--untracked-files=all") == ""
    assert staged_is_head(store_dir) and git(store_dir, "fsck", "--strict", "--no-dangling") == ""
    assert mem.get("notes/after").body.strip() == "the next writer" and mem.check().ok


def test_a_live_gits_index_lock_is_never_removed(split_mem, store_dir):
    """A real git holding index.lock (update-index waits for its paths on stdin): the put fails naming the lock
    and commits nothing, the lock stays; once git is done, the put goes through."""
    mem = split_mem
    lock = store_dir / ".git" / "index.lock"
    head = git(store_dir, "rev-parse", "HEAD")
    g = subprocess.Popen(["git", "-C", str(store_dir), "update-index", "--add", "--stdin"], stdin=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60   # a hang guard, not a timing assert
        while not lock.exists() and g.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert lock.exists() and g.poll() is None
        with pytest.raises(hutch.MemoryStoreError, match="index.lock"):
            mem.put("notes", "Blocked")
        assert _gitindex.recover_lock(str(store_dir / ".git")) is False
        assert lock.exists() and g.poll() is None and git(store_dir, "rev-parse", "HEAD") == head
    finally:
        g.stdin.close()
        assert g.wait(30) == 0
    assert not lock.exists()
    mem.put("notes", "Blocked")
    assert git(store_dir, "status", "--porcelain", "--untracked-files=all") == "" and staged_is_head(store_dir)
