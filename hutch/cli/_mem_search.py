"""`hutch mem search | reindex | doctor`: the search index from the shell (thin wrappers over Memory).

Registered on the `mem` group by hutch/cli/_mem.py. Exit codes: 0 success;
1 a hutch error; 2 a usage error; 3 `doctor` found problems in the store's files (malformed front matter,
links that dangle or lead out of the store: each named with its fix), the index being up to date; 4 `doctor`
found the index out of date.
"""

from __future__ import annotations

import json
import warnings

import click

from hutch._core.errors import MalformedEntityWarning, ReasonerWarning
from hutch.cli._mem import EXIT_CHECK_FAILED, mem, open_store

EXIT_INDEX_STALE = 4


@mem.command()
@click.argument("query")
@click.option("-k", "k", default=10, show_default=True, help="How many hits.")
@click.option("--class", "classes", multiple=True, help="Only entities of this class (repeatable).")
@click.option("--since", help="Only entities whose time is on or after this ISO date.")
@click.option("--until", help="Only entities whose time is on or before this ISO date.")
@click.option("--as-of", "as_of", help="Only entities valid at this ISO date.")
@click.option("--expand", default=0, show_default=True, help="Add entities up to N links away from the hits.")
@click.option("--now", help="Read relative time words in the query ('last week') against this ISO date "
                            "(default: --as-of, else the clock).")
@click.option("--explain", is_flag=True, help="Show each channel's rank and score for every hit.")
@click.option("--json", "as_json", is_flag=True, help="Print the hits as JSON.")
@click.option("--reasoner", is_flag=True, help="Let the LLM endpoint of $HUTCH_REASONER_URL rewrite the query and "
                                               "re-order the best hits (its key: $HUTCH_REASONER_KEY_FILE or "
                                               "$OPENAI_API_KEY; docs/retrieval.md says what is sent).")
@click.pass_context
def search(ctx, query, k, classes, since, until, as_of, expand, now, explain, as_json, reasoner) -> None:
    """Search the store by words, meaning, links and time (files changed by hand are indexed first).

    \b
    Examples:
      hutch mem search "customer churn" -k 5 --explain
      hutch mem search "what did Alice decide about pricing?" --class decisions --since 2026-10-01
      hutch mem search Acme --expand 1
      hutch mem search "what did we ship last week?" --now 2026-11-30
      HUTCH_REASONER_URL=http://127.0.0.1:8000/v1 hutch mem search "what has Melanie painted?" --reasoner
    """
    if reasoner:
        from hutch.memory._index._reason import OpenAIReasoner

        reasoner = OpenAIReasoner.from_settings()
    m = open_store(ctx, reasoner=reasoner or None)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always", MalformedEntityWarning)
        warnings.simplefilter("always", ReasonerWarning)
        hits = m.search(query, k=k, classes=list(classes) or None, since=since, until=until, as_of=as_of,
                        expand=expand, now=now)
    # files search left out (malformed front matter), a failing reasoner: named on stderr, never listed as hits
    for w in said:
        if issubclass(w.category, (MalformedEntityWarning, ReasonerWarning)):
            click.echo(f"hutch: warning: {w.message}", err=True)
        else:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    if as_json:
        click.echo(json.dumps([{"id": h.entity_id, "anchor": h.anchor, "speaker": h.speaker, "score": h.score,
                                "channels": {c: dict(v) for c, v in h.channels.items()}} for h in hits], indent=1))
        return
    for i, h in enumerate(hits, 1):
        where = f"{h.entity_id}#{h.anchor}" if h.anchor else h.entity_id
        click.echo(f"{i:3d}. {h.score:7.3f}  {where}")
        if explain:
            parts = []
            for name, v in h.channels.items():
                if "rank" in v:
                    parts.append(f"{name} #{v['rank']} ({v['score']:.3g})")
                else:
                    parts.append(f"{name} {v.get('hops')} hop(s) via {v.get('via')}")
            click.echo("       " + "; ".join(parts))
            text = " ".join(h.text.split())
            who = h.speaker
            text = f"{who}: {text}" if who else text
            click.echo("       " + (text[:160] + ("..." if len(text) > 160 else "")))


@mem.command()
@click.option("--full", is_flag=True, help="Start from an empty index file instead of updating the current one.")
@click.pass_context
def reindex(ctx, full) -> None:
    """Bring the search index up to date now, embedding everything pending (--full: rebuild from nothing).

    \b
    Example:
      hutch mem reindex
    """
    report = open_store(ctx).reindex(full=full)
    for line in report.lines():
        click.echo(line)


@mem.command()
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.pass_context
def doctor(ctx, as_json) -> None:
    """Verify the search index against the files and report its exact state and the problems of the files.

    Exit 4 if the index is out of date (`hutch mem reindex`), else 3 if files have problems (each line says its
    fix; `hutch mem check` checks the rest of the store), else 0.

    \b
    Example:
      hutch mem doctor
    """
    report = open_store(ctx).doctor()
    if as_json:
        d = {k: (list(v) if isinstance(v, tuple) else v) for k, v in report.__dict__.items()}
        d["path"] = str(report.path)
        click.echo(json.dumps(d, indent=1))
    else:
        for line in report.lines():
            click.echo(line)
    if not report.fresh:
        ctx.exit(EXIT_INDEX_STALE)
    if report.problems:
        ctx.exit(EXIT_CHECK_FAILED)
