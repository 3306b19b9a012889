"""Fixtures for the SMF store tests: a fresh store in a temp dir, removed afterwards."""

import shutil
import tempfile
from pathlib import Path

import pytest

import hutch


@pytest.fixture
def store_dir():
    d = Path(tempfile.mkdtemp(prefix="hutch-mem-test-"))
    try:
        yield d / "agent-memory"
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def mem(store_dir):
    return hutch.Memory(store_dir)
