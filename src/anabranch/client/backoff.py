"""Reconnect backoff: doubling from a minimum to a maximum, jittered by an injected random.

Delays start at ``min_s`` and double up to ``max_s``; each is reduced by up to 10 % of
itself (``random()`` in [0, 1)) so that many clients of a restarted broker do not retry in
lockstep, but never below ``min_s``. This is upstream's ``Backoff`` shape.

Example:
    >>> b = Backoff(0.1, 1.0, random=lambda: 0.0)
    >>> [round(b.next(), 3) for _ in range(6)]
    [0.1, 0.2, 0.4, 0.8, 1.0, 1.0]
    >>> b.reset(); b.next()
    0.1
"""

from __future__ import annotations

import random as _random
from collections.abc import Callable

from anabranch.limits import CLIENT_RECONNECT_BACKOFF_MAX_S, CLIENT_RECONNECT_BACKOFF_MIN_S

JITTER_FRACTION = 0.1
"""Largest share of a delay removed by jitter (upstream subtracts up to current/10)."""


class Backoff:
    """A bounded, jittered exponential backoff schedule."""

    def __init__(
        self,
        min_s: float = CLIENT_RECONNECT_BACKOFF_MIN_S,
        max_s: float = CLIENT_RECONNECT_BACKOFF_MAX_S,
        random: Callable[[], float] = _random.random,
    ) -> None:
        if not 0 < min_s <= max_s:
            raise ValueError(f"backoff bounds must satisfy 0 < {min_s} <= {max_s}")
        self.min_s = min_s
        self.max_s = max_s
        self._random = random
        self._current = min_s

    def next(self) -> float:
        """The next delay in seconds (then the schedule doubles, up to ``max_s``)."""
        current = self._current
        self._current = min(current * 2, self.max_s)
        return max(self.min_s, current - current * JITTER_FRACTION * self._random())

    def reset(self) -> None:
        """Start over from ``min_s`` (after a successful connect)."""
        self._current = self.min_s
