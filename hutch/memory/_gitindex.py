"""Staging a few paths in git's split index without reading its shared part.

`git update-index` reads the whole index (110,000 entries, 11 MB at 100,000 entities: most of a put's
time) to change one entry. A split index (core.splitIndex, see Committer.stage) is two files:
`.git/sharedindex.<sha>`, which never changes, and `.git/index`, which holds the entries changed since
(those replacing a shared entry first, then the ones added, sorted by name) and the `link` extension
naming the shared file and which of its entries are deleted or replaced (git's
Documentation/technical/index-format.txt). An entry added to `.git/index` takes the place of a shared
entry of the same name when git merges the two, so adding or changing paths needs only `.git/index`:
`stage()` reads it (a few KB), puts the new entries among the added ones in git's order, drops the
extensions that describe the whole index (the cache tree, the untracked cache, offsets: git rebuilds
them when it needs them) and writes it back under git's `index.lock`, as git does.

An entry records the file's stat data as it was before its bytes were read, so git sees a file changed
later; an entry carried over whose mtime is not older than the index it was written with ("racily
clean", git's racy-git rule) is checked against the file and smudged (size 0: git re-reads it) if the
file changed. Anything else — a removal, an index that is not split, index version 4, an extension git
requires that is not `link`, a `.git/index` grown past _MAX_BYTES — is left to git (`stage()`
returns False); a split part grown past _MAX_BYTES is folded by git into a new shared index (`crowded`).
"""

from __future__ import annotations

import hashlib
import os
import stat
import struct

from hutch._core.errors import MemoryStoreError
from hutch.memory._objects import object_id

#: A `.git/index` larger than this (about 2,500 entries) is left to git, told to write a new shared index.
_MAX_BYTES = 256 << 10
_KEEP_EXT = (b"link", b"REUC")     # carried as they are; other optional extensions are dropped
_ENTRY = struct.Struct(">10I20sH")  # ctime s/ns, mtime s/ns, dev, ino, mode, uid, gid, size, sha, flags


class _NotHere(Exception):
    """The index is not one this module writes: git stages the paths."""


def _ewah_ones(data: bytes, pos: int) -> tuple[int, int]:
    """(number of set bits, end offset) of the EWAH bitmap at `pos` (git's ewah/ewah_io.c format)."""
    if pos + 8 > len(data):
        raise _NotHere
    _bits, words = struct.unpack_from(">II", data, pos)
    pos += 8
    end = pos + 8 * words
    if end + 4 > len(data):
        raise _NotHere
    ones, i = 0, 0
    while i < words:
        rlw = struct.unpack_from(">Q", data, pos + 8 * i)[0]
        run = (rlw >> 1) & 0xFFFFFFFF
        lits = rlw >> 33
        if rlw & 1:
            ones += 64 * run
        for j in range(lits):
            if i + 1 + j >= words:
                raise _NotHere
            ones += bin(struct.unpack_from(">Q", data, pos + 8 * (i + 1 + j))[0]).count("1")
        i += 1 + lits
    return ones, end + 4


def _parse(raw: bytes) -> tuple[int, list[tuple[bytes, bytes]], list[tuple[bytes, bytes]]]:
    """(version, [(name, entry bytes)], [(signature, extension bytes)]) of a v2/v3 index file."""
    if len(raw) < 32 or raw[:4] != b"DIRC":
        raise _NotHere
    version, count = struct.unpack_from(">II", raw, 4)
    if version not in (2, 3):
        raise _NotHere
    pos, end = 12, len(raw) - 20
    entries = []
    for _ in range(count):
        if pos + 62 > end:
            raise _NotHere
        flags = struct.unpack_from(">H", raw, pos + 60)[0]
        if flags & 0x3000:          # a conflict stage: git's business
            raise _NotHere
        start = pos + (64 if flags & 0x4000 else 62)
        nul = raw.index(b"\0", start)
        size = ((start - pos) + (nul - start) + 8) & ~7
        entries.append((raw[start:nul], raw[pos:pos + size]))
        pos += size
    exts = []
    while pos + 8 <= end:
        sig, n = raw[pos:pos + 4], struct.unpack_from(">I", raw, pos + 4)[0]
        if pos + 8 + n > end:
            raise _NotHere
        exts.append((sig, raw[pos:pos + 8 + n]))
        pos += 8 + n
    if pos != end:
        raise _NotHere
    return version, entries, exts


def _entry(name: bytes, st: os.stat_result, mode: int, sha: str) -> bytes:
    m = lambda x: x & 0xFFFFFFFF   # noqa: E731 - git keeps the low 32 bits of every stat field
    head = _ENTRY.pack(m(int(st.st_ctime)), m(st.st_ctime_ns % 1_000_000_000), m(int(st.st_mtime)),
                       m(st.st_mtime_ns % 1_000_000_000), m(st.st_dev), m(st.st_ino), mode, m(st.st_uid),
                       m(st.st_gid), m(st.st_size), bytes.fromhex(sha), min(len(name), 0xFFF))
    size = (62 + len(name) + 8) & ~7
    return head + name + b"\0" * (size - 62 - len(name))


def _racy_checked(root: str, name: bytes, entry: bytes, index_mtime: tuple[int, int]) -> bytes:
    """`entry`, smudged (size 0) if it is racily clean and the file no longer holds its blob."""
    f = _ENTRY.unpack_from(entry)
    if (f[2], f[3]) < index_mtime or f[9] == 0:
        return entry
    path = os.path.join(root, os.fsdecode(name))
    try:
        st = os.lstat(path)
        if stat.S_ISLNK(st.st_mode):
            data, kind = os.fsencode(os.readlink(path)), b"blob"
        else:
            with open(path, "rb") as fh:
                data, kind = fh.read(), b"blob"
        same = object_id(kind, data) == f[10].hex()
    except OSError:
        same = False
    if same:
        return entry
    return entry[:36] + b"\0\0\0\0" + entry[40:]


def split(git_dir: str) -> bool:
    """True if the repository's index is split (its `.git/index` names a shared index)."""
    try:
        with open(os.path.join(git_dir, "index"), "rb") as f:
            head = f.read(12)
    except OSError:
        return False
    return head[:4] == b"DIRC" and any(n.startswith("sharedindex.") for n in os.listdir(git_dir))


def crowded(git_dir: str) -> bool:
    """True if `.git/index` has grown past what `stage` rewrites: the next staging by git should fold it into
    a new shared index."""
    try:
        return os.path.getsize(os.path.join(git_dir, "index")) > _MAX_BYTES
    except OSError:
        return False


def stage(git_dir: str, root: str, new: dict[str, tuple[os.stat_result, int, str]]) -> bool:
    """Add or change the entries `new` (path -> (its lstat before it was read, git mode, blob sha)) in the split
    index of `git_dir`; False (nothing written) where git must do it (module docstring). MemoryStoreError if
    another git holds index.lock."""
    index = os.path.join(git_dir, "index")
    try:
        with open(index, "rb") as f:
            st_index = os.fstat(f.fileno())
            if st_index.st_size > _MAX_BYTES:
                raise _NotHere
            raw = f.read()
        version, entries, exts = _parse(raw)
        link = [e for sig, e in exts if sig == b"link"]
        if len(link) != 1 or any(sig[:1].islower() and sig != b"link" for sig, _ in exts):
            raise _NotHere
        body = link[0][8:]
        if len(body) < 20 or body[:20] == b"\0" * 20:
            raise _NotHere
        replaced = 0
        if len(body) > 20:
            _, pos = _ewah_ones(body, 20)
            replaced, pos = _ewah_ones(body, pos)
            if pos != len(body):
                raise _NotHere
        if replaced > len(entries):
            raise _NotHere
    except (_NotHere, OSError, ValueError, struct.error):
        return False
    mtime = (int(st_index.st_mtime) & 0xFFFFFFFF, st_index.st_mtime_ns % 1_000_000_000)
    head_part = [e for _, e in entries[:replaced]]
    added = {name: _racy_checked(root, name, e, mtime) for name, e in entries[replaced:]}
    for rel, (st, mode, sha) in new.items():
        name = os.fsencode(rel)
        if len(name) >= 0xFFF:
            return False
        added[name] = _entry(name, st, mode, sha)
    out = [b"DIRC", struct.pack(">II", version, len(head_part) + len(added)), *head_part]
    out += [added[name] for name in sorted(added)]
    out += [e for sig, e in exts if sig in _KEEP_EXT]
    data = b"".join(out)
    data += hashlib.sha1(data).digest()
    lock = index + ".lock"
    try:
        fd = os.open(lock, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
    except FileExistsError:
        raise MemoryStoreError(
            f"Unable to create '{lock}': File exists: another git process seems to be running in this "
            f"repository; if none is, remove the file (rm {lock}) and write again.") from None
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        finally:
            os.close(fd)
        os.replace(lock, index)
    except BaseException:
        try:
            os.unlink(lock)
        except FileNotFoundError:
            pass
        raise
    return True


def git_mode(st: os.stat_result) -> int:
    """The mode git records for a file of this lstat."""
    if stat.S_ISLNK(st.st_mode):
        return 0o120000
    return 0o100755 if st.st_mode & 0o100 else 0o100644
