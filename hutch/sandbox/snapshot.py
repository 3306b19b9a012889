"""`hutch.Snapshot`: a memory snapshot of a gVisor sandbox (processes, memory and filesystem), kept by the host.

    sb = hutch.Sandbox.create(runtime="gvisor")
    snap = sb.snapshot_memory()          # sb runs on
    sb2 = hutch.Sandbox.restore(snap)    # a new sandbox carrying on where sb was
    kids = sb.fork(4)                    # four running copies, each with its own filesystem and identity
    snap.export("s.tar"); hutch.Snapshot.import_("s.tar")   # to another host (same runsc build and base image)

A snapshot lives in the daemon's state directory until `delete()`; its filesystem is an image
(`snap.image`), kept while the snapshot is.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from hutch._core.errors import ConfigError, NotFoundError
from hutch.sandbox import _client


@dataclass(frozen=True)
class Snapshot:
    """A memory snapshot on the host: `id` (32 hex digits), the sandbox it was taken of (`source`), when,
    its memory image's size in bytes, and the image holding its filesystem."""

    id: str
    source: str = ""
    created_at: float = 0.0
    memory_bytes: int = 0
    image: str = ""

    @classmethod
    def from_json(cls, d: dict) -> "Snapshot":
        return cls(id=d["id"], source=d.get("source") or "", created_at=float(d.get("created_at") or 0),
                   memory_bytes=int(d.get("memory_bytes") or 0), image=d.get("image") or "")

    @classmethod
    def of(cls, value: "Snapshot | str") -> "Snapshot":
        if isinstance(value, Snapshot):
            return value
        if isinstance(value, str) and value:
            return cls(id=value)
        raise ConfigError(f"{value!r} is not a memory snapshot; pass what Sandbox.snapshot_memory() returned, or its id.")

    @classmethod
    def from_id(cls, snapshot_id: str) -> "Snapshot":
        """The snapshot of that id on this host (NotFoundError if none)."""
        return cls.from_json(_client.default_client().json("GET", f"/v1/memory-snapshots/{snapshot_id}"))

    @classmethod
    def list(cls) -> "list[Snapshot]":
        """Every memory snapshot on this host."""
        d = _client.default_client().json("GET", "/v1/memory-snapshots")
        return [cls.from_json(s) for s in d["snapshots"]]

    def export(self, path: "str | os.PathLike") -> None:
        """Write this snapshot (memory image, filesystem, metadata) to `path` as a tar, for `Snapshot.import_`
        on another host. That host needs the same runsc build, the same base image build and busybox; its
        import refuses anything else. Credentials are never in it (a restore there is given none)."""
        _client.default_client().download(f"/v1/memory-snapshots/{self.id}/export", path)

    @classmethod
    def import_(cls, path: "str | os.PathLike", *, base: "str | None" = None) -> "Snapshot":
        """Import an archive written by `Snapshot.export` (on this or another host); returns the new snapshot
        (its own id). Refused, with nothing kept, unless every part checks out: sizes, sha256s, the image's
        layer digests, and this host's runsc build, flags, busybox and base image equal the archive's. A
        filesystem on a directory base is refused unless `base` names it (an Image or "dir:/path"), as for
        `Image.import_`."""
        from hutch.sandbox.image import Image

        src = Path(path)
        if not src.is_file():
            raise NotFoundError(f"{src} is not a file; give the path of an archive made by Snapshot.export().")
        params = {"base": Image.of(base).ref} if base is not None else None
        with open(src, "rb") as f:
            return cls.from_json(_client.default_client().json("POST", "/v1/memory-snapshots/import", content=f,
                                                               params=params))

    def delete(self) -> None:
        """Remove the snapshot's memory image from the host (sandboxes restored from it run on)."""
        _client.default_client().request("DELETE", f"/v1/memory-snapshots/{self.id}")


__all__ = ["Snapshot"]
