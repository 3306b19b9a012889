"""One sandbox's egress decisions, in bounded memory that the sandbox cannot flush.

The sandbox itself makes most decisions happen (each query and connection is one), so a log
that keeps "the last N" lets it erase its refusals by making noise. Here:

- refusals and policy changes live apart from allowed decisions: allowed noise never pushes
  them out;
- of the refusals, the first REFUSED_FIRST of the sandbox's life are kept for good, then a ring
  of the latest REFUSED_LAST (policy changes alike: POLICY_FIRST, POLICY_LAST);
- allowed decisions are a ring of the latest ALLOWED_KEPT;
- what the sandbox makes happen is stored at most LOG_RATE a second per kind (bursts of
  LOG_BURST); beyond that, and whatever a ring pushes out, is counted in `dropped`. A limit of
  the resolver or proxy noting that it holds a flood back (at most once a second) always is;
- every refusal, stored or not, is counted by reason and by target (the name or address),
  with the time of the first and the last, so a flood leaves a count, never a silent gap.

Strings are cut to fixed lengths on the way in, so all of it fits in LOG_MEMORY_BOUND bytes.
Pure logic: the caller passes the clock.
"""

from __future__ import annotations

import collections
import heapq
from dataclasses import dataclass, field

ALLOWED_KEPT = 400
REFUSED_FIRST = 200
REFUSED_LAST = 500
POLICY_FIRST = 20
POLICY_LAST = 80
LOG_RATE = 20.0          # decisions stored per second per kind (allowed, refused); policy changes are not limited
LOG_BURST = 200
REASONS_KEPT = 32        # distinct refusal reasons counted one by one; the rest in one row
TARGETS_KEPT = 64        # distinct refused names/addresses counted one by one; the rest in one row
MAX_NAME = 253
MAX_ADDRESS = 64
MAX_REASON = 200
#: What one sandbox's log may hold at most, counters included (checked by tests/egress/test_audit.py).
LOG_MEMORY_BOUND = 1 << 20

KINDS = ("allowed", "refused", "policy")


@dataclass(frozen=True, slots=True)
class Decision:
    """One egress decision: a DNS answer, a TCP connection or a policy change, allowed or denied, and why."""

    time: float
    name: str | None
    address: str | None
    port: int | None
    protocol: str          # dns | tls | http | tcp | policy
    verdict: str           # allow | deny
    reason: str

    @property
    def kind(self) -> str:
        if self.protocol == "policy":
            return "policy"
        return "refused" if self.verdict == "deny" else "allowed"

    def to_dict(self) -> dict:
        return {"time": self.time, "name": self.name, "address": self.address, "port": self.port,
                "protocol": self.protocol, "verdict": self.verdict, "reason": self.reason}


class TokenBucket:
    """`rate` events a second, bursts of `burst`; `take(now)` says whether one more fits."""

    __slots__ = ("rate", "burst", "tokens", "stamp")

    def __init__(self, rate: float, burst: float, now: float):
        self.rate, self.burst = float(rate), float(burst)
        self.tokens, self.stamp = float(burst), now

    def take(self, now: float) -> bool:
        if now > self.stamp:
            self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
            self.stamp = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return True
        return False


@dataclass(frozen=True, slots=True)
class RefusalCount:
    """How often one reason (or one target) was refused, first and last time. `key` None: all the others."""

    protocol: str | None
    key: str | None
    count: int
    first: float
    last: float
    example: str | None     # by reason: the last target; by target: the last reason


@dataclass(slots=True)
class _Tally:
    count: int
    first: float
    last: float
    example: str | None


class _Counter:
    """Counts per key for the first `keep` distinct keys; every later key goes into one row."""

    __slots__ = ("keep", "rows", "rest")

    def __init__(self, keep: int):
        self.keep = keep
        self.rows: dict[tuple, _Tally] = {}
        self.rest: _Tally | None = None

    def add(self, key: tuple, t: float, example: str | None) -> None:
        row = self.rows.get(key)
        if row is None and len(self.rows) < self.keep:
            row = self.rows[key] = _Tally(0, t, t, None)
        elif row is None:
            row = self.rest = self.rest or _Tally(0, t, t, None)
        row.count += 1
        row.last = t
        row.example = example

    def view(self) -> tuple[RefusalCount, ...]:
        out = [RefusalCount(k[0], k[1], r.count, r.first, r.last, r.example) for k, r in self.rows.items()]
        if self.rest is not None:
            r = self.rest
            out.append(RefusalCount(None, None, r.count, r.first, r.last, r.example))
        return tuple(out)


def _cut(text: str | None, n: int) -> str | None:
    if text is None:
        return None
    text = str(text)
    return text if len(text) <= n else text[:n - 3] + "..."


def reason_pattern(d: Decision) -> str:
    """The reason with the decision's own name and address taken out, so one rule is one row."""
    r = d.reason
    if d.name:
        r = r.replace(d.name, "<name>")
    if d.address:
        r = r.replace(d.address, "<address>")
    return r


@dataclass(frozen=True)
class LogView:
    """What `Gateway.log()` returns: the decisions kept, oldest first, and the counts of everything else.

    Iterating (or indexing) it walks `decisions`, so it reads like a list of Decision.
    """

    decisions: tuple[Decision, ...]
    seen: dict[str, int]                   # per kind: every decision made
    dropped: dict[str, int]                # per kind: not in `decisions` (over the log's rate, or pushed out)
    refusals_by_reason: tuple[RefusalCount, ...]
    refusals_by_target: tuple[RefusalCount, ...]
    limits: dict[str, int] = field(default_factory=dict)   # what the resolver and proxy held back, by limit

    def __iter__(self):
        return iter(self.decisions)

    def __len__(self) -> int:
        return len(self.decisions)

    def __getitem__(self, i):
        return self.decisions[i]

    def to_dict(self) -> dict:
        return {
            "decisions": [d.to_dict() for d in self.decisions],
            "seen": dict(self.seen),
            "dropped": dict(self.dropped),
            "refusals_by_reason": [{"protocol": r.protocol, "reason": r.key, "count": r.count, "first": r.first,
                                    "last": r.last, "last_target": r.example} for r in self.refusals_by_reason],
            "refusals_by_target": [{"protocol": r.protocol, "target": r.key, "count": r.count, "first": r.first,
                                    "last": r.last, "last_reason": r.example} for r in self.refusals_by_target],
            "limits": dict(self.limits),
        }


class _Store:
    """The first `first` entries for good, then a ring of the latest `last`."""

    __slots__ = ("head", "tail", "first")

    def __init__(self, first: int, last: int):
        self.first = first
        self.head: list[Decision] = []
        self.tail: collections.deque = collections.deque(maxlen=last)

    def add(self, d: Decision) -> bool:
        """Store d; True when that pushed an older entry out."""
        if len(self.head) < self.first:
            self.head.append(d)
            return False
        full = len(self.tail) == self.tail.maxlen
        self.tail.append(d)
        return full

    def __iter__(self):
        yield from self.head
        yield from self.tail


class DecisionLog:
    """One sandbox's decisions. `record()` is O(1); memory stays under LOG_MEMORY_BOUND whatever comes."""

    def __init__(self, now: float):
        self._stores = {"allowed": _Store(0, ALLOWED_KEPT), "refused": _Store(REFUSED_FIRST, REFUSED_LAST),
                        "policy": _Store(POLICY_FIRST, POLICY_LAST)}
        self._buckets = {"allowed": TokenBucket(LOG_RATE, LOG_BURST, now),
                         "refused": TokenBucket(LOG_RATE, LOG_BURST, now)}
        self.seen = dict.fromkeys(KINDS, 0)
        self.dropped = dict.fromkeys(KINDS, 0)
        self._by_reason = _Counter(REASONS_KEPT)
        self._by_target = _Counter(TARGETS_KEPT)

    def record(self, t: float, now: float, name, address, port, protocol: str, verdict: str, reason: str,
               *, metered: bool = True) -> None:
        """Add one decision made at wall-clock time `t`; `now` is the monotonic clock (for the rate).

        `metered=False`: not subject to the rate, for entries that are rare by construction (a limit
        noting that it holds a flood back does so at most once a second).
        """
        d = Decision(t, _cut(name, MAX_NAME), _cut(address, MAX_ADDRESS), port if isinstance(port, int) else None,
                     protocol, verdict, _cut(reason, MAX_REASON))
        kind = d.kind
        self.seen[kind] += 1
        if kind == "refused":
            target = d.name or d.address
            self._by_reason.add((d.protocol, reason_pattern(d)), t, target)
            self._by_target.add((d.protocol, target), t, d.reason)
        bucket = self._buckets.get(kind) if metered else None
        if bucket is not None and not bucket.take(now):
            self.dropped[kind] += 1
            return
        if self._stores[kind].add(d):
            self.dropped[kind] += 1

    def view(self, limits: dict | None = None) -> LogView:
        merged = heapq.merge(*(iter(s) for s in self._stores.values()), key=lambda d: d.time)
        return LogView(tuple(merged), dict(self.seen), dict(self.dropped), self._by_reason.view(),
                       self._by_target.view(), dict(limits or {}))
