"""The memory store and its FUSE view keep to their parts: no module reaches into another's private names."""

import ast
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "hutch"
# hutch/memory/_index is the search index's own package (its own suite keeps it)
PACKAGES = [("memory", ROOT / "memory", {"_index"}), ("fuse", ROOT / "fuse", set())]
#: third-party names with no public equivalent, each with the reason
ALLOWED = {
    "mfusepy._libfuse": "mfusepy has no public handle of the libfuse it loaded (hutch/fuse/_kcache.py)",
}


def _modules():
    for pkg, path, skip in PACKAGES:
        for f in sorted(path.rglob("*.py")):
            if not skip & set(f.relative_to(path).parts):
                yield pkg, f


def _is_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def private_uses(source: str) -> list[str]:
    """`from m import _x` (not a module) and `obj._x` on anything but self, cls or super()."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module:
            for a in node.names:
                if a.name.startswith("_") and not _is_module(f"{node.module}.{a.name}"):
                    out.append(f"line {node.lineno}: from {node.module} import {a.name}")
        elif isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            v = node.value
            if isinstance(v, ast.Name) and v.id in ("self", "cls"):
                continue
            if isinstance(v, ast.Call) and isinstance(v.func, ast.Name) and v.func.id == "super":
                continue
            if ast.unparse(node) in ALLOWED:
                continue
            out.append(f"line {node.lineno}: {ast.unparse(node)}")
    return out


@pytest.mark.parametrize("pkg,path", [(p, f) for p, f in _modules()], ids=lambda x: getattr(x, "name", x))
def test_no_module_uses_another_modules_private_names(pkg, path):
    assert private_uses(path.read_text()) == [], f"{path.relative_to(ROOT.parent)}: use a public name"


def test_the_check_sees_what_it_forbids():
    found = private_uses("from hutch.fuse._handles import _x\nimport a\na.b._lock\nself._ok\nsuper()._ok\n")
    assert found == ["line 1: from hutch.fuse._handles import _x", "line 3: a.b._lock"]
