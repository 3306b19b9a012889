"""The public surface: `hutch.__all__` is complete, sorted and importable."""

import ast
import pathlib

import hutch

ROOT = pathlib.Path(hutch.__file__).parent


def test_all_is_sorted_and_importable():
    assert hutch.__all__ == sorted(hutch.__all__)
    for name in hutch.__all__:
        assert getattr(hutch, name) is not None, name


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
