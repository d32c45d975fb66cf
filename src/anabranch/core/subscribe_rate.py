"""Subscribe rate limits (Pulsar's ``subscribeRate``): how often one consumer may
subscribe to a topic, as pure arithmetic on a ``now`` the caller passes.

A consumer is known by its client's host, its name and its id, as upstream knows it, so
the limit holds a consumer that reconnects in a loop (a subscribe storm) without slowing
the others. Each consumer has a bucket of ``per_consumer`` subscribes refilled over
``period_s`` seconds; a subscribe it does not hold is refused and takes nothing. At most
``limits.SUBSCRIBE_RATE_CONSUMERS_MAX`` consumers are tracked per topic: the least recently
seen are forgotten first. A rate of 0 or less is no limit (upstream's -1).

Example:
    >>> limiter = SubscribeLimiter(SubscribeRate(per_consumer=2, period_s=10), max_tracked=100)
    >>> me = ("10.0.0.1", "worker", 1)
    >>> [limiter.try_acquire(me, now=0.0) for _ in range(3)]
    [True, True, False]
    >>> limiter.try_acquire(("10.0.0.1", "worker", 2), now=0.0)   # another consumer
    True
    >>> limiter.try_acquire(me, now=5.0)                          # half a period later
    True
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from anabranch.core.publish_rate import TokenBucket

ConsumerKey = tuple[str, str, int]
"""(client host, consumer name, consumer id)."""


@dataclass(frozen=True, slots=True)
class SubscribeRate:
    """Subscribes one consumer may make per ``period_s`` seconds (<= 0: unlimited)."""

    per_consumer: int = -1
    period_s: int = 30

    @property
    def unlimited(self) -> bool:
        return self.per_consumer <= 0


class SubscribeLimiter:
    """One topic's buckets, one per consumer (see the module docstring)."""

    __slots__ = ("_buckets", "_max_tracked", "rate")

    def __init__(self, rate: SubscribeRate, *, max_tracked: int) -> None:
        self.rate = rate
        self._max_tracked = max_tracked
        self._buckets: OrderedDict[ConsumerKey, TokenBucket] = OrderedDict()

    def try_acquire(self, consumer: ConsumerKey, now: float) -> bool:
        """Whether ``consumer`` may subscribe now (taking one of its subscribes if so)."""
        bucket = self._buckets.get(consumer)
        if bucket is None:
            limit = self.rate.per_consumer
            bucket = TokenBucket(limit / max(self.rate.period_s, 1), now, burst=limit)
            self._buckets[consumer] = bucket
            while len(self._buckets) > self._max_tracked:
                self._buckets.popitem(last=False)
        else:
            self._buckets.move_to_end(consumer)
        return bucket.try_take(1, now)

    @property
    def tracked(self) -> int:
        return len(self._buckets)
