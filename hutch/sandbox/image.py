"""`hutch.Image`: which root filesystem a sandbox starts from.

An Image is a frozen value that resolves to an image reference string (see
hutch/sandbox/_images.py); the daemon builds or finds the layers behind it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from hutch._core.errors import InvalidSpecError, NotFoundError
from hutch.sandbox._spec import DEFAULT_IMAGE


@dataclass(frozen=True)
class Image:
    """A sandbox image. Build with `Image.debian_slim()` or `Image.from_directory(path)`."""

    ref: str

    @classmethod
    def debian_slim(cls) -> "Image":
        """The default image: a minimal Debian 12 with python3, built once on first use and cached."""
        return cls(DEFAULT_IMAGE)

    @classmethod
    def from_directory(cls, path: str | os.PathLike) -> "Image":
        """A prepared root directory on the host, used read-only as the sandbox's lower layer.

        It must hold what the commands need (a shell or busybox, their libraries); the
        sandbox's writes go to a throw-away layer above it and never reach `path`.
        """
        if not isinstance(path, (str, os.PathLike)):
            raise InvalidSpecError(f"Image.from_directory path={path!r} must be a host directory path.")
        root = os.path.abspath(os.fspath(path))
        if not os.path.isdir(root):
            raise NotFoundError(
                f"Image.from_directory: {root} is not a directory; give the path of a prepared root filesystem."
            )
        return cls(f"dir:{root}")

    @classmethod
    def of(cls, value: "Image | str | None") -> "Image":
        """An Image from an Image, a reference string, or None (the default image)."""
        if value is None:
            return cls.debian_slim()
        if isinstance(value, Image):
            return value
        if isinstance(value, str) and value:
            return cls(value)
        raise InvalidSpecError(
            f"image={value!r} is not an image; use hutch.Image.debian_slim() or hutch.Image.from_directory(path)."
        )

    def __str__(self) -> str:
        return self.ref
