"""The source has no unused imports or variables, undefined names or placeholder-less f-strings (pyflakes, the dev
extra), in the package, the tests and the benchmarks alike."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

pyflakes_api = pytest.importorskip("pyflakes.api", reason="pip install -e '.[dev]' (pyflakes)")
from pyflakes.reporter import Reporter  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def flakes(*paths: Path) -> list[str]:
    out, err = io.StringIO(), io.StringIO()
    pyflakes_api.checkRecursive([str(p) for p in paths], Reporter(out, err))
    return [line for line in (out.getvalue() + err.getvalue()).splitlines() if line]


@pytest.mark.parametrize("tree", ["hutch", "tests", "bench"])
def test_pyflakes_clean(tree):
    found = flakes(ROOT / tree)
    assert found == [], "pyflakes found (fix the cause; pyflakes reads no noqa):\n" + "\n".join(found)


def test_the_check_sees_an_unused_import(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import os\n\n\ndef f():\n    x = 1\n    return f'plain'\n")
    found = flakes(bad)
    assert len(found) == 3 and "'os' imported but unused" in found[0], found
