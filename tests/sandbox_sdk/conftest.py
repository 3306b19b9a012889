"""Fixtures of the SDK suite: a private daemon, a tiny busybox root, and sandboxes that are always cleaned up.

The daemon runs with its own HUTCH_RUN_DIR / HUTCH_SOCKET, so it never meets a
host daemon; HUTCH_STATE_DIR stays the default so that the default image is
built once per machine and reused. Every sandbox a test makes carries the tag
suite=<this run>, and the session ends by terminating whatever has it.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest
import os

from hutch_testing import restore_env, sandbox_maker, session_daemon, temp_busybox_root
from sdk_support import REMOTE_ENV, RUN_TAG


@pytest.fixture(scope="session")
def daemon():
    """A private hutch daemon for the session; HUTCH_RUN_DIR/HUTCH_SOCKET point the SDK at it."""
    with session_daemon("hutch-sdk-run-", RUN_TAG) as run_dir:
        yield run_dir


@pytest.fixture(scope="session")
def busybox_root():
    """A tiny root filesystem: static busybox and its applets, enough for sh, cat, sleep, ls ..."""
    with temp_busybox_root("hutch-sdk-root-") as root:
        yield root


@pytest.fixture
def make_sandbox(daemon, busybox_root):
    """make_sandbox(*command, **create_kwargs) -> a Sandbox tagged for this run (busybox root by default),
    terminated when the test ends, also when it fails."""
    with sandbox_maker(busybox_root, RUN_TAG) as make:
        yield make


@pytest.fixture
def sb(make_sandbox):
    """One idle busybox sandbox."""
    return make_sandbox()


@pytest.fixture
def remote_dir():
    """A temp dir for a remote daemon's files (start_remote); the SDK's variables (REMOTE_ENV) restored after."""
    d = Path(tempfile.mkdtemp(prefix="hutch-sdk-remote-"))
    saved = {k: os.environ.get(k) for k in REMOTE_ENV}
    try:
        yield d
    finally:
        restore_env(saved)
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def public():
    """A sticky directory every user may write, as /tmp is (root's, 1777): where a second account plants things."""
    d = Path(tempfile.mkdtemp(prefix="hutch-public-"))
    os.chmod(d, 0o1777)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)
