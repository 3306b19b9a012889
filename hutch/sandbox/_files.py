"""`sb.files`: read and write files inside a sandbox.

Paths are absolute paths inside the sandbox; the daemon resolves them within
the sandbox's root, so neither `..` nor a symlink reaches the host.
"""

from __future__ import annotations

from dataclasses import dataclass

from hutch._core.errors import InvalidSpecError
from hutch.sandbox._api import check_path


@dataclass(frozen=True)
class FileInfo:
    """One entry of `files.list()` / the answer of `files.stat()`."""

    name: str
    path: str
    type: str        # "file", "dir", "symlink" or "other"
    size: int
    mode: int
    mtime: float
    uid: int = 0     # the owner, as the sandbox sees it (its root 0, its user 1000)
    gid: int = 0

    @classmethod
    def from_dict(cls, d: dict) -> "FileInfo":
        return cls(str(d["name"]), str(d["path"]), str(d["type"]), int(d.get("size") or 0),
                   int(d.get("mode") or 0), float(d.get("mtime") or 0.0), int(d.get("uid") or 0),
                   int(d.get("gid") or 0))


def file_data(data) -> bytes:
    if isinstance(data, str):
        return data.encode()
    if isinstance(data, (bytes, bytearray, memoryview)):
        return bytes(data)
    raise InvalidSpecError(f"files.write data must be bytes or str, not {type(data).__name__}.")


def file_mode(mode) -> str:
    if isinstance(mode, bool) or not isinstance(mode, int) or not 0 <= mode <= 0o7777:
        raise InvalidSpecError(f"mode={mode!r} must be a permission number like 0o644.")
    return format(mode, "04o")


class Files:
    """The files of one sandbox (`sb.files`)."""

    def __init__(self, client, sandbox_id: str) -> None:
        self._c = client
        self._base = f"/v1/sandboxes/{sandbox_id}/files"

    def read(self, path: str) -> bytes:
        """The bytes of the file at `path`."""
        return self._c.request("GET", f"{self._base}/read", params={"path": check_path(path)}).content

    def write(self, path: str, data: bytes | str, *, mode: int = 0o644) -> None:
        """Create or replace the file at `path` with `data` (str is written as UTF-8)."""
        self._c.request("PUT", f"{self._base}/write", params={"path": check_path(path), "mode": file_mode(mode)},
                        content=file_data(data))

    def list(self, path: str = "/home/user") -> list[FileInfo]:
        """The entries of the directory at `path`."""
        d = self._c.json("GET", f"{self._base}/list", params={"path": check_path(path)})
        return [FileInfo.from_dict(e) for e in d["entries"]]

    def stat(self, path: str) -> FileInfo:
        """What is at `path` (a symlink itself, not its target)."""
        return FileInfo.from_dict(self._c.json("GET", f"{self._base}/stat", params={"path": check_path(path)}))

    def remove(self, path: str, *, recursive: bool = False) -> None:
        """Remove the file or empty directory at `path`; `recursive=True` removes a whole tree."""
        self._c.request("POST", f"{self._base}/remove", params={"path": check_path(path), "recursive": int(bool(recursive))})

    def mkdir(self, path: str, *, parents: bool = False) -> None:
        """Make the directory `path`; `parents=True` makes missing parents and accepts an existing directory."""
        self._c.request("POST", f"{self._base}/mkdir", params={"path": check_path(path), "parents": int(bool(parents))})


class AsyncFiles:
    """The files of one AsyncSandbox (`sb.files`), awaitable."""

    def __init__(self, client, sandbox_id: str) -> None:
        self._c = client
        self._base = f"/v1/sandboxes/{sandbox_id}/files"

    async def read(self, path: str) -> bytes:
        """The bytes of the file at `path`."""
        return (await self._c.request("GET", f"{self._base}/read", params={"path": check_path(path)})).content

    async def write(self, path: str, data: bytes | str, *, mode: int = 0o644) -> None:
        """Create or replace the file at `path` with `data` (str is written as UTF-8)."""
        await self._c.request("PUT", f"{self._base}/write", params={"path": check_path(path), "mode": file_mode(mode)},
                              content=file_data(data))

    async def list(self, path: str = "/home/user") -> list[FileInfo]:
        """The entries of the directory at `path`."""
        d = await self._c.json("GET", f"{self._base}/list", params={"path": check_path(path)})
        return [FileInfo.from_dict(e) for e in d["entries"]]

    async def stat(self, path: str) -> FileInfo:
        """What is at `path` (a symlink itself, not its target)."""
        return FileInfo.from_dict(await self._c.json("GET", f"{self._base}/stat", params={"path": check_path(path)}))

    async def remove(self, path: str, *, recursive: bool = False) -> None:
        """Remove the file or empty directory at `path`; `recursive=True` removes a whole tree."""
        await self._c.request("POST", f"{self._base}/remove",
                              params={"path": check_path(path), "recursive": int(bool(recursive))})

    async def mkdir(self, path: str, *, parents: bool = False) -> None:
        """Make the directory `path`; `parents=True` makes missing parents and accepts an existing directory."""
        await self._c.request("POST", f"{self._base}/mkdir",
                              params={"path": check_path(path), "parents": int(bool(parents))})
