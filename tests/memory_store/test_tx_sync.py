"""A transaction flushes its writes once (one syncfs of the store's file system), not a fsync per file, and
what it wrote is committed and on disk when it returns. (A writer killed mid-transaction is rolled back by
the next one: tests/memory_store/test_store_attacks.py kills a real child at three points.)"""

import os

from hutch.memory import _tx


def test_a_transaction_syncs_once_not_per_file(mem, store_dir, monkeypatch):
    calls = {"syncfs": 0, "fsync": 0}
    real_syncfs, real_fsync = _tx._syncfs, os.fsync

    def syncfs(fd):   # the real call, counted
        calls["syncfs"] += 1
        return real_syncfs(fd)

    def fsync(fd):
        calls["fsync"] += 1
        return real_fsync(fd)

    monkeypatch.setattr(_tx, "_syncfs", syncfs)
    monkeypatch.setattr(os, "fsync", fsync)
    with mem.transaction("many"):
        last = None
        for i in range(200):
            e = mem.put("notes", f"n{i}", body=f"note {i}\n")
            if last is not None and i % 10 == 0:
                mem.link(e, "after", last)
            last = e
    assert calls["syncfs"] == 1
    assert calls["fsync"] <= 2, calls   # the moved ref's directory at most, never one per file
    monkeypatch.undo()
    assert len(mem.ls("notes")) == 200
    assert mem.git.run("status", "--porcelain", "--untracked-files=all") == ""
    assert len(mem.git.ls_tree("HEAD", "notes")) == 200 + 19
