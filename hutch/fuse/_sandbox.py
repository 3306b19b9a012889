"""`hutch.MemoryMount`: a memory store's FUSE view inside a sandbox.

    sb = hutch.Sandbox.create(mounts=[hutch.MemoryMount(mem, "/memory", writable=True)])
    sb.run("sh", "-c", "ls '/memory/search/customer churn/' && echo note >> /memory/topics/churn.md")
    mem.history("topics/churn")[0].source        # 'sandbox:<sb.id>'

How (the sandbox wing knows nothing of memory; see hutch/sandbox/_provided.py):

1. before the sandbox starts, a view server is mounted on a private host
   directory, one per sandbox, so that its provenance can name the sandbox;
2. the sandbox binds that directory at the target (read-only bind for a
   read-only mount, and the view itself refuses writes with EROFS, so even
   root inside cannot write);
3. once the sandbox runs, the server is moved into the sandbox's cgroups (so
   what it does for the sandbox, searching and indexing included, counts
   against the sandbox's memory, pids and cpu limits: a blow-up OOM-kills the
   view inside the sandbox's budget, not the host), then learns the sandbox id
   (every commit it makes then carries `Hutch-Source: sandbox:<id>`) and its
   disk limit (what it adds to the store counts against it, _quota.py), and
   the host's own mount is detached: the sandbox's mount namespace holds the
   only reference, so when the sandbox ends the kernel drops the mount, the
   FUSE connection ends, and the server exits (or the daemon kills it with
   what is left in the sandbox's cgroups). Nothing is left, whoever ends the
   sandbox.
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
import threading
from dataclasses import dataclass

from hutch._core.errors import ConfigError, SandboxError

CGROUP_ROOT = "/sys/fs/cgroup"


@dataclass(frozen=True)
class MemoryMount:
    """A memory store mounted into a sandbox at `target` (read-only unless `writable=True`).

    Pass it in `hutch.Sandbox.create(mounts=[MemoryMount(...)])`, beside any Mount.
    Inside, `ls '/memory/search/<query>/'` lists the hits best first, `cat` reads them,
    and (when writable) each file written becomes a commit whose source is `sandbox:<id>`.
    """

    store: str
    target: str = "/memory"
    writable: bool = False

    def __init__(self, mem, target: str = "/memory", *, writable: bool = False):
        root = getattr(mem, "root", mem)
        if not isinstance(root, (str, os.PathLike)):
            raise ConfigError(f"MemoryMount needs a hutch.Memory or a store path, not {mem!r}.")
        root = os.path.abspath(os.fspath(root))
        if not os.path.isdir(os.path.join(root, ".git")):
            raise ConfigError(f"{root} is not a memory store: create it with hutch.Memory({root!r}) first.")
        if not isinstance(target, str) or not target.startswith("/") or ".." in target.split("/"):
            raise ConfigError(f"MemoryMount target {target!r} must be an absolute path inside the sandbox, like '/memory'.")
        object.__setattr__(self, "store", root)
        object.__setattr__(self, "target", target.rstrip("/") or "/")
        object.__setattr__(self, "writable", bool(writable))

    def prepare_mount(self) -> "_Lease":
        """Mount a view for one sandbox on a private host directory (called by Sandbox.create)."""
        from hutch.fuse._mount import mount
        from hutch._core import settings
        from hutch.sandbox._spec import Mount

        if settings.URL.is_set():
            raise ConfigError(
                f"A memory mount needs the sandbox daemon on this host, but ${settings.URL.name} points at a remote one: "
                "unset it, or copy the store to that host and mount it there.")
        mp = tempfile.mkdtemp(prefix="hutch-memory-")
        try:
            proc = mount(self.store, mp, writable=self.writable, handover=True)
        except BaseException:
            os.rmdir(mp)
            raise
        return _Lease(Mount.bind(mp, self.target, readonly=not self.writable), proc, mp)


class _Lease:
    def __init__(self, mount, proc, mountpoint: str):
        self.mount = mount
        self.proc = proc
        self.mountpoint = mountpoint

    def started(self, run) -> None:
        """`run`: hutch.sandbox._provided.Started (the sandbox's id, cgroups and disk limit)."""
        from hutch.fuse._mount import detach

        try:
            join_cgroups(self.proc.pid, run.cgroups, run.id)
            self.proc.stdin.write(f"sandbox {run.id} disk {int(run.disk)}\n".encode())
            self.proc.stdin.close()
        except OSError as e:
            self.abort()
            raise SandboxError(f"the memory view for sandbox {run.id} died before it started ({e}); "
                               "create the sandbox again.") from None
        except BaseException:
            self.abort()
            raise
        detach(self.mountpoint)  # from now on only the sandbox holds the mount: it ends with the sandbox
        _rmdir(self.mountpoint)
        threading.Thread(target=self.proc.wait, name="hutch-memory-view-reaper", daemon=True).start()

    def abort(self) -> None:
        from hutch.fuse._mount import detach

        try:
            self.proc.stdin.close()  # the server unmounts on EOF before its handover
        except OSError:
            pass
        detach(self.mountpoint)
        try:
            self.proc.wait(5)
        except Exception:
            self.proc.kill()
            self.proc.wait()
        _rmdir(self.mountpoint)


def join_cgroups(pid: int, cgroups, sandbox_id: str) -> None:
    """Move process `pid` (all its threads) into the sandbox's cgroups: from here on its memory, threads and
    CPU count against the sandbox's limits. SandboxError if there are none or it cannot: a view that the
    sandbox could make use the host's memory without bound is not served."""
    if not cgroups:
        raise SandboxError(
            f"the daemon did not report the cgroups of sandbox {sandbox_id}, so its memory view could not be "
            "charged to it: upgrade the daemon (hutch serve) to this version of hutch.")
    for d in cgroups:
        real = os.path.realpath(d)
        if not real.startswith(CGROUP_ROOT + "/") or not os.path.isfile(os.path.join(real, "cgroup.procs")):
            raise SandboxError(f"the daemon reported {d!r} as a cgroup of sandbox {sandbox_id}; it is not one "
                               f"under {CGROUP_ROOT}: check the daemon's cgroup setup (docs/architecture.md).")
        try:
            with open(os.path.join(real, "cgroup.procs"), "w") as f:
                f.write(str(pid))
        except OSError as e:
            if e.errno == errno.ESRCH:
                raise SandboxError(f"the memory view for sandbox {sandbox_id} died before it started; "
                                   "create the sandbox again.") from None
            raise SandboxError(
                f"the memory view could not join sandbox {sandbox_id}'s cgroup {real} ({e.strerror}): a memory "
                "mount is served by a process of its creator, which must be root (as the daemon is).") from None


def _rmdir(path: str) -> None:
    try:
        os.rmdir(path)
    except OSError:
        shutil.rmtree(path, ignore_errors=True) if not os.path.ismount(path) else None
