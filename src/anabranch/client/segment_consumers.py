"""What the consumers of a scalable topic share: the internal consumers of many segments
feeding one inbox.

The stream, queue and checkpoint consumers each keep one internal consumer per segment
(by segment id, and by consumer id to find a queued message's segment). All of them put
their messages into one :class:`OwnedInbox` (the queue and checkpoint consumers: a
:class:`CountingInbox`); the owner's ``receive`` takes the next one with
:meth:`OwnedInbox.get_owned`, which drops the messages of segments that left
meanwhile, and its ``close`` ends them all with :func:`close_all`. The queue and checkpoint
consumers follow the DAG in a task that sleeps in :func:`wake_or_change`.

Example::

    got = await inbox.get_owned(inbox.deadline(1.0), by_consumer_id)
    if got is not None:
        raw, consumer = got
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

from anabranch.client.consumer import Consumer, Inbox
from anabranch.client.message import Message

OwnerT = TypeVar("OwnerT")
ConsumerT = TypeVar("ConsumerT", bound=Consumer)


class OwnedInbox(Inbox):
    """The inbox of many segment consumers: a receive takes the next message of a consumer
    that is still wanted (see :meth:`get_owned`)."""

    @staticmethod
    def deadline(timeout: float | None) -> float | None:
        """The deadline of :meth:`get_owned`: the running loop's time ``timeout`` seconds
        from now (None: no deadline)."""
        return None if timeout is None else asyncio.get_running_loop().time() + timeout

    async def get_owned(
        self, deadline: float | None, owners: Mapping[int, OwnerT]
    ) -> tuple[Message, OwnerT] | None:
        """The next message whose consumer id is in ``owners``, with its owner; None once
        the loop's clock passes ``deadline`` (None: wait forever).

        Messages of a consumer id not in ``owners`` (its segment left meanwhile) are dropped.
        """
        loop = asyncio.get_running_loop()
        while True:
            remaining = None if deadline is None else max(0.0, deadline - loop.time())
            raw = await self.get(remaining)
            if raw is None:
                return None
            owner = owners.get(raw._entry.consumer_id)
            if owner is not None:
                return raw, owner

    def close(self) -> None:
        """Ignored: a segment consumer closing (retired, or a terminal error on its
        segment) must not end the whole consumer; the owner calls :meth:`shutdown`."""

    def shutdown(self) -> None:
        """Wake every receiver with ``Closed``."""
        super().close()


class CountingInbox(OwnedInbox):
    """An owned inbox that also knows how many queued messages each consumer id has."""

    def __init__(self) -> None:
        super().__init__()
        self._queued: dict[int, int] = {}
        """Queued messages per consumer id (a plain dict: this is counted per message)."""

    def put(self, messages: list[Message]) -> None:
        """Queue messages of one consumer (a consumer puts what one MESSAGE held)."""
        if messages:
            consumer_id = messages[0]._entry.consumer_id
            self._queued[consumer_id] = self._queued.get(consumer_id, 0) + len(messages)
            super().put(messages)

    async def get(self, timeout: float | None) -> Message | None:  # noqa: ASYNC109
        msg = await super().get(timeout)
        if msg is not None:
            self._queued[msg._entry.consumer_id] -= 1
        return msg

    def queued(self, consumer_id: int) -> int:
        """How many messages of this consumer are queued."""
        return self._queued.get(consumer_id, 0)

    def remove_where(self, predicate: Callable[[Message], bool]) -> int:
        removed = super().remove_where(predicate)
        self._queued = dict(Counter(m._entry.consumer_id for m in self._items))
        return removed


async def stop_task(task: asyncio.Task[Any] | None) -> None:
    """Cancel ``task`` (if any) and wait until it has ended."""
    if task is not None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def wake_or_change(
    change: asyncio.Task[Any], wake: asyncio.Event, max_wait_s: float | None
) -> None:
    """Wait until ``change`` is done, ``wake`` is set or ``max_wait_s`` seconds pass
    (None: no limit); then clear ``wake``."""
    woke = asyncio.get_running_loop().create_task(wake.wait())
    try:
        await asyncio.wait({change, woke}, timeout=max_wait_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        # Also when the caller is cancelled: a forgotten waiter lingers on the event
        # until it is garbage ("Task was destroyed but it is pending").
        woke.cancel()
    wake.clear()


async def close_all(
    segments: dict[int, ConsumerT], by_consumer_id: dict[int, Any], *also: Awaitable[Any]
) -> None:
    """Forget every segment's consumer, then close them all (and await ``also``) at once,
    ignoring their errors."""
    consumers = list(segments.values())
    segments.clear()
    by_consumer_id.clear()
    await asyncio.gather(*(c.close() for c in consumers), *also, return_exceptions=True)


__all__ = ["CountingInbox", "close_all", "stop_task", "wake_or_change"]
