"""`hutch doctor`: how this host's daemon runs sandboxes (a thin wrapper over GET /v1/doctor)."""

from __future__ import annotations

import json

import click


def _lines(d: dict) -> list[tuple[str, str]]:
    img = d["images"]["default"]
    if img.get("built"):
        took = f", built in {img['build_seconds']:.0f} s" if img.get("build_seconds") else ""
        default = f"default image built ({img['key']}, {(img.get('size') or 0) / 1e6:.0f} MB{took})"
    else:
        default = f"default image not built yet ({img['key']}): the first sandbox of it builds it (about 2 minutes)"
    cg = d["cgroup"]
    return [
        ("daemon", f"pid {d['pid']}, hutch {d['version']}, kernel {d['kernel']}, run dir {d['run_dir']}"),
        ("mode", d["mode"]),
        ("userns", "yes" if d["userns"] else f"no: {d['userns_why_not']}"),
        ("idmap", {True: "yes (image layers and binds are idmapped per sandbox)", None: "not probed (no user namespace)"}
         .get(d["idmap"], "no")),
        ("cgroups", f"v{cg['version']}, under {cg['parent']}"),
        ("egress", "gateway running" if d["egress"] else "gateway not running: only Network.none() is served"),
        ("gvisor", f"available ({d['gvisor']['version']}): runtime=\"gvisor\", memory snapshots, fork"
         if d.get("gvisor", {}).get("available") else f"not available: {d.get('gvisor', {}).get('why_not')}"),
        ("pause", "cgroup freezer" if d.get("freezer") else "no cgroup freezer: sandboxes cannot be paused"),
        ("warm pool", f"{d['warm_pool']['ready']} of {d['warm_pool']['target']} inits ready"),
        ("sandboxes", f"{d['sandboxes']} running"),
        ("images", f"{default}; {d['images']['stored']} built images and snapshots in {d['state_dir']}"),
    ]


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print the daemon's report as JSON.")
def doctor(as_json):
    """Show how this host's daemon runs sandboxes: isolation mode (user namespaces, or the fallback and why),
    cgroup version, idmap support, egress gateway, warm pool, default image cache. Starts the daemon if none runs.

    \b
    Example:
      hutch doctor
    """
    from hutch.sandbox import _client

    d = _client.default_client().json("GET", "/v1/doctor")
    if as_json:
        click.echo(json.dumps(d, indent=1))
        return
    for k, v in _lines(d):
        click.echo(f"{k + ':':<11} {v}")
