"""The default image build: a failed build leaves nothing behind (the good path runs in test_default_image)."""

import os

import pytest

import hutch
from hutch.sandbox import _images


def test_failed_build_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("HUTCH_STATE_DIR", str(tmp_path))
    # an unreachable mirror on loopback: debootstrap fails at its first download
    monkeypatch.setenv(_images.ENV_DEBIAN_MIRROR, "http://127.0.0.1:9/debian")
    events = []
    with pytest.raises(hutch.ImageError, match="debootstrap of the default image failed.*HUTCH_DEBIAN_MIRROR"):
        _images.ensure_image("debian-slim", events.append)
    assert events and events[0]["phase"] == "start"
    assert all({"phase", "message", "bytes", "elapsed"} <= set(e) for e in events)
    left = [p for p in os.listdir(tmp_path / "images") if not p.endswith(".lock")]
    assert left == []
    with pytest.raises(hutch.NotFoundError, match="not built yet"):
        _images.resolve_image("debian-slim")
    with open("/proc/self/mountinfo") as f:
        assert str(tmp_path) not in f.read()


def test_unknown_and_directory_refs(tmp_path):
    with pytest.raises(hutch.NotFoundError, match="Image.from_directory"):
        _images.ensure_image("no-such-image")
    r = _images.ensure_image(f"dir:{tmp_path}")
    assert r.lowerdirs == (tmp_path,)
