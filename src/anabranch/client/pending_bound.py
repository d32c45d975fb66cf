"""``PendingBound``: the limit on messages a producer holds (``pending_messages_max``).

A counter and one shared wake-up future instead of an ``asyncio.Semaphore``: a producer
sending 100 k messages/s cannot afford a semaphore acquire and a release callback per
message.

Example:
    >>> import asyncio
    >>> async def demo() -> list[int]:
    ...     bound = PendingBound(1)
    ...     await bound.enter(block=True, owner="p")
    ...     waiter = asyncio.ensure_future(bound.enter(block=True, owner="p"))
    ...     await asyncio.sleep(0)
    ...     seen = [bound.count, waiter.done()]
    ...     bound.leave(1)
    ...     await waiter
    ...     return seen + [bound.count]
    >>> asyncio.run(demo())
    [1, False, 1]
"""

from __future__ import annotations

import asyncio

from anabranch.client.errors import ProducerQueueFull


class PendingBound:
    """Counts held messages; ``enter`` waits (or raises ``ProducerQueueFull``) at the limit."""

    __slots__ = ("_freed", "count", "limit")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.count = 0
        self._freed: asyncio.Future[None] | None = None

    def try_enter(self) -> bool:
        """Take one slot if one is free (the no-wait path every send tries first)."""
        if self.count >= self.limit:
            return False
        self.count += 1
        return True

    async def enter(self, *, block: bool, owner: object) -> None:
        """Take one slot, waiting while every slot is taken (``block``) or raising."""
        while self.count >= self.limit:
            if not block:
                raise ProducerQueueFull(f"{owner} has {self.limit} pending")
            if self._freed is None:
                self._freed = asyncio.get_running_loop().create_future()
            # Shielded: one waiter cancelled must not cancel the wake-up of the others.
            await asyncio.shield(self._freed)
        self.count += 1

    def leave(self, count: int) -> None:
        """``count`` messages left the producer (stored, failed or dropped)."""
        self.count -= count
        freed = self._freed
        if freed is not None and self.count < self.limit:
            self._freed = None
            if not freed.done():
                freed.set_result(None)
