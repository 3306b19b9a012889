"""The public API, the spec and the core type-check clean: mypy with the configuration in pyproject.toml
([tool.mypy]: which modules, and which are left out)."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_mypy_is_clean_on_the_public_api_and_the_spec():
    pytest.importorskip("mypy", reason="mypy is in the dev extra (scripts/setup.sh installs it)")
    r = subprocess.run([sys.executable, "-m", "mypy", "--no-incremental", "--no-error-summary"], cwd=ROOT,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr


def test_the_checked_files_include_the_public_modules():
    files = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"]["files"])
    for must in ("hutch/__init__.py", "hutch/_core", "hutch/sandbox/sandbox.py", "hutch/sandbox/aio.py",
                 "hutch/sandbox/_spec.py", "hutch/sandbox/_api.py", "hutch/memory/__init__.py"):
        assert must in files, must
    assert all((ROOT / f).exists() for f in files)
