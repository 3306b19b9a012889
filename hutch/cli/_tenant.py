"""`hutch tenant add|set|rotate|rm|ls`: edit the tenants file `hutch serve --tenants FILE` reads.

A tenant's token is printed once (or written to --token-file) and never stored: the file keeps its
SHA-256 only. The daemon rereads the file when it changes, so every command takes effect at once.
"""

from __future__ import annotations

import os

import click

from hutch.sandbox._host.daemon import tenants as T

_FILE = click.option("--file", "path", type=click.Path(dir_okay=False), default=str(T.DEFAULT_FILE),
                     show_default=True, help="The tenants file (root's, mode 0600).")
_TOKEN_FILE = click.option("--token-file", type=click.Path(dir_okay=False), metavar="PATH",
                           help="Write the token to this new file (mode 0600) instead of printing it.")


def _root() -> None:
    if os.geteuid() != 0:
        raise click.ClickException("the tenants file is root's (it says who may drive the daemon); run this as root.")


def _give(token: str, token_file: str | None, name: str) -> None:
    if token_file:
        fd = os.open(token_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(token + "\n")
        click.echo(f"tenant {name}: token written to {token_file}", err=True)
    else:
        click.echo(token)
        click.echo(f"tenant {name}: this token is shown once; give it to the tenant (HUTCH_TOKEN or "
                   "HUTCH_TOKEN_FILE of its clients).", err=True)


@click.group()
def tenant():
    """Tenants of a daemon: each has its own token, sees only its own sandboxes, images and volumes, within
    its quotas (docs/tenants.md).

    \b
    Quotas (--quota NAME=VALUE, repeatable; VALUE none removes one):
      sandboxes=10 cpu=8 memory=16G disk=20G creates_per_second=5 egress_bytes_per_day=1G

    \b
    Example:
      hutch tenant add acme --quota sandboxes=10 --quota memory=16G --token-file /root/acme.token
      hutch serve --listen 0.0.0.0:7450 --tenants /etc/hutch/tenants.json
    """


@tenant.command("add")
@click.argument("name")
@click.option("--quota", "quotas", multiple=True, metavar="NAME=VALUE", help="A quota (repeatable).")
@click.option("--image", "images", multiple=True, metavar="REF", help="An image shared with it (repeatable).")
@_TOKEN_FILE
@_FILE
def add(name, quotas, images, token_file, path):
    """Add a tenant and print its token once (or write it to --token-file).

    \b
    Example:
      hutch tenant add acme --quota sandboxes=10 --quota cpu=8 --image python-base
    """
    _root()
    if token_file and os.path.lexists(token_file):
        raise click.ClickException(f"--token-file {token_file} exists; give a new path.")
    token = T.add(path, name, T.Quotas().with_pairs(quotas), images)
    _give(token, token_file, name)


@tenant.command("set")
@click.argument("name")
@click.option("--quota", "quotas", multiple=True, metavar="NAME=VALUE", help="A quota to change (repeatable).")
@click.option("--image", "images", multiple=True, metavar="REF", help="The images shared with it (replaces them).")
@click.option("--no-images", is_flag=True, help="Share no image with it any more.")
@_FILE
def set_(name, quotas, images, no_images, path):
    """Change a tenant's quotas or shared images.

    \b
    Example:
      hutch tenant set acme --quota memory=32G --quota disk=none
    """
    _root()
    t = T.set_(path, name, quotas, () if no_images else (images or None))
    click.echo(f"tenant {t.name}: quotas {t.quotas.to_dict() or 'none'}, images {list(t.images)}")


@tenant.command("rotate")
@click.argument("name")
@_TOKEN_FILE
@_FILE
def rotate(name, token_file, path):
    """Give a tenant a new token; the old one stops working at once.

    \b
    Example:
      hutch tenant rotate acme --token-file /root/acme.token
    """
    _root()
    if token_file and os.path.lexists(token_file):
        raise click.ClickException(f"--token-file {token_file} exists; give a new path.")
    _give(T.rotate(path, name), token_file, name)


@tenant.command("rm")
@click.argument("name")
@_FILE
def rm(name, path):
    """Remove a tenant: its token stops working (its running sandboxes run on until they end), and its name is
    never given again (what it owned is recorded by its name; a new tenant of that name would take it over).

    \b
    Example:
      hutch tenant rm acme
    """
    _root()
    T.remove(path, name)
    click.echo(f"tenant {name} removed")


@tenant.command("ls")
@_FILE
@click.option("--json", "as_json", is_flag=True, help="As JSON (the file without the token digests).")
def ls(path, as_json):
    """List the tenants, their quotas and shared images.

    \b
    Example:
      hutch tenant ls --json
    """
    _root()
    ts = T.load_or_empty(path)
    if as_json:
        import json
        click.echo(json.dumps({n: {"quotas": t.quotas.to_dict(), "images": list(t.images)} for n, t in ts.items()},
                              indent=2))
        return
    for n, t in sorted(ts.items()):
        q = " ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in t.quotas.to_dict().items())
        click.echo(f"{n}\t{q or '-'}\t{','.join(t.images) or '-'}")
