"""What the adapter tests share beside their fixtures (a module of its own, not conftest: test directories
collected in one run each have a conftest, and `from conftest import` would pick whichever came first)."""

from __future__ import annotations

import uuid

import hutch

#: Every sandbox a test makes itself carries this tag; adapters tag theirs created_by=hutch-integrations.
RUN_TAG = {"suite": f"integrations-{uuid.uuid4().hex[:8]}"}


def running(tags: dict | None = None) -> list[str]:
    """Ids of sandboxes an adapter made that are still running (tags: created_by=hutch-integrations)."""
    want = {"created_by": "hutch-integrations", **(tags or {})}
    return [s.id for s in hutch.Sandbox.list(tags=want) if s.status not in ("exited", "terminated", "timeout",
                                                                              "idle_timeout", "oom", "failed")]
