"""Time, injected: core code takes ``now``; shells take a ``Clock``.

Example:
    >>> clock = SystemClock()
    >>> clock.monotonic() > 0
    True
"""

from __future__ import annotations

import asyncio
import time
from typing import Protocol


class Clock(Protocol):
    """The only way server code reads time or sleeps."""

    def monotonic(self) -> float:
        """Seconds on a clock that never goes back (deadlines, TTLs)."""
        ...

    def wall_ms(self) -> int:
        """Milliseconds since the epoch (publish times, record timestamps)."""
        ...

    async def sleep(self, seconds: float) -> None:
        """Sleep on this clock."""
        ...


class SystemClock:
    """The real clock."""

    def monotonic(self) -> float:
        return time.monotonic()

    def wall_ms(self) -> int:
        return time.time_ns() // 1_000_000

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)
