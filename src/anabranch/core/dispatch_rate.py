"""Dispatch rate limits (Pulsar's ``dispatchRate`` and ``subscriptionDispatchRate``):
messages and bytes a topic, or one subscription, may be sent per period, as pure
arithmetic on a ``now`` the caller passes.

Before a read the dispatcher asks :meth:`DispatchThrottle.allowance` how many messages and
bytes may go now: it reads no more entries than that, keeps of them no more bytes than that
(at least one entry), and reads nothing while no message may go (then it waits the seconds
the answer gives). After sending it :meth:`~DispatchThrottle.take`\\ s
what went, which may take a bucket below zero: a batch entry holds several messages and
an entry's size is only known once read, as upstream's limiter also learns after the
fact. Each bucket holds one period's worth, so an idle subscription may be sent a
period's quota at once and no more. A rate of 0 or less is no limit (upstream's -1).

Example:
    >>> throttle = DispatchThrottle(DispatchRate(messages=10, period_s=2), now=0.0)
    >>> throttle.allowance(now=0.0)
    Allowance(messages=10, bytes=None, wait_s=0.0)
    >>> throttle.take(messages=10, size=100, now=0.0)
    >>> throttle.allowance(now=0.0).wait_s       # the period's quota is gone
    0.2
    >>> throttle.allowance(now=1.0).messages     # half a period later: half the quota
    5
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

from anabranch.core.publish_rate import TokenBucket


@dataclass(frozen=True, slots=True)
class DispatchRate:
    """Messages and bytes per ``period_s`` seconds (<= 0: unlimited)."""

    messages: int = -1
    bytes: int = -1
    period_s: int = 1

    @property
    def unlimited(self) -> bool:
        return self.messages <= 0 and self.bytes <= 0


def _bucket(limit: int, period_s: int, now: float) -> TokenBucket | None:
    if limit <= 0:
        return None
    return TokenBucket(limit / max(period_s, 1), now, burst=limit)


def _wait_s(bucket: TokenBucket, level: float, needed: float) -> float:
    return (needed - level) / bucket.rate


class Allowance(NamedTuple):
    """What the rates let go now: messages and bytes (None: any), and when nothing may go
    (``messages == 0``), the seconds until something may."""

    messages: int | None
    bytes: int | None
    wait_s: float


UNLIMITED = Allowance(None, None, 0.0)


class DispatchThrottle:
    """The message and byte buckets of one rate (a topic's or a subscription's)."""

    __slots__ = ("_bytes", "_messages", "rate")

    def __init__(self, rate: DispatchRate, now: float) -> None:
        self.rate = rate
        self._messages = _bucket(rate.messages, rate.period_s, now)
        self._bytes = _bucket(rate.bytes, rate.period_s, now)

    def allowance(self, now: float) -> Allowance:
        """What may be sent now (see :class:`Allowance`)."""
        messages: int | None = None
        size: int | None = None
        wait = 0.0
        if self._bytes is not None:
            level = self._bytes.level(now)
            if level <= 0:
                wait = _wait_s(self._bytes, level, 1)
                messages = 0
            size = max(math.floor(level), 0)
        if self._messages is not None:
            level = self._messages.level(now)
            if level < 1:
                wait = max(wait, _wait_s(self._messages, level, 1))
                messages = 0
            elif messages is None:
                messages = math.floor(level)
        return Allowance(messages, size, wait if messages == 0 else 0.0)

    def take(self, *, messages: int, size: int, now: float) -> None:
        """Account what was just sent."""
        if self._messages is not None:
            self._messages.take(messages, now)
        if self._bytes is not None:
            self._bytes.take(size, now)


def _least(a: int | None, b: int | None) -> int | None:
    return b if a is None else a if b is None else min(a, b)


def combined(allowances: list[Allowance]) -> Allowance:
    """The allowance of several throttles at once (a topic's and a subscription's): the
    least of each, and when no message may go the longest of the waits.

    Example:
        >>> combined([UNLIMITED, Allowance(4, None, 0.0)])
        Allowance(messages=4, bytes=None, wait_s=0.0)
        >>> combined([Allowance(0, 0, 0.5), Allowance(3, 9, 0.0), Allowance(0, None, 0.2)])
        Allowance(messages=0, bytes=0, wait_s=0.5)
    """
    out = UNLIMITED
    for one in allowances:
        out = Allowance(
            _least(out.messages, one.messages),
            _least(out.bytes, one.bytes),
            max(out.wait_s, one.wait_s),
        )
    return out
