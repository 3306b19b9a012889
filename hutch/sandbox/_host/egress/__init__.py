"""The egress gateway: per-sandbox network policy enforced by one asyncio gateway per host.

The daemon uses only `Gateway` (start, attach, set_policy, log, detach, stop);
see gateway.py for the interface and docs/egress.md for the design.
"""

from hutch.sandbox._host.egress.attacher import DaemonAttacher, daemon_attacher
from hutch.sandbox._host.egress.audit import Decision, LogView
from hutch.sandbox._host.egress.gateway import Attachment, Gateway

__all__ = ["Attachment", "DaemonAttacher", "Decision", "Gateway", "LogView", "daemon_attacher"]
