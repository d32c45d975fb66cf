"""A subscription of a non-persistent topic: hands each message to one connected consumer
now, or drops it.

Theory of operation (upstream ``NonPersistentSubscription`` and its dispatchers). There is
no cursor and no read loop: :meth:`NonPersistentSubscription.dispatch` is called by the
topic for every published entry, synchronously, and either writes it to the consumer its
type picks or counts it as dropped. Nothing is kept for later:

- Exclusive / Failover: the active consumer (:func:`~anabranch.broker.dispatcher.choose_active`,
  the persistent dispatcher's choice) gets everything.
- Shared: round-robin over the best-priority consumers that can take it.
- Key_Shared: the entry's sticky-key slot picks the consumer with the persistent
  dispatcher's selectors (auto-split or sticky hash ranges); per key, a message goes to
  that consumer or nowhere.

A consumer can take an entry while it has permits (its receiver queue has room) and its
connection's output buffer is under the high-water mark; otherwise the message is
dropped for this subscription (``msgDropRate``). What is sent is not tracked: acks are
accepted and ignored, redelivery requests have nothing to redeliver, and a consumer that
leaves takes nothing with it. The subscription ends with its last consumer.

Example:
    >>> from anabranch.broker.consumer import FakeWriter
    >>> from anabranch.broker.dispatcher_entries import EntryInfo
    >>> sub = NonPersistentSubscription(None, "s", pb.CommandSubscribe.Shared, "t", -1)
    >>> c = Consumer(FakeWriter(), 1, "c", pb.CommandSubscribe.Shared)
    >>> sub.attach(c); c.add_permits(1)
    >>> info = EntryInfo(1, b"k", None, 0)
    >>> sub.dispatch(Position(7, 0), b"...", info), sub.dispatch(Position(7, 1), b"...", info)
    (True, False)
    >>> sub.messages_out, sub.messages_dropped, c.unacked_messages
    (1, 1, 0)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from anabranch import limits
from anabranch.broker.consumer import Consumer
from anabranch.broker.dispatcher import choose_active, round_robin
from anabranch.broker.dispatcher_entries import EntryInfo, hash_slot
from anabranch.broker.dispatcher_key_shared import AutoSplitSelector, StickySelector, join_selector
from anabranch.broker.subscription import TYPE_NAMES
from anabranch.broker.topic_limits import NO_LIMITS, TopicLimits
from anabranch.core.rate_window import RateWindow
from anabranch.errors import (
    Closed,
    ConsumerBusy,
    NonPersistentUnsupported,
)
from anabranch.protocol._generated import pulsar_api_pb2 as pb
from anabranch.storage.api import Position

if TYPE_CHECKING:
    from anabranch.broker.nonpersistent import NonPersistentTopic

SubType = pb.CommandSubscribe


def can_take(consumer: Consumer) -> bool:
    """Whether ``consumer`` takes a message now: permits left, open, and its connection
    not backed up (a ``Session``'s ``write_paused``; a plain writer never is)."""
    return consumer.ready


class NonPersistentSubscription:
    """One named subscription of a non-persistent topic (see the module docstring)."""

    durable = False
    """Ends with its last consumer (``consumer_commands`` removes it then)."""

    def __init__(
        self,
        topic: NonPersistentTopic | None,
        name: str,
        sub_type: int,
        topic_name: str,
        partition: int,
        *,
        created: float = 0.0,
    ) -> None:
        self.topic: Any = topic
        """The :class:`NonPersistentTopic` (None in unit tests); loose, like
        ``Subscription.topic`` where the consumer handlers use both kinds alike."""
        self.name = name
        self.sub_type = sub_type
        self.topic_name = topic_name
        self.partition = partition
        self._consumers: list[Consumer] = []
        self.active: Consumer | None = None
        self._next = 0
        self._selector: AutoSplitSelector[Consumer] | StickySelector[Consumer] | None = None
        self._key_mode: int | None = None
        self.messages_out = 0
        self.bytes_out = 0
        self.messages_dropped = 0
        self._rates = RateWindow(limits.STATS_RATE_WINDOW_MIN_S, created, (0, 0, 0))
        self._closed = False

    @property
    def consumers(self) -> list[Consumer]:
        return list(self._consumers)

    # --- consumers ------------------------------------------------------------------------

    async def add_consumer(self, consumer: Consumer, caps: TopicLimits = NO_LIMITS) -> None:
        """Attach ``consumer``; ConsumerBusy / ConsumerAssignError per the type's rules
        and ``caps``."""
        self.attach(consumer, caps)

    def attach(self, consumer: Consumer, caps: TopicLimits = NO_LIMITS) -> None:
        """:meth:`add_consumer` without the coroutine (the checks and the choice)."""
        if self._closed:
            raise Closed(f"subscription {self.name} is closed")
        if self._consumers and consumer.sub_type != self.sub_type:
            raise ConsumerBusy(
                f"subscription {self.name} is {TYPE_NAMES.get(self.sub_type)}, not "
                f"{TYPE_NAMES.get(consumer.sub_type)}"
            )
        if not self._consumers:
            # A subscription without consumers takes its next consumer's type (upstream).
            self.sub_type = consumer.sub_type
            self._selector, self._key_mode, self.active = None, None, None
        if self.sub_type == SubType.Exclusive and self._consumers:
            raise ConsumerBusy("Exclusive consumer is already connected")
        if self.topic is not None:
            self.topic.check_consumer_room(self.name, len(self._consumers), caps)
        if self.sub_type == SubType.Key_Shared:
            self._add_keyed(consumer)
        self._consumers.append(consumer)
        consumer.subscription = self
        if self.sub_type in (SubType.Exclusive, SubType.Failover):
            self._pick_active(newcomer=consumer)

    def _add_keyed(self, consumer: Consumer) -> None:
        self._selector, self._key_mode = join_selector(self._selector, self._key_mode, consumer)

    def _pick_active(self, newcomer: Consumer | None = None) -> None:
        if not self._consumers:
            self.active = None
            return
        chosen = choose_active(self._consumers, self.partition, self.topic_name)
        changed = chosen is not self.active
        self.active = chosen
        if self.sub_type != SubType.Failover:
            return
        if changed:
            for consumer in self._consumers:
                consumer.notify_active(consumer is chosen)
        elif newcomer is not None:
            newcomer.notify_active(newcomer is chosen)

    async def remove_consumer(self, consumer: Consumer) -> None:
        """Detach ``consumer``; nothing it was sent comes back."""
        self.detach(consumer)

    def detach(self, consumer: Consumer) -> None:
        """:meth:`remove_consumer` without the coroutine."""
        consumer.closed = True
        consumer.take_pending()
        if consumer not in self._consumers:
            return
        self._consumers.remove(consumer)
        if isinstance(self._selector, AutoSplitSelector | StickySelector):
            self._selector.remove(consumer)
        if consumer is self.active:
            self.active = None
            self._pick_active()

    # --- dispatch -------------------------------------------------------------------------

    def _choose(self, info: EntryInfo) -> Consumer | None:
        if self.sub_type in (SubType.Exclusive, SubType.Failover):
            return self.active
        if self.sub_type == SubType.Key_Shared:
            selector = self._selector
            return selector.select(hash_slot(info.sticky_key)) if selector is not None else None
        consumer, self._next = round_robin(self._consumers, self._next, can_take)
        return consumer

    def dispatch(self, position: Position, entry: bytes, info: EntryInfo) -> bool:
        """Send one published entry to the consumer this type picks, or count it dropped
        (no consumer, or the chosen one cannot take it). True when sent."""
        consumer = self._choose(info)
        if consumer is None or not can_take(consumer):
            self.messages_dropped += info.batch_size
            return False
        consumer.send_entry(position, entry, batch_size=info.batch_size, redelivery_count=0)
        consumer.forget(position)  # acks are ignored: nothing is tracked once written
        self.messages_out += info.batch_size
        self.bytes_out += len(entry)
        return True

    # --- what clients may ask -------------------------------------------------------------

    async def acknowledge(self, consumer: Consumer, cmd: pb.CommandAck) -> None:
        """Accepted and ignored (at-most-once); a transactional ack is refused."""
        if cmd.HasField("txnid_most_bits") or cmd.HasField("txnid_least_bits"):
            raise NonPersistentUnsupported("transactional acknowledgement")

    async def redeliver(
        self, consumer: Consumer, message_ids: list[pb.MessageIdData] | None
    ) -> None:
        """Nothing is kept, so nothing is redelivered."""

    async def seek(self, position: Position | None = None, timestamp_ms: int | None = None) -> None:
        """Refused: there is nothing stored to seek to."""
        raise NonPersistentUnsupported("seek")

    async def close(self) -> None:
        """Disconnect the consumers (they reconnect and subscribe again)."""
        if self._closed:
            return
        self._closed = True
        for consumer in list(self._consumers):
            consumer.disconnect()
            registry = getattr(consumer.session, "consumers", None)
            if isinstance(registry, dict) and registry.get(consumer.consumer_id) is consumer:
                del registry[consumer.consumer_id]
            self.detach(consumer)

    # --- stats ----------------------------------------------------------------------------

    def stats(self, now: float) -> dict[str, Any]:
        """Upstream ``NonPersistentSubscriptionStats``; rates over a window shared by
        every caller."""
        rate_out, throughput_out, drop_rate = self._rates.rates(
            now, (self.messages_out, self.bytes_out, self.messages_dropped)
        )
        out_stats: dict[str, Any] = {
            "type": TYPE_NAMES.get(self.sub_type, str(self.sub_type)),
            "msgRateOut": rate_out,
            "msgThroughputOut": throughput_out,
            "msgDropRate": drop_rate,
            "msgOutCounter": self.messages_out,
            "bytesOutCounter": self.bytes_out,
            "msgDropCounter": self.messages_dropped,
            "msgBacklog": 0,
            "unackedMessages": 0,
            "isDurable": False,
            "consumers": [c.stats() for c in self._consumers],
        }
        if self.active is not None:
            out_stats["activeConsumerName"] = self.active.name
        if isinstance(self._selector, AutoSplitSelector):
            out_stats["consumerHashRanges"] = {
                c.name: list(r) for c, r in self._selector.ranges().items()
            }
        return out_stats
