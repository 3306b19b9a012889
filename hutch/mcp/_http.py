"""`hutch mcp --http`: the MCP SDK's streamable-HTTP app behind a bearer token, served by uvicorn.

The server's tools run code and change memory with the rights of whoever started
it (and its sandbox tools drive the root daemon), so nobody reaches the app without
the token: a request without `Authorization: Bearer <token>` (compared in constant
time) gets 401 before the MCP SDK sees it.
"""

from __future__ import annotations

import json
import secrets

from hutch._core import settings
from hutch._core.errors import ConfigError
from hutch._core.tokens import check_token, token_matches

#: Environment variable with the token of `hutch mcp --http` (distinct from the daemon's HUTCH_TOKEN).
ENV_TOKEN = settings.MCP_TOKEN.name


def new_token() -> str:
    """A fresh random token (256 bits), for a server started without one."""
    return secrets.token_urlsafe(32)


class BearerAuth:
    """ASGI middleware: HTTP requests must carry the bearer token; lifespan events pass; anything else is refused."""

    def __init__(self, app, token: str):
        self.app = app
        self.token = check_token(token, "the MCP server's token")

    async def __call__(self, scope, receive, send):
        if scope["type"] == "lifespan":
            return await self.app(scope, receive, send)
        if scope["type"] == "http":
            header = next((v for k, v in scope.get("headers", ()) if k == b"authorization"), b"")
            if token_matches(header.decode("latin-1"), self.token):
                return await self.app(scope, receive, send)
            body = json.dumps({"error": "unauthorized", "message": "this MCP server needs Authorization: Bearer "
                               "<token>; the token is the one `hutch mcp --http` printed or read from "
                               "--token-file / $HUTCH_MCP_TOKEN."}).encode()
            await send({"type": "http.response.start", "status": 401,
                        "headers": [(b"content-type", b"application/json"), (b"www-authenticate", b"Bearer"),
                                    (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body})
            return None
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
        return None


def serve_http(server, *, host: str, port: int, token: str | None) -> None:
    """Serve `server` (an MCPServer) at http://host:port/mcp behind BearerAuth until stopped."""
    import anyio
    import uvicorn

    if not token:
        raise ConfigError("the MCP server over HTTP needs a token: pass --token-file PATH or set HUTCH_MCP_TOKEN "
                          "(`hutch mcp --http` makes one when neither is given).")
    app = BearerAuth(server.streamable_http_app(host=host), token)
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", timeout_keep_alive=5)
    anyio.run(uvicorn.Server(config).serve)


__all__ = ["ENV_TOKEN", "BearerAuth", "new_token", "serve_http"]
