"""Fixtures of the code-interpreter suite: a private daemon, the code-interpreter image, and sandboxes that
are always cleaned up.

The image (the default image + ipykernel, jupyter_client, numpy, pandas, matplotlib) is built once per
machine through the image builder and cached under the state dir (the first build takes a minute or more);
only this suite and the adapters' run_code tests use it, so no other module waits for it.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest
from hutch_testing import sdk_pointed_at, start_daemon, stop_daemon
from interp_support import RUN_TAG

import hutch



@pytest.fixture(scope="session")
def daemon():
    run_dir = Path(tempfile.mkdtemp(prefix="hutch-interp-run-"))
    proc = None
    try:
        with sdk_pointed_at(run_dir):
            proc = start_daemon(run_dir)
            try:
                yield {"HUTCH_RUN_DIR": str(run_dir), "HUTCH_SOCKET": str(run_dir / "hutch.sock")}
            finally:
                if proc.poll() is None:
                    for sb in hutch.Sandbox.list(tags=RUN_TAG):
                        sb.terminate()
    finally:
        if proc is not None:
            stop_daemon(proc)
        shutil.rmtree(run_dir, ignore_errors=True)


@pytest.fixture(scope="session")
def image(daemon):
    """The code-interpreter image, built (or found cached) once for the session."""
    return hutch.Image.code_interpreter().build(quiet=True)


@pytest.fixture
def make(image):
    """make(**create_kwargs) -> a code-interpreter Sandbox tagged for this run, terminated when the test ends."""
    made = []

    def make_one(**kw):
        kw.setdefault("image", image)
        kw.setdefault("timeout", 180)
        kw["tags"] = {**RUN_TAG, **(kw.get("tags") or {})}
        sb = hutch.Sandbox.create(**kw)
        made.append(sb)
        return sb

    try:
        yield make_one
    finally:
        for sb in made:
            sb.terminate()


@pytest.fixture
def sb(make):
    return make()
