"""Every public function of the memory store is documented, and the format spec names what the code uses."""

import inspect
from pathlib import Path

import pytest

import hutch
from hutch.memory import _format
from hutch.memory._history import MemoryView

DOCS = Path(__file__).resolve().parents[2] / "docs" / "smf-format.md"


@pytest.mark.parametrize("cls", [hutch.Memory, MemoryView, hutch.Entity, hutch.CheckReport])
def test_public_methods_have_docstrings(cls):
    assert cls.__doc__
    for name, member in inspect.getmembers(cls):
        if name.startswith("_") or not (inspect.isfunction(member) or isinstance(member, property)):
            continue
        doc = member.__doc__ if not isinstance(member, property) else member.fget.__doc__
        if isinstance(member, property) and name in ("cls", "slug", "title", "source", "tags", "valid_from",
                                                     "valid_to", "ok", "errors", "warnings", "path"):
            continue  # self-describing accessors
        assert doc and doc.strip(), f"{cls.__name__}.{name} has no docstring"


def test_format_spec_lists_every_standard_key_and_reserved_name():
    text = DOCS.read_text()
    for key in _format.STANDARD_KEYS:
        assert f"`{key}`" in text, key
    for name in _format.RESERVED_CLASSES:
        assert f"`{name}`" in text, name
    for code in ["dangling-link", "bad-front-matter", "orphan", "link-escapes", "id-mismatch"]:
        assert f"`{code}`" in text, code


def test_resolve_path_refuses_paths_outside_the_store(mem, store_dir, tmp_path):
    mem.put("actors", "A")
    assert mem.resolve_path(store_dir / "actors" / "a.md") == "actors/a"
    assert mem.resolve_path("actors/a.md") == "actors/a"
    for bad in [tmp_path / "x.md", "../x.md", "actors/a.links/knows/b.md", ".hutch/index.md"]:
        with pytest.raises(hutch.StorePathError):
            mem.resolve_path(bad)
