"""The one place where anabranch errors become Pulsar ``ServerError`` values.

Every class in :mod:`anabranch.errors` names its wire code (``errors.WIRE_CODES``); this
module turns that name into the protobuf enum value. Names that upstream's enum lacks
(e.g. ``MessageTooBig``, ``InvalidMessage``) get the closest upstream code, and anything
that is not an ``AnabranchError`` is ``UnknownError``.

Example:
    >>> from anabranch.errors import NotFound, ValueTooLarge
    >>> server_error(NotFound("/x")) == pb.TopicNotFound
    True
    >>> server_error(ValueTooLarge("message", 9, 1)) == pb.NotAllowedError
    True
    >>> server_error(KeyError("boom")) == pb.UnknownError
    True
"""

from __future__ import annotations

from typing import Final

from anabranch.errors import WIRE_CODES, AnabranchError
from anabranch.protocol._generated import pulsar_api_pb2 as pb

_ALIASES: Final[dict[str, int]] = {
    # Upstream has no per-send "too big" code: its clients check sizes themselves, and a
    # broker that sees one refuses the request as not allowed.
    "MessageTooBig": pb.NotAllowedError,
    "InvalidMessage": pb.NotAllowedError,
}


def code_for_name(name: str) -> int:
    """The ``ServerError`` value for a wire-code name (unknown names: UnknownError).

    Example:
        >>> code_for_name("ProducerBusy") == pb.ProducerBusy
        True
    """
    if name in _ALIASES:
        return _ALIASES[name]
    try:
        return int(pb.ServerError.Value(name))
    except ValueError:
        return int(pb.UnknownError)


def server_error(exc: BaseException) -> int:
    """The ``ServerError`` value to answer ``exc`` with."""
    if isinstance(exc, AnabranchError):
        name = WIRE_CODES.get(type(exc), exc.wire_code)
        return code_for_name(name)
    return int(pb.UnknownError)
