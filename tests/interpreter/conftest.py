"""Fixtures of the code-interpreter suite: a private daemon, the code-interpreter image, and sandboxes that
are always cleaned up.

The image (the default image + ipykernel, jupyter_client, numpy, pandas, matplotlib) is built once per
machine through the image builder and cached under the state dir (the first build takes a minute or more);
only this suite and the adapters' run_code tests use it, so no other module waits for it.
"""

from __future__ import annotations

import pytest
from hutch_testing import sandbox_maker, session_daemon
from interp_support import RUN_TAG

import hutch



@pytest.fixture(scope="session")
def daemon():
    with session_daemon("hutch-interp-run-", RUN_TAG) as run_dir:
        yield {"HUTCH_RUN_DIR": str(run_dir), "HUTCH_SOCKET": str(run_dir / "hutch.sock")}


@pytest.fixture(scope="session")
def image(daemon):
    """The code-interpreter image, built (or found cached) once for the session."""
    return hutch.Image.code_interpreter().build(quiet=True)


@pytest.fixture
def make(image):
    """make(**create_kwargs) -> a code-interpreter Sandbox tagged for this run, terminated when the test ends."""
    with sandbox_maker(image, RUN_TAG, timeout=180) as make_one:
        yield make_one


@pytest.fixture
def sb(make):
    return make()
