"""Who may drive the daemon: the Unix socket's peers, and the token of the TCP listener.

The daemon is root and whoever drives it can do what root can, so:

- The socket is bound inside a fresh 0700 directory, given its mode (0600, or 0660
  root:GROUP with `--group`) there, and only then renamed to its path: it is never
  connectable by anyone else at any instant, whatever the umask. A socket directory
  the daemon makes (or its own run directory) is 0700, or 0750 root:GROUP.
- Its run directory, its socket's and its state directory, and every directory above them, are root's and
  writable by nobody else (an ancestor may be sticky, as /tmp is): a run directory another user made first
  could hold their links (daemon.pid -> /etc/shadow), and one they may rename could be swapped for theirs
  while the daemon runs (`owned_by_root`).
- Every accepted connection is checked with SO_PEERCRED before any byte of it is
  read: root, or a member of the operator's group, nobody else (`PeerPolicy`).
- The TCP token comes from a file or the environment, never argv (hutch/_core/tokens.py).
"""

from __future__ import annotations

import grp
import os
import pwd
import socket
import stat
import struct
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from hutch._core.errors import ConfigError
from hutch._core.paths import owned_by_root

#: Seconds a uid's group membership is remembered (bounds the group-database lookups a client can cause).
MEMBERSHIP_TTL = 2.0
_CRED = struct.Struct("3i")


@dataclass(frozen=True)
class Peer:
    """The credentials the kernel recorded when the peer connected (SO_PEERCRED)."""

    pid: int
    uid: int
    gid: int

    @classmethod
    def of(cls, sock: socket.socket) -> "Peer":
        return cls(*_CRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size)))


@dataclass(frozen=True)
class PeerPolicy:
    """Root may connect; so may members of `gid` (the operator's `--group`), if one is named.

    Membership is the group database's (getgrouplist of the peer's uid) plus the peer's own gid
    at connect time: both are fixed for this connection or this uid, so nothing about the peer
    process can change underneath the check (reading /proc/<pid>/status could meet a reused pid).
    A member removed from the group is refused from the next connection on.
    """

    gid: int | None = None
    group: str | None = None

    @classmethod
    def for_group(cls, group: str | int | None) -> "PeerPolicy":
        if group is None or group == "":
            return cls()
        try:
            g = grp.getgrgid(int(group)) if str(group).isdigit() else grp.getgrnam(str(group))
        except (KeyError, OverflowError):
            raise ConfigError(f"--group {group!r}: no such group on this host; create it with "
                              f"`groupadd {group}` and add the users who may drive hutch with `usermod -aG`.") from None
        if g.gr_gid == 0:
            raise ConfigError("--group root would let every member of root's group drive the daemon; "
                              "create a dedicated group (`groupadd hutch`) and name it.")
        return cls(g.gr_gid, g.gr_name)

    def describe(self) -> str:
        return "root" + (f" and members of group {self.group}" if self.group else "")


class PeerCheck:
    """`allows(peer)`, with a short per-uid cache of group membership."""

    def __init__(self, policy: PeerPolicy):
        self.policy = policy
        self._cache: dict[int, tuple[float, bool]] = {}
        self._lock = threading.Lock()

    def allows(self, peer: Peer) -> bool:
        if peer.uid == 0:
            return True
        gid = self.policy.gid
        if gid is None:
            return False
        if peer.gid == gid:
            return True
        now = time.monotonic()
        with self._lock:
            hit = self._cache.get(peer.uid)
            if hit and now - hit[0] < MEMBERSHIP_TTL:
                return hit[1]
        try:
            pw = pwd.getpwuid(peer.uid)
            ok = gid in os.getgrouplist(pw.pw_name, pw.pw_gid)
        except (KeyError, OSError):
            ok = False   # a uid without a passwd entry (a sandbox's host uid, say) is nobody's member
        with self._lock:
            if len(self._cache) > 4096:
                self._cache.clear()
            self._cache[peer.uid] = (now, ok)
        return ok


def private_dir(path: Path, policy: PeerPolicy, *, close: bool = True) -> None:
    """Make `path` (a directory of this daemon's: its run directory, its socket's) root's and 0700, or
    0750 root:GROUP; refused if it is shared with every user (a /tmp-like directory is nobody's to close).
    `close=False` only makes and checks it (before the daemon knows it is the only one using it)."""
    owned_by_root(path)   # before mkdir: nothing is made under a directory someone else controls
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"{path} is not a directory; point HUTCH_RUN_DIR / HUTCH_SOCKET at a directory of the daemon's own.")
    owned_by_root(path)
    if not close:
        return
    os.chown(path, 0, policy.gid if policy.gid is not None else 0)
    os.chmod(path, 0o750 if policy.gid is not None else 0o700)


def bind_unix(path: Path, policy: PeerPolicy, *, own_dir: bool) -> socket.socket:
    """A listening Unix socket at `path`, never connectable by others at any instant (see the module docstring).

    `own_dir`: the socket's directory belongs to this daemon (its run directory, or one it makes now), so
    `private_dir` closes it too; another directory (HUTCH_SOCKET elsewhere) keeps its mode."""
    path = Path(path)
    parent = path.parent
    sock_mode = 0o660 if policy.gid is not None else 0o600
    if own_dir or not parent.exists():
        private_dir(parent, policy)
    else:   # another's directory keeps its mode, but nobody else may swap the stage dir (chmod follows links)
        owned_by_root(parent, "HUTCH_SOCKET", sticky=True)
    stage = tempfile.mkdtemp(prefix=".s", dir=parent)   # 0700, root's: nobody else reaches what is inside
    staged = os.path.join(stage, "s")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        try:
            s.bind(staged)
        except OSError as e:
            raise ConfigError(f"cannot create the daemon socket {path} ({e}); a Unix socket path must be "
                              "shorter than 100 bytes: set HUTCH_SOCKET to a shorter one.") from e
        os.chown(staged, 0, policy.gid if policy.gid is not None else 0)
        os.chmod(staged, sock_mode)
        s.listen(1024)
        s.setblocking(False)
        try:
            os.rename(staged, path)   # appears at its path with its final owner and mode, replacing a stale one
        except OSError as e:
            raise ConfigError(f"cannot put the daemon socket at {path} ({e.strerror}); remove what is there or "
                              "set HUTCH_SOCKET to another path.") from e
    except BaseException:
        s.close()
        raise
    finally:
        try:
            os.unlink(staged)
        except OSError:
            pass
        os.rmdir(stage)
    return s


__all__ = ["Peer", "PeerCheck", "PeerPolicy", "bind_unix", "private_dir"]
