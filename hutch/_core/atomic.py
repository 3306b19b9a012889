"""Atomic file writes: a unique temp file in the same directory, fsync, rename.

A reader sees the old bytes or the new bytes, never a half-written file, and a
crash leaves at most a stray temp file whose name starts with `.tmp-`.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

TEMP_PREFIX = ".tmp-"


@contextlib.contextmanager
def replace_file(path: str | os.PathLike, *, mode: int | None = 0o644, fsync_file: bool = True,
                 fsync_dir: bool = True) -> Iterator[BinaryIO]:
    """A binary file to write `path`'s new content into, under a temporary name beside it: when the block
    ends without an error it replaces `path` (with `mode`; None keeps mkstemp's 0600), else it is removed.

    `fsync_file=False` / `fsync_dir=False` leave durability to the caller, who
    syncs once for a batch (the memory store's transactions do).
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=TEMP_PREFIX, dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            if fsync_file:
                os.fsync(f.fileno())
        if mode is not None:
            os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    if fsync_dir:
        dfd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)


def atomic_write(path: str | os.PathLike, data: bytes, *, mode: int = 0o644, fsync_dir: bool = True,
                 fsync_file: bool = True) -> None:
    """Replace `path` with `data` atomically (see replace_file)."""
    with replace_file(path, mode=mode, fsync_file=fsync_file, fsync_dir=fsync_dir) as f:
        f.write(data)
