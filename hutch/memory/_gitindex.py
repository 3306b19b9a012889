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

A writer killed while it holds index.lock (SIGKILL in the millisecond between taking it and renaming it over
the index) left the lock behind, and every later write failed with "File exists" until someone removed it by
hand. The lock is now the file this module recorded under a flock of its own (`_replace_index`), so the next
writer knows it for a dead writer's and removes it (`recover_lock`); the lock of any other git is left alone.

A git child of the store's (update-index, reset, write-tree: `Git.start`) killed while it holds index.lock
leaves it too. Each such child (and each update-ref) runs holding a shared flock of CHILD_FILE, which it inherits
and which the parent lets go of once the child is started, with its pid and start time recorded there before it
can take the lock (`ChildGuard`). The next writer removes an index.lock only if all of these hold: an exclusive
flock of CHILD_FILE is free (no child of ours, and no process that inherited it, is alive), every recorded
process is dead (its pid gone or reused), the lock was made after our children were started (its ctime is not
older than the records), and no process on this host has the lock open (git keeps its lock open while it writes
it). A user's `git` holding the lock has it open, and a lock that was there before our child started is older
than the record: neither is ever removed. The same flock tells the recovery of a writer that died when the
gits it left running are done (`wait_for_dead_writers_children`): an update-ref moving HEAD after the recovery
looked at it would leave HEAD holding files the recovery had put back.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import stat
import struct

from hutch._core.errors import MemoryStoreError
from hutch.memory._objects import object_id

#: A `.git/index` larger than this (about 2,500 entries) is left to git, told to write a new shared index.
_MAX_BYTES = 256 << 10
_KEEP_EXT = (b"link", b"REUC")     # carried as they are; other optional extensions are dropped
_ENTRY = struct.Struct(">10I20sH")
#: In .git: the flock a writer holds while it holds index.lock, and the identity of that lock (_replace_index)
OWNER_FILE = "hutch-index-lock.owner"
#: In .git: the new index before it is linked as index.lock
TEMP_FILE = "hutch-index.new"  # ctime s/ns, mtime s/ns, dev, ino, mode, uid, gid, size, sha, flags
#: In .git: the flock each git child that may take index.lock inherits, and the record of that child (ChildGuard)
CHILD_FILE = "hutch-git-child"


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
    _replace_index(git_dir, data)
    return True


def _replace_index(git_dir: str, data: bytes) -> None:
    """Write `data` as `.git/index` under git's index.lock, recorded so that a lock this process leaves when it
    is killed (between taking it and renaming it over the index) is known for its own by the next writer.

    The bytes go to a temp file first; its identity (device, inode, size, mtime, the checksum it ends with) is
    written into OWNER_FILE, whose flock this process holds, and only then is it linked as index.lock (link
    fails if the name exists, as O_EXCL would). The lock left by a killed writer is removed by the next one
    (`recover_lock`): the flock is free (its holder is dead) and the lock is the very file recorded."""
    index = os.path.join(git_dir, "index")
    lock = index + ".lock"
    tmp = os.path.join(git_dir, TEMP_FILE)
    owner = _owner(git_dir, wait=True)
    try:
        _clear_stale(git_dir, owner)   # the lock a killed writer left, as its record names it
        try:
            os.unlink(tmp)   # a killed writer's, not linked yet (or no longer)
        except FileNotFoundError:
            pass
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            st = os.fstat(fd)
        finally:
            os.close(fd)
        _record(owner, f"{st.st_dev} {st.st_ino} {st.st_size} {st.st_mtime_ns} {data[-20:].hex()} {os.getpid()}")
        try:
            try:
                os.link(tmp, lock, follow_symlinks=False)
            except FileExistsError:
                raise MemoryStoreError(
                    f"Unable to create '{lock}': File exists: another git process seems to be running in this "
                    f"repository; if none is, remove the file (rm {lock}) and write again.") from None
            os.unlink(tmp)
            try:
                os.replace(lock, index)
            except BaseException:
                os.unlink(lock)
                raise
        finally:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
            _record(owner, "")
    finally:
        os.close(owner)   # releases the flock


def _owner(git_dir: str, *, wait: bool) -> int | None:
    """OWNER_FILE, open and flocked (None if another process holds it and `wait` is False)."""
    fd = os.open(os.path.join(git_dir, OWNER_FILE), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    except BaseException:
        os.close(fd)
        raise
    return fd


def _record(fd: int, line: str) -> None:
    data = line.encode()
    os.pwrite(fd, data, 0)
    os.ftruncate(fd, len(data))


def _clear_stale(git_dir: str, owner: int) -> bool:
    """With OWNER_FILE's flock held: remove `.git/index.lock` if it is the lock a killed hutch writer left (the very
    file recorded in OWNER_FILE); True if the name is free now. A lock of any other process is never touched."""
    lock = os.path.join(git_dir, "index.lock")
    rec = os.pread(owner, 4096, 0).decode("ascii", "replace").split()
    try:
        st = os.lstat(lock)
    except FileNotFoundError:
        return True
    if len(rec) < 5 or not stat.S_ISREG(st.st_mode) or \
            rec[:4] != [str(st.st_dev), str(st.st_ino), str(st.st_size), str(st.st_mtime_ns)]:
        return False
    try:
        fd = os.open(lock, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return True
    try:
        tail = os.pread(fd, 20, max(0, st.st_size - 20))
        same = (os.fstat(fd).st_ino == st.st_ino) and tail.hex() == rec[4]
    finally:
        os.close(fd)
    if not same:
        return False
    os.unlink(lock)
    _record(owner, "")
    return True


def recover_lock(git_dir: str) -> bool:
    """Remove the `.git/index.lock` a hutch writer, or a git child of one, left when it was killed while it held
    it (every later write failed with "File exists"). Only such a lock, and only when no live process of ours holds
    it (module docstring): a lock another git holds is left alone. True if there is no index.lock now."""
    if not os.path.lexists(os.path.join(git_dir, "index.lock")):
        return True
    owner = _owner(git_dir, wait=False)
    if owner is None:
        return False   # a live hutch writer holds it: its lock is its own
    try:
        if _clear_stale(git_dir, owner):
            return True
    finally:
        os.close(owner)
    return _clear_dead_child(git_dir)


class ChildGuard:
    """Around the start of a git child that may take index.lock or move a ref (Git.start): CHILD_FILE flocked
    shared, the child recorded, the flock handed to the child (`fds` go to Popen's pass_fds).

    Every such child holds a shared flock of its own open of CHILD_FILE, so several may run at once (update-ref
    while update-index stages) and an exclusive flock is free exactly when none lives. Its record is one line of
    the file (_LINE bytes): "<pid> <start time> <since> <until>", `since` the file's mtime before the child was
    started ("0 - <since> ?" until it is), `until` '?' while it runs (and for good if its writer dies), '0' once it
    exited (its lock, if any, it removed itself), or when it was found killed by a signal (`child_ended`); the
    first guard taken while no child lives and no index.lock is there empties the file. `close()` lets go of this
    process's copy of the flock, so that it is held exactly as long as the child (and anything it started) lives.
    None of this may fail a write: where CHILD_FILE cannot be had, the child runs unguarded (`fds` is empty)."""

    def __init__(self, git_dir: str):
        self.fd: int | None = None
        self.git_dir = git_dir
        self.since = 0
        self.at = 0
        self.pid = 0
        try:
            fd = os.open(os.path.join(git_dir, CHILD_FILE), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                         0o600)
        except OSError:
            return
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                if not os.path.lexists(os.path.join(git_dir, "index.lock")):
                    os.ftruncate(fd, 0)   # no child lives, and none left a lock: their records can go
                fcntl.flock(fd, fcntl.LOCK_SH)
            except BlockingIOError:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)   # other children live: one more record
            self.at = os.fstat(fd).st_size
            os.pwrite(fd, _line("0 -"), self.at)
            self.since = os.fstat(fd).st_mtime_ns
            os.pwrite(fd, _line(f"0 - {self.since} ?"), self.at)
        except BlockingIOError:   # a recovery holds it exclusive: this child runs unguarded
            os.close(fd)
            return
        except BaseException:
            os.close(fd)
            raise
        self.fd = fd

    @property
    def fds(self) -> tuple[int, ...]:
        return () if self.fd is None else (self.fd,)

    def started(self, pid: int) -> None:
        if self.fd is not None:
            self.pid = pid
            os.pwrite(self.fd, _line(f"{pid} {_start_time(pid)} {self.since} ?"), self.at)

    def token(self) -> tuple[str, int, int] | None:
        """What `child_ended` needs to find this child's record again; None if it runs unguarded."""
        return (self.git_dir, self.at, self.pid) if self.pid else None

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def child_ended(token: tuple[str, int, int], returncode: int) -> None:
    """Tell the record of a guarded child how it ended: exited ('0': whatever lock it took, it removed), or
    killed by a signal (the time now: a lock it left is older)."""
    import time

    git_dir, at, pid = token
    try:
        fd = os.open(os.path.join(git_dir, CHILD_FILE), os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return
    try:
        f = os.pread(fd, _LINE, at).decode("ascii", "replace").split()
        if len(f) == 4 and f[0] == str(pid) and f[3] == "?":   # (the records may have been emptied meanwhile)
            until = "0" if returncode >= 0 else str(time.time_ns())
            os.pwrite(fd, _line(f"{f[0]} {f[1]} {f[2]} {until}"), at)
    except OSError:
        pass
    finally:
        os.close(fd)


#: the length of one record line of CHILD_FILE
_LINE = 80
#: a child whose end nobody saw (its writer died too): the lock it may have left is at most this much younger than
#: the child (git takes it at once: update-index before it reads its paths)
_UNSEEN_END_NS = 10 * 10**9


def _line(text: str) -> bytes:
    return text.encode().ljust(_LINE - 1)[:_LINE - 1] + b"\n"


def _records(fd: int) -> list[tuple[int, str, int, int | None]]:
    """(pid, start time, since, until: None if unknown, 0 if it exited) of each record of CHILD_FILE (pid 0: a
    child not started yet, or its line half written)."""
    out: list[tuple[int, str, int, int | None]] = []
    for line in os.pread(fd, 1 << 20, 0).decode("ascii", "replace").splitlines():
        f = line.split()
        if len(f) == 4 and f[0].isdigit() and f[2].isdigit() and (f[3] == "?" or f[3].isdigit()):
            out.append((int(f[0]), f[1], int(f[2]), None if f[3] == "?" else int(f[3])))
        elif line.strip():
            out.append((0, "-", 0, None))   # half written: unknown
    return out


def _lives(pid: int, start: str) -> bool:
    return pid > 0 and start != "-" and _start_time(pid) == start


def _left_by(recs: list[tuple[int, str, int, int | None]], ctime: int) -> bool:
    """True if a lock made at `ctime` falls in the life of a recorded child that did not exit (killed, or its end
    unseen): made after it started, before it was found dead (or soon after it started, if nobody saw it end)."""
    for _pid, _start, since, until in recs:
        if until == 0 or since == 0:
            continue
        if since <= ctime <= (until if until is not None else since + _UNSEEN_END_NS):
            return True
    return False


#: how long the recovery of a dead writer waits for the git commands it left running
SETTLE_SECONDS = 10.0


def wait_for_dead_writers_children(git_dir: str, timeout: float | None = None) -> None:
    """Before the recovery of a writer that died: wait until no git it started still runs (an update-ref that
    moves HEAD, or an update-index that stages, after the recovery looked would undo it halfway); at most
    `timeout` s, then MemoryStoreError naming the process."""
    import time

    try:
        fd = os.open(os.path.join(git_dir, CHILD_FILE), os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return
    try:
        deadline = time.monotonic() + (SETTLE_SECONDS if timeout is None else timeout)
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    break
                time.sleep(0.01)
        alive = [pid for pid, start, _, _ in _records(fd) if _lives(pid, start)]
        who = f"pid {', '.join(map(str, alive))}" if alive else "its pid is not recorded"
        raise MemoryStoreError(
            f"A git process started by a writer of this store that died still runs ({who}; it may hold "
            f"{os.path.join(git_dir, 'index.lock')}): the dead writer's changes cannot be undone while it runs. "
            "Write again once it has ended, or end it (kill PID).")
    finally:
        os.close(fd)


def _start_time(pid: int) -> str:
    """The start time of process `pid` (field 22 of /proc/<pid>/stat, clock ticks since boot); '-' if it is gone
    (or a zombie): no live process has that start time.
    A pid reused by a later process has another start time."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return "-"
    fields = raw[raw.rfind(b")") + 2:].split()   # the name, in parentheses, may hold spaces
    if len(fields) < 20 or fields[0] == b"Z":    # a zombie has let go of its files and locks
        return "-"
    return fields[19].decode()


def _open_anywhere(st: os.stat_result) -> bool:
    """True if any process of this host that we may look at has the file `st` open (git holds its lock open
    while it writes it)."""
    try:
        pids = [p for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return True   # cannot tell: as if it were
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue   # gone, or not ours to look at
        for fd in fds:
            try:
                o = os.stat(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if (o.st_ino, o.st_dev) == (st.st_ino, st.st_dev):
                return True
    return False


def _clear_dead_child(git_dir: str) -> bool:
    """Remove `.git/index.lock` if a git child of ours that died left it (the rule in the module docstring); True
    if there is no index.lock now."""
    lock = os.path.join(git_dir, "index.lock")
    try:
        fd = os.open(os.path.join(git_dir, CHILD_FILE), os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return not os.path.lexists(lock)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return not os.path.lexists(lock)   # a child of ours lives: whatever lock there is may be its own
        try:
            st = os.lstat(lock)
        except FileNotFoundError:
            return True
        recs = _records(fd)
        if any(_lives(pid, start) for pid, start, _, _ in recs):
            return False   # one still lives (the flock says none does: a pid check besides)
        if not stat.S_ISREG(st.st_mode) or not _left_by(recs, st.st_ctime_ns) or _open_anywhere(st):
            return False   # not made while a child of ours that died ran, or a live git's
        os.unlink(lock)
        os.ftruncate(fd, 0)
        return True
    finally:
        os.close(fd)


def git_mode(st: os.stat_result) -> int:
    """The mode git records for a file of this lstat."""
    if stat.S_ISLNK(st.st_mode):
        return 0o120000
    return 0o100755 if st.st_mode & 0o100 else 0o100644
