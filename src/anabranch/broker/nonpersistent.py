"""NonPersistentTopic: a ``non-persistent://`` topic, dispatched from memory and never stored.

Theory of operation (upstream ``NonPersistentTopic``, PIP-2):

* **Publishing.** :meth:`NonPersistentTopic.publish` hands the entry to every subscription
  at once (each picks one of its connected consumers or drops it, see
  :mod:`anabranch.broker.nonpersistent_subscription`) and answers with a message id
  right away: no ledger, no cursor, no dedup, nothing on disk, and a broker restart
  loses nothing but what was in flight. Ids are ``(incarnation, n)``: ``n`` counts the
  topic's entries and ``incarnation`` is chosen when the topic loads (the wall clock in
  ms), so ids keep growing across reloads as clients expect.
* **Bounds.** A consumer without permits (its receiver queue is full) or whose connection
  is backed up gets nothing: the message is dropped for it and counted (``msgDropRate``).
  What one topic hands to its consumers' connections in one event-loop iteration is
  bounded by ``limits.NON_PERSISTENT_INFLIGHT_BYTES_MAX``: a send past it is dropped,
  counted on its publisher, and answered with the (-1, -1) receipt as upstream does.
  Subscriptions and consumers per topic are bounded too (``limits.NON_PERSISTENT_*``).
* **Producers.** Access modes as on persistent topics: Shared producers coexist unless an
  exclusive one holds the topic; Exclusive fails (ProducerFenced) when anyone is there;
  ExclusiveWithFencing closes the others; WaitForExclusive queues.
* **Transactions** cannot include a non-persistent topic: a transactional send or ack is
  refused with :class:`~anabranch.errors.NonPersistentUnsupported`.

Example:
    >>> import tempfile
    >>> from pathlib import Path
    >>> from anabranch.protocol._generated import pulsar_api_pb2 as pb
    >>> from anabranch.protocol.frames import encode_entry
    >>> from anabranch.testing.broker import InProcessBroker
    >>> async def demo(topic: NonPersistentTopic) -> None:
    ...     md = pb.MessageMetadata(producer_name="producer-a", sequence_id=0, publish_time=0)
    ...     entry_bytes = encode_entry(md, b"hello")     # a SEND's message section
    ...     position = await topic.publish("producer-a", 0, None, entry_bytes, 1)
    ...     assert topic.stats()["msgInCounter"] == 1
    ...     print(position.entry_id)                     # (incarnation, n): the first
    >>> async def main() -> None:
    ...     with tempfile.TemporaryDirectory() as tmp:
    ...         async with InProcessBroker(Path(tmp)) as broker:
    ...             name = "non-persistent://public/default/t"
    ...             await demo(await broker.service.get_non_persistent_topic(name, create=True))
    >>> asyncio.run(main())
    0
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter, deque
from typing import TYPE_CHECKING, Any

from anabranch import limits
from anabranch.broker.dispatcher_entries import entry_info
from anabranch.broker.nonpersistent_subscription import NonPersistentSubscription
from anabranch.broker.producer_access import ProducerAccess
from anabranch.broker.topic_limits import NO_LIMITS, TopicLimits
from anabranch.clock import Clock
from anabranch.core.names import TopicName
from anabranch.core.publish_rate import PublishThrottle
from anabranch.core.rate_window import RateWindow
from anabranch.errors import (
    Closed,
    NonPersistentUnsupported,
    ResourceLimitReached,
    TopicTerminated,
)
from anabranch.storage.api import Position
from anabranch.transactions.ids import TxnId

if TYPE_CHECKING:
    from anabranch.broker.producer import Producer

log = logging.getLogger(__name__)

DROPPED_POSITION = Position(-1, -1)
"""The receipt of a send dropped before dispatch (upstream answers (-1, -1))."""


class NonPersistentTopic(ProducerAccess):
    """One non-persistent topic's producers and subscriptions (see the module docstring)."""

    dedup = None
    """Never deduplicated (nothing is stored to judge retries against)."""

    def __init__(self, name: str, *, clock: Clock, incarnation: int) -> None:
        self.name = name
        self.clock = clock
        parsed = TopicName.parse(name)
        self.partition = parsed.partition if parsed.partition is not None else -1
        self.subscriptions: dict[str, NonPersistentSubscription] = {}
        self.publish_throttle: PublishThrottle | None = None
        """The buckets of the topic's publish rate (``broker/publish_throttling.py``)."""
        self.producers: dict[str, Producer] = {}
        self.topic_epoch = 0
        self._exclusive: str | None = None
        self._waiting: deque[tuple[Producer, asyncio.Future[None]]] = deque()
        self._ledger_id = incarnation
        self._next_entry = 0
        self._inflight_bytes = 0
        self._inflight_reset: asyncio.Handle | None = None
        self._closing = False
        self.msg_in_counter = 0
        self.bytes_in_counter = 0
        self.publish_drops: Counter[str] = Counter()
        """Messages dropped before dispatch, per producer name (the in-flight bound)."""
        self._publish_drop_rates: dict[str, RateWindow] = {}
        """Each dropping publisher's drop rate, from its first drop on."""
        self._gone_out = (0, 0, 0)
        """(messages, bytes, drops) of subscriptions that ended: counters never go back."""
        self._rates = RateWindow(limits.STATS_RATE_WINDOW_MIN_S, clock.monotonic(), (0,) * 5)
        """msgRateIn/ThroughputIn/RateOut/ThroughputOut/DropRate, shared by all pollers."""
        self.idle_since: float | None = None
        """When the idle sweep first saw it without producers and subscriptions."""

    # --- counters the metrics collector reads ---------------------------------------------

    @property
    def msg_out_counter(self) -> int:
        return self._gone_out[0] + sum(s.messages_out for s in self.subscriptions.values())

    @property
    def bytes_out_counter(self) -> int:
        return self._gone_out[1] + sum(s.bytes_out for s in self.subscriptions.values())

    @property
    def msg_drop_counter(self) -> int:
        """Messages dropped: for a subscription (no consumer could take them) or before
        dispatch (the in-flight bound)."""
        subs = sum(s.messages_dropped for s in self.subscriptions.values())
        return self._gone_out[2] + subs + sum(self.publish_drops.values())

    # --- producers ------------------------------------------------------------------------

    def add_producer(
        self, producer: Producer, caps: TopicLimits = NO_LIMITS
    ) -> asyncio.Future[None] | None:
        """Admit ``producer`` under its access mode and ``caps``; a future when it must
        wait (WaitForExclusive), else None. Raises ProducerBusy/ProducerFenced/
        TopicTerminated."""
        if self._closing:
            raise TopicTerminated(f"{self.name} is closing")
        return self._admit(producer, caps)

    def remove_producer(self, producer: Producer) -> None:
        """Forget ``producer``; hand exclusivity to a waiter."""
        if self._release(producer):
            self.publish_drops.pop(producer.name, None)
            self._publish_drop_rates.pop(producer.name, None)

    def last_sequence_id(self, producer_name: str) -> int:
        """Always -1: no dedup state survives anything."""
        return -1

    # --- publishing -----------------------------------------------------------------------

    def publish(
        self,
        producer_name: str,
        sequence_id: int,
        highest_sequence_id: int | None,
        entry: bytes,
        num_messages: int,
        *,
        txn: TxnId | None = None,
        role: str | None = None,
    ) -> asyncio.Future[Position]:
        """Dispatch one SEND to the subscriptions now; the future is already resolved
        with its message id (DROPPED_POSITION when the in-flight bound dropped it).
        Raises NonPersistentUnsupported for a transactional send (whatever ``role``),
        TopicTerminated while closing."""
        if txn is not None:
            raise NonPersistentUnsupported("transactions")
        if self._closing:
            raise TopicTerminated(f"{self.name} is closing")
        messages = max(num_messages, 1)
        self.msg_in_counter += messages
        self.bytes_in_counter += len(entry)
        if self._inflight_bytes + len(entry) > limits.NON_PERSISTENT_INFLIGHT_BYTES_MAX:
            if producer_name not in self._publish_drop_rates:
                self._publish_drop_rates[producer_name] = RateWindow(
                    limits.STATS_RATE_WINDOW_MIN_S, self.clock.monotonic(), (0,)
                )
            self.publish_drops[producer_name] += messages
            return _resolved(DROPPED_POSITION)
        position = Position(self._ledger_id, self._next_entry)
        self._next_entry += 1
        if self.subscriptions:
            info = entry_info(entry)
            sent = sum(sub.dispatch(position, entry, info) for sub in self.subscriptions.values())
            if sent:
                self._charge(sent * len(entry))
        return _resolved(position)

    def _charge(self, size: int) -> None:
        # The sessions flush what was written at the end of this loop iteration; the
        # bound covers what one iteration fans out.
        self._inflight_bytes += size
        if self._inflight_reset is None:
            self._inflight_reset = asyncio.get_running_loop().call_soon(self._reset_inflight)

    def _reset_inflight(self) -> None:
        self._inflight_bytes = 0
        self._inflight_reset = None

    # --- subscriptions --------------------------------------------------------------------

    def get_or_create_subscription(
        self, name: str, sub_type: int, caps: TopicLimits = NO_LIMITS
    ) -> NonPersistentSubscription:
        """The subscription ``name`` (created empty; it takes its first consumer's type;
        a new one only within ``caps``)."""
        if self._closing:
            raise Closed(f"{self.name} is closing")
        sub = self.subscriptions.get(name)
        if sub is None:
            caps.check_new_subscription(self.name, name, existing=self.subscriptions)
            if len(self.subscriptions) >= limits.NON_PERSISTENT_SUBSCRIPTIONS_MAX:
                raise ResourceLimitReached(
                    f"subscriptions on {self.name}", limits.NON_PERSISTENT_SUBSCRIPTIONS_MAX
                )
            sub = NonPersistentSubscription(
                self, name, sub_type, self.name, self.partition, created=self.clock.monotonic()
            )
            self.subscriptions[name] = sub
        return sub

    def check_consumer_room(
        self, subscription: str, on_subscription: int, caps: TopicLimits = NO_LIMITS
    ) -> None:
        """ResourceLimitReached when the topic holds NON_PERSISTENT_CONSUMERS_MAX;
        ConsumerBusy when one more consumer of ``subscription`` (which has
        ``on_subscription``) would pass ``caps``."""
        count = sum(len(s.consumers) for s in self.subscriptions.values())
        if count >= limits.NON_PERSISTENT_CONSUMERS_MAX:
            raise ResourceLimitReached(
                f"consumers on {self.name}", limits.NON_PERSISTENT_CONSUMERS_MAX
            )
        caps.check_consumer(subscription, on_topic=count, on_subscription=on_subscription)

    def forget_subscription(self, sub: NonPersistentSubscription) -> None:
        """``sub`` ended (its last consumer left): keep its counts in the topic's."""
        if self.subscriptions.get(sub.name) is sub:
            del self.subscriptions[sub.name]
        messages, size, drops = self._gone_out
        self._gone_out = (
            messages + sub.messages_out,
            size + sub.bytes_out,
            drops + sub.messages_dropped,
        )
        # The subscription's own counters now live in the topic's: zero them, so a
        # late second call cannot count them twice.
        sub.messages_out = sub.bytes_out = sub.messages_dropped = 0

    async def remove_subscription(self, name: str) -> None:
        """Drop a subscription, disconnecting its consumers."""
        sub = self.subscriptions.get(name)
        if sub is not None:
            self.forget_subscription(sub)
            await sub.close()

    # --- state ----------------------------------------------------------------------------

    @property
    def in_use(self) -> bool:
        """Producers or consumers are connected."""
        return bool(self.producers) or any(s.consumers for s in self.subscriptions.values())

    def stats(self) -> dict[str, Any]:
        """Upstream ``NonPersistentTopicStats``; rates over a window shared by every
        caller (``core/rate_window.py``, as persistent topics')."""
        now = self.clock.monotonic()
        out_msgs, out_bytes, dropped = (
            self.msg_out_counter,
            self.bytes_out_counter,
            self.msg_drop_counter,
        )
        rate_in, throughput_in, rate_out, throughput_out, drop_rate = self._rates.rates(
            now, (self.msg_in_counter, self.bytes_in_counter, out_msgs, out_bytes, dropped)
        )
        publishers = []
        for producer in self.producers.values():
            stats = producer.stats()
            drops = self.publish_drops.get(producer.name, 0)
            window = self._publish_drop_rates.get(producer.name)
            stats["msgDropCounter"] = drops
            stats["msgDropRate"] = window.rates(now, (drops,))[0] if window else 0.0
            publishers.append(stats)
        return {
            "msgRateIn": rate_in,
            "msgThroughputIn": throughput_in,
            "msgRateOut": rate_out,
            "msgThroughputOut": throughput_out,
            "msgDropRate": drop_rate,
            "msgInCounter": self.msg_in_counter,
            "bytesInCounter": self.bytes_in_counter,
            "msgOutCounter": out_msgs,
            "bytesOutCounter": out_bytes,
            "msgDropCounter": dropped,
            "averageMsgSize": self.bytes_in_counter / self.msg_in_counter
            if self.msg_in_counter
            else 0.0,
            "storageSize": 0,
            "backlogSize": 0,
            "publishers": publishers,
            "subscriptions": {name: s.stats(now) for name, s in self.subscriptions.items()},
            "replication": {},
            "deduplicationStatus": "Disabled",
            "topicEpoch": self.topic_epoch,
        }

    async def close(self) -> None:
        """Stop taking sends; disconnect producers and consumers (they reconnect)."""
        if self._closing:
            return
        self._closing = True
        if self._inflight_reset is not None:
            self._inflight_reset.cancel()
            self._inflight_reset = None
        for _, fut in self._waiting:
            if not fut.done():
                fut.set_exception(Closed(f"{self.name} is closing"))
        self._waiting.clear()
        for sub in list(self.subscriptions.values()):
            try:
                await sub.close()
            except Exception:
                log.exception("%s: closing a subscription failed", self.name)
        self.subscriptions.clear()
        for producer in list(self.producers.values()):
            producer.detach()


def _resolved(position: Position) -> asyncio.Future[Position]:
    fut: asyncio.Future[Position] = asyncio.get_running_loop().create_future()
    fut.set_result(position)
    return fut
