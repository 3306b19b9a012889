"""Relations (docs/smf-format.md, "Relations"): relative symlinks `<class>/<slug>.links/<rel>/<name>.md`.

Reading takes no lock and reads what is on disk; back-links are derived by scanning every link, never
stored. Making or removing a link is one operation of the store's write path (_writer.py): under its
lock, journaled, one commit.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

from hutch._core.errors import EntityNotFoundError, MemoryStoreError
from hutch.memory import _format as fmt
from hutch.memory._entity import Entity, Neighbor
from hutch.memory._layout import Layout

if TYPE_CHECKING:  # pragma: no cover
    from hutch.memory._writer import Writer


def link_ids(layout: Layout, cls: str, slug: str) -> dict[str, tuple[str, ...]]:
    """Relation -> the entities the entity `cls/slug` links to on disk, sorted: well-formed in-store links to an
    entity that exists (a regular file in a real class directory), no others.

    A `.links` or relation directory that is a symbolic link is not followed (it could lead outside the store);
    a relation or target whose name is not UTF-8, a link that leads out of the store and a link whose target is
    gone or is not a regular file (dangling) are left out: check() and doctor() name each."""
    out: dict[str, list[str]] = {}
    for rel, _name, tid in link_entries(layout, layout.links_dir(cls, slug)):
        if tid is not None and is_entity(layout, tid):
            out.setdefault(rel, []).append(tid)
    return {rel: tuple(ids) for rel, ids in out.items()}


def is_entity(layout: Layout, entity_id: str) -> bool:
    """True if `entity_id` is an entity now: a regular file `<class>/<slug>.md` in a class that is a real
    directory of the store (never through a symbolic link: lstat only, nothing is opened or followed)."""
    cls, _, slug = entity_id.partition("/")
    if not (_real_dir(layout.root / cls) and fmt.is_name(cls)):
        return False
    try:
        return stat.S_ISREG(os.lstat(layout.root / cls / f"{slug}.md").st_mode)
    except (OSError, ValueError):
        return False


def link_entries(layout: Layout, ldir: Path) -> Iterator[tuple[str, str, str | None]]:
    """(relation, link name, target id or None) of every symbolic link in the links directory `ldir`, as
    link_ids reads them (relation directories that are links, and names that are not UTF-8, are left out); the
    target id is None for a link that does not point to `<class>/<slug>.md` inside the store."""
    if not _real_dir(ldir):
        return
    try:
        rels = sorted(os.listdir(ldir))
    except OSError:
        return
    for rel in rels:
        if not _utf8(rel) or not _real_dir(ldir / rel):
            continue
        try:
            names = sorted(os.listdir(ldir / rel))
        except OSError:
            continue
        for name in names:
            if not _utf8(name) or not os.path.islink(ldir / rel / name):
                continue
            tid = layout.target_id(ldir / rel / name)
            yield rel, name, tid if tid is not None and _utf8(tid) else None


def _real_dir(path: Path) -> bool:
    """True for a directory that is not a symbolic link."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def _utf8(name: str) -> bool:
    """False for a name that is not UTF-8 (os gives it with surrogates, which no caller can print or store)."""
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


class Links:
    """The link graph of one store: `ids` / `iter_all` / `neighbors` read it, `link` / `unlink` change it."""

    def __init__(self, layout: Layout, writer: "Writer"):
        self.layout = layout
        self.writer = writer

    # ------------------------------------------------------------ reading

    def ids(self, cls: str, slug: str) -> dict[str, tuple[str, ...]]:
        """Relation -> the ids this entity links to (well-formed in-store links only), sorted."""
        return link_ids(self.layout, cls, slug)

    def iter_all(self) -> Iterator[tuple[str, str, str, Path]]:
        """Every link in the store: (source id, relation, target id or '' if malformed, link path)."""
        for cls in self.layout.classes():
            d = self.layout.root / cls
            try:
                with os.scandir(d) as it:
                    ldirs = [e for e in it if e.name.endswith(fmt.LINKS_SUFFIX) and e.is_dir(follow_symlinks=False)]
            except OSError:  # unreadable or gone (check() names it)
                continue
            for e in ldirs:
                src = f"{cls}/{e.name[: -len(fmt.LINKS_SUFFIX)]}"
                try:
                    rels = os.listdir(e.path)
                except OSError:  # gone, not a directory since the listing, or unreadable
                    continue
                for rel in sorted(rels):
                    rdir = Path(e.path) / rel
                    if not _utf8(rel) or not _real_dir(rdir):
                        continue
                    try:
                        names = sorted(os.listdir(rdir))
                    except OSError:
                        continue
                    for name in names:
                        yield src, rel, self.layout.target_id(rdir / name) or "", rdir / name

    def neighbors(self, entity: Entity) -> list[Neighbor]:
        """Typed edges of `entity`: its links ('out') and the links pointing to it ('in', by a scan); only entities
        that exist (a dangling link's target, or the owner of a links directory without its entity, is none)."""
        out = [Neighbor(rel, "out", tid) for rel, ids in entity.link_ids.items() for tid in ids]
        out += [Neighbor(rel, "in", src) for src, rel, tid, _ in self.iter_all()
                if tid == entity.id and is_entity(self.layout, src)]   # (a links directory its entity outlived)
        return out

    # ------------------------------------------------------------ writing

    def link(self, sid: str, relation: str, did: str, *, source: str | None = None) -> Path:
        """Link `sid` -[relation]-> `did` (idempotent); the link's path."""
        fmt.check_relation(relation)
        scls, sslug, spath = self.layout.entity(sid)
        dcls, dslug, dpath = self.layout.entity(did)
        rdir = self.layout.links_dir(scls, sslug) / relation
        target = f"../../../{dcls}/{dslug}.md"
        self.layout.check_link_dirs(rdir)
        with self.writer.op("link", f"{sid} -[{relation}]-> {did}", source=source) as tx:
            for eid, p in ((sid, spath), (did, dpath)):  # checked under the lock: no writer can forget them now
                if not p.is_file() or p.is_symlink():
                    raise EntityNotFoundError(
                        f"Cannot link {sid} -[{relation}]-> {did}: {eid} does not exist. Create it with put() first."
                    )
            for name in (f"{dslug}.md", f"{dcls}--{dslug}.md"):
                lp = rdir / name
                if os.path.islink(lp):
                    if self.layout.target_id(lp) == f"{dcls}/{dslug}":
                        tx.forget_op("link", f"{sid} -[{relation}]-> {did}")
                        return lp
                    continue  # the name belongs to a same-slug entity of another class
                if os.path.lexists(lp):
                    continue
                tx.symlink(lp, target)
                return lp
            raise MemoryStoreError(f"{rdir} holds files that are not links; run check() and remove them.")

    def unlink(self, sid: str, relation: str, did: str, *, source: str | None = None) -> None:
        """Remove the link `sid` -[relation]-> `did`; EntityNotFoundError if there is none."""
        fmt.check_relation(relation)
        scls, sslug, _ = self.layout.entity(sid)
        self.layout.entity(did)
        rdir = self.layout.links_dir(scls, sslug) / relation
        self.layout.check_link_dirs(rdir)
        with self.writer.op("unlink", f"{sid} -[{relation}]-> {did}", source=source) as tx:
            for name in sorted(os.listdir(rdir)) if rdir.is_dir() else []:
                if self.layout.target_id(rdir / name) == did:
                    tx.remove(rdir / name)
                    return
            raise EntityNotFoundError(
                f"There is no link {sid} -[{relation}]-> {did}: `hutch mem show {sid}` lists its links."
            )
