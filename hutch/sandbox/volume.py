"""`hutch.Volume`: a named directory that outlives sandboxes and is shared by those that mount it.

    vol = hutch.Volume.from_name("datasets", create=True)
    vol.write("/train.csv", b"a,b\\n1,2\\n")
    sb = hutch.Sandbox.create(mounts=[hutch.Mount.volume(vol, "/data")])              # read-write
    ro = hutch.Sandbox.create(mounts=[hutch.Mount.volume(vol, "/data", readonly=True)])  # EROFS, even as root

Concurrent writers: a volume is one plain directory shared by every sandbox that
mounts it, with no locking across sandboxes. The last writer of a file wins; a
rename is atomic (readers see the old or the new file, never half of one), so
write a temp file and rename it, as `Volume.write` does. Appends to one file from
several sandboxes interleave. See docs/images.md.
"""

from __future__ import annotations

from dataclasses import dataclass

from hutch._core.errors import InvalidSpecError
from hutch.sandbox import _client
from hutch.sandbox._files import FileInfo, file_data, file_mode
from hutch.sandbox._spec import check_volume_name


def _path(path: str) -> str:
    if not isinstance(path, str) or not path or "\0" in path:
        raise InvalidSpecError(f"path={path!r} must be a path inside the volume, like '/data.csv'.")
    return path


@dataclass(frozen=True)
class Volume:
    """A named volume on the daemon's host. Get one with `Volume.from_name(name, create=True)`."""

    name: str

    @classmethod
    def from_name(cls, name: str, *, create: bool = False) -> "Volume":
        """The volume `name`; with `create=True` it is made if missing (else NotFoundError)."""
        check_volume_name(name)
        d = _client.default_client().json("POST", "/v1/volumes", json={"name": name, "create": bool(create)})
        return cls(d["name"])

    @staticmethod
    def list_all() -> "list[dict]":
        """Every volume on the host: name, created_at, in_use (ids of running sandboxes that mount it)."""
        return _client.default_client().json("GET", "/v1/volumes")["volumes"]

    @staticmethod
    def delete(name: str, *, force: bool = False) -> None:
        """Remove a volume and its files. Refused while a running sandbox mounts it, unless `force`."""
        check_volume_name(name)
        _client.default_client().request("DELETE", f"/v1/volumes/{name}", params={"force": int(bool(force))})

    @property
    def _base(self) -> str:
        return f"/v1/volumes/{self.name}/files"

    def list(self, path: str = "/") -> "list[FileInfo]":
        """The entries of the directory at `path` in the volume."""
        d = _client.default_client().json("GET", f"{self._base}/list", params={"path": _path(path)})
        return [FileInfo.from_dict(e) for e in d["entries"]]

    def read(self, path: str) -> bytes:
        """The bytes of the file at `path` in the volume."""
        return _client.default_client().request("GET", f"{self._base}/read", params={"path": _path(path)}).content

    def write(self, path: str, data: "bytes | str", *, mode: int = 0o644) -> None:
        """Create or replace a file (parents made as needed): a temp file renamed into place."""
        _client.default_client().request("PUT", f"{self._base}/write", params={"path": _path(path), "mode": file_mode(mode)},
                                         content=file_data(data))

    def remove(self, path: str, *, recursive: bool = False) -> None:
        """Remove a file or empty directory; `recursive=True` removes a whole tree."""
        _client.default_client().request("POST", f"{self._base}/remove",
                                         params={"path": _path(path), "recursive": int(bool(recursive))})

    def __str__(self) -> str:
        return self.name
