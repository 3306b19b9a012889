"""`hutch image build|ls|rm|prune|export|import`: thin wrappers over hutch.Image and the daemon's image store."""

from __future__ import annotations

import json
import runpy
import time

import click


def _client():
    from hutch.sandbox import _client

    return _client.default_client()


@click.group()
def image() -> None:
    """Build, list, remove, export and import images (built images and snapshots).

    \b
    Example: hutch image ls
    """


@image.command()
@click.argument("target", metavar="FILE:NAME")
@click.option("--name", "tag", help="Name the built image (default: NAME).")
@click.option("--quiet", "-q", is_flag=True, help="Print only the image reference.")
def build(target: str, tag: str | None, quiet: bool) -> None:
    """Build the hutch.Image bound to NAME in the Python file FILE, and name it.

    \b
    Example: hutch image build images.py:agent_image
    """
    import hutch

    path, sep, var = target.rpartition(":")
    if not sep or not path or not var:
        raise click.BadParameter("give FILE:NAME, like images.py:agent_image", param_hint="FILE:NAME")
    try:
        namespace = runpy.run_path(path, run_name="__hutch_build__")
    except FileNotFoundError as e:
        raise click.BadParameter(f"{path} does not exist", param_hint="FILE:NAME") from e
    img = namespace.get(var)
    if not isinstance(img, hutch.Image):
        raise click.BadParameter(f"{var!r} in {path} is {type(img).__name__}, not a hutch.Image",
                                 param_hint="FILE:NAME")
    built = img.build(name=tag or var, quiet=quiet)
    click.echo(built.ref)


def _age(t) -> str:
    if not t:
        return "-"
    s = time.time() - t
    return f"{s:.0f}s ago" if s < 120 else f"{s / 60:.0f}m ago" if s < 7200 else f"{s / 3600:.0f}h ago"


@image.command("ls")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.option("--all", "-a", "show_all", is_flag=True, help="Also show intermediate build steps.")
def ls(as_json: bool, show_all: bool) -> None:
    """List the images on the daemon's host: the default image, named builds, snapshots.

    \b
    Example: hutch image ls --all
    """
    items = _client().json("GET", "/v1/images")["images"]
    if not show_all:
        items = [i for i in items if i.get("kind") in ("base", "snapshot") or i.get("name") or i.get("pinned")]
    if as_json:
        click.echo(json.dumps(items, indent=1))
        return
    click.echo(f"{'ID':<14}{'NAME':<20}{'KIND':<10}{'SIZE':>10}  {'CREATED':<10}  DESCRIPTION")
    for i in items:
        ident = (i.get("id") or "")[:12] if i.get("kind") != "base" else i["ref"]
        click.echo(f"{ident:<14}{(i.get('name') or '-')[:19]:<20}{i.get('kind') or '-':<10}"
                   f"{(i.get('size') or 0) / 1e6:>8.1f}MB  {_age(i.get('created_at')):<10}  "
                   f"{(i.get('description') or '')[:60]}")


@image.command()
@click.argument("key")
@click.option("--force", is_flag=True, help="Also remove the images built on it.")
def rm(key: str, force: bool) -> None:
    """Remove an image by name, id or id prefix (its layers go at the next prune).

    \b
    Example: hutch image rm agent_image
    """
    d = _client().json("DELETE", f"/v1/images/{key}", params={"force": int(force)})
    for nid in d["removed"]:
        click.echo(f"removed {nid[:12]}")


@image.command()
def prune() -> None:
    """Remove build cache that no named image or snapshot needs, and every unused layer.

    \b
    Example: hutch image prune
    """
    d = _client().json("POST", "/v1/images/prune")
    click.echo(f"removed {len(d['nodes'])} image(s) and {len(d['layers'])} layer(s), "
               f"{d['bytes'] / 1e6:.1f} MB freed")


@image.command("export")
@click.argument("key")
@click.argument("file", type=click.Path(dir_okay=False))
def export_(key: str, file: str) -> None:
    """Write image KEY (name, id or prefix) to FILE as a tar archive (its layers, not its base).

    \b
    Example: hutch image export agent_image agent.tar
    """
    import hutch

    hutch.Image.from_name(key).export(file)
    click.echo(file)


@image.command("import")
@click.argument("file", type=click.Path(exists=True, dir_okay=False))
@click.option("--base", default=None, metavar="REF",
              help="The base the archive sits on; needed for a directory base (dir:/PATH), which its sandboxes see.")
@click.option("--replace", is_flag=True,
              help="Move a name this host gives another image to the archive's image (refused otherwise).")
def import_(file: str, base: str | None, replace: bool) -> None:
    """Import an archive made by `hutch image export`; prints the image reference.

    The archive is untrusted input: nothing is stored unless every layer is well formed and
    matches its digest (docs/images.md). An archive on a host directory is refused unless
    --base names that directory. A name the archive gives an image is refused
    if it names another image here, unless --replace.

    \b
    Example: hutch image import agent.tar
             hutch image import tools.tar --base dir:/srv/roots/tools
    """
    import hutch

    click.echo(hutch.Image.import_(file, base=base, replace=replace).ref)
