"""User namespaces: root in a sandbox is host uid HOST_ID_BASE, never host root.

Every sandbox's user namespace maps ids 0..65535 to HOST_ID_BASE..+65535 on the
host. The image's layers, owned by host root, are seen through idmapped mounts
(host 0 -> HOST_ID_BASE, so root in the sandbox owns them and overlay can copy
them up); the daemon makes one per layer directory, under run_dir/layers, and
removes them at shutdown (or at the next start, after a crash).
"""

from __future__ import annotations

import hashlib
import os
import signal
from pathlib import Path

from hutch.sandbox._native import _linux as L

HOST_ID_BASE = 1_000_000_000   # far above /etc/subuid's usual 100000-based ranges
ID_COUNT = 65536
MAP_LINE = f"0 {HOST_ID_BASE} {ID_COUNT}\n"


def write_maps(pid: int) -> None:
    """Map the ids of `pid`'s (new, still empty) user namespace; done from the host by the daemon."""
    for f in ("uid_map", "gid_map"):
        fd = os.open(f"/proc/{pid}/{f}", os.O_WRONLY)
        try:
            os.write(fd, MAP_LINE.encode())
        finally:
            os.close(fd)


def mounts_under(path: Path) -> list[str]:
    prefix = str(path).rstrip("/") + "/"
    out = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        mp = line.split()[4].encode().decode("unicode_escape")
        if mp.startswith(prefix):
            out.append(mp)
    return sorted(out, key=len, reverse=True)


class IdMapper:
    """Idmapped views of image layers, made with one user namespace that holds the mapping."""

    def __init__(self, run_dir: Path):
        self.dir = run_dir / "layers"
        self.userns_fd = -1
        self.layers: dict[str, str] = {}
        self.broken: dict[str, str] = {}

    def reap(self) -> None:
        """Unmount layer views a crashed predecessor left."""
        for mp in mounts_under(self.dir):
            try:
                L.umount2(mp, L.MNT_DETACH)
            except OSError:
                pass
        if self.dir.is_dir():
            for p in self.dir.iterdir():
                self._remove(str(p))

    def start(self) -> bool:
        """Make the mapping namespace; False if this kernel cannot (then sandboxes run without one)."""
        self.dir.mkdir(parents=True, exist_ok=True)
        r, w = os.pipe()
        pid = os.fork()  # at start-up, before the daemon has threads
        if pid == 0:
            try:
                os.close(w)
                L.unshare(L.CLONE_NEWUSER)
                os.read(r, 1)
            finally:
                os._exit(0)
        os.close(r)
        try:
            write_maps_when_ready(pid)
            self.userns_fd = os.open(f"/proc/{pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC)
            probe = self.dir / "probe"
            probe.mkdir(exist_ok=True)
            L.idmapped_mount(str(self.dir), str(probe), self.userns_fd)
            L.umount2(str(probe), L.MNT_DETACH)
            probe.rmdir()
            return True
        except OSError:
            if self.userns_fd >= 0:
                os.close(self.userns_fd)
                self.userns_fd = -1
            return False
        finally:
            os.write(w, b"x")
            os.close(w)
            os.waitpid(pid, 0)

    def layer(self, path: str) -> str | None:
        """The idmapped view of a layer directory (made once), or None if its filesystem cannot idmap."""
        if self.userns_fd < 0 or path in self.broken:
            return None
        view = self.layers.get(path)
        if view is None:
            view = str(self.dir / hashlib.sha1(path.encode()).hexdigest()[:16])
            os.makedirs(view, exist_ok=True)
            try:
                L.idmapped_mount(path, view, self.userns_fd)
            except OSError as e:
                self.broken[path] = str(e)
                os.rmdir(view)
                return None
            self.layers[path] = view
        return view

    def bind_view(self, name: str, source: str) -> str | None:
        """An idmapped view of a bind source for one sandbox (dropped once it is mounted), or None."""
        if self.userns_fd < 0:
            return None
        view = str(self.dir / f"b-{name}")
        try:
            if os.path.isdir(source):
                os.makedirs(view, exist_ok=True)
            else:
                open(view, "a").close()
            L.idmapped_mount(source, view, self.userns_fd)
        except OSError:  # e.g. a filesystem without idmapping (FUSE): the bind stays as it is
            self._remove(view)
            return None
        return view

    def drop(self, view: str) -> None:
        try:
            L.umount2(view, L.MNT_DETACH)
        except OSError:
            pass
        self._remove(view)

    @staticmethod
    def _remove(path: str) -> None:
        try:
            os.rmdir(path) if os.path.isdir(path) else os.unlink(path)
        except OSError:
            pass

    def stop(self) -> None:
        for view in self.layers.values():
            try:
                L.umount2(view, L.MNT_DETACH)
                os.rmdir(view)
            except OSError:
                pass
        self.layers.clear()
        self.reap()
        if self.userns_fd >= 0:
            os.close(self.userns_fd)
            self.userns_fd = -1


def write_maps_when_ready(pid: int) -> None:
    """The child unshares right after fork: wait until its user namespace differs from ours."""
    mine = os.stat("/proc/self/ns/user").st_ino
    for _ in range(2000):
        if os.stat(f"/proc/{pid}/ns/user").st_ino != mine:
            write_maps(pid)
            return
        os.sched_yield()
    os.kill(pid, signal.SIGKILL)
    raise OSError("the user namespace helper did not start")
