"""Reading entities: the working tree as it is, uncommitted edits included, never a lock, never a write.

An entity file is opened O_NOFOLLOW|O_NONBLOCK and read only if it is a regular file, so a symbolic link
(which could lead outside the store) or a FIFO planted as an entity is refused instead of followed or
waited on (docs/smf-format.md, "Hostile files").
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

from hutch._core.errors import EntityNotFoundError, StorePathError
from hutch.memory import _format as fmt
from hutch.memory._entity import Entity
from hutch.memory._layout import Layout
from hutch.memory._links import Links


class Reader:
    """Entities of one store. `store` is what the entities hand out resolve their links through (the Memory)."""

    def __init__(self, layout: Layout, links: Links, store: Any):
        self.layout = layout
        self.links = links
        self.store = store

    def get(self, entity_id: str) -> Entity:
        cls, slug, path = self.layout.entity(entity_id)
        return self.read(f"{cls}/{slug}", path)

    def head(self, entity_id: str, limit: int) -> tuple[Entity, bool]:
        """(the entity as its file's first `limit` bytes read, cut at white space as the index cuts its units;
        True if that is the whole file): what a search hit shows never costs more than `limit` bytes, whatever
        the file's size."""
        cls, slug, path = self.layout.entity(entity_id)
        return self._read(f"{cls}/{slug}", path, limit)

    def read(self, entity_id: str, path: Path) -> Entity:
        """The entity `entity_id` from its file `path`, exactly as it is."""
        return self._read(entity_id, path, None)[0]

    def _read(self, entity_id: str, path: Path, limit: int | None) -> tuple[Entity, bool]:
        try:
            # O_NONBLOCK: a FIFO planted as an entity file would otherwise block the open forever
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except FileNotFoundError:
            raise EntityNotFoundError(
                f"There is no entity {entity_id} (no file {path}): create it with put(), "
                "or list what exists with ls() / `hutch mem ls`."
            ) from None
        except OSError as e:
            raise StorePathError(
                f"{path} is a symbolic link or unreadable ({e.strerror}): an entity must be a regular file "
                "inside the store. Replace it with the file it points to."
            ) from None
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise StorePathError(
                f"{path} is not a regular file (a FIFO, device or directory): an entity must be a regular file "
                "inside the store. Remove it, or move it out of the store."
            )
        with os.fdopen(fd, "rb") as f:
            raw = f.read() if limit is None else f.read(limit + 1)
        whole = limit is None or len(raw) <= limit
        if not whole:
            from hutch.memory._index._units import cut  # (the index's package loads numpy: only when needed)

            raw = raw[:cut(raw, limit)]
        text = raw.decode("utf-8", errors="surrogateescape")
        meta, body = fmt.parse(text, str(path))
        cls, slug = entity_id.split("/")
        return Entity(entity_id, meta, body, text, path, self.links.ids(cls, slug), self.store), whole

    def exists(self, entity_id: str) -> bool:
        _, _, path = self.layout.entity(entity_id)
        return os.path.isfile(path) and not os.path.islink(path)
