"""Shared by the SDK suite's conftest and tests (a unique module name: the tests/ tree has several conftests)."""

import uuid

#: Every sandbox the suite makes carries this tag; the session ends by terminating whatever has it.
RUN_TAG = {"suite": f"sdk-{uuid.uuid4().hex[:8]}"}
