"""The docs hold to the repository: every file they name exists, every Python example parses, and every
`hutch.NAME` an example uses is exported. (tests/memory_store/test_readme_memory.py runs the README's memory
examples as written; tests/sandbox_sdk/test_sdk_readme.py its first sandbox examples.)"""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

import pytest

import hutch

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
#: a relative path with at least one folder, ending in one of these suffixes
PATH = re.compile(r"(?<![\w./~$:-])((?:[\w.-]+/)+[\w.-]+\.(?:py|md|txt|toml|json|sh|cfg|yaml|yml|sqlite))\b")
#: paths that are not the repository's: inside an example memory store (its classes, its relative symlinks),
#: made at run time, or the development machine's shared directory beside the repository (data sets, notes)
NOT_OURS = ("../", ".../", "actors/", "orgs/", "topics/", "churn/", "shared/", ".hutch/")


def tracked() -> list[str]:
    out = subprocess.run(["git", "-C", str(ROOT), "ls-files", "--cached", "--others", "--exclude-standard"],
                         capture_output=True, text=True, check=True).stdout.split()
    return [p for p in out if (ROOT / p).exists()]


def missing_paths(text: str, files: list[str]) -> list[str]:
    """The paths `text` names that no file of `files` is (or ends with: docs name a module inside its package,
    `_host/daemon/manager.py`, once the package is said)."""
    out = []
    for m in PATH.finditer(text):
        p = m.group(1)
        if p.startswith(NOT_OURS) or any(f == p or f.endswith("/" + p) for f in files):
            continue
        out.append(f"line {text[:m.start()].count(chr(10)) + 1}: {p}")
    return out


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_file_a_doc_names_exists(doc):
    bad = missing_paths(doc.read_text(), tracked())
    assert bad == [], f"{doc.relative_to(ROOT)} names files the repository does not have: {bad}"


def test_the_path_check_sees_what_it_forbids():
    files = ["hutch/sandbox/_host/daemon/manager.py", "README.md"]
    text = "see `_host/daemon/manager.py`, hutch/sandbox/gone.py and actors/alice-chen.md\n(docs/nothing.md)"
    assert missing_paths(text, files) == ["line 1: hutch/sandbox/gone.py", "line 2: docs/nothing.md"]


def python_blocks(doc: Path) -> list[tuple[int, str]]:
    text = doc.read_text()
    return [(text[:m.start()].count("\n") + 2, m.group(1)) for m in re.finditer(r"```python\n(.*?)```", text, re.S)]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_python_example_parses_and_uses_exported_names(doc):
    for line, code in python_blocks(doc):
        try:
            tree = ast.parse(code)
        except SyntaxError as e:
            pytest.fail(f"{doc.relative_to(ROOT)}, the example at line {line}: {e}")
        used = {n.attr for n in ast.walk(tree)
                if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "hutch"}
        unknown = sorted(u for u in used if not hasattr(hutch, u))
        assert unknown == [], f"{doc.relative_to(ROOT)}, the example at line {line} uses hutch.{unknown}"
