"""Publish rate limits (Pulsar's ``publishRate``): token buckets of messages and bytes per
second for one topic, as pure arithmetic on a ``now`` the caller passes.

A send always goes through (it was already read off the wire); it takes its messages and
bytes from the buckets, which may go below zero. While a bucket is below zero the topic is
over its rate, and :meth:`PublishThrottle.take` answers how long the sender's connection
is to stop being read for the buckets to be back at zero. A bucket holds at most one
second of its rate, so an idle topic can absorb a burst of one second's worth and no more.
A rate of 0 or less is no limit (upstream's -1).

Example:
    >>> throttle = PublishThrottle(PublishRate(messages=100, bytes=-1), now=0.0)
    >>> throttle.take(messages=100, size=1, now=0.0)   # one second's burst
    0.0
    >>> throttle.take(messages=50, size=1, now=0.0)    # 50 over: half a second to wait
    0.5
    >>> throttle.take(messages=1, size=1, now=1.0)     # refilled meanwhile
    0.0
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class PublishRate:
    """Messages and bytes per second a topic takes (<= 0: unlimited)."""

    messages: int = -1
    bytes: int = -1

    @property
    def unlimited(self) -> bool:
        return self.messages <= 0 and self.bytes <= 0


class TokenBucket:
    """One rate; see the module docstring. ``burst``: what the bucket holds when full
    (default: one second of the rate)."""

    __slots__ = ("_at", "_burst", "_tokens", "rate")

    def __init__(self, rate: float, now: float, burst: float | None = None) -> None:
        self.rate = rate
        self._burst = rate if burst is None else burst
        self._tokens = self._burst
        self._at = now

    def level(self, now: float) -> float:
        """The tokens in the bucket at ``now`` (below zero: over the rate)."""
        if now > self._at:
            self._tokens = min(self._burst, self._tokens + (now - self._at) * self.rate)
            self._at = now
        return self._tokens

    def try_take(self, amount: float, now: float) -> bool:
        """Take ``amount`` only if the bucket holds it; whether it did."""
        if self.rate <= 0:
            return True
        level = self.level(now)
        if level < amount:
            return False
        self._tokens = level - amount
        return True

    def take(self, amount: float, now: float) -> float:
        """Take ``amount``; seconds until the bucket is back at zero (0.0: not over)."""
        if self.rate <= 0:
            return 0.0
        self._tokens = self.level(now) - amount
        return 0.0 if self._tokens >= 0 else -self._tokens / self.rate


class PublishThrottle:
    """The message and byte buckets of one topic."""

    __slots__ = ("_bytes", "_messages", "rate")

    def __init__(self, rate: PublishRate, now: float) -> None:
        self.rate = rate
        self._messages = TokenBucket(rate.messages, now)
        self._bytes = TokenBucket(rate.bytes, now)

    def take(self, *, messages: int, size: int, now: float) -> float:
        """Account one send; how long to pause its connection (0.0: not at all)."""
        return max(self._messages.take(messages, now), self._bytes.take(size, now))
