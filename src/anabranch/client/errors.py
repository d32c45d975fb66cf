"""Client-side errors: the broker's ``ServerError`` codes mapped to typed exceptions.

Every class is an :class:`anabranch.errors.AnabranchError`, so callers branch on the class
or on ``err.retriable`` exactly as they do for server-side errors. ``SERVER_ERRORS`` is the
one table from wire code to class; ``from_server_error`` builds the exception.

    AnabranchError
    ├── ClientError                       base of the errors only the client raises
    │   ├── ConnectionClosed              retriable: the connection went away mid-request
    │   │   └── BrokerUnresponsive        retriable: closed because the broker stopped answering
    │   ├── OperationTimeout              retriable: no answer within the operation timeout
    │   ├── ServiceNotReady               retriable: broker not ready / topic moving
    │   ├── TooManyRequests               retriable: broker throttling lookups
    │   ├── LookupFailed                  lookup redirect loop or broker failure
    │   ├── ConsumerBusy                  exclusive subscription already has a consumer
    │   ├── SubscriptionNotFound
    │   ├── AuthenticationFailed / AuthorizationFailed
    │   │   (TlsHandshakeFailed: an AuthenticationFailed of the TLS layer)
    │   └── BrokerError                   any other code (``code`` attribute)
    ├── MessageTooBig (ValueTooLarge)     per-send: over the broker's max message size
    ├── ProducerQueueFull (NotAllowed)    block_if_queue_full=False and the queue is full
    ├── ExpiredTransactionError (TransactionError)   a timed-out or fenced transaction used
    ├── TransactionOperationFailed (TransactionError) commit found a failed send/ack: aborted
    └── (reused) NotFound, NotAllowed, ProducerBusy, ProducerFenced, TopicTerminated,
        ChecksumMismatch, IncompatibleSchema, InvalidArgument, MetadataError, StorageError,
        TransactionConflict, InvalidTxnStatus, TransactionNotFound,
        TransactionCoordinatorNotFound (transactions disabled on the broker)

A transaction error code whose message says the transaction timed out (or expired, or
was fenced) maps to ``ExpiredTransactionError``: the wire has no code of its own for it.

Example:
    >>> err = from_server_error(pb.ServiceNotReady, "topic is being unloaded")
    >>> (type(err).__name__, err.retriable)
    ('ServiceNotReady', True)
    >>> isinstance(from_server_error(pb.TopicNotFound, "x"), NotFound)
    True
    >>> type(from_server_error(pb.TransactionConflict, "txn 0_7 timed out")).__name__
    'ExpiredTransactionError'
"""

from __future__ import annotations

import re
from typing import Final

from anabranch.errors import (
    AnabranchError,
    ChecksumMismatch,
    IncompatibleSchema,
    InvalidArgument,
    InvalidTxnStatus,
    MetadataError,
    NotAllowed,
    NotFound,
    ProducerBusy,
    ProducerFenced,
    StorageError,
    TopicTerminated,
    TransactionConflict,
    TransactionCoordinatorNotFound,
    TransactionError,
    TransactionNotFound,
    ValueTooLarge,
)
from anabranch.protocol._generated import pulsar_api_pb2 as pb


class ClientError(AnabranchError):
    """Errors raised by the client itself or mapped from broker codes without a server twin."""


class ConnectionClosed(ClientError):
    """The connection closed before the request was answered; retrying may succeed."""

    retriable = True


class BrokerUnresponsive(ConnectionClosed):
    """The broker stopped answering (a probe's PING or a handshake got no answer within
    the probe timeout) although TCP stayed up, as a paused or partitioned broker does; the
    connection was closed so that its users look their topics up again elsewhere."""


class OperationTimeout(ClientError):
    """No answer within the operation timeout; the request may or may not have happened."""

    retriable = True


class ServiceNotReady(ClientError):
    """The broker is not ready for the topic (starting, unloading, fenced); retry."""

    retriable = True
    wire_code = "ServiceNotReady"


class TooManyRequests(ClientError):
    """The broker throttled the request (too many concurrent lookups); retry later."""

    retriable = True
    wire_code = "TooManyRequests"


class LookupFailed(ClientError):
    """A topic lookup failed or exceeded the redirect bound."""


class ConsumerBusy(ClientError):
    """An Exclusive subscription already has a consumer, the consumer id is taken, or
    the topic or subscription holds as many consumers as its cap allows."""

    wire_code = "ConsumerBusy"


class SubscriptionNotFound(ClientError):
    """The subscription does not exist."""

    wire_code = "SubscriptionNotFound"


class AuthenticationFailed(ClientError):
    """The broker rejected our credentials."""

    wire_code = "AuthenticationError"


class TlsHandshakeFailed(AuthenticationFailed):
    """The TLS handshake failed: the broker's certificate is not trusted (or does not
    name the host), or the broker refused ours. Not retried: it fails the same way again."""


class AuthorizationFailed(ClientError):
    """The credentials are valid but not allowed to do this."""

    wire_code = "AuthorizationError"


class BrokerError(ClientError):
    """A broker error code without a more specific class; ``code`` holds the ServerError."""

    def __init__(self, message: str, code: int = int(pb.UnknownError)) -> None:
        super().__init__(message)
        self.code = code


class MessageTooBig(ValueTooLarge):
    """A message (metadata + payload) over the broker's advertised max message size."""


class ProducerQueueFull(NotAllowed):
    """``block_if_queue_full=False`` and the producer's pending queue is at its bound."""


class ExpiredTransactionError(TransactionError):
    """The transaction timed out (the client's clock or the broker's answer says so), or
    was fenced: nothing more can join it and it cannot commit. Start a new one."""


class TransactionOperationFailed(TransactionError):
    """``commit`` found a send or ack of the transaction failed, so it aborted instead;
    ``cause`` is the first failure."""

    def __init__(self, txn_id: object, cause: BaseException) -> None:
        super().__init__(
            f"transaction {txn_id} aborted: an operation in it failed: "
            f"{type(cause).__name__}: {cause}"
        )
        self.txn_id = txn_id
        self.cause = cause


class _Retriable(BrokerError):
    retriable = True


SERVER_ERRORS: Final[dict[int, tuple[type[AnabranchError], bool]]] = {
    # code: (class, retriable). Retriable codes make producers/consumers reconnect and
    # resend instead of failing the caller (upstream ClientCnx.getPulsarClientException).
    pb.UnknownError: (BrokerError, False),
    pb.MetadataError: (MetadataError, True),
    pb.PersistenceError: (StorageError, True),
    pb.AuthenticationError: (AuthenticationFailed, False),
    pb.AuthorizationError: (AuthorizationFailed, False),
    pb.ConsumerBusy: (ConsumerBusy, False),
    pb.ServiceNotReady: (ServiceNotReady, True),
    pb.ProducerBlockedQuotaExceededError: (NotAllowed, False),
    pb.ProducerBlockedQuotaExceededException: (NotAllowed, False),
    pb.ChecksumError: (ChecksumMismatch, True),
    pb.UnsupportedVersionError: (BrokerError, False),
    pb.TopicNotFound: (NotFound, False),
    pb.SubscriptionNotFound: (SubscriptionNotFound, False),
    pb.ConsumerNotFound: (BrokerError, False),
    pb.TooManyRequests: (TooManyRequests, True),
    pb.TopicTerminatedError: (TopicTerminated, False),
    pb.ProducerBusy: (ProducerBusy, False),
    pb.InvalidTopicName: (InvalidArgument, False),
    pb.IncompatibleSchema: (IncompatibleSchema, False),
    pb.ConsumerAssignError: (BrokerError, False),
    # PIP-473: every broker serves every coordinator partition, so "no coordinator" means
    # transactions are disabled there, not "still loading": not retriable.
    pb.TransactionCoordinatorNotFound: (TransactionCoordinatorNotFound, False),
    pb.InvalidTxnStatus: (InvalidTxnStatus, False),
    pb.NotAllowedError: (NotAllowed, False),
    pb.TransactionConflict: (TransactionConflict, False),
    pb.TransactionNotFound: (TransactionNotFound, False),
    pb.ProducerFenced: (ProducerFenced, False),
}
"""ServerError code -> (exception class, retriable). Codes not listed map to BrokerError."""


def from_server_error(code: int, message: str) -> AnabranchError:
    """The typed exception for a broker ``ServerError`` code and its message.

    Example:
        >>> e = from_server_error(pb.ProducerBusy, "producer p is connected")
        >>> (isinstance(e, ProducerBusy), e.retriable, str(e))
        (True, False, 'ProducerBusy: producer p is connected')
    """
    cls, retriable = SERVER_ERRORS.get(code, (BrokerError, False))
    name = _code_name(code)
    text = f"{name}: {message}" if message else name
    if _says_expired(code, message or ""):
        cls = ExpiredTransactionError
    err: AnabranchError
    if cls is BrokerError:
        err = BrokerError(text, code)
    elif cls is NotFound:
        # NotFound adds "not found" itself; brokers' messages usually end with it already.
        err = NotFound(message.removesuffix(" not found") if message else name)
    else:
        err = cls(text)
    if err.retriable != retriable:
        err.retriable = retriable
    return err


_TXN_CODES: Final = frozenset({pb.TransactionConflict, pb.InvalidTxnStatus, pb.TransactionNotFound})
_EXPIRED_WORDS: Final = re.compile(r"timed.?out|timeout|expired|fenced", re.IGNORECASE)
"""Words of a broker message saying a transaction ran out of time or was fenced."""
_TXN_WORDS: Final = re.compile(r"\btxn|transaction", re.IGNORECASE)


def _says_expired(code: int, message: str) -> bool:
    """Whether an answer says the transaction timed out or was fenced: a transaction code,
    or NotAllowed about a transaction, whose message says so (no code of its own)."""
    if not _EXPIRED_WORDS.search(message):
        return False
    return code in _TXN_CODES or (code == pb.NotAllowedError and bool(_TXN_WORDS.search(message)))


def _code_name(code: int) -> str:
    try:
        return str(pb.ServerError.Name(code))
    except ValueError:
        return f"ServerError({code})"
