"""Producer access modes of a topic (upstream's ``AbstractTopic``), shared by persistent
and non-persistent topics.

Shared producers coexist unless an exclusive one holds the topic (ProducerBusy).
Exclusive fails with ProducerFenced when anyone else is there. ExclusiveWithFencing closes
everyone else. WaitForExclusive queues until the topic is free. Each grant of exclusivity
bumps ``topic_epoch``; a reconnecting exclusive producer from an older epoch is fenced.

A topic class mixes :class:`ProducerAccess` in and keeps the state it declares; its own
``add_producer`` checks what is particular to it (writable, quotas) and then calls
:meth:`ProducerAccess._admit`.

Example:
    >>> from types import SimpleNamespace
    >>> from anabranch.broker.topic_limits import NO_LIMITS
    >>> class Topic(ProducerAccess):
    ...     def __init__(self) -> None:
    ...         self.name, self.producers, self.topic_epoch = "t", {}, 0
    ...         self._exclusive, self._waiting = None, deque()
    >>> topic = Topic()
    >>> p = SimpleNamespace(name="p", access_mode=Mode.Exclusive, requested_epoch=None)
    >>> topic._admit(p, NO_LIMITS) is None, topic.topic_epoch, p.topic_epoch
    (True, 1, 1)
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import TYPE_CHECKING

from anabranch.errors import NotAllowed, ProducerBusy, ProducerFenced
from anabranch.protocol._generated import pulsar_api_pb2 as pb

if TYPE_CHECKING:
    from anabranch.broker.producer import Producer
    from anabranch.broker.topic_limits import TopicLimits

Mode = pb.ProducerAccessMode


class ProducerAccess:
    """The access-mode state and rules (see the module docstring)."""

    name: str
    producers: dict[str, Producer]
    topic_epoch: int
    _exclusive: str | None
    """The producer holding exclusivity, if any."""
    _waiting: deque[tuple[Producer, asyncio.Future[None]]]
    """WaitForExclusive producers in arrival order, with what they wait on."""

    def _admit(self, producer: Producer, caps: TopicLimits) -> asyncio.Future[None] | None:
        """Admit ``producer`` under its access mode and the topic's producer cap; a future
        when it must wait (WaitForExclusive), else None. Raises ProducerBusy/ProducerFenced/
        NotAllowed."""
        if producer.name in self.producers:
            raise ProducerBusy(f"producer {producer.name!r} is already connected to {self.name}")
        # Waiters count: each one holds a connection's request and its memory too.
        caps.check_producer(self.name, producers=len(self.producers) + len(self._waiting))
        mode = producer.access_mode
        requested = producer.requested_epoch
        if mode != Mode.Shared and requested is not None and requested < self.topic_epoch:
            # A reconnecting exclusive producer from before a fencing takeover.
            raise ProducerFenced(f"{self.name} moved to epoch {self.topic_epoch} (had {requested})")
        if mode == Mode.Shared:
            if self._exclusive is not None or self._waiting:
                raise ProducerBusy(f"{self.name} has an exclusive producer {self._exclusive!r}")
        elif mode == Mode.Exclusive:
            if self._exclusive is not None or self._waiting or self.producers:
                raise ProducerFenced(f"{self.name} already has producers")
            self._grant(producer)
        elif mode == Mode.ExclusiveWithFencing:
            for other in list(self.producers.values()):
                other.fence()
            self._grant(producer)
        elif mode == Mode.WaitForExclusive:
            if self._exclusive is not None or self.producers:
                waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
                self._waiting.append((producer, waiter))
                return waiter
            self._grant(producer)
        else:
            raise NotAllowed(f"unknown producer access mode {mode}")
        self.producers[producer.name] = producer
        return None

    def _grant(self, producer: Producer) -> None:
        self._exclusive = producer.name
        self.topic_epoch += 1
        producer.topic_epoch = self.topic_epoch

    def _release(self, producer: Producer) -> bool:
        """Forget ``producer`` (closed or disconnected) and hand exclusivity to the next
        waiter; whether it was connected."""
        self._waiting = deque((p, f) for p, f in self._waiting if p is not producer)
        if self.producers.get(producer.name) is not producer:
            return False
        del self.producers[producer.name]
        if self._exclusive == producer.name:
            self._exclusive = None
        while self._waiting and not self.producers:
            waiter, fut = self._waiting.popleft()
            if fut.done():
                continue
            self._grant(waiter)
            self.producers[waiter.name] = waiter
            fut.set_result(None)
        return True
