"""`hutch mcp`: the MCP server (hutch/mcp, docs/mcp.md)."""

from __future__ import annotations

import click


@click.command()
@click.option("--store", "-s", metavar="PATH", envvar="HUTCH_MEMORY",
              help="Memory store the memory_* tools use (default: $HUTCH_MEMORY; none: no memory tools).")
@click.option("--no-sandboxes", is_flag=True, help="Leave out the sandbox_* tools.")
@click.option("--image", metavar="REF", help="Default image of sandbox_create (default: Debian with python3).")
@click.option("--http", is_flag=True, help="Serve streamable HTTP instead of stdio.")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address for --http.")
@click.option("--port", default=8765, show_default=True, type=int, help="Port for --http (path /mcp).")
@click.option("--allow-remote", is_flag=True,
              help="Let --http bind a non-loopback address. The server has no authentication of its own: "
                   "put an authenticating proxy in front of it.")
def mcp(store, no_sandboxes, image, http, host, port, allow_remote) -> None:
    """Serve sandboxes and memory as MCP tools, over stdio or streamable HTTP.

    \b
    Example (an MCP client's server entry):
      {"command": "hutch", "args": ["mcp", "--store", "/home/me/agent-memory"]}
    Example (HTTP, at http://127.0.0.1:8765/mcp):
      hutch mcp --store ./agent-memory --http
    """
    import ipaddress

    from hutch import mcp as hmcp
    from hutch._core.errors import ConfigError

    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if http and not loopback and not allow_remote:
        raise ConfigError(
            f"hutch mcp --http has no authentication, and anyone who reaches {host}:{port} could run code in "
            "sandboxes and change memory: serve 127.0.0.1 (the default), or put an authenticating proxy in "
            "front and pass --allow-remote.")
    hmcp.run(store, sandboxes=not no_sandboxes, image=image, http=http, host=host, port=port)
