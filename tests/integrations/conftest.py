"""Fixtures of the adapter tests: a private daemon, a busybox image, a real store, and leak checks.

The frameworks are real (LangChain, LangGraph, LlamaIndex, the anthropic and openai clients, the Agents SDK,
smolagents); only the model is fake, at the model boundary (see fake_llm.py). A module whose framework is not
installed is skipped with the extra that installs it (scripts/setup.sh installs them all).
"""

from __future__ import annotations

import asyncio

import pytest

import hutch
from hutch_testing import session_daemon, temp_busybox_root
from integ_support import RUN_TAG, running



@pytest.fixture(scope="session")
def daemon():
    """A private hutch daemon for the session (the SDK points at it); every sandbox is gone at the end."""
    with session_daemon("hutch-integ-run-", None) as run_dir:
        yield {"HUTCH_RUN_DIR": str(run_dir), "HUTCH_SOCKET": str(run_dir / "hutch.sock")}


@pytest.fixture
def own_event_loop():
    """The thread's default event loop, new for this test and closed after it. The Agents SDK's Runner.run_sync
    runs on the thread's default loop and leaves it open after calling its shutdown_asyncgens(), so on one loop
    shared by the tests every later run's first async generator (httpx2's auth flow in the openai client) is
    'scheduled after loop.shutdown_asyncgens() call' (a ResourceWarning): each test's runs get a loop of their own."""
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    try:
        yield loop
    finally:
        asyncio.set_event_loop(None)
        loop.close()


@pytest.fixture(scope="session")
def busybox_image():
    """A busybox root (sh, cat, ls, sed ...; no python) as an image."""
    with temp_busybox_root("hutch-integ-root-") as root:
        yield hutch.Image.from_directory(root)


@pytest.fixture
def opts(daemon, busybox_image):
    """sandbox_options for an adapter that makes its own sandbox: the busybox image, a short life."""
    return {"image": busybox_image, "timeout": 120, "tags": RUN_TAG}


@pytest.fixture
def sb(daemon, busybox_image):
    """A busybox sandbox the test owns, terminated when it ends (also when it fails)."""
    s = hutch.Sandbox.create(image=busybox_image, timeout=120, tags=RUN_TAG)
    try:
        yield s
    finally:
        s.terminate()


@pytest.fixture
def store(tmp_path):
    """A real store with a few entities."""
    mem = hutch.Memory(tmp_path / "store")
    acme = mem.put("orgs", "Acme", body="Acme worries about customer churn: clients cancel after onboarding.")
    mem.link(mem.put("actors", "Alice Chen", body="Head of data at Acme.", facts=["prefers weekly reports"]),
             "works_at", acme)
    mem.put("topics", "Pricing", body="Tiered pricing was decided in November.")
    return mem


@pytest.fixture
def no_leaks(daemon):
    """Asserts at the end of the test that no sandbox an adapter made in it is still running."""
    before = set(running())
    yield
    left = set(running()) - before
    for sid in left:   # clean up before failing, so one leak does not cascade into other tests
        hutch.Sandbox.from_id(sid).terminate()
    assert not left, f"sandboxes made by an adapter are still running: {sorted(left)}"
