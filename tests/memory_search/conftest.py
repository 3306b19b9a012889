"""Fixtures for the search-index tests: a fresh store in a temp dir, removed afterwards (helpers and the small
LoCoMo-form conversation the tests ingest live in _search_helpers.py)."""

import shutil
import tempfile
from pathlib import Path

import pytest

import hutch


@pytest.fixture
def store_dir():
    d = Path(tempfile.mkdtemp(prefix="hutch-search-test-"))
    try:
        yield d / "mem"
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def mem(store_dir):
    m = hutch.Memory(store_dir)
    try:
        yield m
    finally:
        if m._search_index is not None:
            m._search_index.close()
