"""hutch's MCP server: sandboxes and memory as tools for any agent framework.

    hutch mcp --store ./agent-memory            # stdio
    hutch mcp --store ./agent-memory --http     # streamable HTTP on 127.0.0.1:8765/mcp, bearer token

`build_server()` composes both wings (this entry point may import both; they
never import each other). Over HTTP every request needs `Authorization: Bearer
<token>` (_http.py). See docs/mcp.md for the tools and their arguments.
"""

from __future__ import annotations

import os

from hutch._core.extras import require

require("hutch.mcp", "mcp")

#: Defaults of `hutch mcp --http`.
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8765
INSTRUCTIONS = (
    "hutch gives you isolated Linux sandboxes to run code in (sandbox_* tools) and a long-term memory "
    "of entities, facts and links kept as files with full history (memory_* tools). Search memory before "
    "asking the user again; remember what matters with memory_put and memory_link, naming the source."
)


def build_server(store: str | os.PathLike | None = None, *, sandboxes: bool = True, image: str | None = None,
                 allow_host_dirs: bool = False):
    """An MCPServer with the memory tools (if `store` is given) and the sandbox tools (if `sandboxes`).

    `allow_host_dirs`: clients may name `dir:` images and bind host paths (hutch/mcp/_policy.py)."""
    from mcp.server.mcpserver import MCPServer

    import hutch

    server = MCPServer("hutch", instructions=INSTRUCTIONS, version=hutch.__version__, log_level="WARNING")
    mem = None
    if store is not None:
        from hutch.mcp import _memory_tools

        mem = hutch.Memory(store)
        _memory_tools.register(server, mem)
    if sandboxes:
        from hutch.mcp import _sandbox_tools

        def mount(writable: bool, target: str):
            return hutch.MemoryMount(mem, target, writable=writable)
        from hutch.mcp._policy import HostAccess

        _sandbox_tools.register(server, image=image, memory_mount=mount if mem is not None else None,
                                policy=HostAccess(allow_host_dirs=allow_host_dirs, default_image=image))
    return server


def run(store=None, *, sandboxes: bool = True, image: str | None = None, http: bool = False,
        host: str = DEFAULT_HOST, port: int = DEFAULT_PORT, token: str | None = None,
        allow_host_dirs: bool = False) -> None:
    """Serve over stdio (default) or streamable HTTP at http://host:port/mcp, until stopped.

    Over HTTP every request must carry `Authorization: Bearer <token>`; `token` is required."""
    server = build_server(store, sandboxes=sandboxes, image=image, allow_host_dirs=allow_host_dirs)
    if http:
        from hutch.mcp._http import serve_http

        serve_http(server, host=host, port=port, token=token)
    else:
        server.run("stdio")


__all__ = ["DEFAULT_HOST", "DEFAULT_PORT", "build_server", "run"]
