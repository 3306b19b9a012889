"""Fixtures of the image suite: a private daemon with a private state dir (its own layer store and
volumes), a busybox root as the base image, and sandboxes that are always cleaned up."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest
from hutch_testing import sandbox_maker, sdk_pointed_at
from hutch_testing import temp_busybox_root
from img_support import RUN_TAG, start_daemon, stop_daemon

class Daemon:
    """The suite's daemon; `restart()` stops it and starts a new one on the same dirs."""

    def __init__(self, run_dir: Path, state_dir: Path):
        self.run_dir, self.state_dir = run_dir, state_dir
        self.proc = start_daemon(run_dir)

    def restart(self) -> None:
        stop_daemon(self.proc)
        self.proc = start_daemon(self.run_dir)

    def stop(self) -> None:
        if self.proc.poll() is None:
            import hutch

            try:
                for sb in hutch.Sandbox.list(tags=RUN_TAG):
                    sb.terminate()
            finally:
                stop_daemon(self.proc)


@pytest.fixture(scope="module")
def daemon():
    """A private daemon per module: the environment it sets must not outlive this directory's tests."""
    run_dir = Path(tempfile.mkdtemp(prefix="hutch-img-run-"))
    state_dir = Path(tempfile.mkdtemp(prefix="hutch-img-state-"))
    d = None
    try:
        with sdk_pointed_at(run_dir, HUTCH_STATE_DIR=str(state_dir)):
            d = Daemon(run_dir, state_dir)
            try:
                yield d
            finally:
                d.stop()
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
        shutil.rmtree(state_dir, ignore_errors=True)


@pytest.fixture(scope="session")
def busybox_root():
    busybox = shutil.which("busybox")
    if busybox is None:
        pytest.fail("busybox is not installed; run scripts/setup.sh (busybox-static is in scripts/debian-packages.txt).")
    with temp_busybox_root("hutch-img-root-", busybox) as root:
        yield root


@pytest.fixture
def base(daemon, busybox_root):
    import hutch

    return hutch.Image.from_directory(busybox_root)


@pytest.fixture
def make_sandbox(daemon, busybox_root):
    """make_sandbox(**create_kwargs) -> a Sandbox tagged for this run, terminated when the test ends."""
    with sandbox_maker(busybox_root, RUN_TAG) as make:
        yield make
