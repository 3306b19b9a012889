"""A snapshot copies every byte of a sandbox's writes into the host's store, holes of sparse files included (a
layer is a plain tree, hashed as such). A sparse file costs its sandbox nothing against disk=, so the copy is
bounded by disk= itself: a sandbox cannot make the root daemon fill the host's disk."""

from __future__ import annotations

import os

import pytest

import hutch


def _store_usage(state_dir) -> int:
    """Bytes of blocks the layer store holds (what a copy would have cost the host's disk)."""
    total = 0
    for root, _, files in os.walk(state_dir / "layers"):
        for f in files:
            try:
                total += os.lstat(os.path.join(root, f)).st_blocks * 512
            except FileNotFoundError:
                pass
    return total


def test_a_sparse_file_past_the_disk_limit_is_not_copied_into_the_store(daemon, make_sandbox):
    sb = make_sandbox("sleep", "600", disk="64MiB")
    # 512 MiB apparent, a few blocks used: well inside the sandbox's 64 MiB quota
    sb.run("sh", "-c", "truncate -s 512M /holes && echo x >> /holes && du -k /holes", check=True)
    before = _store_usage(daemon.state_dir)
    with pytest.raises(hutch.ImageError) as refused:
        sb.snapshot_filesystem()
    msg = str(refused.value)
    assert "/holes" in msg and "disk" in msg, msg
    assert _store_usage(daemon.state_dir) - before < 16 << 20   # nothing like 512 MiB was written
    assert not [p for p in os.listdir(daemon.state_dir / "layers") if p.startswith(".tmp")]
    sb.run("rm", "/holes", check=True)
    # hard links: 16 MiB charged once, copied once per name (12 names: 192 MiB)
    sb.run("sh", "-c", "dd if=/dev/zero of=/f bs=1M count=16 2>/dev/null; for i in $(seq 11); do ln /f /f$i; done",
           check=True)
    with pytest.raises(hutch.ImageError, match="hard link"):
        sb.snapshot_filesystem()
    assert _store_usage(daemon.state_dir) - before < 80 << 20
    assert not [p for p in os.listdir(daemon.state_dir / "layers") if p.startswith(".tmp")]
    sb.run("sh", "-c", "rm /f*", check=True)
    sb.files.write("/small", b"fits\n")
    img = sb.snapshot_filesystem()   # the same sandbox, once its writes fit its disk=, snapshots as ever
    assert make_sandbox(image=img).run("cat", "/small").stdout == "fits\n"
