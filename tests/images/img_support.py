"""Helpers of the image suite (a unique module name: the tests/ tree has several conftests)."""

from __future__ import annotations

import uuid

from hutch_testing import make_busybox_root, start_daemon, stop_daemon

#: Every sandbox the suite makes carries this tag; the session ends by terminating whatever has it.
RUN_TAG = {"suite": f"img-{uuid.uuid4().hex[:8]}"}

__all__ = ["RUN_TAG", "make_busybox_root", "start_daemon", "stop_daemon"]
