"""Fixtures of the fleet suite: one real 3-node Ray cluster on loopback with a hutch fleet, for the session."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest
from fleet_support import RUN_TAG, RayFleet
from hutch_testing import make_busybox_root

pytest.importorskip("ray", reason="the fleet needs Ray: pip install 'hutch[ray]' (scripts/setup.sh installs it)")

@pytest.fixture(scope="session")
def ray_fleet():
    f = RayFleet()
    try:
        yield f
    finally:
        f.close()


@pytest.fixture(scope="session")
def fleet_busybox():
    tmp = Path(tempfile.mkdtemp(prefix="hutch-fleet-root-"))
    try:
        yield make_busybox_root(tmp / "root")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture
def fleet_sdk(ray_fleet):
    """The SDK pointed at the fleet for one test; every sandbox tagged RUN_TAG is ended after it."""
    import hutch
    from hutch.sandbox import _client

    ray_fleet.sdk()
    try:
        yield ray_fleet
    finally:
        for sb in hutch.Sandbox.list(tags=RUN_TAG):
            sb.terminate()
        _client._connected.clear()
