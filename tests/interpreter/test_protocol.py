"""The SDK's half of the bridge protocol, I/O-free: what a hostile bridge (the sandbox's code) sends is bounded."""

from __future__ import annotations

import json

import pytest

import hutch
from hutch.sandbox.interpreter import CELL_RESULTS, CELL_STREAM, MAX_CHUNKS, Cell, Lines, check_code, request


def line(obj) -> bytes:
    return json.dumps(obj).encode() + b"\n"


def test_lines_split_across_chunks_and_skip_what_is_too_long_or_not_an_object():
    lines = Lines(limit=100)
    data = line({"id": 1, "kind": "stdout", "text": "a"}) + b"x" * 500 + b"\n" + b"[1, 2]\n" + b"not json\n" \
        + line({"id": 2, "kind": "done"})
    out = []
    for i in range(0, len(data), 7):   # in pieces that cut lines anywhere
        out += lines.feed(data[i:i + 7])
    assert [m["id"] for m in out] == [1, 2] and lines.oversized == 3


def test_a_cell_keeps_its_bounds_whatever_the_bridge_claims():
    cell = Cell("default")
    cell.feed({"kind": "stdout", "text": "x" * (CELL_STREAM + 10)})
    cell.feed({"kind": "stdout", "text": "more"})
    for _ in range(MAX_CHUNKS + 10):
        cell.feed({"kind": "stderr", "text": "e"})
    cell.feed({"kind": "result", "data": {"image/png": "A" * (CELL_RESULTS + 1), "text/plain": "t"}})
    cell.feed({"kind": "result", "data": "not a bundle"})
    cell.feed({"kind": "result", "data": {"text/plain": 5, "image/png": "!!notbase64"}, "main": True})
    cell.feed({"kind": "error", "name": ["odd"], "value": None, "traceback": "t" * 10_000_000})
    cell.feed({"kind": "done", "execution_count": "three", "restarted": "yes", "dropped": {"stdout": -5, "x": 1}})
    cell.feed({"kind": "stdout", "text": "after the end"})
    ex = cell.execution()
    assert sum(map(len, ex.logs.stdout)) == CELL_STREAM and ex.dropped["stdout"] == 14
    assert len(ex.logs.stderr) == MAX_CHUNKS and sum(map(len, ex.logs.stderr)) == MAX_CHUNKS + 10
    assert ex.dropped["results"] == CELL_RESULTS + 1 and ex.results[0].formats() == ["text"]
    assert ex.results[1].text is None and ex.results[1].png is None and ex.text is None
    assert len(ex.error.traceback) < 100_000 and ex.execution_count is None and ex.restarted is False


def test_requests_are_one_line_and_code_must_be_text():
    assert request("execute", id=1, code="a\nb", context=None).count(b"\n") == 1
    with pytest.raises(hutch.ConfigError, match="UTF-8"):
        check_code("bad \udc80 surrogate")
    with pytest.raises(hutch.ConfigError, match="NUL"):
        check_code("a\0b")
