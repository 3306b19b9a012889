"""The public surface: `hutch.__all__` is complete, sorted, importable and documented (docs/python-api.md)."""

import ast
import pathlib
import re

import hutch

ROOT = pathlib.Path(hutch.__file__).parent


def test_all_is_sorted_and_importable():
    assert hutch.__all__ == sorted(hutch.__all__)
    for name in hutch.__all__:
        assert getattr(hutch, name) is not None, name


def _type_checking_names() -> set[str]:
    """The names hutch/__init__.py imports for type checkers (its `if TYPE_CHECKING:` block)."""
    tree = ast.parse((ROOT / "__init__.py").read_text())
    block = next(n for n in tree.body if isinstance(n, ast.If) and ast.unparse(n.test) == "TYPE_CHECKING")
    return {a.asname or a.name for n in block.body if isinstance(n, ast.ImportFrom) for a in n.names}


def test_all_is_complete():
    """Every public name the package binds is in __all__, each lazy name is seen by type checkers, and what the
    wings' packages export (their classes: hutch.memory re-exports from hutch) is exported from hutch too."""
    from hutch._core import errors
    import hutch.memory

    bound = {n for n, v in vars(hutch).items() if not n.startswith("_") and not isinstance(v, type(hutch))
             and n not in ("annotations", "TYPE_CHECKING")}
    assert bound - set(hutch.__all__) == set(), "bound in hutch but not in __all__"
    assert set(hutch.__all__) == set(errors.__all__) | {"MalformedEntityWarning", "ReasonerWarning"} | set(hutch._LAZY)
    assert _type_checking_names() == set(hutch._LAZY), "the TYPE_CHECKING imports and _LAZY must name the same"
    wing_classes = {n for n in hutch.memory.__all__ if isinstance(getattr(hutch.memory, n), type)}
    assert wing_classes - set(hutch.__all__) == set()
    for name, module in hutch._LAZY.items():
        assert getattr(hutch, name).__name__ == name, f"{module}.{name} is exported under another name"


def test_every_exported_name_is_documented():
    """docs/python-api.md has one row per name in __all__, and no row for a name that is not exported."""
    text = (ROOT.parent / "docs" / "python-api.md").read_text()
    rows = re.findall(r"^\| `hutch\.(\w+)` \|", text, re.M)
    assert len(rows) == len(set(rows)), "a name is listed twice"
    assert set(rows) == set(hutch.__all__), (set(hutch.__all__) - set(rows), set(rows) - set(hutch.__all__))


def test_every_error_derives_from_hutch_error():
    from hutch._core import errors

    for name in errors.__all__:
        assert issubclass(getattr(errors, name), hutch.Error)
        assert name in hutch.__all__, f"{name} is an error but not exported from hutch"


def test_wings_do_not_import_each_other():
    """hutch.sandbox never imports hutch.memory and vice versa (see docs/architecture.md)."""
    for wing, other in (("sandbox", "hutch.memory"), ("memory", "hutch.sandbox")):
        for path in (ROOT / wing).rglob("*.py"):
            tree = ast.parse(path.read_text(), str(path))
            for node in ast.walk(tree):
                names = []
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.module:
                    names = [node.module]
                for n in names:
                    assert not n.startswith(other), f"{path} imports {n}: the wings must stay apart"
