"""`hutch fleet`: start, list, cordon and end a fleet of hutch daemons on a Ray cluster (docs/fleet.md)."""

from __future__ import annotations

import contextlib
import json
import sys

import click


@contextlib.contextmanager
def _as_driver():
    """Run a fleet call as a Ray driver: Ray's own messages (a node marked dead ...) go to stderr, not into our
    table on stdout, and the driver leaves Ray before we print."""
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        if "ray" in sys.modules and sys.modules["ray"].is_initialized():
            with contextlib.redirect_stdout(sys.stderr):
                sys.modules["ray"].shutdown()


def _mib(n) -> str:
    return f"{int(n or 0) >> 20} MiB"


def _print(rows, as_json: bool) -> None:
    if as_json:
        click.echo(json.dumps(rows, indent=2, sort_keys=True))
        return
    click.echo(f"{'KEY':8}  {'NODE':24}  {'HEALTH':9}  {'SANDBOXES':>11}  {'LOAD':>5}  {'MEM FREE':>10}  ADDRESS")
    for r in rows:
        health = "cordoned" if r.get("cordoned") and r.get("healthy") else "ok" if r.get("healthy") else "down"
        click.echo(f"{r['key']:8}  {str(r.get('name'))[:24]:24}  {health:9}  "
                   f"{str(r.get('live', 0)) + '/' + str(r.get('max_sandboxes', 0)):>11}  {r.get('load', 0):5.2f}  "
                   f"{_mib(r.get('mem_available')):>10}  {r.get('url', '')}"
                   + (f"  ({r['problem']})" if r.get("problem") else ""))


@click.group()
def fleet():
    """hutch on a Ray cluster: one daemon per Ray node; HUTCH_URL=ray://auto places sandboxes on them.

    \b
    Examples:
      ray start --head --port 6379          # and `ray start --address HEAD:6379` on each other host
      hutch fleet up --ray auto
      HUTCH_URL=ray://auto hutch run -- hostname
      hutch fleet ls
      hutch fleet down
    """


_RAY = click.option("--ray", "address", default="auto", show_default=True, metavar="ADDR",
                    help="The Ray cluster: auto (the one this host is in), HOST:6379, or ray://HOST:10001.")


@fleet.command()
@_RAY
@click.option("--max-per-node", type=int, default=1000, show_default=True, help="Sandboxes one node takes at most.")
@click.option("--listen-host", metavar="IP", help="Address the daemons' TLS listeners bind (default: each Ray node's).")
@click.option("--run-root", type=click.Path(file_okay=False), default="/run/hutch-fleet", show_default=True,
              help="Each node's run directory is RUN_ROOT/KEY.")
@click.option("--state-dir", type=click.Path(file_okay=False),
              help="The daemons' state directory (default /var/lib/hutch, shared by the nodes of one host).")
@click.option("--state-per-node", is_flag=True, help="One state directory per node (STATE_DIR/KEY).")
@click.option("--tenants", "tenants_file", metavar="FILE",
              help="Every node's daemon serves this tenants file (docs/tenants.md); it must be on every host.")
@click.option("--timeout", type=float, default=120.0, show_default=True, help="Seconds to wait for every node.")
@click.option("--json", "as_json", is_flag=True, help="Print the table as JSON.")
def up(address, max_per_node, listen_host, run_root, state_dir, state_per_node, tenants_file, timeout, as_json):
    """Start a hutch daemon on every Ray node (nodes that join later get one too).

    \b
    Examples:
      hutch fleet up --ray auto
      hutch fleet up --ray 10.0.0.1:6379 --max-per-node 500
      hutch fleet up --ray auto --tenants /etc/hutch/tenants.json
    """
    from hutch.fleet import up as fleet_up

    with _as_driver():
        rows = fleet_up(address, max_per_node=max_per_node, listen_host=listen_host, run_root=run_root,
                        state_dir=state_dir, state_per_node=state_per_node, tenants=tenants_file,
                        timeout=timeout)
    _print(rows, as_json)


@fleet.command("ls")
@_RAY
@click.option("--json", "as_json", is_flag=True, help="Print the table as JSON.")
def ls_(address, as_json):
    """The fleet's nodes: health, live sandboxes and cap, load, free memory, daemon address.

    \b
    Examples:
      hutch fleet ls
      hutch fleet ls --json
    """
    from hutch.fleet import ls

    with _as_driver():
        rows = ls(address)
    _print(rows, as_json)


@fleet.command()
@_RAY
@click.argument("node")
@click.option("--off", is_flag=True, help="Let the node take new sandboxes again.")
def cordon(address, node, off):
    """Take NODE (key, HOST/SLOT or Ray node id) out of placement; its sandboxes run on.

    \b
    Examples:
      hutch fleet cordon web-3/0
      hutch fleet cordon --off 8954449e
    """
    from hutch.fleet import cordon as fleet_cordon

    with _as_driver():
        key = fleet_cordon(node, not off, address)
    click.echo(f"{key}: {'takes new sandboxes again' if off else 'cordoned: takes no new sandboxes'}")


@fleet.command()
@_RAY
def down(address):
    """End the fleet: every node's daemon and its sandboxes, the agents, the controller.

    \b
    Example:
      hutch fleet down --ray auto
    """
    from hutch.fleet import down as fleet_down

    with _as_driver():
        rows = fleet_down(address)
    for r in rows:
        click.echo(f"{r.get('key') or r.get('node_id')}: " + (f"error: {r['error']}" if r.get("error") else "stopped"))


@fleet.command()
@_RAY
@click.argument("name")
@click.option("--remote", metavar="URL", help="The store's git remote (needed to start it): a path, ssh:// or https://.")
@click.option("--init-remote", is_flag=True, help="Make the remote (a bare repository at the path --remote names).")
@click.option("--root", type=click.Path(file_okay=False), help="Where each node keeps its clones "
              "(default /var/lib/hutch-fleet/memory).")
@click.option("--down", "stop", is_flag=True, help="End the store's writer and readers (their clones too; the "
              "remote is kept).")
@click.option("--json", "as_json", is_flag=True, help="Print the status as JSON.")
def memory(address, name, remote, init_remote, root, stop, as_json):
    """Start (with --remote), show or end (--down) the memory store NAME of the Ray cluster: one writer, a reader
    per node, the remote as its truth (docs/fleet.md, "Memory").

    \b
    Examples:
      hutch fleet memory notes --remote /srv/git/notes.git --init-remote
      hutch fleet memory notes --json
      hutch fleet memory notes --down
    """
    from hutch.fleet import init_remote as make_remote
    from hutch.fleet import memory as fleet_memory
    from hutch.fleet import memory_down

    if init_remote:
        if not remote:
            raise click.UsageError("--init-remote needs --remote PATH.")
        remote = make_remote(remote)
    with _as_driver():
        if stop:
            rows = memory_down(name, address=address)
        else:
            st = fleet_memory(name, remote, address=address, root=root).status()
    if stop:
        for r in rows:
            click.echo(f"{r.get('node_id', '')[:16]}: " + (f"error: {r['error']}" if r.get("error") else "stopped"))
        click.echo(f"{name}: down (the remote is kept)")
        return
    if as_json:
        click.echo(json.dumps(st, indent=2, sort_keys=True))
        return
    click.echo(f"{name}: writer on {st['node_id'][:16]}, commit {(st['commit'] or '-')[:12]}, {st['writes']} writes "
               f"since it started; remote {st['remote']}")
    for r in st["readers"]:
        click.echo(f"  reader {r['node_id'][:16]}: " + (f"error: {r['error']}" if r.get("error") and not r.get("commit")
                                                         else f"commit {(r.get('commit') or '-')[:12]}"))
