"""A sandbox's run plan: what its init needs to build its root, decided once by the daemon.

`build_plan(spec, image)` checks and turns a spec and its resolved image into a `Plan`, a frozen value;
each later decision (the sandbox's hostname and user namespace, its writable layer, how each bind is
idmapped, which descriptor carries which tree) is a copy made with `dataclasses.replace`. The init, which
imports only the standard library, gets `plan.to_wire()`: the plain dict of these fields, over JSON.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Literal, Union

from hutch._core.errors import InvalidSpecError
from hutch.sandbox._host.native.idmap import SANDBOX_HOST_IDS, ID_COUNT, VOLUME_ID_BASE

#: Capability numbers (linux/capability.h) of the names SandboxSpec.capabilities may hold.
CAPABILITIES = {"CHOWN": 0, "DAC_OVERRIDE": 1, "FOWNER": 3, "FSETID": 4, "KILL": 5, "SETGID": 6, "SETUID": 7,
                "NET_BIND_SERVICE": 10}
SHM_SIZE = 64 * 1024**2
MAX_ID = 4294967294   # (uid_t)-1 means "no id"

#: How a bind is idmapped: "sandbox" (through the sandbox's own user namespace), (uid_map, gid_map) of a
#: helper user namespace, or None (attached plain).
IdMap = Union[Literal["sandbox"], "tuple[str, str]", None]


@dataclass(frozen=True)
class PlannedMount:
    kind: Literal["bind", "tmpfs"]
    target: str
    source: str | None = None              # a bind's host path (a volume's directory for a volume)
    readonly: bool = False
    size: int | None = None                # a tmpfs's bytes
    owner: tuple[int, int] | None = None   # Mount.bind(owner=): the host ids root's writes land as
    volume: bool = False
    map: IdMap = None                      # set by with_bind_maps
    tree: int | None = None                # its detached mount's index among the fds sent with the plan


@dataclass(frozen=True)
class Plan:
    scratch: str                           # the daemon's scratch directory (the init's, without a user namespace)
    disk: int                              # bytes of the writable layer
    shm: int                               # bytes of /dev/shm
    lowerdirs: tuple[str, ...]             # the image's layers, top first
    mounts: tuple[PlannedMount, ...]
    workdir: str
    caps: tuple[int, ...]                  # capabilities the init keeps (image build steps only)
    hostname: str = ""                     # set once the sandbox has its id
    userns: bool = False                   # whether the init runs in a user namespace of its own
    layer: str | None = None               # its subvolume in the zygote's store (None: a tmpfs of `disk` bytes)
    lower_trees: tuple[int, ...] | None = None   # the image's layers as idmapped trees: fd indexes

    def to_wire(self) -> dict:
        """What the init reads (native/init.py _setup_root): these fields as a plain dict."""
        return dataclasses.asdict(self)


def build_plan(spec, image, *, scratch: str) -> Plan:
    """Spec + resolved image -> the plan of its root (pure apart from path checks on this host)."""
    lowerdirs = tuple(str(p) for p in image.lowerdirs)
    for d in lowerdirs:
        if any(c in d for c in ":,\\\n") or not os.path.isdir(d):
            raise InvalidSpecError(f"image layer {d!r} is not a usable directory (no ':' ',' or '\\' in its path).")
    mounts = []
    for m in spec.mounts:
        if m.kind == "bind":
            if not os.path.exists(m.source):
                raise InvalidSpecError(
                    f"bind mount source {m.source!r} does not exist on the host; create it or fix the path.")
            owner = m.owner
            if owner is not None and any(i in SANDBOX_HOST_IDS for i in owner):
                raise InvalidSpecError(f"Mount.bind owner={tuple(owner)} lies in the host ids hutch gives sandboxes "
                                       f"({SANDBOX_HOST_IDS.start}..{SANDBOX_HOST_IDS.stop - 1}); give a host user's uid.")
            mounts.append(PlannedMount("bind", m.target, m.source, m.readonly,
                                       owner=tuple(owner) if owner is not None else None))
        elif m.kind == "tmpfs":
            mounts.append(PlannedMount("tmpfs", m.target, size=m.size))
        elif m.kind == "volume":   # a named volume is a bind of its directory (NotFoundError names the fix)
            from hutch.sandbox._host.volumes import data_dir

            mounts.append(PlannedMount("bind", m.target, str(data_dir(m.source)), m.readonly, volume=True))
        else:
            raise InvalidSpecError(f"mount kind {m.kind!r} is not supported by the native runtime yet; "
                                   "use Mount.bind or Mount.tmpfs.")
    return Plan(scratch=scratch, disk=spec.limits.disk, shm=min(SHM_SIZE, spec.limits.memory), lowerdirs=lowerdirs,
                mounts=tuple(mounts), workdir=spec.workdir, caps=tuple(CAPABILITIES[c] for c in spec.capabilities))


def swap_map(a: int, b: int, n: int) -> str:
    """uid_map lines that swap host ids a.. and b.. (n each, apart) and map every other id to itself.

    Through an idmapped mount with this map, a file owned by a+k on disk belongs to b+k and b+k's writes
    land as a+k, while every other owner stays valid (a write to a file of an unmapped owner is refused
    whatever its mode) and keeps its id."""
    if a == b:
        return f"0 0 {MAX_ID + 1}\n"
    lo, hi = sorted((a, b))
    lines = [(0, 0, lo), (lo, hi, n), (lo + n, lo + n, hi - lo - n), (hi, lo, n), (hi + n, hi + n, MAX_ID + 1 - hi - n)]
    return "".join(f"{x} {y} {c}\n" for x, y, c in lines if c > 0)


def bind_map(m: PlannedMount, root: int, userns: bool, write_base: int = 0) -> IdMap:
    """The id mapping of bind `m` for a sandbox whose root is host id `root`.

    What root inside writes through a bind never lands as host root unless the operator asked for it:
    - read-only binds: through the sandbox's own user namespace ("sandbox": host root's files are root's
      inside); plain without one;
    - writable binds: plain with a user namespace, so writes land as the sandbox's own host ids and host
      files keep their owners (strangers to the sandbox: writable only where their mode lets others write);
      without one, through a swap of the ids 0.. with `write_base`.. (a host id range taken for the
      sandbox), to the same effect;
    - with `owner` (uid, gid): host `owner` and root inside swap: root's writes land as `owner`, and the
      files `owner` has are root's;
    - volumes: the ids of root inside.. swap with VOLUME_ID_BASE.., one range for every sandbox.
    A map other than "sandbox" is a pair of uid_map / gid_map texts for a helper user namespace (Zygote.userns).
    """
    if m.volume:
        return (swap_map(VOLUME_ID_BASE, root, ID_COUNT),) * 2
    if m.readonly:
        return "sandbox" if userns else None
    if m.owner:
        uid, gid = m.owner
        return (swap_map(uid, root, 1), swap_map(gid, root, 1))
    if userns:
        return None
    return (swap_map(write_base, 0, ID_COUNT),) * 2


def with_bind_maps(plan: Plan, root: int, userns: bool, write_base: int = 0) -> Plan:
    """`plan` with the id mapping of each bind decided (bind_map)."""
    return dataclasses.replace(plan, mounts=tuple(
        dataclasses.replace(m, map=bind_map(m, root, userns, write_base)) if m.kind == "bind" else m
        for m in plan.mounts))


def needs_write_range(plan: Plan) -> bool:
    """Whether a sandbox without a user namespace needs a host id range for its writable binds."""
    return any(m.kind == "bind" and not m.readonly and not m.volume and not m.owner for m in plan.mounts)


__all__ = ["CAPABILITIES", "MAX_ID", "Plan", "PlannedMount", "bind_map", "build_plan", "needs_write_range",
           "swap_map", "with_bind_maps"]
