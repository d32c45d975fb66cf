"""One consumer of a subscription: permits, outstanding entries, and the MESSAGE it sends.

Theory of operation. A client grants permits with FLOW, counted in messages: an entry that
is a batch of N messages costs N permits (N minus its already acknowledged indexes when the
cursor holds a partial batch ack), as upstream's ``Consumer.sendMessages`` does. Permits may
go negative by the last batch sent; the dispatcher only picks consumers with permits > 0.
Every entry sent stays in ``pending`` (position -> :class:`PendingEntry`) until it is
acknowledged, redelivered, or the consumer goes away; Shared subscriptions hand a closed
consumer's pending entries to other consumers, single-active ones rewind.

The consumer never touches the ledger: the dispatcher decides, the consumer writes.

Example:
    >>> from anabranch.storage.api import Position
    >>> c = Consumer(FakeWriter(), consumer_id=1, name="c1", sub_type=0)
    >>> c.add_permits(10)
    >>> c.send_entry(Position(3, 0), b"...", batch_size=4, redelivery_count=0)
    >>> (c.permits, c.unacked_messages, c.written[0].message.message_id.entryId)
    (6, 4, 0)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from anabranch import limits
from anabranch.broker.hot_frames import encode_message_head
from anabranch.core.unacked_gate import UnackedGate
from anabranch.protocol import commands
from anabranch.protocol._generated import pulsar_api_pb2 as pb
from anabranch.storage.api import Position

if TYPE_CHECKING:
    from anabranch.broker.nonpersistent_subscription import NonPersistentSubscription
    from anabranch.broker.subscription import Subscription

U64_MASK = (1 << 64) - 1
NO_REQUEST_ID = U64_MASK
"""Request id of a broker-initiated CLOSE_CONSUMER (upstream sends -1 in a uint64 field)."""


def to_u64(value: int) -> int:
    """A signed 64-bit id as the unsigned value the wire carries (-1 -> 2**64 - 1).

    >>> to_u64(-1) == 2**64 - 1, to_u64(7)
    (True, 7)
    """
    return value & U64_MASK


def from_u64(value: int) -> int:
    """The signed 64-bit value of a uint64 field (clients send -1 as 2**64 - 1).

    >>> from_u64(2**64 - 1), from_u64(5)
    (-1, 5)
    """
    return value - (1 << 64) if value >= 1 << 63 else value


def message_id_data(
    position: Position, partition: int = -1, batch_index: int = -1
) -> pb.MessageIdData:
    """A MessageIdData for ``position`` (negative ids encoded as uint64, as upstream).

    >>> message_id_data(Position(-1, -1)).ledgerId == 2**64 - 1
    True
    """
    msg_id = pb.MessageIdData(ledgerId=to_u64(position[0]), entryId=to_u64(position[1]))
    if partition != -1:
        msg_id.partition = partition
    if batch_index != -1:
        msg_id.batch_index = batch_index
    return msg_id


class Writer(Protocol):
    """What a consumer needs of its connection (``broker.session.Session`` is one)."""

    def write(self, command: pb.BaseCommand) -> None: ...

    def write_message(self, command: pb.BaseCommand, entry: bytes) -> None: ...


@dataclass
class Written:
    """One command a :class:`FakeWriter` received (with the entry of a MESSAGE)."""

    command: pb.BaseCommand
    entry: bytes | None = None

    @property
    def message(self) -> pb.CommandMessage:
        return self.command.message


@dataclass
class FakeWriter:
    """A writer that records commands (for doctests and unit tests)."""

    written: list[Written] = field(default_factory=list)

    def write(self, command: pb.BaseCommand) -> None:
        self.written.append(Written(command))

    def write_message(self, command: pb.BaseCommand, entry: bytes) -> None:
        self.written.append(Written(command, entry))


@dataclass(slots=True)
class PendingEntry:
    """An entry sent to a consumer and not yet acknowledged."""

    batch_size: int
    """Messages in the entry (1 unless it is a batch)."""
    messages: int
    """Messages actually delivered (batch size minus indexes acked before sending)."""
    slot: int | None = None
    """Key_Shared hash slot of the entry's sticky key (None elsewhere)."""


class Consumer:
    """A subscribed consumer on one connection."""

    def __init__(
        self,
        session: Writer,
        consumer_id: int,
        name: str,
        sub_type: int,
        *,
        priority: int = 0,
        partition: int = -1,
        key_shared_meta: pb.KeySharedMeta | None = None,
        epoch: int = 0,
        remote_address: str = "",
    ) -> None:
        self.session = session
        self._write_parts: Callable[[bytes, bytes], None] | None = getattr(
            session, "write_parts", None
        )
        """Writes an encoded frame in two parts (a ``Session``); a plain ``Writer`` gets
        commands."""
        self.consumer_id = consumer_id
        self.name = name
        self.sub_type = sub_type
        self.priority = priority
        self.partition = partition
        self.key_shared_meta = key_shared_meta
        self.epoch = epoch
        """Consumer epoch (Exclusive/Failover): messages carry it so that a client drops
        what was in flight before its last redelivery request."""
        self.remote_address = remote_address
        self.read_compacted = False
        """Reads the topic's compacted view up to its horizon (Exclusive/Failover)."""
        self.permits = 0
        self.pending: dict[Position, PendingEntry] = {}
        self.unacked_messages = 0
        self.unacked_gate = UnackedGate(limits.CONSUMER_UNACKED_MESSAGES_MAX)
        """Closed while this consumer holds too many unacknowledged messages (Shared and
        Key_Shared only: the other types deliver in order to one consumer)."""
        self.subscription: Subscription | NonPersistentSubscription | None = None
        self.closed = False
        self.reached_end_sent = False
        self.messages_out = 0
        self.bytes_out = 0
        self.redelivered_messages = 0

    def __repr__(self) -> str:
        return f"Consumer(id={self.consumer_id}, name={self.name!r})"

    # --- permits ------------------------------------------------------------------------

    def add_permits(self, permits: int) -> None:
        """FLOW: ``permits`` more messages may be sent (clamped to CONSUMER_PERMITS_MAX)."""
        self.permits = min(self.permits + max(permits, 0), limits.CONSUMER_PERMITS_MAX)

    @property
    def has_permits(self) -> bool:
        return self.permits > 0 and not self.closed

    @property
    def ready(self) -> bool:
        """Whether a dispatcher may send to it now: permits left, open, and its connection
        not backed up (a ``Session``'s ``write_paused``; a plain writer never is). A client
        that sends FLOW and never reads would otherwise have the whole backlog queued in
        the broker's memory, once per subscription."""
        return self.has_permits and not getattr(self.session, "write_paused", False)

    def writable_again(self) -> None:
        """Its connection drained below the low-water mark: dispatch to it again."""
        dispatcher = getattr(self.subscription, "dispatcher", None)
        if dispatcher is not None:
            dispatcher.kick()

    # --- sending ------------------------------------------------------------------------

    @property
    def written(self) -> list[Written]:
        """Commands written so far (only when the session is a :class:`FakeWriter`)."""
        assert isinstance(self.session, FakeWriter)
        return self.session.written

    def send_entry(
        self,
        position: Position,
        data: bytes,
        *,
        batch_size: int,
        redelivery_count: int,
        ack_set: Sequence[int] = (),
        unacked_in_batch: int | None = None,
        slot: int | None = None,
        permits_cost: int | None = None,
    ) -> None:
        """Write one MESSAGE for a stored entry and remember it as pending.

        ``ack_set`` is the consumer-side bitset of a partially acknowledged batch (set bit
        = index still to deliver), ``unacked_in_batch`` how many indexes it leaves.
        ``permits_cost`` (default: those messages) is what the send takes from the permits:
        a Key_Shared part costs the whole batch, because the client grants back a permit
        for every index it skips too.
        """
        messages = batch_size if unacked_in_batch is None else unacked_in_batch
        write_parts = self._write_parts
        if write_parts is not None and not ack_set:
            # The hot path: the frame's bytes directly (see ``hot_frames``), the stored entry
            # written as it is, not copied into a joined frame.
            head = encode_message_head(
                self.consumer_id,
                position[0],
                position[1],
                self.partition,
                redelivery_count,
                self.epoch,
                len(data),
            )
            write_parts(head, data)
        else:
            body = pb.CommandMessage(
                consumer_id=self.consumer_id,
                message_id=message_id_data(position, self.partition),
            )
            if redelivery_count:
                body.redelivery_count = redelivery_count
            if ack_set:
                body.ack_set.extend(ack_set)
            if self.epoch:
                body.consumer_epoch = self.epoch
            message = pb.BaseCommand(type=pb.BaseCommand.MESSAGE, message=body)
            self.session.write_message(message, data)
        previous = self.pending.get(position)
        if previous is not None:
            self.unacked_messages -= previous.messages
        self.pending[position] = PendingEntry(batch_size, messages, slot)
        self.unacked_messages += messages
        self.permits -= messages if permits_cost is None else permits_cost
        self.messages_out += messages
        self.bytes_out += len(data)
        if redelivery_count:
            self.redelivered_messages += messages

    def forget(self, position: Position) -> PendingEntry | None:
        """Drop ``position`` from pending (acknowledged or taken back); returns what it was."""
        entry = self.pending.pop(position, None)
        if entry is not None:
            self.unacked_messages -= entry.messages
        return entry

    def forget_upto(self, position: Position) -> list[tuple[Position, PendingEntry]]:
        """Drop every pending position at or below ``position`` (cumulative ack)."""
        gone = [(p, e) for p, e in self.pending.items() if p <= position]
        for p, _ in gone:
            self.forget(p)
        return gone

    def take_pending(self) -> dict[Position, PendingEntry]:
        """Remove and return everything pending (redelivery, close)."""
        pending, self.pending = self.pending, {}
        self.unacked_messages = 0
        return pending

    # --- notifications ------------------------------------------------------------------

    def notify_active(self, is_active: bool) -> None:
        """ACTIVE_CONSUMER_CHANGE (Failover)."""
        if not self.closed:
            self.session.write(commands.active_consumer_change(self.consumer_id, is_active))

    def notify_reached_end(self) -> None:
        """REACHED_END_OF_TOPIC, once."""
        if not self.closed and not self.reached_end_sent:
            self.reached_end_sent = True
            self.session.write(commands.reached_end_of_topic(self.consumer_id))

    def disconnect(self) -> None:
        """Broker-initiated close: the client reconnects and subscribes again (seek, unload)."""
        if not self.closed:
            self.session.write(commands.close_consumer(self.consumer_id, NO_REQUEST_ID))

    # --- stats --------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """Pulsar-admin-like consumer stats."""
        return {
            "consumerName": self.name,
            "availablePermits": self.permits,
            "unackedMessages": self.unacked_messages,
            "blockedConsumerOnUnackedMsgs": self.unacked_gate.is_closed,
            "msgOutCounter": self.messages_out,
            "bytesOutCounter": self.bytes_out,
            "msgRedeliverCounter": self.redelivered_messages,
            "priorityLevel": self.priority,
            "address": self.remote_address,
        }
