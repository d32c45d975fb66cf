"""Readers: a non-durable, exclusive subscription that starts at a chosen position.

Nothing is acknowledged and nothing is kept on the broker after ``close``. The start is a
``MessageId`` (exclusive unless ``start_inclusive``), ``MessageId.earliest()`` or
``MessageId.latest()``; after a reconnect the reader resumes after its last message.

Example (with a client)::

    reader = await client.create_reader(topic, MessageId.earliest())
    while await reader.has_message_available():
        msg = await reader.read_next(timeout=1.0)
    await reader.close()
"""

from __future__ import annotations

import uuid

from anabranch.client.connection import ConnectionPool
from anabranch.client.consumer import Consumer, ConsumerOptions, InitialPosition
from anabranch.client.message import Message
from anabranch.client.message_id import MessageId
from anabranch.errors import InvalidArgument
from anabranch.limits import CONSUMER_RECEIVER_QUEUE_MESSAGES


def start_position(start: MessageId | str) -> MessageId:
    """``"earliest"``/``"latest"`` or a MessageId, as a MessageId.

    Example:
        >>> start_position("earliest") == MessageId.earliest()
        True
    """
    if isinstance(start, MessageId):
        return start
    if start == "earliest":
        return MessageId.earliest()
    if start == "latest":
        return MessageId.latest()
    raise InvalidArgument(f"reader start {start!r} is not a MessageId, 'earliest' or 'latest'")


class Reader:
    """Reads a (non-partitioned) topic from a position, without a durable subscription."""

    def __init__(
        self,
        pool: ConnectionPool,
        topic: str,
        start: MessageId,
        *,
        start_inclusive: bool = False,
        reader_name: str | None = None,
        receiver_queue_size: int | None = None,
        read_compacted: bool = False,
    ) -> None:
        self.topic = topic
        self.start = start
        earliest = start == MessageId.earliest()
        options = ConsumerOptions(
            consumer_name=reader_name,
            initial_position=InitialPosition.EARLIEST if earliest else InitialPosition.LATEST,
            receiver_queue_size=receiver_queue_size or CONSUMER_RECEIVER_QUEUE_MESSAGES,
            read_compacted=read_compacted,
        )
        subscription = f"reader-{uuid.uuid4().hex[:10]}"
        self._consumer = Consumer(
            pool,
            topic,
            subscription,
            options,
            durable=False,
            start_message_id=start,
            start_inclusive=start_inclusive,
        )
        self._last_read: MessageId | None = None

    async def _start(self) -> None:
        await self._consumer._start()

    async def read_next(self, timeout: float | None = None) -> Message | None:  # noqa: ASYNC109 (fixed API)
        """The next message, or None if none arrives within ``timeout`` seconds."""
        msg = await self._consumer.receive(timeout)
        if msg is not None:
            self._last_read = msg.message_id
        return msg

    async def has_message_available(self) -> bool:
        """True if a message after the last one read exists (asks GET_LAST_MESSAGE_ID)."""
        if self._consumer.has_queued_messages():
            return True
        last = await self._consumer.get_last_message_id()
        if last.entry_id < 0:
            return False  # nothing readable: an empty topic, or one retention emptied
        ref = self._last_read
        if ref is None:
            if self.start == MessageId.earliest():
                return True
            if self.start == MessageId.latest():
                return False
            ref = self.start
        # A batch arrives whole, so its later messages would already be queued locally.
        return (last.ledger_id, last.entry_id) > (ref.ledger_id, ref.entry_id)

    async def seek(self, target: MessageId | int) -> None:
        """Move to a message id (inclusive) or a publish time in ms."""
        await self._consumer.seek(target)
        self._last_read = None
        if isinstance(target, MessageId):
            self.start = target

    async def close(self) -> None:
        """Close the reader (its non-durable subscription disappears)."""
        await self._consumer.close()
