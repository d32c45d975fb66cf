"""``Message``: one received message with its payload, key, properties and position.

Example:
    >>> m = Message(b"hi", "k", {"a": "1"}, MessageId(1, 2), "persistent://public/default/t")
    >>> (m.value, m.key, m.properties["a"], m.redelivery_count)
    (b'hi', 'k', '1', 0)
"""

from __future__ import annotations

from dataclasses import dataclass, field

from anabranch.client.message_id import MessageId


@dataclass(frozen=True, slots=True)
class Message:
    """A received message.

    ``publish_time`` and ``event_time`` are milliseconds since the epoch (``event_time``
    is None when the producer set none); ``topic`` is the partition's topic name.
    """

    value: bytes
    key: str | None
    properties: dict[str, str]
    message_id: MessageId
    topic: str
    publish_time: int = 0
    event_time: int | None = None
    redelivery_count: int = 0
    producer_name: str = ""
    sequence_id: int = 0
    _consumer_id: int = field(default=0, compare=False, repr=False)

    def __repr__(self) -> str:
        return f"Message({self.message_id}, key={self.key!r}, {len(self.value)} bytes)"
