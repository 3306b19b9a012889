"""Mounts that another part of hutch provides (a memory store's view): the sandbox wing's side of the seam.

The sandbox wing knows nothing of memory. A value passed in `mounts=` that is
not a `Mount` but has a `prepare_mount()` method is a provider (`memory=` is
only ever the RAM limit): before the sandbox starts, its
`prepare_mount()` returns a lease whose `.mount` is a plain `Mount` (a bind of
a host path); once the sandbox runs, `lease.started(Started(...))` is called;
if creating the sandbox fails, or `started` raises, `lease.abort()` (and the
sandbox is ended). `hutch.MemoryMount` (hutch/fuse) is one.

What a provider does on the host for its sandbox is charged to that sandbox:
`Started` names the sandbox's cgroups (a process serving the mount moves into
them, so its memory, processes and CPU count against the sandbox's limits) and
its disk limit (what it adds to the host's disk for the sandbox counts against it).
"""

from __future__ import annotations

from dataclasses import dataclass

from hutch._core.errors import InvalidSpecError
from hutch.sandbox._spec import Mount


@dataclass(frozen=True)
class Started:
    """What a provider's lease is told once its sandbox runs.

    `cgroups`: the sandbox's cgroup directories on this host (memory, pids and cpu on cgroup v1; one on
    v2), as the daemon reports them; empty if it did not. `disk`: the sandbox's `disk=` limit in bytes.
    """

    id: str
    cgroups: tuple[str, ...]
    disk: int


#: Mount kinds of a sandbox file that another part provides: kind -> (module, class). The one place the sandbox
#: wing names them, by string, so that it imports none of them until a file asks for one.
PROVIDER_KINDS = {"memory": ("hutch.fuse._sandbox", "MemoryMount")}


def provider(kind: str):
    """The class a sandbox file's mount of `kind` is made with (called as cls(store, target, writable=...))."""
    import importlib

    module, name = PROVIDER_KINDS[kind]
    return getattr(importlib.import_module(module), name)


def kind_of(value) -> str:
    """The sandbox-file kind of a provided mount (the inverse of `provider`)."""
    for kind, (module, name) in PROVIDER_KINDS.items():
        if type(value).__module__ == module and type(value).__name__ == name:
            return kind
    raise InvalidSpecError(f"{value!r} is no mount kind a sandbox file can write.")


def _is_provider(value) -> bool:
    return not isinstance(value, Mount) and callable(getattr(value, "prepare_mount", None))


class Provided:
    """The leases of one create() call; a context manager that aborts them if the block raises."""

    def __init__(self, leases):
        self.leases = list(leases)

    def started(self, sandbox_id: str, *, cgroups=(), disk: int) -> None:
        """Tell every lease its sandbox runs; if one fails, every lease is aborted and the error raised."""
        run = Started(sandbox_id, tuple(str(c) for c in cgroups or ()), int(disk))
        try:
            for lease in self.leases:
                lease.started(run)
        except BaseException:
            self.abort()
            raise

    def abort(self) -> None:
        for lease in self.leases:
            try:
                lease.abort()
            except Exception:
                pass

    def __enter__(self) -> "Provided":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()


def prepare(memory, mounts) -> tuple[tuple, Provided]:
    """(mounts with every provider replaced by its Mount, the leases); `memory` is only checked not to be a
    provider, as it was once taken for one."""
    if _is_provider(memory):
        raise InvalidSpecError(
            f"memory={memory!r}: memory= is the sandbox's RAM limit (a size like '512M'); a memory store's mount "
            "goes in mounts=, e.g. hutch.Sandbox.create(mounts=[hutch.MemoryMount(mem, '/memory')]).")
    out, leases = [], []
    try:
        for m in mounts or ():
            if _is_provider(m):
                lease = m.prepare_mount()
                leases.append(lease)
                out.append(lease.mount)
            else:
                out.append(m)
    except BaseException:
        Provided(leases).abort()
        raise
    return tuple(out), Provided(leases)
