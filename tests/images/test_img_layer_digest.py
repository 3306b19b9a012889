"""A layer's digest is its name in the store (an identical one is reused, an import is checked against it), so two
different trees must never share one, whatever names and symlink targets a sandbox or an archive gives them."""

from __future__ import annotations

import os
from pathlib import Path

from hutch.sandbox._host import layers as _layers


def _tree(root: Path, link_dir: str, target: str, file_rel: str) -> Path:
    root.mkdir(mode=0o755)
    os.chmod(root, 0o755)
    (root / link_dir).mkdir(mode=0o755)
    os.chmod(root / link_dir, 0o755)
    os.symlink(target, root / link_dir / "a")
    f = root / file_rel
    f.write_text("same\n")
    os.chmod(f, 0o644)
    return root


def test_names_and_targets_with_newlines_do_not_make_two_trees_one_digest(tmp_path):
    # A: /x\n/a -> "t\n/x", then /y.   B: /x\n/a -> "t", then /x\n/y.   Listed line by line, both read
    # ".../a\0l\0...\0t\n/x\n/y\0f\0..." before the fix.
    a = _tree(tmp_path / "A", "x\n", "t\n/x", "y")
    b = _tree(tmp_path / "B", "x\n", "t", "x\n/y")
    da, db = _layers.measure_tree(a)["digest"], _layers.measure_tree(b)["digest"]
    assert da != db


def test_ordinary_names_keep_their_digest(tmp_path):
    # The listing of a tree without such names is unchanged: its digest is the sha256 of these lines.
    import hashlib
    root = tmp_path / "r"
    root.mkdir(mode=0o755)
    os.chmod(root, 0o755)
    os.symlink("target with spaces \\n", root / "l")
    st_root, st_l = os.lstat(root), os.lstat(root / "l")
    want = hashlib.sha256(
        f"/\0d\0{st_root.st_mode & 0o7777:o}\0{st_root.st_uid}\0{st_root.st_gid}\0\n"
        f"/l\0l\0{st_l.st_mode & 0o7777:o}\0{st_l.st_uid}\0{st_l.st_gid}\0target with spaces \\n\n".encode()).hexdigest()
    assert _layers.measure_tree(root)["digest"] == want
