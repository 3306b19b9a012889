"""Disk-backed writable layers: one btrfs per zygote, a subvolume per sandbox with a quota of its disk=.

A sandbox's overlay upper and work dirs live in a subvolume of its own, limited to `disk` bytes by a
qgroup: filling it fails with EDQUOT inside while the sandbox lives, and its page cache is reclaimable
(a tmpfs layer was charged to the memory limit: with the defaults it OOM-killed the sandbox first).
btrfs because its quotas need nothing else of the kernel (XFS project quotas need CONFIG_XFS_QUOTA, ext4's
CONFIG_QFMT_V2, which kernels lack), and a subvolume is made and destroyed in microseconds, its blocks
freed by the filesystem's cleaner in the background.

The store is a file under the state dir, fallocated (so no write into it can fail for want of host
space), mkfs.btrfs'd (at zygote start, never on the create path), attached to a loop device (autoclear,
direct I/O, no write cache: a layer dies with its sandbox, flushing it is waste) and unlinked at once.
The zygote mounts it in a mount namespace of its own and works from its root, which every init's
copy of that namespace inherits as its working directory; nothing is mounted on the host. When the
zygote and its inits are gone (with the daemon, or on a crash) the mount goes, the loop device
clears itself and the file's blocks are freed: there is nothing to reap.

The store grows (fallocate, LOOP_SET_CAPACITY, BTRFS_IOC_RESIZE) when a create finds less free than its
disk= or a periodic check less than GROW_MARGIN; it never takes the host disk below HOST_RESERVE.
"""

from __future__ import annotations

import asyncio
import errno
import fcntl
import glob
import os
import secrets
import struct
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from hutch._core.errors import ConfigError, SandboxError

INITIAL_SIZE = 2 << 30        # the store's first size: room for a sandbox of the default disk= (1 GiB) and metadata
GROW_MARGIN = 256 << 20       # keep at least this free, and the disk= of each new sandbox
HOST_RESERVE = 1 << 30        # never take the host's disk below this much free
WATCH_EVERY = 2.0             # seconds between free-space checks while the store lives
IMAGE_GLOB = ".layers-*.img"

# ioctls (linux/loop.h, linux/btrfs.h)
LOOP_CTL_GET_FREE = 0x4C82
LOOP_CONFIGURE = 0x4C0A
LOOP_SET_CAPACITY = 0x4C07
LO_FLAGS_AUTOCLEAR, LO_FLAGS_DIRECT_IO = 4, 16
BTRFS_IOC_RESIZE = 0x50009403
BTRFS_IOC_SUBVOL_CREATE = 0x5000940E
BTRFS_IOC_SNAP_DESTROY = 0x5000940F   # also in zygote.py (stdlib only, it does not import this module)
BTRFS_IOC_QUOTA_CTL = 0xC0109428
BTRFS_IOC_QGROUP_LIMIT = 0x8030942B
BTRFS_QUOTA_CTL_ENABLE, BTRFS_QUOTA_CTL_ENABLE_SIMPLE_QUOTA = 1, 4
BTRFS_QGROUP_LIMIT_MAX_RFER = 1


def vol_args(name: str) -> bytearray:
    return bytearray(struct.pack("q4088s", 0, name.encode()))   # struct btrfs_ioctl_vol_args (4096 bytes)


class LayerStore:
    """The daemon's side of one store: made by make(), mounted by the zygote, given its root by attach()."""

    def __init__(self, image_fd: int, loop_fd: int, dev: str, size: int, state_dir: Path):
        self.image_fd, self.loop_fd, self.dev, self.size = image_fd, loop_fd, dev, size
        self.state_dir = state_dir
        self.root = -1
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="hutch-layers")
        self.watcher: asyncio.TimerHandle | None = None
        self.growing = self.warned = False
        self.closed = False
        self.last_free = 0

    @classmethod
    def make(cls, state_dir: Path) -> "LayerStore":
        """A new, empty store on a loop device (blocking: mkfs). OSError if this host cannot have one."""
        state_dir.mkdir(parents=True, exist_ok=True)
        for old in glob.glob(str(state_dir / IMAGE_GLOB)):   # a crash between create and unlink (milliseconds)
            try:
                if time.time() - os.stat(old).st_mtime > 60:
                    os.unlink(old)
            except OSError:
                pass
        path = state_dir / f".layers-{secrets.token_hex(6)}.img"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        loop_fd = -1
        try:
            _reserve(fd, 0, INITIAL_SIZE, state_dir)
            r = subprocess.run(["mkfs.btrfs", "-q", "-f", str(path)], capture_output=True, text=True)
            if r.returncode != 0:
                raise OSError(errno.EIO, f"mkfs.btrfs failed: {r.stderr.strip()[-300:]}")
            loop_fd, dev = attach_loop(fd)
        except FileNotFoundError as e:
            os.close(fd)
            raise OSError(errno.ENOENT, f"{e.filename or 'mkfs.btrfs'} is missing (Debian: btrfs-progs)") from None
        except BaseException:
            os.close(fd)
            if loop_fd >= 0:
                os.close(loop_fd)
            raise
        finally:
            path.unlink(missing_ok=True)   # the loop device holds the file from now on
        return cls(fd, loop_fd, dev, INITIAL_SIZE, state_dir)

    def attach(self, root_fd: int) -> None:
        """The store's root (an fd from the zygote, which mounted it): turn quotas on."""
        self.root = root_fd
        os.fchmod(root_fd, 0o711)   # inits (any sandbox's uid) may pass through, not list
        try:
            fcntl.ioctl(root_fd, BTRFS_IOC_QUOTA_CTL, struct.pack("QQ", BTRFS_QUOTA_CTL_ENABLE_SIMPLE_QUOTA, 0))
        except OSError:   # simple quotas are 6.7+; full qgroups cost more but behave the same here
            fcntl.ioctl(root_fd, BTRFS_IOC_QUOTA_CTL, struct.pack("QQ", BTRFS_QUOTA_CTL_ENABLE, 0))
        self.watcher = asyncio.get_running_loop().call_later(WATCH_EVERY, self._watch)

    # --- per sandbox ---------------------------------------------------------------------------

    def prepare(self, name: str, owner: int, disk: int) -> None:
        """Subvolume `name` holding upper/ and work/, owned by host uid `owner` (the sandbox's root), at most
        `disk` bytes. Made while its init warms, with the default disk=: only another limit waits for the plan
        (each btrfs call may wait for a transaction to commit)."""
        fcntl.ioctl(self.root, BTRFS_IOC_SUBVOL_CREATE, vol_args(name))
        fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self.root)
        try:
            _limit(fd, disk)
            for d in ("upper", "work"):
                os.mkdir(d, 0o755, dir_fd=fd)
                os.chown(d, owner, owner, dir_fd=fd)
            os.fchmod(fd, 0o700)
            os.fchown(fd, owner, owner)
        except BaseException:
            self.remove(name)
            raise
        finally:
            os.close(fd)

    def limit(self, name: str, disk: int) -> None:
        """At most `disk` bytes in subvolume `name` (its qgroup; data and metadata)."""
        fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self.root)
        try:
            _limit(fd, disk)
        finally:
            os.close(fd)

    def remove(self, name: str) -> None:
        """Destroy subvolume `name` (its blocks are freed in the background). A sandbox's, once it ended, is
        destroyed by the zygote instead (Zygote.release_layer): the ioctl costs ~0.1 ms, more for a layer with
        much unwritten data, which it then never writes, and neither the daemon's loop nor a thread of it (the
        GIL) should wait for that."""
        if self.closed:
            return   # the whole store went with its zygote
        try:
            fcntl.ioctl(self.root, BTRFS_IOC_SNAP_DESTROY, vol_args(name))
        except FileNotFoundError:
            pass

    # --- room ------------------------------------------------------------------------------------

    def free(self) -> int:
        st = os.fstatvfs(self.root)
        self.last_free = st.f_bavail * st.f_frsize
        return self.last_free

    async def ensure_room(self, disk: int) -> None:
        """Grow the store if it has less free than `disk` (+ a margin); SandboxError if the host cannot give it.
        Trusts the free space the watcher saw last while that is plenty (statfs is not free on btrfs)."""
        if self.last_free >= 2 * (disk + GROW_MARGIN):
            return
        free = self.free()
        if free >= disk + GROW_MARGIN:
            return
        try:
            await asyncio.get_running_loop().run_in_executor(self.pool, self.grow, disk + GROW_MARGIN - free)
        except OSError as e:
            free = self.free()
            if free >= disk:
                return
            if e.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise SandboxError(f"the disk of writable layers cannot grow ({e}): a sandbox with disk={disk >> 20}M "
                                   "does not fit; see the daemon's log.") from None
            st = os.statvfs(self.state_dir)
            more = max(0, st.f_bavail * st.f_frsize - HOST_RESERVE)
            fits = max(0, free + more - GROW_MARGIN)
            raise ConfigError(
                f"disk={disk >> 20}M does not fit on this host: the disk of writable layers has {free >> 20} MiB free "
                f"and the host disk under {self.state_dir} can add {more >> 20} MiB (it keeps {HOST_RESERVE >> 20} MiB "
                f"free); give disk= of at most {fits >> 20}M, end some sandboxes, or free space on the host.") from None

    def grow(self, need: int) -> None:
        """Make the store at least `need` bytes bigger (blocking); OSError if the host disk cannot give it."""
        step = max(need, self.size // 4, INITIAL_SIZE)
        _reserve(self.image_fd, self.size, step, self.state_dir)
        self.size += step
        fcntl.ioctl(self.loop_fd, LOOP_SET_CAPACITY, 0)
        fcntl.ioctl(self.root, BTRFS_IOC_RESIZE, vol_args("1:max"))
        self.free()

    def _watch(self) -> None:
        """Every WATCH_EVERY seconds: grow in the background before running sandboxes find the store full."""
        if self.closed:
            return
        loop = asyncio.get_running_loop()
        try:
            low = self.free() < max(GROW_MARGIN, self.size // 10)
        except OSError:
            low = False
        if low and not self.growing:
            self.growing = True

            def grow():
                try:
                    self.grow(GROW_MARGIN)
                    self.warned = False
                except OSError as e:
                    if not self.warned:   # once until it can grow again, not every WATCH_EVERY
                        self.warned = True
                        print(f"hutch daemon: the disk of writable layers is nearly full and cannot grow ({e}); "
                              "sandboxes writing to it will get ENOSPC.", file=sys.stderr)
                finally:
                    self.growing = False

            loop.run_in_executor(self.pool, grow)
        self.watcher = loop.call_later(WATCH_EVERY, self._watch)

    def close(self) -> None:
        """Let go of the store: once the zygote's namespace and this are gone, so is everything."""
        if self.closed:
            return
        self.closed = True
        if self.watcher is not None:
            self.watcher.cancel()
        self.pool.shutdown(wait=True, cancel_futures=True)   # not while a destroy or grow still uses the fds
        for fd in (self.root, self.loop_fd, self.image_fd):
            if fd >= 0:
                os.close(fd)
        self.root = self.loop_fd = self.image_fd = -1


def _limit(subvol_fd: int, disk: int) -> None:
    # qgroup 0 is the fd's own subvolume
    fcntl.ioctl(subvol_fd, BTRFS_IOC_QGROUP_LIMIT, struct.pack("6Q", 0, BTRFS_QGROUP_LIMIT_MAX_RFER, disk, 0, 0, 0))


def _reserve(fd: int, offset: int, length: int, state_dir: Path) -> None:
    """fallocate the image, keeping HOST_RESERVE free on the host disk."""
    st = os.statvfs(state_dir)
    if st.f_bavail * st.f_frsize - length < HOST_RESERVE:
        raise OSError(errno.ENOSPC, f"the host disk under {state_dir} has {st.f_bavail * st.f_frsize >> 20} MiB "
                                    f"free, {(length + HOST_RESERVE) >> 20} MiB are needed")
    os.posix_fallocate(fd, offset, length)


def attach_loop(image_fd: int) -> tuple[int, str]:
    """A free loop device backed by `image_fd`: (its fd, its path)."""
    info = struct.pack("QQQQQIIII64s64s32sQQ", 0, 0, 0, 0, 0, 0, 0, 0, LO_FLAGS_AUTOCLEAR | LO_FLAGS_DIRECT_IO,
                       b"hutch-layers", b"", b"", 0, 0)            # struct loop_info64
    config = struct.pack("II", image_fd, 0) + info + bytes(64)    # struct loop_config
    ctl = os.open("/dev/loop-control", os.O_RDWR | os.O_CLOEXEC)
    try:
        for _ in range(20):   # another process may take the free device between the two calls
            n = fcntl.ioctl(ctl, LOOP_CTL_GET_FREE)
            fd = os.open(f"/dev/loop{n}", os.O_RDWR | os.O_CLOEXEC)
            try:
                fcntl.ioctl(fd, LOOP_CONFIGURE, config)
            except OSError as e:
                os.close(fd)
                if e.errno == errno.EBUSY:
                    continue
                raise
            try:   # no volatile cache: flushes (every fsync inside) become no-ops
                with open(f"/sys/block/loop{n}/queue/write_cache", "w") as f:
                    f.write("write through")
            except OSError:
                pass
            return fd, f"/dev/loop{n}"
    finally:
        os.close(ctl)
    raise OSError(errno.EBUSY, "no free loop device")


__all__ = ["LayerStore"]
