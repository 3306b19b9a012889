"""Bytes written through the mount -> one committed store operation, with provenance.

A process that writes a file under the mount hands us whole-file bytes, not a
store call. `commit_bytes` turns them into the nearest store operation, so that
every write through the mount is atomic, validated and one git commit whose
`Hutch-Source` names the mount or the sandbox:

- bytes with front matter replace the file as they are (a hand edit), after the
  front matter parses and its `id` / `class`, when present, match the path;
- bytes without front matter are the new body of an existing entity
  (`update(body=...)`), or the body of a new one (`put(...)` with the slug the
  file name gives), so `echo note >> topics/churn.md` and `cat > x.md` both work.
"""

from __future__ import annotations

from hutch._core.errors import MalformedEntityError
from hutch.memory import _format as fmt


def has_front_matter(text: str) -> bool:
    return fmt.split_front_matter(text) is not None


def commit_bytes(mem, entity_id: str, data: bytes, source: str) -> str:
    """Write `data` as the entity `entity_id` through the store's write path; returns the op done ('' if none)."""
    cls, slug = fmt.split_id(entity_id)
    text = data.decode("utf-8", errors="surrogateescape")
    exists = mem.exists(entity_id)
    if not has_front_matter(text):
        if exists:
            before = mem.get(entity_id)
            after = mem.update(entity_id, body=text, source=source)
            return "update" if after.text != before.text else ""
        title = " ".join(slug.replace("-", " ").split()) or slug
        mem.put(cls, title, body=text, slug=slug, source=source)
        return "put"
    meta, _ = fmt.parse(text, f"{entity_id}.md (written through the mount)")
    for key, want in (("id", entity_id), ("class", cls)):
        if key in meta and meta[key] is not None and str(meta[key]) != want:
            raise MalformedEntityError(
                f"{entity_id}.md: front matter says {key}: {meta[key]} but the file is {entity_id}.md; "
                f"write {key}: {want}, or drop the key.", path=f"{entity_id}.md")
    if exists and mem.get(entity_id).text == text:
        return ""
    op = "update" if exists else "put"
    path = mem.root / cls / f"{slug}.md"
    with mem.transaction(source=source) as tx:
        tx.kind = op
        tx.record(op, entity_id)
        tx.write(path, text)
    return op

