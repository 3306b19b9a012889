"""A git child of the store's (update-index) SIGKILLed while it holds `.git/index.lock` (issue 16): the lock it
leaves no longer blocks every later write; a lock that a live process holds is never removed, be it our own child
whose parent died or a user's git that took the lock after our child died.

The git is real and really killed: a `git` wrapper first on the writer's PATH runs the real git's update-index
with its stdin on a FIFO the test holds open, so git takes index.lock and then waits for its paths, holding it
(git takes the lock before it reads stdin) until the test kills it."""

import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest

import hutch
from hutch.memory import _gitindex

_WRAPPER = """#!/bin/sh
for a in "$@"; do
  if [ "$a" = "$WRAP_CMD" ]; then
    echo $$ >> "$WRAP_PIDS"
    exec "$WRAP_GIT" "$@" < "$WRAP_FIFO"
  fi
done
exec "$WRAP_GIT" "$@"
"""
_WRITER = """
import sys, hutch
try:
    hutch.Memory(sys.argv[1]).put("notes", "Killed", body="its git dies holding index.lock")
except hutch.MemoryStoreError as e:
    print("raised:", e, flush=True)
"""


def git(root, *args, check=True):
    return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, check=check).stdout


def staged_is_head(root):
    index = sorted(line.replace(" 0\t", "\t") for line in git(root, "ls-files", "-s").splitlines())
    head = sorted(line.replace(" blob ", " ") for line in git(root, "ls-tree", "-r", "HEAD").splitlines())
    return index == head


def _wait_for(cond, what):
    deadline = time.monotonic() + 60   # a hang guard, not a timing assert
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


class _Held:
    """A writer process whose update-index is a real git holding index.lock, waiting on the FIFO."""

    def __init__(self, store_dir, tmp, cmd="update-index"):
        wrap = tmp / "bin"
        wrap.mkdir()
        (wrap / "git").write_text(_WRAPPER)
        (wrap / "git").chmod(0o755)
        self.fifo, self.pids = tmp / "fifo", tmp / "pids"
        os.mkfifo(self.fifo)
        env = dict(os.environ, PATH=f"{wrap}:{os.environ['PATH']}", WRAP_GIT=shutil.which("git"),
                   WRAP_FIFO=str(self.fifo), WRAP_PIDS=str(self.pids), WRAP_CMD=cmd)
        self.writer = subprocess.Popen([sys.executable, "-c", _WRITER, str(store_dir)], env=env,
                                       stdout=subprocess.PIPE, text=True)
        self.lock = store_dir / ".git" / "index.lock"
        self.w = None
        self.git_pid = None
        try:
            _wait_for(lambda: self.pids.exists() and self.pids.read_text().strip() or self.writer.poll() is not None,
                      f"the writer never ran {cmd}")
            assert self.writer.poll() is None
            self.git_pid = int(self.pids.read_text().split()[0])
            if cmd == "update-index":
                self.release()
                _wait_for(lambda: self.lock.exists(), "git never took index.lock")
        except BaseException:
            self.close()
            raise

    def release(self):
        """The wrapper's open of the FIFO returns: the real git starts (and finds its stdin open, empty)."""
        self.w = open(self.fifo, "wb")

    def git_alive(self):
        try:
            with open(f"/proc/{self.git_pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] != "Z"
        except FileNotFoundError:
            return False

    def kill_git(self):
        os.kill(self.git_pid, signal.SIGKILL)
        _wait_for(lambda: not self.git_alive(), "git outlived SIGKILL")

    def close(self):
        if self.git_pid is not None and self.git_alive():
            os.kill(self.git_pid, signal.SIGKILL)
        if self.writer.poll() is None:
            self.writer.kill()
        self.writer.wait(60)
        if self.w is not None:
            try:
                self.w.close()
            except BrokenPipeError:
                pass
        self.writer.stdout.close()


@pytest.fixture
def held(mem, store_dir, tmp_path):
    mem.put("notes", "Before", body="a first write")
    head = git(store_dir, "rev-parse", "HEAD")   # (before the writer starts: it may move HEAD at once)
    h = _Held(store_dir, tmp_path)
    h.head = head
    try:
        yield h
    finally:
        h.close()


def _after_recovery_all_is_clean(mem, store_dir, head, writer_died=False):
    mem.put("notes", "After", body="the next writer")
    assert not (store_dir / ".git" / "index.lock").exists()
    assert git(store_dir, "status", "--porcelain", "--untracked-files=all") == ""
    assert staged_is_head(store_dir) and git(store_dir, "fsck", "--strict", "--no-dangling") == ""
    assert mem.get("notes/after").body.strip() == "the next writer"
    in_head = "notes/killed.md" in git(store_dir, "ls-tree", "-r", "--name-only", "HEAD").split()
    assert mem.exists("notes/killed") == in_head   # the killed write is all there or not at all
    if not writer_died:   # it raised: it committed nothing
        assert not in_head and git(store_dir, "rev-parse", "HEAD~1") == head
    else:   # its writer died too: HEAD had moved (the commit landed) or the next writer rolled it back
        log = git(store_dir, "log", "--format=%H %s", "--name-status")
        assert git(store_dir, "rev-parse", "HEAD~2" if in_head else "HEAD~1") == head, log
    assert mem.check().errors == []


def test_a_git_child_killed_holding_index_lock_does_not_block_the_next_write(mem, store_dir, held):
    head = held.head
    assert _gitindex.recover_lock(str(store_dir / ".git")) is False and held.lock.exists()   # it lives: left alone
    held.kill_git()
    out = held.writer.communicate(timeout=120)[0]
    assert held.writer.returncode == 0 and "raised: git update-index --add failed" in out and "killed by signal 9" in out
    # the kill left the lock; the writer's own rollback (which unstages its paths) removed it: its child was dead
    assert not held.lock.exists()
    assert git(store_dir, "rev-parse", "HEAD") == head   # the write raised: it committed nothing
    _after_recovery_all_is_clean(mem, store_dir, head)


def test_our_child_alive_after_its_writer_died_keeps_its_lock_until_it_dies(mem, store_dir, held, monkeypatch):
    head = held.head
    held.writer.kill()   # the writer dies, its git (holding the lock) lives on
    held.writer.wait(60)
    assert held.git_alive() and held.lock.exists()
    monkeypatch.setattr(_gitindex, "SETTLE_SECONDS", 0.5)
    with pytest.raises(hutch.MemoryStoreError, match=f"still runs \\(pid {held.git_pid};"):
        mem.put("notes", "Blocked")   # the dead writer's recovery waits for its git, then gives up naming it
    assert held.lock.exists() and held.git_alive()
    held.kill_git()
    _after_recovery_all_is_clean(mem, store_dir, head, writer_died=True)


def test_a_users_git_holding_the_lock_after_our_child_died_is_never_removed(mem, store_dir, held):
    """The record of our killed child is still there, and is older than the lock, but the lock is a live git's
    (it has it open): left alone."""
    head = held.head
    held.writer.kill()   # writer and git both die: nothing of ours cleared the record or the lock
    held.writer.wait(60)
    held.kill_git()
    record = (store_dir / ".git" / _gitindex.CHILD_FILE).read_text().split()
    assert record[0] == str(held.git_pid) and held.lock.exists()
    held.lock.unlink()   # removed by hand, as a user would; then the user's own git takes the lock
    g = subprocess.Popen(["git", "-C", str(store_dir), "update-index", "--add", "--stdin"], stdin=subprocess.PIPE)
    try:
        _wait_for(lambda: held.lock.exists() or g.poll() is not None, "the user's git never took index.lock")
        assert g.poll() is None
        with pytest.raises(hutch.MemoryStoreError, match="index.lock"):
            mem.put("notes", "Blocked")
        assert _gitindex.recover_lock(str(store_dir / ".git")) is False
        assert held.lock.exists() and g.poll() is None
    finally:
        g.stdin.close()
        assert g.wait(60) == 0
    _after_recovery_all_is_clean(mem, store_dir, head, writer_died=True)


def test_the_recovery_of_a_dead_writer_waits_for_the_update_ref_it_left_running(mem, store_dir, tmp_path):
    """The writer dies while its update-ref (moving HEAD to its commit) has not run yet: the next writer's
    recovery must not undo the files and then see HEAD move under it (git status: ' D', HEAD holding a file the
    work tree lost); it waits for that git, then finds the commit landed."""
    mem.put("notes", "Before", body="a first write")
    head = git(store_dir, "rev-parse", "HEAD")
    held = _Held(store_dir, tmp_path, cmd="update-ref")
    try:
        held.writer.kill()   # the writer dies; its update-ref waits on the FIFO
        held.writer.wait(60)
        assert held.git_alive()
        done = []
        t = threading.Thread(target=lambda: done.append(mem.put("notes", "After", body="the next writer")))
        t.start()
        t.join(2)   # (not a timing assert: before the fix the put was done by now, and HEAD moved after it)
        held.release()   # the orphaned update-ref runs: HEAD moves to the dead writer's commit
        t.join(120)
        assert done and not t.is_alive()
    finally:
        held.close()
    assert git(store_dir, "status", "--porcelain", "--untracked-files=all") == ""
    assert staged_is_head(store_dir) and git(store_dir, "fsck", "--strict", "--no-dangling") == ""
    assert mem.get("notes/killed").body.strip() == "its git dies holding index.lock"   # it landed: kept
    assert git(store_dir, "rev-parse", "HEAD~2") == head and mem.check().errors == []
