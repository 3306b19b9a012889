"""The egress gateway: per-sandbox network policy enforced by one asyncio gateway per host.

The daemon uses only `Gateway` (start, attach, set_policy, log, detach, stop);
see _gateway.py for the interface and docs/egress.md for the design.
"""

from hutch.sandbox._egress._daemon import DaemonAttacher, daemon_attacher
from hutch.sandbox._egress._audit import Decision, LogView
from hutch.sandbox._egress._gateway import Attachment, Gateway

__all__ = ["Attachment", "DaemonAttacher", "Decision", "Gateway", "LogView", "daemon_attacher"]
