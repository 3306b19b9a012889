"""The default image build: a failed build leaves nothing behind (the good path runs in test_default_image)."""

import os

import pytest

import hutch
from hutch.sandbox._host import images


def test_failed_build_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("HUTCH_STATE_DIR", str(tmp_path))
    # an unreachable mirror on loopback: debootstrap fails at its first download
    monkeypatch.setenv(images.ENV_DEBIAN_MIRROR, "http://127.0.0.1:9/debian")
    events = []
    with pytest.raises(hutch.ImageError, match="debootstrap of the default image failed.*HUTCH_DEBIAN_MIRROR"):
        images.ensure_image("debian-slim", events.append)
    assert events and events[0]["phase"] == "start"
    assert all({"phase", "message", "bytes", "elapsed"} <= set(e) for e in events)
    left = [p for p in os.listdir(tmp_path / "images") if not p.endswith(".lock")]
    assert left == []
    with pytest.raises(hutch.NotFoundError, match="not built yet"):
        images.resolve_image("debian-slim")
    with open("/proc/self/mountinfo") as f:
        assert str(tmp_path) not in f.read()


def test_unknown_and_directory_refs(tmp_path):
    with pytest.raises(hutch.NotFoundError, match="Image.from_directory"):
        images.ensure_image("no-such-image")
    r = images.ensure_image(f"dir:{tmp_path}")
    assert r.lowerdirs == (tmp_path,)


def test_an_image_cached_under_an_older_definition_is_not_used(tmp_path, monkeypatch):
    """The default image's cache key changes with its definition: the entry of an older one (python3-minimal,
    cached as images/debian-slim) is neither used nor replaced; it may still serve an older daemon."""
    monkeypatch.setenv("HUTCH_STATE_DIR", str(tmp_path))
    old = tmp_path / "images" / "debian-slim"
    (old / "rootfs").mkdir(parents=True)
    (old / "image.json").write_text('{"ref": "debian-slim", "id": "debian-slim-bookworm-1", "size": 1}')
    with pytest.raises(hutch.NotFoundError, match="not built yet"):
        images.resolve_image("debian-slim")
    assert images.default_image_status()["built"] is False
    key = images.default_image_key()
    assert key != "debian-slim" and key.startswith("debian-slim-bookworm-")
    monkeypatch.setattr(images, "DEBIAN_EXTRA_PACKAGES", images.DEBIAN_EXTRA_PACKAGES + ("git",))
    assert images.default_image_key() != key
    monkeypatch.setattr(images, "DEBIAN_EXTRA_PACKAGES", ("python3-minimal", "ca-certificates"))
    assert images.default_image_key() not in (key, "debian-slim")
    assert (old / "image.json").exists()
