"""The memory wing: SMF, the Semantic Memory Filesystem. Never imports hutch.sandbox."""
