"""The FUSE view of a memory store, and memory mounted into sandboxes.

`hutch mem mount STORE MOUNTPOINT` shows a store as a filesystem in which a
query is a directory (`ls "search/customer churn/"`), the past is a directory
(`as-of/2026-11-01/`), and `profile.md` is a digest generated on read; writes
become commits with provenance. `hutch.MemoryMount` mounts the same view into
a sandbox. This package joins the two wings (it may import both); neither of
them imports it. See docs/fuse.md.
"""

from hutch._core.extras import require

require("hutch.fuse", "fuse")

from hutch.fuse._mount import mount, serve, umount  # noqa: E402

__all__ = ["mount", "serve", "umount"]
