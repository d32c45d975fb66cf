"""A clock that moves only when the test says so.

``sleep`` parks the caller until :meth:`ManualClock.advance` moves time past its
deadline; nothing ever waits on real time, so tests that use it are deterministic.

Example:
    >>> async def demo() -> None:
    ...     clock = ManualClock()
    ...     sleeper = asyncio.ensure_future(clock.sleep(5))
    ...     await clock.settle()
    ...     clock.advance(4)
    ...     await clock.settle()
    ...     print(sleeper.done())
    ...     clock.advance(1)
    ...     await clock.settle()
    ...     print(sleeper.done(), clock.monotonic())
    >>> asyncio.run(demo())
    False
    True 1005.0
"""

from __future__ import annotations

import asyncio
import heapq
import itertools


class ManualClock:
    """Monotonic time, wall time and sleep under test control."""

    def __init__(self, start_s: float = 1_000.0, wall_ms_at_start: int = 1_700_000_000_000) -> None:
        self._start_s = start_s
        self._now_s = start_s
        self._wall_ms_at_start = wall_ms_at_start
        # (deadline, sequence, future): the sequence keeps equal deadlines in sleep order.
        self._sleepers: list[tuple[float, int, asyncio.Future[None]]] = []
        self._sequence = itertools.count()

    def monotonic(self) -> float:
        return self._now_s

    def wall_ms(self) -> int:
        return self._wall_ms_at_start + round((self._now_s - self._start_s) * 1000)

    async def sleep(self, seconds: float) -> None:
        """Wait until the clock has been advanced by ``seconds`` (0 just yields once)."""
        if seconds <= 0:
            await asyncio.sleep(0)
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._sleepers, (self._now_s + seconds, next(self._sequence), future))
        await future

    def advance(self, seconds: float) -> None:
        """Move time forward and wake every sleeper whose deadline has come.

        Woken tasks run when the event loop next gets control (see :meth:`settle`).
        """
        if seconds < 0:
            raise ValueError("a monotonic clock never goes back")
        self._now_s += seconds
        while self._sleepers and self._sleepers[0][0] <= self._now_s:
            _, _, future = heapq.heappop(self._sleepers)
            if not future.done():
                future.set_result(None)

    @property
    def sleepers(self) -> int:
        """Sleeps still waiting (cancelled ones excluded)."""
        return sum(1 for _, _, future in self._sleepers if not future.done())

    async def settle(self, rounds: int = 20) -> None:
        """Let woken tasks (and the tasks they wake) run; no real time passes."""
        for _ in range(rounds):
            await asyncio.sleep(0)
