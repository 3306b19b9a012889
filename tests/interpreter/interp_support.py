"""What the code-interpreter tests share beside their fixtures (a module of its own, not conftest: test
directories collected in one run each have a conftest, and `from conftest import` would pick whichever came first)."""

from __future__ import annotations

import uuid

#: Every sandbox the suite makes carries this tag; the session ends by terminating whatever has it.
RUN_TAG = {"suite": f"interp-{uuid.uuid4().hex[:8]}"}
