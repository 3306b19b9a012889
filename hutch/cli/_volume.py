"""`hutch volume ls|create|rm`: thin wrappers over hutch.Volume."""

from __future__ import annotations

import json
import time

import click


@click.group()
def volume() -> None:
    """List, create and remove named volumes.

    \b
    Example: hutch volume ls
    """


@volume.command("ls")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def ls(as_json: bool) -> None:
    """List volumes and the running sandboxes that mount them.

    \b
    Example: hutch volume ls --json
    """
    import hutch

    vols = hutch.Volume.list_all()
    if as_json:
        click.echo(json.dumps(vols, indent=1))
        return
    click.echo(f"{'NAME':<32}{'CREATED':<22}IN USE BY")
    for v in vols:
        created = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(v["created_at"]))
        click.echo(f"{v['name']:<32}{created:<22}{', '.join(v['in_use']) or '-'}")


@volume.command()
@click.argument("name")
def create(name: str) -> None:
    """Create volume NAME (nothing happens if it exists).

    \b
    Example: hutch volume create datasets
    """
    import hutch

    click.echo(hutch.Volume.from_name(name, create=True).name)


@volume.command()
@click.argument("name")
@click.option("--force", is_flag=True, help="Remove it even while running sandboxes mount it (they see it emptied).")
def rm(name: str, force: bool) -> None:
    """Remove volume NAME and its files; refused while a running sandbox mounts it, unless --force.

    \b
    Example: hutch volume rm datasets
    """
    import hutch

    hutch.Volume.delete(name, force=force)
    click.echo(f"removed {name}")
