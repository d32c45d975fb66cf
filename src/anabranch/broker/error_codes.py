"""The one place where anabranch errors become Pulsar ``ServerError`` values.

Every class in :mod:`anabranch.errors` names its wire code (``errors.WIRE_CODES``); this
module turns that name into the protobuf enum value. Names that upstream's enum lacks
(e.g. ``MessageTooBig``, ``InvalidMessage``) get the closest upstream code, and anything
that is not an ``AnabranchError`` is ``UnknownError``.

:func:`client_message` is the one rule for what a client is told (wire ERROR/SEND_ERROR/
*_RESPONSE messages and HTTP error bodies): an ``AnabranchError``'s message (these name
no file path: storage wraps OSError in a path-free StorageIOError), and for anything else
only "internal error" (the exception, traceback and any path go to the log).

Example:
    >>> from anabranch.errors import NotFound, ValueTooLarge
    >>> server_error(NotFound("/x")) == pb.TopicNotFound
    True
    >>> server_error(ValueTooLarge("message", 9, 1)) == pb.NotAllowedError
    True
    >>> server_error(KeyError("boom")) == pb.UnknownError
    True
    >>> client_message(OSError(36, "File name too long", "/data/x"))
    'internal error'
"""

from __future__ import annotations

from typing import Final

from anabranch.broker.policies import ROOT as ADMIN_ROOT
from anabranch.broker.policies import describe_path
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


INTERNAL_ERROR_MESSAGE: Final = "internal error"


def client_message(exc: BaseException) -> str:
    """The message to answer ``exc`` with (see the module docstring).

    Example:
        >>> from anabranch.errors import ValueTooLarge
        >>> client_message(ValueTooLarge("message", 9, 1))
        'message is 9 bytes, over the limit of 1'
    """
    if isinstance(exc, AnabranchError):
        text = str(exc)
        path = getattr(exc, "path", None)
        if isinstance(path, str) and path.startswith(ADMIN_ROOT + "/"):
            # A policies record's path is where the broker keeps it: name the resource.
            text = text.replace(path, describe_path(path))
        return text
    return INTERNAL_ERROR_MESSAGE
