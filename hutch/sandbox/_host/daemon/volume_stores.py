"""Tenants' volumes on filesystems of their own, bounded by their disk quota as they are written.

Each tenant's volumes live in one btrfs filesystem of its own: a sparse file `state_dir()/volume-stores/
<tenant>.img` on a loop device, mounted (nosuid, nodev) at `volumes_dir()/.stores/<tenant>`, where
`volumes.data_dir` finds the volumes named `t.<tenant>.*`. The qgroup of its top-level subvolume (data and
metadata) is limited to the tenant's disk quota less the bytes of its images, so a sandbox writing into a
mounted volume gets EDQUOT at the quota, whatever it writes and however (the files API's writes get the same
and answer QuotaExceededError); the host's disk gives the file only what the tenant was allowed. The limit
follows the quota and the images (`sync`).

The filesystem is as large as the host disk under the state dir (sparse: it costs only what is written), so
it never needs to grow; the qgroup, not the size, bounds it. The mounts are the daemon's: made at its start
(for every store that exists) or at a tenant's first volume, and detached at its stop (the loop device then
clears itself); a store still mounted by a daemon that died is used as it is.

Volumes a tenant made before stores existed (directories under volumes_dir()) are moved into its store when
the store is first made.
"""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
import struct
import subprocess
import threading
from pathlib import Path

from hutch._core import paths
from hutch._core.errors import SandboxError
from hutch.sandbox._host import volumes
from hutch.sandbox._host.native import disk, linux

#: A qgroup limit of this many bytes is none.
UNLIMITED = (1 << 64) - 1
#: The largest store (the sparse file's size) whatever the host disk.
MAX_SIZE = 1 << 44


def images_dir() -> Path:
    return paths.state_dir() / "volume-stores"


class VolumeStores:
    """The daemon's tenant volume stores (see the module docstring)."""

    def __init__(self):
        self.roots: dict[str, int] = {}      # tenant -> fd of its mounted store's root
        self.limits: dict[str, int] = {}     # tenant -> the qgroup limit set last
        self.sizes: dict[str, int] = {}      # tenant -> its store's size (its file's)
        self.mounted: list[Path] = []        # mount points this daemon made (detached at close)
        self.lock = threading.Lock()

    def start(self, quotas: dict) -> None:
        """Mount every store that exists (blocking); `quotas`: tenant -> its disk quota."""
        d = images_dir()
        if d.is_dir():
            for img in sorted(d.glob("*.img")):
                try:
                    self.ensure(img.stem, quotas.get(img.stem))
                except (OSError, SandboxError) as e:
                    import sys
                    print(f"hutch daemon: tenant {img.stem}'s volume store {img} cannot be mounted, its volumes are "
                          f"unavailable: {e}", file=sys.stderr, flush=True)

    def ensure(self, tenant: str, quota: int | None = None) -> int:
        """The root fd of `tenant`'s store, made (for disk quota `quota`) and mounted if need be (blocking: mkfs
        the first time)."""
        with self.lock:
            fd = self.roots.get(tenant)
            if fd is not None:
                return fd
            target = volumes.store_dir(tenant)
            volumes.private_dir(target.parent)
            target.mkdir(mode=0o700, exist_ok=True)
            if not os.path.ismount(target):
                self._mount(tenant, target, quota)
            fd = os.open(target, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
            if linux.fs_type(target) != BTRFS_MAGIC:
                os.close(fd)
                raise SandboxError(f"{target} is a mount point of something else than tenant {tenant}'s volume "
                                   "store; unmount it.")
            os.fchmod(fd, 0o700)
            self.roots[tenant] = fd
            return fd

    @staticmethod
    def size_for(quota: int | None) -> int:
        """The store's size for a disk quota: room for it and btrfs's own (the qgroup holds the tenant to its
        limit; the size bounds what the host gives the file whatever happens inside). No quota: the host's disk."""
        st = os.statvfs(paths.state_dir())
        host = min(MAX_SIZE, st.f_blocks * st.f_frsize)
        return host if quota is None else min(host, max(MIN_SIZE, quota + quota // 4 + MIN_SIZE // 2))

    def _mount(self, tenant: str, target: Path, quota: int | None) -> None:
        d = images_dir()
        d.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(d, 0o700)
        img = d / f"{tenant}.img"
        new = not img.exists()
        if new:
            tmp = d / f".{tenant}.img.new"
            with open(tmp, "wb") as f:
                f.truncate(self.size_for(quota))
            os.chmod(tmp, 0o600)
            try:
                r = subprocess.run(["mkfs.btrfs", "-q", "-f", "-m", "single", str(tmp)], capture_output=True, text=True)
            except FileNotFoundError:
                tmp.unlink()
                raise SandboxError("mkfs.btrfs is missing (Debian: btrfs-progs): tenants' volumes need it") from None
            if r.returncode != 0:
                tmp.unlink()
                raise SandboxError(f"mkfs.btrfs failed for tenant {tenant}'s volume store: {r.stderr.strip()[-300:]}")
            os.replace(tmp, img)
        fd = os.open(img, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
        try:
            loop_fd, dev = disk.attach_loop(fd)   # autoclear: it goes with the mount
        finally:
            os.close(fd)
        try:
            # discard: blocks btrfs frees (its copy-on-write metadata moves at every commit) are punched out of
            # the sparse file, so the host holds what the store holds, not every block it ever wrote
            linux.mount(dev, str(target), "btrfs", linux.MS_NOSUID | linux.MS_NODEV, "discard=async")
        finally:
            os.close(loop_fd)
        self.mounted.append(target)
        root = os.open(target, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            if new:
                try:
                    fcntl.ioctl(root, disk.BTRFS_IOC_QUOTA_CTL, struct.pack("QQ", disk.BTRFS_QUOTA_CTL_ENABLE_SIMPLE_QUOTA, 0))
                except OSError:
                    fcntl.ioctl(root, disk.BTRFS_IOC_QUOTA_CTL, struct.pack("QQ", disk.BTRFS_QUOTA_CTL_ENABLE, 0))
                self._migrate(tenant, target)
        finally:
            os.close(root)

    def _migrate(self, tenant: str, target: Path) -> None:
        """Move the tenant's volumes of before stores (plain directories) into its new store."""
        prefix = f"t.{tenant}."
        vd = volumes.volumes_dir()
        for old in sorted(vd.glob(prefix + "*")):
            if not old.is_dir() or old.is_symlink():
                continue
            r = subprocess.run(["cp", "-a", "--", str(old), str(target / old.name)], capture_output=True, text=True)
            if r.returncode != 0:
                shutil.rmtree(target / old.name, ignore_errors=True)
                raise SandboxError(f"moving volume {old.name} into tenant {tenant}'s store failed: {r.stderr[-300:]}")
            shutil.rmtree(old)

    def limit(self, tenant: str, nbytes: int | None, quota: int | None) -> None:
        """At most `nbytes` in `tenant`'s store (None: no limit), the store grown first if `quota` (its disk
        quota) needs more room than it has; an ioctl only when something changes."""
        value = UNLIMITED if nbytes is None else max(0, nbytes)
        fd = self.ensure(tenant, quota)
        want = self.size_for(quota)
        if want > self.sizes.get(tenant, 0):
            self._grow(tenant, fd, want)
        if self.limits.get(tenant) == value:
            return
        fcntl.ioctl(fd, disk.BTRFS_IOC_QGROUP_LIMIT, struct.pack("6Q", 0, disk.BTRFS_QGROUP_LIMIT_MAX_RFER, value, 0, 0, 0))
        self.limits[tenant] = value

    def _grow(self, tenant: str, root: int, size: int) -> None:
        img = images_dir() / f"{tenant}.img"
        have = os.stat(img).st_size
        if have < size:
            dev = _loop_of(volumes.store_dir(tenant))
            os.truncate(img, size)
            lfd = os.open(dev, os.O_RDWR | os.O_CLOEXEC)
            try:
                fcntl.ioctl(lfd, disk.LOOP_SET_CAPACITY, 0)
            finally:
                os.close(lfd)
            fcntl.ioctl(root, disk.BTRFS_IOC_RESIZE, disk.vol_args("1:max"))
        self.sizes[tenant] = max(size, have)

    def close(self) -> None:
        """Let go of the stores: what this daemon mounted is detached (a sandbox still holding one keeps it)."""
        with self.lock:
            for fd in self.roots.values():
                os.close(fd)
            self.roots.clear()
            for target in self.mounted:
                try:
                    linux.umount2(str(target), linux.MNT_DETACH)
                except OSError as e:
                    if e.errno not in (errno.EINVAL, errno.ENOENT):
                        raise
            self.mounted.clear()


BTRFS_MAGIC = 0x9123683E
#: The smallest store (btrfs needs ~114 MiB for itself with its default profiles).
MIN_SIZE = 256 << 20


def _loop_of(target: Path) -> str:
    """The device mounted at `target` (/proc/self/mountinfo: the source, after the ' - ')."""
    want = str(target)
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            if left.split()[4] == want:
                return right.split()[1]
    raise OSError(errno.ENOENT, f"{target} is not mounted")

__all__ = ["VolumeStores"]
