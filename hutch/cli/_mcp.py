"""`hutch mcp`: the MCP server (hutch/mcp, docs/mcp.md)."""

from __future__ import annotations

import sys

import click

from hutch._core import settings


@click.command()
@click.option("--store", "-s", metavar="PATH", envvar=settings.MEMORY.name,
              help="Memory store the memory_* tools use (default: $HUTCH_MEMORY; none: no memory tools).")
@click.option("--no-sandboxes", is_flag=True, help="Leave out the sandbox_* tools.")
@click.option("--image", metavar="REF", help="Default image of sandbox_create (default: Debian with python3).")
@click.option("--allow-host-dirs", is_flag=True,
              help="Let clients name host directories as images (dir:...) and bind host paths. Default: refused.")
@click.option("--http", is_flag=True, help="Serve streamable HTTP (bearer token required) instead of stdio.")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address for --http.")
@click.option("--port", default=8765, show_default=True, type=int, help="Port for --http (path /mcp).")
@click.option("--token-file", type=click.Path(dir_okay=False), metavar="PATH",
              help="File holding the token --http clients must send (mode 0600; else $HUTCH_MCP_TOKEN; else a "
                   "new one is made and printed).")
@click.option("--allow-remote", is_flag=True,
              help="Let --http bind a non-loopback address. It speaks plain HTTP, so the token would cross the "
                   "network in the clear: put a TLS-terminating proxy in front of it.")
def mcp(store, no_sandboxes, image, allow_host_dirs, http, host, port, token_file, allow_remote) -> None:
    """Serve sandboxes and memory as MCP tools, over stdio or streamable HTTP.

    Over HTTP every request needs `Authorization: Bearer <token>`. Over either,
    clients may not use host directories (dir: images, host binds) unless
    --allow-host-dirs is given, and act only on the sandboxes this server created.

    \b
    Example (an MCP client's server entry):
      {"command": "hutch", "args": ["mcp", "--store", "/home/me/agent-memory"]}
    Example (HTTP, at http://127.0.0.1:8765/mcp; prints the token clients send):
      hutch mcp --store ./agent-memory --http
    """
    import ipaddress
    from hutch import mcp as hmcp
    from hutch._core.errors import ConfigError
    from hutch._core.tokens import check_token, read_token_file
    from hutch.mcp._http import ENV_TOKEN, new_token

    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if http and not loopback and not allow_remote:
        raise ConfigError(
            f"hutch mcp --http speaks plain HTTP, and anyone on the path to {host}:{port} could read its token and "
            "then run code in sandboxes and change memory: serve 127.0.0.1 (the default), or put a TLS-terminating "
            "proxy in front and pass --allow-remote.")
    token = None
    if http:
        if token_file:
            token = read_token_file(token_file)
        elif env_token := settings.MCP_TOKEN.pop():
            token = check_token(env_token.strip(), f"${ENV_TOKEN}")
        else:
            token = new_token()
            print(f"hutch mcp: serving http://{host}:{port}/mcp; clients send the header\n"
                  f"  Authorization: Bearer {token}\n"
                  f"(a new token each start; give --token-file or ${ENV_TOKEN} to keep one)", file=sys.stderr, flush=True)
    hmcp.run(store, sandboxes=not no_sandboxes, image=image, http=http, host=host, port=port, token=token,
             allow_host_dirs=allow_host_dirs)
