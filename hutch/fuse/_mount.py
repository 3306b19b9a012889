"""Mounting and unmounting the view: the serving process, its start-up handshake, and `umount`.

`mount()` starts a serving process (`python -m hutch.fuse._mount ...`) in its
own session and returns once the mount is live, or raises with the reason it
failed. The process mounts with libfuse3's `auto_unmount`: a `fusermount3`
helper holds the FUSE connection and unmounts the moment the serving process
dies, however it dies (SIGKILL included), so a killed view never leaves a hung
mount behind. `hutch mem mount --foreground` runs `serve()` in the calling process.

A mount made for a sandbox (`handover=True`) is told `sandbox <id> disk <bytes>`
on stdin once the sandbox runs and the server is in the sandbox's cgroups (its
writes, searches and history reads wait for that, so each commit names the
sandbox and all of its work is charged to it); if stdin closes before that,
its creator died and it unmounts.
"""

from __future__ import annotations

import argparse
import ctypes
import errno
import logging
import os
import select
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

from hutch._core.errors import ConfigError, Error, MemoryStoreError

#: Seconds `mount()` waits for the serving process to report the mount live.
MOUNT_TIMEOUT = 30.0
#: Seconds the kernel may keep names, attributes and pages of the view between invalidations (_kcache.py).
CACHE_SECONDS = 60.0
_READY = b"ready\n"
#: Texts per model run when a sandbox's view embeds: its peak memory, charged to the sandbox, grows with it.
VIEW_EMBED_BATCH = 8

log = logging.getLogger("hutch.fuse")


def _check_fuse() -> None:
    if not os.path.exists("/dev/fuse"):
        raise ConfigError("/dev/fuse is missing: load the fuse module (modprobe fuse) to mount a memory view.")
    if shutil.which("fusermount3") is None:
        raise ConfigError("fusermount3 is missing: install the Debian package fuse3 (scripts/debian-packages.txt).")


def _check_mountpoint(mountpoint: Path) -> None:
    if not mountpoint.is_dir():
        raise ConfigError(f"The mount point {mountpoint} is not a directory: create it first (mkdir -p {mountpoint}).")
    if os.path.ismount(mountpoint):
        raise ConfigError(f"{mountpoint} is already a mount point: unmount it first (hutch mem umount {mountpoint}).")


def serve(store: str | os.PathLike, mountpoint: str | os.PathLike, *, writable: bool = True,
          source: str | None = None, ready_fd: int | None = None, handover: bool = False,
          debug: bool = False, cache_seconds: float = CACHE_SECONDS) -> None:
    """Mount the view of `store` at `mountpoint` and serve it until unmounted (blocks).

    `cache_seconds`: how long the kernel may keep names, attributes and pages it has seen. Every change
    (through the mount, through the API, by any program) invalidates them at once (hutch/fuse/_kcache.py),
    so this only bounds a change the server could not see; 0 asks the server on every path component.
    """
    from mfusepy import FUSE

    from hutch.fuse._fs import MemoryFS
    from hutch.memory import Memory

    mountpoint = Path(os.path.abspath(mountpoint))
    _check_fuse()
    _check_mountpoint(mountpoint)
    embedder = None
    if handover:
        from hutch.memory._index._embed import MiniLMProvider

        # A sandbox's view runs inside the sandbox's cgroups: one session of one thread, small batches (the
        # default's bulk sessions and batches of 32 peak near 1 GB, docs/fuse.md "What the view costs").
        embedder = MiniLMProvider(threads=1, batch=VIEW_EMBED_BATCH)
    mem = Memory(store, create=False, embedder=embedder)
    # a sandbox's view learns whom it serves (and its disk budget) once the sandbox runs: until then it waits
    fs = MemoryFS(mem, writable=writable, source=source or f"fuse:{mountpoint}", source_known=not handover)

    live = threading.Event()

    def ready():
        live.set()
        if ready_fd is not None:
            try:
                os.write(ready_fd, _READY)
                os.close(ready_fd)
            except OSError:
                pass
        if handover:
            threading.Thread(target=_await_handover, args=(fs, mountpoint), daemon=True).start()

    fs.on_ready = ready
    name = "hutch:" + "".join(c if c.isalnum() or c in "/-_." else "_" for c in str(mem.root))
    logging.basicConfig(level=logging.DEBUG if debug else logging.WARNING, stream=sys.stderr,
                        format="hutch-fuse: %(levelname)s %(message)s")
    # entry/attr timeouts > 0: a lookup per path component on every open was most of a cat's cost. A file
    # may still change behind the kernel's back (a commit through the API, or through this mount, which adds
    # front matter) and sendfile readers (busybox cat) trust the cached size: _kcache.py invalidates exactly.
    try:
        FUSE(fs, str(mountpoint), raw_fi=True, foreground=True, nothreads=False, auto_unmount=True,
             fsname=name, subtype="hutch", attr_timeout=cache_seconds, entry_timeout=cache_seconds,
             **({"ro": True} if not writable else {}),
             # a sandbox in a user namespace (HUTCH_USERNS=1) is not uid 0 to the kernel: let it in; its host
             # mount point is a 0700 directory of root's, detached at once, so nobody else can reach it
             **({"allow_other": True} if handover else {}))
    except RuntimeError:
        if not live.is_set():
            raise  # never mounted: main() reports why
        # libfuse reports the signal that ended a live mount (SIGTERM, Ctrl-C) as an error: it is a clean stop


def _await_handover(fs, mountpoint: Path) -> None:
    """Read 'sandbox <id>' from stdin; stdin closing first means the creator died: unmount."""
    line = b""
    try:
        while not line.endswith(b"\n"):
            chunk = os.read(0, 256)
            if not chunk:
                break
            line += chunk
    except OSError:
        pass
    words = line.decode(errors="replace").split()
    if len(words) == 4 and words[0] == "sandbox" and words[2] == "disk" and words[3].isdigit():
        from hutch.fuse._quota import DiskBudget

        fs.provenance.learn(f"sandbox:{words[1]}", DiskBudget(int(words[3]), str(fs.mem.root)))
        return
    subprocess.run(["fusermount3", "-u", "-z", str(mountpoint)], capture_output=True)


def mount(store: str | os.PathLike, mountpoint: str | os.PathLike, *, writable: bool = True,
          source: str | None = None, handover: bool = False, log_path: str | None = None,
          cache_seconds: float = CACHE_SECONDS) -> subprocess.Popen:
    """Start a serving process for `store` at `mountpoint`; returns it once the mount is live.

    The process runs in its own session, so it outlives the caller (unless
    `handover`: then it needs the caller to say which sandbox it serves).
    """
    from hutch.memory import Memory

    mountpoint = Path(os.path.abspath(mountpoint))
    _check_fuse()
    _check_mountpoint(mountpoint)
    Memory(store, create=False)  # fail here, with the store's own message, not in the child
    r, w = os.pipe2(os.O_CLOEXEC)
    argv = [sys.executable, "-m", "hutch.fuse._mount", os.fspath(os.path.abspath(store)), str(mountpoint),
            "--ready-fd", str(w)]
    if not writable:
        argv.append("--read-only")
    if source:
        argv += ["--source", source]
    if handover:
        argv.append("--handover")
    if cache_seconds != CACHE_SECONDS:
        argv += ["--cache-seconds", str(float(cache_seconds))]
    err = open(log_path, "ab") if log_path else subprocess.DEVNULL
    try:
        proc = subprocess.Popen(argv, stdin=subprocess.PIPE if handover else subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=err, pass_fds=[w], start_new_session=True,
                                close_fds=True)
    finally:
        os.close(w)
        if log_path:
            err.close()
    got = b""
    try:
        deadline = time.monotonic() + MOUNT_TIMEOUT
        while not got.endswith(b"\n") and time.monotonic() < deadline:
            ready, _, _ = select.select([r], [], [], max(0.0, deadline - time.monotonic()))
            chunk = os.read(r, 4096) if ready else b""
            if not chunk:
                break
            got += chunk
    finally:
        os.close(r)
    if got != _READY:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        why = got.decode(errors="replace").strip().removeprefix("error: ")
        raise MemoryStoreError(
            f"Mounting {store} at {mountpoint} failed: "
            + (why or f"the serving process exited with {proc.returncode} and said nothing")
            + ("" if why.endswith(".") else "."))
    return proc


def umount(mountpoint: str | os.PathLike, *, lazy: bool = False, timeout: float = 5.0) -> None:
    """Unmount a view; the serving process then exits by itself. `lazy` detaches a busy mount."""
    mp = os.path.abspath(mountpoint)
    if not os.path.ismount(mp):
        raise ConfigError(f"{mp} is not a mount point: nothing to unmount (`mount | grep hutch` lists the views).")
    argv = ["fusermount3", "-u"] + (["-z"] if lazy else []) + [mp]
    p = subprocess.run(argv, capture_output=True, text=True)
    if p.returncode != 0:
        busy = "busy" in p.stderr.lower()
        raise MemoryStoreError(
            f"Unmounting {mp} failed: {p.stderr.strip() or 'fusermount3 exit ' + str(p.returncode)}."
            + (" A process still uses it: close it, or pass --lazy to detach now." if busy else ""))
    deadline = time.monotonic() + timeout
    while os.path.ismount(mp) and time.monotonic() < deadline:
        time.sleep(0.01)


def detach(mountpoint: str | os.PathLike) -> None:
    """Lazily detach a mount from this mount namespace (what stays bound elsewhere keeps working)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.umount2(os.fsencode(os.fspath(mountpoint)), 2) != 0:  # MNT_DETACH
        e = ctypes.get_errno()
        if e not in (errno.EINVAL, errno.ENOENT):
            raise OSError(e, f"umount2 {mountpoint}: {os.strerror(e)}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hutch.fuse._mount", description="Serve a memory store's FUSE view.")
    ap.add_argument("store")
    ap.add_argument("mountpoint")
    ap.add_argument("--read-only", action="store_true")
    ap.add_argument("--source")
    ap.add_argument("--ready-fd", type=int)
    ap.add_argument("--handover", action="store_true")
    ap.add_argument("--debug", action="store_true")
    ap.add_argument("--cache-seconds", type=float, default=CACHE_SECONDS)
    a = ap.parse_args(argv)
    try:
        serve(a.store, a.mountpoint, writable=not a.read_only, source=a.source, ready_fd=a.ready_fd,
              handover=a.handover, debug=a.debug, cache_seconds=a.cache_seconds)
    except (Error, RuntimeError) as e:
        msg = str(e) if isinstance(e, Error) else (
            f"libfuse could not mount at {a.mountpoint} ({e}); check it is an empty directory and not a mount")
        if a.ready_fd is not None:
            try:
                os.write(a.ready_fd, f"error: {msg}\n".encode())
            except OSError:
                pass
        print(f"hutch: error: {msg}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
