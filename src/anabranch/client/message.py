"""``Message``: one received message with its payload, key, properties and position.

A consumer receives most messages inside batch entries of hundreds; what the messages of an
entry share (topic, publish time, producer, position) lives once in an :class:`EntryInfo`,
and what is each message's own beyond its value (key, properties, event time, sequence id,
message id) is decoded from its raw metadata only when first read. A consumer that reads
values and acks pays for neither.

Example:
    >>> m = Message(b"hi", "k", {"a": "1"}, MessageId(1, 2), "persistent://public/default/t")
    >>> (m.value, m.key, m.properties["a"], m.redelivery_count)
    (b'hi', 'k', '1', 0)
"""

from __future__ import annotations

from typing import Any

from google.protobuf.message import DecodeError  # type: ignore[import-untyped]

from anabranch.client.message_id import MessageId
from anabranch.errors import InvalidMessage
from anabranch.protocol._generated import pulsar_api_pb2 as pb


class EntryInfo:
    """What every message of one stored entry shares, read once per entry.

    ``pending`` is the consumer's set of this entry's batch indexes not yet acked (the
    same set object it tracks the entry with), ``generation`` the consumer's tracking
    generation when it was made: a consumer that forgets its tracking (reconnect,
    redelivery) starts a new generation, and older entries take its slow path.
    """

    __slots__ = (
        "batch_size",
        "consumer_id",
        "entry_id",
        "generation",
        "ledger_id",
        "partition",
        "pending",
        "position",
        "producer_name",
        "publish_time",
        "redelivery_count",
        "segment_id",
        "topic",
    )

    def __init__(  # noqa: PLR0917 (one call per entry, positional for speed)
        self,
        topic: str,
        publish_time: int,
        producer_name: str,
        redelivery_count: int,
        consumer_id: int,
        position: MessageId | None = None,
        batch_size: int = 0,
    ) -> None:
        self.topic = topic
        self.publish_time = publish_time
        self.producer_name = producer_name
        self.redelivery_count = redelivery_count
        self.consumer_id = consumer_id
        self.position = position
        """The entry's id (batch index -1); None for a message built by hand."""
        self.batch_size = batch_size
        self.pending: set[int] | None = None
        self.generation = -1
        if position is not None:
            self.ledger_id = position.ledger_id
            self.entry_id = position.entry_id
            self.partition = position.partition
            self.segment_id = position.segment_id


_new = object.__new__


def batch_message(value: bytes, entry: EntryInfo, index: int, metadata: bytes) -> Message:
    """A message of a batch entry whose own fields are decoded from ``metadata`` (the raw
    ``SingleMessageMetadata``) when first read."""
    msg: Message = _new(Message)
    msg._value = value
    msg._entry = entry
    msg._index = index
    msg._raw = metadata
    msg._mid = None
    return msg


def single_message(  # noqa: PLR0917 (one call per non-batched entry)
    value: bytes,
    entry: EntryInfo,
    key: str | None,
    properties: dict[str, str],
    event_time: int | None,
    sequence_id: int,
) -> Message:
    """The message of a non-batched entry (its id is the entry's)."""
    msg: Message = _new(Message)
    msg._value = value
    msg._entry = entry
    msg._index = -1
    msg._raw = None
    msg._mid = entry.position
    msg._key = key
    msg._properties = properties
    msg._event_time = event_time
    msg._sequence_id = sequence_id
    return msg


class Message:
    """A received message (immutable).

    ``publish_time`` and ``event_time`` are milliseconds since the epoch (``event_time``
    is None when the producer set none); ``topic`` is the partition's topic name.
    """

    __slots__ = (
        "_entry",
        "_event_time",
        "_index",
        "_key",
        "_mid",
        "_properties",
        "_raw",
        "_sequence_id",
        "_value",
    )
    __match_args__ = ("value", "key", "properties", "message_id", "topic")

    _value: bytes
    _entry: EntryInfo
    _index: int
    _raw: bytes | None
    _mid: MessageId | None
    _key: str | None
    _properties: dict[str, str]
    _event_time: int | None
    _sequence_id: int

    def __init__(  # noqa: PLR0917 (the dataclass-era signature, kept)
        self,
        value: bytes,
        key: str | None,
        properties: dict[str, str],
        message_id: MessageId,
        topic: str,
        publish_time: int = 0,
        event_time: int | None = None,
        redelivery_count: int = 0,
        producer_name: str = "",
        sequence_id: int = 0,
        _consumer_id: int = 0,
    ) -> None:
        self._value = value
        self._entry = EntryInfo(topic, publish_time, producer_name, redelivery_count, _consumer_id)
        self._index = message_id.batch_index
        self._raw = None
        self._mid = message_id
        self._key = key
        self._properties = properties
        self._event_time = event_time
        self._sequence_id = sequence_id

    # --- what the entry shares ---------------------------------------------------------------

    @property
    def value(self) -> bytes:
        """The payload."""
        return self._value

    @property
    def topic(self) -> str:
        """The topic (partition) name; a stream consumer's is the ``topic://`` name."""
        return self._entry.topic

    @property
    def publish_time(self) -> int:
        """When the broker's producer stamped the entry (ms since the epoch)."""
        return self._entry.publish_time

    @property
    def producer_name(self) -> str:
        """The name of the producer that wrote it."""
        return self._entry.producer_name

    @property
    def redelivery_count(self) -> int:
        """How often the broker delivered it before."""
        return self._entry.redelivery_count

    @property
    def _consumer_id(self) -> int:
        return self._entry.consumer_id

    @property
    def message_id(self) -> MessageId:
        """Where it is stored."""
        mid = self._mid
        if mid is None:
            e = self._entry
            mid = self._mid = MessageId(
                e.ledger_id, e.entry_id, self._index, e.partition, e.segment_id, e.batch_size
            )
        return mid

    # --- its own metadata, decoded on first read ---------------------------------------------

    @property
    def key(self) -> str | None:
        """The partition key, or None."""
        if self._raw is not None:
            self._decode()
        return self._key

    @property
    def properties(self) -> dict[str, str]:
        """The application's properties."""
        if self._raw is not None:
            self._decode()
        return self._properties

    @property
    def event_time(self) -> int | None:
        """The producer's event time (ms since the epoch), or None."""
        if self._raw is not None:
            self._decode()
        return self._event_time

    @property
    def sequence_id(self) -> int:
        """The producer's sequence id."""
        if self._raw is not None:
            self._decode()
        return self._sequence_id

    def _decode(self) -> None:
        raw = self._raw
        assert raw is not None
        try:
            single = pb.SingleMessageMetadata.FromString(raw)
        except DecodeError as err:
            # The value arrived whole; only this metadata is broken. Reading it says so, typed,
            # every time (the message can still be acked).
            raise InvalidMessage(f"message {self._index}: unparsable metadata: {err}") from err
        self._key = single.partition_key if single.HasField("partition_key") else None
        self._properties = {p.key: p.value for p in single.properties}
        self._event_time = int(single.event_time) or None
        self._sequence_id = int(single.sequence_id)
        self._raw = None

    # --- the value semantics of the former frozen dataclass ----------------------------------

    def _fields(self) -> tuple[Any, ...]:
        return (
            self.value,
            self.key,
            self.properties,
            self.message_id,
            self.topic,
            self.publish_time,
            self.event_time,
            self.redelivery_count,
            self.producer_name,
            self.sequence_id,
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Message):
            return NotImplemented
        try:
            return self._fields() == other._fields()
        except InvalidMessage:  # a message whose metadata is broken equals only itself
            return self is other

    __hash__ = None  # type: ignore[assignment]  # properties is a dict, as before

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (*self._fields(), self._consumer_id))

    def relocated(self, message_id: MessageId, topic: str) -> Message:
        """This message under another id and topic (a segment's message as its scalable
        topic shows it)."""
        return Message(
            self.value,
            self.key,
            self.properties,
            message_id,
            topic,
            self.publish_time,
            self.event_time,
            self.redelivery_count,
            self.producer_name,
            self.sequence_id,
            self._consumer_id,
        )

    def __repr__(self) -> str:
        try:
            key = repr(self.key)
        except InvalidMessage:
            key = "<unparsable>"
        return f"Message({self.message_id}, key={key}, {len(self.value)} bytes)"


def _rebuild(*fields: Any) -> Message:
    return Message(*fields)
