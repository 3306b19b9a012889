"""The memory wing: SMF, the Semantic Memory Filesystem. Never imports hutch.sandbox.

`Memory` (the store), `Entity`, `Neighbor`, `Version`, `CheckReport` and
`CheckIssue` are defined in private modules and re-exported here and from
`hutch` (with the search index's and the extractor's public names: docs/python-api.md
lists them all). The on-disk format is specified in docs/smf-format.md.
"""

from hutch._core.extras import require

require("hutch.memory", "memory")   # numpy, pyyaml, the embedding model: one line naming the extra, not a traceback

from hutch.memory._entity import CheckIssue, CheckReport, Entity, Neighbor, Version  # noqa: E402
from hutch.memory._format import slugify  # noqa: E402
from hutch.memory._store import Memory  # noqa: E402

__all__ = ["CheckIssue", "CheckReport", "Entity", "Memory", "Neighbor", "Version", "slugify"]
