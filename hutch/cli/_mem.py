"""`hutch mem ...`: the SMF memory store from the shell; thin wrappers over hutch.Memory.

The group is `mem` (hutch.cli._mem.mem). Other modules add subcommands to it
with `@mem.command()` and open the store with `open_store(ctx)`, which honours
`--store` / $HUTCH_MEMORY / the current directory, in that order.

Exit codes: 0 success; 1 a hutch error (message on stderr); 2 a usage error;
3 `check` found errors.
"""

from __future__ import annotations

import json
import os
import sys

import click

from hutch._core import settings

EXIT_CHECK_FAILED = 3


class _NeedsExtra(click.Group):
    """Every subcommand needs the memory extra (mount and umount: fuse): without it, the one line naming the
    extra, before a store is looked at. Help needs none."""

    def resolve_command(self, ctx, args):
        name, cmd, rest = super().resolve_command(ctx, args)
        if not ctx.resilient_parsing and not {"-h", "--help"} & set(rest):
            from hutch._core.extras import require

            require(*(("hutch.fuse", "fuse") if name in ("mount", "umount") else ("hutch.memory", "memory")))
        return name, cmd, rest


@click.group(cls=_NeedsExtra)
@click.option("--store", "-s", metavar="PATH", envvar=settings.MEMORY.name,
              help="The store directory (default: $HUTCH_MEMORY, else the current directory).")
@click.pass_context
def mem(ctx: click.Context, store: str | None) -> None:
    """SMF memory: entities as Markdown files, relations as symlinks, history in git.

    \b
    Examples:
      hutch mem init ./agent-memory
      hutch mem -s ./agent-memory add actors "Alice Chen" --fact "prefers weekly reports"
      hutch mem -s ./agent-memory link actors/alice-chen works_at orgs/acme
      hutch mem -s ./agent-memory check
    """
    ctx.ensure_object(dict)
    ctx.obj["store"] = store


def store_path(ctx: click.Context) -> str:
    """The store path chosen by --store / $HUTCH_MEMORY / the current directory."""
    root = ctx.find_root()
    obj = ctx.obj or root.obj or {}
    return obj.get("store") or "."


def open_store(ctx: click.Context, *, create: bool = False, reasoner=None):
    """Open the store for a subcommand (hutch.Memory, with search's `reasoner`); a missing store is a clear error."""
    import hutch

    path = store_path(ctx)
    if not create and not os.path.isdir(os.path.join(path, ".git")):
        raise hutch.MemoryStoreError(
            f"{os.path.abspath(path)} is not a memory store: create one with `hutch mem init {path}`, "
            "or point to one with --store PATH or $HUTCH_MEMORY."
        )
    return hutch.Memory(path, create=create, reasoner=reasoner)


def _echo_json(value) -> None:
    click.echo(json.dumps(value, indent=2, ensure_ascii=False, default=str))


def _entity_dict(e, mem=None) -> dict:
    d = {"id": e.id, "path": str(e.path), "meta": dict(e.meta), "facts": e.facts,
         "links": {k: list(v) for k, v in e.link_ids.items()}, "body": e.body}
    if mem is not None:
        d["backlinks"] = mem.backlinks(e.id)
    return d


@mem.command()
@click.argument("path", required=False)
@click.pass_context
def init(ctx: click.Context, path: str | None) -> None:
    """Create a store (a directory with its git repository) at PATH; harmless if it exists.

    Without PATH: the --store / $HUTCH_MEMORY directory, else the current one.

    \b
    Example:
      hutch mem init ./agent-memory
    """
    import hutch

    m = hutch.Memory(path if path is not None else store_path(ctx))
    click.echo(f"initialized SMF store at {m.root}")


@mem.command()
@click.argument("cls", metavar="CLASS")
@click.argument("title")
@click.option("--body", "-b", help="Markdown body text ('-' reads stdin).")
@click.option("--fact", "-f", "facts", multiple=True, help="A fact (repeatable).")
@click.option("--source", help="Provenance, e.g. chat:2026-11-02#14.")
@click.option("--tag", "-t", "tags", multiple=True, help="A tag (repeatable).")
@click.option("--confidence", type=float, help="A number in [0, 1].")
@click.option("--valid-from", help="When it became true (ISO 8601).")
@click.option("--valid-to", help="When it stopped being true (ISO 8601).")
@click.option("--slug", help="File name to use instead of one made from the title.")
@click.option("--exist-ok", is_flag=True, help="If it exists, add the facts / replace the body instead of failing.")
@click.pass_context
def add(ctx, cls, title, body, facts, source, tags, confidence, valid_from, valid_to, slug, exist_ok) -> None:
    """Add an entity TITLE of class CLASS; prints its id.

    \b
    Example:
      hutch mem add actors "Alice Chen" -b "Head of data at Acme." -f "prefers weekly reports"
    """
    m = open_store(ctx)
    if body == "-":
        body = sys.stdin.read()
    e = m.put(cls, title, body=body or "", facts=facts, source=source, tags=tags, confidence=confidence,
              valid_from=valid_from, valid_to=valid_to, slug=slug, exist_ok=exist_ok)
    click.echo(e.id)


@mem.command()
@click.argument("entity_id", metavar="ID")
@click.option("--json", "as_json", is_flag=True, help="Print JSON (id, meta, facts, links, backlinks, body).")
@click.option("--raw", is_flag=True, help="Print the file exactly as it is on disk.")
@click.option("--as-of", help="Show the version valid on this date (ISO 8601).")
@click.pass_context
def show(ctx, entity_id, as_json, raw, as_of) -> None:
    """Show an entity: its file, then its links and back-links.

    \b
    Example:
      hutch mem show actors/alice-chen
      hutch mem show actors/alice-chen --as-of 2026-11-01
    """
    m = open_store(ctx)
    e = m.as_of(as_of).get(entity_id) if as_of else m.get(entity_id)
    if as_json:
        _echo_json(_entity_dict(e, None if as_of else m))
        return
    click.echo(e.text, nl=not e.text.endswith("\n"))
    if raw:
        return
    for rel, ids in e.link_ids.items():
        for t in ids:
            click.echo(f"-> {rel} {t}")
    if not as_of:
        for rel, ids in m.backlinks(e.id).items():
            for s in ids:
                click.echo(f"<- {rel} {s}")


@mem.command(name="ls")
@click.argument("cls", metavar="[CLASS]", required=False)
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list of ids.")
@click.pass_context
def ls_(ctx, cls, as_json) -> None:
    """List entity ids, of one CLASS or all.

    \b
    Example:
      hutch mem ls actors
    """
    ids = open_store(ctx).ls(cls)
    if as_json:
        _echo_json(ids)
    else:
        for i in ids:
            click.echo(i)


@mem.command()
@click.argument("src", metavar="SRC")
@click.argument("relation")
@click.argument("dst", metavar="DST")
@click.option("--source", help="Provenance of the relation.")
@click.pass_context
def link(ctx, src, relation, dst, source) -> None:
    """Link SRC -[RELATION]-> DST (a relative symlink); idempotent.

    \b
    Example:
      hutch mem link actors/alice-chen works_at orgs/acme
    """
    p = open_store(ctx).link(src, relation, dst, source=source)
    click.echo(str(p))


@mem.command()
@click.argument("src", metavar="SRC")
@click.argument("relation")
@click.argument("dst", metavar="DST")
@click.pass_context
def unlink(ctx, src, relation, dst) -> None:
    """Remove the link SRC -[RELATION]-> DST.

    \b
    Example:
      hutch mem unlink actors/alice-chen works_at orgs/acme
    """
    open_store(ctx).unlink(src, relation, dst)


@mem.command()
@click.argument("entity_id", metavar="[ID]", required=False)
@click.option("-n", "limit", type=int, default=20, show_default=True, help="At most this many entries.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.pass_context
def log(ctx, entity_id, limit, as_json) -> None:
    """History: every version of ID (who, when, op, source, reason), or the store's commits.

    \b
    Example:
      hutch mem log actors/alice-chen
    """
    m = open_store(ctx)
    if entity_id:
        rows = [{"commit": v.commit, "date": v.date, "author": v.author, "op": v.op, "source": v.source,
                 "reason": v.reason, "valid_from": v.valid_from, "valid_to": v.valid_to, "deleted": v.text is None}
                for v in m.history(entity_id)[:limit]]
    else:
        rows = [{"commit": c.sha, "date": c.date, "author": f"{c.author} <{c.email}>",
                 "op": c.trailer("Hutch-Op") or "edit", "subject": c.subject,
                 "source": c.trailer("Hutch-Source"), "reason": c.trailer("Hutch-Reason")}
                for c in m.git.log(limit=limit)]
    if as_json:
        _echo_json(rows)
        return
    for r in rows:
        extra = "".join(f" {k}={r[k]}" for k in ("source", "reason", "valid_from", "valid_to") if r.get(k))
        what = r.get("subject") or ("(deleted)" if r.get("deleted") else "")
        click.echo(f"{r['commit'][:12]} {r['date']} {r['op']:<10} {what}{extra}".rstrip())


@mem.command()
@click.argument("entity_id", metavar="[ID]", required=False)
@click.option("--since", default="HEAD~1", show_default=True, help="The git revision to compare with.")
@click.pass_context
def diff(ctx, entity_id, since) -> None:
    """Show what changed since a revision (the last commit by default), for ID or the whole store.

    \b
    Example:
      hutch mem diff actors/alice-chen --since HEAD~3
    """
    click.echo(open_store(ctx).diff(entity_id, since), nl=False)


@mem.command()
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.option("--no-warnings", is_flag=True, help="Print errors only.")
@click.pass_context
def check(ctx, as_json, no_warnings) -> None:
    """Check the store: dangling links, malformed front matter, orphans; exits 3 if it found errors.

    \b
    Example:
      hutch mem check --no-warnings
    """
    r = open_store(ctx).check()
    issues = r.errors if no_warnings else list(r.issues)
    if as_json:
        _echo_json({"ok": r.ok, "entities": r.entities, "links": r.links,
                    "issues": [{"severity": i.severity, "code": i.code, "path": i.path, "message": i.message,
                                "fix": i.fix} for i in issues]})
    else:
        for i in issues:
            click.echo(str(i))
        click.echo(f"{r.entities} entities, {r.links} links: {len(r.errors)} errors, {len(r.warnings)} warnings")
    if not r.ok:
        sys.exit(EXIT_CHECK_FAILED)


@mem.command()
@click.argument("entity_id", metavar="ID")
@click.option("--reason", "-r", required=True, help="Why it is forgotten (recorded in the commit).")
@click.pass_context
def forget(ctx, entity_id, reason) -> None:
    """Delete ID, its links and the links to it, in one audited commit.

    \b
    Example:
      hutch mem forget actors/bob --reason "asked to be removed"
    """
    open_store(ctx).forget(entity_id, reason=reason)


@mem.command()
@click.argument("paths", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False))
@click.option("--format", "form", type=click.Choice(["auto", "locomo", "text"]), default="auto", show_default=True,
              help="locomo: a multi-session chat log in LoCoMo JSON; text: Markdown/text; auto: by extension.")
@click.option("--class", "cls", default="documents", show_default=True, help="Class for text documents.")
@click.option("--source", help="Provenance for text documents (default file:<path>).")
@click.pass_context
def ingest(ctx, paths, form, cls, source) -> None:
    """Ingest conversations (LoCoMo JSON) or documents (Markdown, split along headings); one commit each.

    \b
    Example:
      hutch mem ingest examples/data/team-chat.json
      hutch mem ingest notes.md --class notes
    """
    m = open_store(ctx)
    for p in paths:
        kind = form if form != "auto" else ("locomo" if p.endswith(".json") else "text")
        if kind == "locomo":
            r = m.ingest_conversation(p)
        else:
            r = m.ingest_text(p, cls=cls, source=source)
        counts = ", ".join(f"{len(v)} {k}" for k, v in sorted(r.entities.items()))
        click.echo(f"{p}: {counts}; {r.links} links; commit {r.commit[:12] if r.commit else '(no change)'}")


# `search`, `reindex` and `doctor` (the search index) and `mount` and `umount` (the FUSE view, hutch/fuse) live in
# their own modules; importing them registers their commands on `mem`, so they come last.
from hutch.cli import _mem_mount, _mem_search  # noqa: E402

COMMAND_MODULES = (_mem_search, _mem_mount)
