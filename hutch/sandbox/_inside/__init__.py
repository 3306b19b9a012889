"""Code that runs inside a sandbox, sent there as source (see docs/architecture.md)."""
