"""Code that runs on the host as root: the daemon and its children (see docs/architecture.md)."""
