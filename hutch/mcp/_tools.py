"""Registering tools: annotations that say what a tool may do, errors a model can act on, aliases."""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable

from mcp.server.mcpserver.exceptions import ToolError
from mcp.types import ToolAnnotations

from hutch._core.errors import ConfigError, Error

#: Reads only: safe to call any time, any number of times.
READ_ONLY = ToolAnnotations(read_only_hint=True, destructive_hint=False, idempotent_hint=True, open_world_hint=False)
#: Adds to what exists (a commit, a link, a file); repeating it is harmless or adds again.
WRITE = ToolAnnotations(read_only_hint=False, destructive_hint=False, idempotent_hint=False, open_world_hint=False)
#: Replaces or ends something (a file's bytes, a sandbox).
DESTRUCTIVE = ToolAnnotations(read_only_hint=False, destructive_hint=True, idempotent_hint=True,
                              open_world_hint=False)
#: Runs code: anything may happen inside the sandbox (never outside it).
RUNS_CODE = ToolAnnotations(read_only_hint=False, destructive_hint=True, idempotent_hint=False,
                            open_world_hint=True)


def first(**named: Any) -> Any:
    """The first given (not None) of several aliases of one argument; ConfigError if two disagree."""
    given = {k: v for k, v in named.items() if v is not None}
    values = list(given.values())
    if len(values) > 1 and any(v != values[0] for v in values[1:]):
        raise ConfigError(f"{' and '.join(given)} name the same argument with different values: give one.")
    return values[0] if values else None


def tool(server, annotations: ToolAnnotations) -> Callable:
    """Register `fn` as a tool; hutch errors become tool errors whose text names the fix."""

    def deco(fn):
        @functools.wraps(fn)
        def wrapped(*a, **kw):
            try:
                return fn(*a, **kw)
            except Error as e:
                raise ToolError(f"{type(e).__name__}: {e}") from e

        wrapped.__signature__ = inspect.signature(fn)
        server.add_tool(wrapped, name=fn.__name__, annotations=annotations)
        return fn

    return deco
