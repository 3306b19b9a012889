"""A pax "GNU sparse" member (format 0.0, 0.1 or 1.0: plain pax records on a regular file, which tarfile
expands) says how large a file is, not what it holds: a 10 KB archive extracts to any size. Such members are
refused like GNU sparse ones, before anything is written, for image and memory snapshot imports alike."""

from __future__ import annotations

import io
import json
import os
import tarfile

import pytest

import hutch
from hutch.sandbox._host import archive as _archive, layers as _layers

REAL = 300_000_000   # the size it claims, a few bytes of which the archive holds


def _sparse_member(name: str) -> tuple[tarfile.TarInfo, bytes]:
    m = b"1\n%d\n%d\n" % (REAL - 4, 4)
    data = m + b"\0" * (512 - len(m)) + b"BOMB"
    info = tarfile.TarInfo(os.path.dirname(name) + "/GNUSparseFile.0/" + os.path.basename(name))
    info.size, info.mode, info.mtime = len(data), 0o644, 1_700_000_000
    info.pax_headers = {"GNU.sparse.major": "1", "GNU.sparse.minor": "0", "GNU.sparse.name": name,
                        "GNU.sparse.realsize": str(REAL)}
    return info, data


def test_a_pax_sparse_member_is_refused_before_it_is_written(daemon, base, tmp_path):
    # The layer the archive stands for, made on the host: its digest is right, so only the member's kind stops it.
    tree = tmp_path / "tree"
    tree.mkdir(mode=0o755)
    os.chmod(tree, 0o755)
    with open(tree / "bomb", "wb") as f:
        f.truncate(REAL - 4)
        f.seek(REAL - 4)
        f.write(b"BOMB")
    os.chmod(tree / "bomb", 0o644)
    os.utime(tree / "bomb", (1_700_000_000, 1_700_000_000))
    os.utime(tree, (1_700_000_000, 1_700_000_000))
    meta = _layers.measure_tree(tree)
    digest, node = meta["digest"], "ef" * 32
    manifest = {"format": 1, "top": node, "base": base.ref, "layers": {digest: meta},
                "nodes": [{"id": node, "parent": base.ref, "layer": digest, "kind": "import"}]}
    archive = tmp_path / "sparse.tar"
    with tarfile.open(archive, "w", format=tarfile.PAX_FORMAT) as t:
        data = json.dumps(manifest).encode()
        info = tarfile.TarInfo(_archive.MANIFEST)
        info.size = len(data)
        t.addfile(info, io.BytesIO(data))
        root = tarfile.TarInfo(f"layers/{digest}")
        root.type, root.mode, root.mtime = tarfile.DIRTYPE, 0o755, 1_700_000_000
        t.addfile(root)
        info, data = _sparse_member(f"layers/{digest}/bomb")
        t.addfile(info, io.BytesIO(data))
    assert archive.stat().st_size < 64 << 10
    with pytest.raises(hutch.ImageError, match="sparse"):
        hutch.Image.import_(archive, base=base)
    with pytest.raises(hutch.NotFoundError):
        hutch.Image.from_name(node)
    assert not (daemon.state_dir / "layers" / digest).exists()
    assert not [p for p in os.listdir(daemon.state_dir / "layers") if p.startswith(".tmp")]
