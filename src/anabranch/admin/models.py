"""JSON shapes of the admin API that are not policies records (those live in
:mod:`anabranch.broker.policies` and are served unchanged).

Example:
    >>> decode_message_id(b'{"ledgerId": 3, "entryId": 7}')
    MessageIdBody(ledger_id=3, entry_id=7, partition_index=-1, batch_index=-1, is_excluded=False)
"""

from __future__ import annotations

from typing import Any

import msgspec

from anabranch.errors import InvalidArgument
from anabranch.storage.api import EARLIEST, LATEST, Position

JAVA_LONG_MAX = 2**63 - 1
"""Pulsar serialises ``MessageId.latest`` with ledger and entry id Long.MAX_VALUE."""


class ErrorBody(msgspec.Struct):
    """Every error answer: ``{"reason": "..."}`` (Pulsar's RestException body)."""

    reason: str


class MessageIdBody(msgspec.Struct, rename="camel", kw_only=True):
    """Pulsar's ``MessageIdImpl`` / ``ResetCursorData`` JSON.

    ``(-1, -1)`` is earliest and ``(Long.MAX, Long.MAX)`` latest, as Pulsar encodes them.
    """

    ledger_id: int
    entry_id: int
    partition_index: int = -1
    batch_index: int = -1
    is_excluded: bool = False

    def position(self) -> Position:
        """The storage position this id names (``is_excluded`` moves one past it)."""
        if (self.ledger_id, self.entry_id) == (-1, -1):
            return EARLIEST
        if self.ledger_id >= JAVA_LONG_MAX or self.entry_id >= JAVA_LONG_MAX:
            return LATEST
        if self.ledger_id < 0 or self.entry_id < 0:
            raise InvalidArgument(f"message id {self.ledger_id}:{self.entry_id} is negative")
        position = Position(self.ledger_id, self.entry_id)
        return position.next() if self.is_excluded else position

    @classmethod
    def of(cls, position: Position, partition_index: int = -1) -> MessageIdBody:
        """The JSON id of a stored position."""
        return cls(
            ledger_id=position.ledger_id,
            entry_id=position.entry_id,
            partition_index=partition_index,
        )


def decode_message_id(body: bytes) -> MessageIdBody:
    """Parse a message id body; InvalidArgument (400) when it is not one."""
    message_id: MessageIdBody = decode_json(body, MessageIdBody, "message id")
    return message_id


class LookupData(msgspec.Struct, rename="camel", kw_only=True):
    """``GET /lookup/v2/topic/...``: where the topic is served (always this broker)."""

    broker_url: str
    http_url: str
    native_url: str
    broker_url_tls: str = ""
    http_url_tls: str = ""


JAVA_LONG_MIN, JAVA_LONG_MAX = -(2**63), 2**63 - 1
"""Every number of Pulsar's admin API is at most a Java ``long``."""


def decode_json(body: bytes, kind: type[Any], what: str) -> Any:
    """Parse a request body into ``kind``; InvalidArgument (400) when it does not fit,
    including an integer no Java ``long`` holds (msgspec decodes any size).

    >>> decode_json(b'{"ledgerId": 1, "entryId": 100000000000000000000}', MessageIdBody, "id")
    Traceback (most recent call last):
    ...
    anabranch.errors.InvalidArgument: bad id body: 100000000000000000000 is out of range (a 64-bit integer)
    """  # noqa: E501 (a doctest's output is one line)
    try:
        value = msgspec.json.decode(body, type=kind)
    except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError) as err:
        # (msgspec raises UnicodeDecodeError for invalid UTF-8 inside a JSON string)
        raise InvalidArgument(f"bad {what} body: {err}") from err
    except RecursionError:
        # msgspec recurses per nesting level, even through values it skips
        raise InvalidArgument(f"bad {what} body: JSON nested too deeply") from None
    out_of_range = _long_out_of_range(msgspec.to_builtins(value))
    if out_of_range is not None:
        raise InvalidArgument(f"bad {what} body: {out_of_range} is out of range (a 64-bit integer)")
    return value


def _long_out_of_range(value: Any) -> int | None:
    """The first integer in ``value`` (decoded JSON) outside a Java ``long``, if any."""
    pending = [value]
    while pending:
        item = pending.pop()
        if isinstance(item, bool):
            continue
        if isinstance(item, int):
            if not JAVA_LONG_MIN <= item <= JAVA_LONG_MAX:
                return item
        elif isinstance(item, dict):
            pending += item.values()
        elif isinstance(item, list):
            pending += item
    return None
