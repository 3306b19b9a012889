"""Where a store keeps what (docs/smf-format.md, "Layout"): entity files, link directories, ids from paths.

Path logic over the store's root, the listing of its tree (which classes and entity files there are), and
the lstat checks that give a clear error early when a class or link directory is a symbolic link. The
guarantee that no write follows a link is the write path's (_tx.py, which opens every directory by fd
with O_NOFOLLOW); these checks only make the error readable.
"""

from __future__ import annotations

import os
from pathlib import Path

from hutch._core.errors import StorePathError
from hutch.memory import _format as fmt


class Layout:
    """The paths of one store (`root`, absolute)."""

    def __init__(self, root: Path):
        self.root = root

    def entity(self, entity_id: str) -> tuple[str, str, Path]:
        """(class, slug, file path) of `entity_id`, validated."""
        cls, slug = fmt.split_id(entity_id)
        return cls, slug, self.class_dir(cls) / f"{slug}.md"

    def class_dir(self, cls: str) -> Path:
        """The directory of class `cls`; StorePathError if it is a symbolic link."""
        cdir = self.root / cls
        if cdir.is_symlink():
            raise StorePathError(
                f"{cdir} is a symbolic link: an entity class must be a real directory inside the store "
                "(a link could lead outside it). Replace the link with a directory."
            )
        return cdir

    def links_dir(self, cls: str, slug: str) -> Path:
        """`<class>/<slug>.links`, where the entity's outgoing relations live."""
        return self.root / cls / f"{slug}{fmt.LINKS_SUFFIX}"

    def check_link_dirs(self, rdir: Path) -> None:
        """Refuse to write links through a `.links` or relation directory that is a symbolic link: the
        link (and the directories made for it) would land wherever that link points, outside the store."""
        for d in (rdir.parent, rdir):
            if d.is_symlink():
                raise StorePathError(
                    f"{d} is a symbolic link: links live in real directories inside the store (a link there "
                    f"could lead outside it). Remove it (rm {d}) and link again.")

    def resolve(self, path: str | os.PathLike) -> str:
        """The entity id for a file path inside the store; StorePathError if it escapes the store."""
        p = Path(os.path.abspath(os.path.join(self.root, os.fspath(path))))
        try:
            rel = p.relative_to(self.root)
        except ValueError:
            raise StorePathError(
                f"{path} is outside the store {self.root}: give a path inside it, such as 'actors/alice-chen.md'."
            ) from None
        parts = rel.parts
        if len(parts) != 2 or not parts[1].endswith(".md"):
            raise StorePathError(
                f"{path} is not an entity file: entities are '<class>/<slug>.md' directly under the store."
            )
        entity_id = f"{parts[0]}/{parts[1][:-3]}"
        fmt.split_id(entity_id)
        return entity_id

    def target_id(self, link: Path) -> str | None:
        """The entity id a link symlink points to, or None if it is not a well-formed in-store link."""
        try:
            target = os.readlink(link)
        except OSError:
            return None
        if os.path.isabs(target):
            return None
        full = os.path.normpath(os.path.join(link.parent, target))
        try:
            rel = Path(full).relative_to(self.root)
        except ValueError:
            return None
        if len(rel.parts) != 2 or not rel.parts[1].endswith(".md"):
            return None
        return f"{rel.parts[0]}/{rel.parts[1][:-3]}"

    def classes(self) -> list[str]:
        """Entity classes present in the store (directories that hold entities), sorted."""
        out = []
        with os.scandir(self.root) as it:
            for e in it:
                if e.is_dir(follow_symlinks=False) and not e.name.startswith(".") and fmt.is_name(e.name):
                    out.append(e.name)
        return sorted(out)

    def ids(self, cls: str | None = None) -> list[str]:
        """Sorted ids of every entity file (of one class if `cls` is given); links, dot names and names that are
        no slug (a newline in one, say: check() names them) are not."""
        out = []
        for c in [fmt.check_class(cls)] if cls else self.classes():
            d = self.root / c
            if not d.is_dir():
                continue
            try:
                it = os.scandir(d)
            except OSError:  # a class directory that cannot be read (check() names it): no entity in it
                continue
            with it:
                for e in it:
                    if e.name.endswith(".md") and fmt.is_slug(e.name[:-3]) and e.is_file(follow_symlinks=False):
                        out.append(f"{c}/{e.name[:-3]}")
        return sorted(out)

    def rel(self, path: Path) -> str:
        """`path` relative to the root, with '/' separators."""
        return path.relative_to(self.root).as_posix()
