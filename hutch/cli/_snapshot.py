"""`hutch snapshot ls|export|import|rm`: memory snapshots (gVisor), thin wrappers over hutch.Snapshot.

Taking, restoring and forking are `hutch sandbox snapshot|restore|fork`.
"""

from __future__ import annotations

import json
import time

import click


@click.group()
def snapshot() -> None:
    """List, export, import and remove memory snapshots (processes, memory and filesystem of gVisor sandboxes).

    \b
    Example: hutch snapshot ls
    """


@snapshot.command("ls")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def ls(as_json: bool) -> None:
    """List the memory snapshots on the daemon's host: id, source sandbox, age, memory image size.

    \b
    Example: hutch snapshot ls --json
    """
    import hutch

    snaps = hutch.Snapshot.list()
    if as_json:
        click.echo(json.dumps([s.__dict__ for s in snaps], indent=2))
        return
    for s in snaps:
        age = int(time.time() - s.created_at) if s.created_at else 0
        click.echo(f"{s.id}  {s.source or '-':12}  {age:>6}s ago  {s.memory_bytes / 2**20:8.1f} MiB")


@snapshot.command("export")
@click.argument("snapshot_id")
@click.argument("file", type=click.Path(dir_okay=False))
def export_(snapshot_id: str, file: str) -> None:
    """Write memory snapshot SNAPSHOT_ID to FILE as a tar (memory image, filesystem, metadata).

    Import it on a host with the same runsc build, busybox and base image build.

    \b
    Example: hutch snapshot export 3f9c0d... s.tar
    """
    import hutch

    hutch.Snapshot.of(snapshot_id).export(file)
    click.echo(file)


@snapshot.command("import")
@click.argument("file", type=click.Path(exists=True, dir_okay=False))
@click.option("--base", default=None, metavar="REF",
              help="The base its filesystem sits on; needed for a directory base (dir:/PATH), which it sees.")
def import_(file: str, base: str | None) -> None:
    """Import an archive made by `hutch snapshot export`; print the new snapshot's id.

    The archive is untrusted input: nothing is kept unless every part is well formed, of its declared
    size and sha256, and this host can restore it (docs/architecture.md, "Moving a memory snapshot").

    \b
    Example: hutch sandbox restore "$(hutch snapshot import s.tar)"
    """
    import hutch

    click.echo(hutch.Snapshot.import_(file, base=base).id)


@snapshot.command("rm")
@click.argument("snapshot_ids", nargs=-1, required=True)
def rm(snapshot_ids) -> None:
    """Remove memory snapshots (sandboxes restored from them run on).

    \b
    Example: hutch snapshot rm 3f9c0d...
    """
    import hutch

    for sid in snapshot_ids:
        hutch.Snapshot.of(sid).delete()
        click.echo(sid)
