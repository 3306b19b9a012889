"""The daemon's log, rate-limited: a flood of one kind of event costs a few lines, not the disk.

    log = RateLog()
    log.note("refused-peer", "refused a connection from uid 1001 ...")

The first BURST lines of a kind in each INTERVAL are written; the rest are only
counted, and once the interval is over one summary line says how many were left
out. `install()` routes Python logging (aiohttp's and asyncio's own messages,
e.g. "socket.accept() out of system resource" with its traceback) through the
same limit, one kind per logger and message.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from typing import Callable, TextIO

#: Seconds of one rate window.
INTERVAL = 10.0
#: Lines of one kind written per window before the rest are counted only.
BURST = 5
#: Longest line written (a traceback is cut to this too).
MAX_LINE = 2000
#: Distinct kinds tracked at once; beyond it, new kinds share one bucket (a flood of unique messages).
MAX_KINDS = 256


class RateLog:
    """Thread-safe; `flush()` writes the summaries of windows that ended (call it now and then)."""

    def __init__(self, out: TextIO | None = None, *, interval: float = INTERVAL, burst: int = BURST,
                 clock: Callable[[], float] = time.monotonic):
        self.out = out
        self.interval, self.burst, self.clock = interval, burst, clock
        self._lock = threading.Lock()
        self._kinds: dict[str, list] = {}   # kind -> [window start, written, suppressed]

    def note(self, kind: str, line: str) -> bool:
        """Write `line` unless this kind already wrote its burst in this window; True if written."""
        now = self.clock()
        with self._lock:
            if kind not in self._kinds and len(self._kinds) >= MAX_KINDS:
                kind = "other"
            w = self._kinds.get(kind)
            summary = None
            if w is None or now - w[0] >= self.interval:
                if w is not None and w[2]:
                    summary = self._summary(kind, w)
                w = self._kinds[kind] = [now, 0, 0]
            write = w[1] < self.burst
            if write:
                w[1] += 1
            else:
                w[2] += 1
        if summary:
            self._write(summary)
        if write:
            self._write(line)
        return write

    def flush(self) -> None:
        """Write one summary line per kind whose window ended with lines left out, and forget idle kinds."""
        now = self.clock()
        lines = []
        with self._lock:
            for kind, w in list(self._kinds.items()):
                if now - w[0] >= self.interval:
                    if w[2]:
                        lines.append(self._summary(kind, w))
                    del self._kinds[kind]
        for line in lines:
            self._write(line)

    def _summary(self, kind: str, w: list) -> str:
        return f"hutch daemon: {w[2]} more {kind!r} events in {self.interval:.0f} s were not logged (rate limit)"

    def _write(self, line: str) -> None:
        out = self.out or sys.stderr
        if len(line) > MAX_LINE:
            line = line[:MAX_LINE] + f"... [{len(line) - MAX_LINE} characters cut]"
        try:
            out.write(line.rstrip("\n") + "\n")
            out.flush()
        except (OSError, ValueError):
            pass   # a full disk or closed log must not stop the daemon


class _Handler(logging.Handler):
    def __init__(self, log: RateLog):
        super().__init__(logging.WARNING)
        self.log = log

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = f"{record.name}: {self.format(record)}"
        except Exception:  # noqa: BLE001 - a bad log call must not raise into the daemon
            line = f"{record.name}: {record.msg!r}"
        self.log.note(f"{record.name}: {record.msg}"[:200], line)


def install(log: RateLog) -> None:
    """Send WARNING and above of every Python logger through `log` (instead of logging's last resort)."""
    root = logging.getLogger()
    for h in [h for h in root.handlers if isinstance(h, _Handler)]:
        root.removeHandler(h)
    root.addHandler(_Handler(log))
    root.setLevel(logging.WARNING)


__all__ = ["BURST", "INTERVAL", "RateLog", "install"]
