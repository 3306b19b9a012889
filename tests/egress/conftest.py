"""Fixtures of the egress conformance suite; the fake internet lives in egress_world.py."""

from __future__ import annotations

import pytest

from egress_world import World


@pytest.fixture(scope="session")
def world(tmp_path_factory):
    w = World(tmp_path_factory.mktemp("egress"))
    try:
        w.up()
        yield w
    finally:
        w.down()


@pytest.fixture
def sandbox(world):
    """sandbox(policy) -> a fresh attached netns, removed after the test."""
    made = []

    def make(policy, attach=True):
        sb = world.sandbox(policy, attach)
        made.append(sb)
        return sb

    try:
        yield make
    finally:
        for sb in made:
            world.drop_sandbox(sb)
