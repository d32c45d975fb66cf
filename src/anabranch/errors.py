"""One error tree for anabranch, mapped to wire codes and HTTP statuses in one place.

    AnabranchError                      retriable, wire_code, http_status
    ├── InvalidArgument                 bad name, path, option, value  (400)
    │   ├── ValueTooLarge               a value or message over its limit
    │   ├── InvalidPolicyValue          a policy value out of its range (412)
    │   ├── UnknownSegment              no such segment id in the layout
    │   └── SegmentsNotAdjacent         merge of two ranges that do not touch
    ├── NotLeader                       not the controller leader (307, retriable)
    │   └── NotOwner                    a cluster broker not owning the topic
    ├── NotAllowed                      valid request, wrong state     (405)
    │   ├── TransactionError            the transaction errors (TransactionKeyFenced: 409)
    │   ├── NotEmpty                    delete of a tenant/namespace in use (409)
    │   ├── ResourceLimitReached        over a connection/broker bound (TooManyRequests, 429)
    │   ├── SegmentSealed               split/merge of a sealed segment
    │   ├── SegmentActive               delete of a segment still active (409)
    │   ├── SegmentTooSmall             split of a segment one hash wide
    │   ├── ScalableTopicsDisabled      topic:// names off (broker or namespace)
    │   └── CompactionInProgress        compaction asked for while one runs (409)
    ├── Closed                          the object was closed by its owner
    ├── AuthorizationError              the role lacks the permission  (403)
    ├── AuthenticationError             missing, wrong or expired credentials (401)
    ├── MetadataError
    │   ├── BadVersion                  CAS condition failed           (409)
    │   ├── NotFound                                                   (404)
    │   ├── AlreadyExists                                              (409)
    │   ├── SessionExpired              the session's TTL ran out
    │   ├── Compacted                   watch history is gone: re-list
    │   └── MetadataUnavailable         backend unreachable (retriable) (503)
    ├── StorageError
    │   ├── LedgerSealed                append after terminate()
    │   ├── LedgerFenced                another writer took the ledger over
    │   ├── CorruptRecord               a record failed its checksum/length check
    │   └── StorageIOError              the disk failed (EIO, ENOSPC, fsync)
    │       └── StorageFull             no space left (ENOSPC, EDQUOT)  (507)
    └── ProtocolError                   malformed frame or command: close the connection
        ├── FrameTooLarge               length prefix over the max frame size
        ├── BadFrameLength              negative or under the header size
        ├── MalformedFrame              bad sizes/magic, unparsable or incomplete protobuf
        ├── UnexpectedCommand           wrong direction, before CONNECT, unknown
        └── InvalidMessage              bad compression, batch or size inside a message

Callers branch on the class or on ``err.retriable``, never on the message.
Error classes carry their facts as attributes, e.g. ``BadVersion(path, expected, actual)``.
``WIRE_CODES`` and ``HTTP_STATUS`` below are the single registry consulted by the broker
and the admin service.

Example:
    >>> try:
    ...     raise BadVersion("/topics/a", expected=3, actual=4)
    ... except MetadataError as err:
    ...     (err.retriable, err.http_status)
    (False, 409)
"""

from __future__ import annotations


class AnabranchError(Exception):
    """Base of every error anabranch raises on purpose."""

    retriable: bool = False
    wire_code: str = "UnknownError"
    http_status: int = 500


class InvalidArgument(AnabranchError):
    """A name, path, option or value that can never be valid."""

    wire_code = "InvalidTopicName"
    http_status = 400


class ValueTooLarge(InvalidArgument):
    """A value, frame or message larger than the configured limit."""

    wire_code = "MessageTooBig"
    http_status = 413

    def __init__(self, what: str, size: int, max_size: int) -> None:
        super().__init__(f"{what} is {size} bytes, over the limit of {max_size}")
        self.what = what
        self.size = size
        self.max_size = max_size


class InvalidPolicyValue(InvalidArgument):
    """A policy value out of its range, such as a negative cap (Pulsar answers 412)."""

    http_status = 412


class NotAllowed(AnabranchError):
    """A well-formed request that the current state does not permit."""

    wire_code = "NotAllowedError"
    http_status = 405


class Closed(AnabranchError):
    """The object (store, ledger, client, connection) was closed by its owner."""

    wire_code = "ServiceNotReady"
    http_status = 503


# --- metadata -----------------------------------------------------------------------------


class MetadataError(AnabranchError):
    """Errors of the metadata store."""

    wire_code = "MetadataError"


class BadVersion(MetadataError):
    """A compare-and-set condition failed; the store is unchanged."""

    http_status = 409

    def __init__(self, path: str, expected: int | None, actual: int) -> None:
        super().__init__(f"{path}: expected version {expected}, found {actual}")
        self.path = path
        self.expected = expected
        self.actual = actual


class NotFound(MetadataError):
    """The path (or topic, subscription, ...) does not exist."""

    wire_code = "TopicNotFound"
    http_status = 404

    def __init__(self, path: str) -> None:
        super().__init__(f"{path} not found")
        self.path = path


class AlreadyExists(MetadataError):
    """Creation of something that exists already."""

    http_status = 409

    def __init__(self, path: str) -> None:
        super().__init__(f"{path} already exists")
        self.path = path


class SessionExpired(MetadataError):
    """The session's TTL ran out (or it was closed); its ephemeral keys are gone."""

    def __init__(self, session_id: int) -> None:
        super().__init__(f"session {session_id:#x} expired")
        self.session_id = session_id


class Compacted(MetadataError):
    """A watch asked for history the store no longer has: re-list, then watch again."""

    def __init__(self, requested_revision: int, compact_revision: int) -> None:
        super().__init__(
            f"revision {requested_revision} is compacted (history starts at {compact_revision})"
        )
        self.requested_revision = requested_revision
        self.compact_revision = compact_revision


class MetadataUnavailable(MetadataError):
    """The backend could not be reached; the operation may or may not have happened."""

    retriable = True
    wire_code = "ServiceNotReady"
    http_status = 503


# --- storage ------------------------------------------------------------------------------


class StorageError(AnabranchError):
    """Errors of the managed ledger."""

    wire_code = "PersistenceError"


class LedgerSealed(StorageError):
    """Append to a terminated (sealed) ledger or topic."""

    wire_code = "TopicTerminatedError"
    http_status = 409


class LedgerFenced(StorageError):
    """Another writer opened the ledger for recovery; this writer may not append."""

    wire_code = "ProducerFenced"
    http_status = 409


class CorruptRecord(StorageError):
    """A stored record failed its length or checksum check."""

    def __init__(self, where: str, offset: int, reason: str) -> None:
        super().__init__(f"corrupt record in {where} at offset {offset}: {reason}")
        self.where = where
        self.offset = offset
        self.reason = reason


class StorageIOError(StorageError):
    """The disk failed under us (EIO, ENOSPC, failed fsync)."""

    retriable = True


class StorageFull(StorageIOError):
    """The disk (or the quota) is full: appends fail until space returns; nothing
    acknowledged is lost. Clients see PersistenceError, on which upstream's clients
    reconnect and resend."""

    http_status = 507


# --- protocol -----------------------------------------------------------------------------


class ProtocolError(AnabranchError):
    """Malformed frame or command; the connection that sent it is closed."""

    wire_code = "InvalidMessage"
    http_status = 400


# --- scalable topics (core) ---------------------------------------------------------------


class UnknownSegment(InvalidArgument):
    """A segment id that the layout does not contain."""

    def __init__(self, segment_id: int, epoch: int) -> None:
        super().__init__(f"segment {segment_id} does not exist in layout epoch {epoch}")
        self.segment_id = segment_id
        self.epoch = epoch


class SegmentsNotAdjacent(InvalidArgument):
    """A merge of two segments whose hash ranges do not touch (or are the same segment)."""

    def __init__(self, first_id: int, second_id: int, first_range: str, second_range: str) -> None:
        super().__init__(
            f"segments {first_id} {first_range} and {second_id} {second_range} are not adjacent"
        )
        self.first_id = first_id
        self.second_id = second_id
        self.first_range = first_range
        self.second_range = second_range


class SegmentSealed(NotAllowed):
    """A split or merge of a segment that is already sealed."""

    def __init__(self, segment_id: int, sealed_at_epoch: int) -> None:
        super().__init__(f"segment {segment_id} was sealed at epoch {sealed_at_epoch}")
        self.segment_id = segment_id
        self.sealed_at_epoch = sealed_at_epoch


class SegmentNotPrunable(NotAllowed):
    """A prune (PIP-468 ``pruneSegment``) of a segment that is active or not yet a root."""

    def __init__(self, segment_id: int, reason: str) -> None:
        super().__init__(f"segment {segment_id} cannot be pruned: {reason}")
        self.segment_id = segment_id


class ScalableTopicsDisabled(NotAllowed):
    """A ``topic://`` name where scalable topics are switched off (the broker's
    ``scalable_topic_enabled`` setting or the namespace's policy).

    Example:
        >>> err = ScalableTopicsDisabled("topic://public/default/x", "namespace public/default")
        >>> (err.wire_code, err.http_status)
        ('NotAllowedError', 405)
    """

    def __init__(self, topic: str, where: str) -> None:
        super().__init__(f"scalable topics are disabled for {where}: {topic} cannot be used")
        self.topic = topic
        self.where = where


class SegmentTooSmall(NotAllowed):
    """A split of a segment whose hash range is a single value."""

    def __init__(self, segment_id: int, hash_range: str) -> None:
        super().__init__(f"segment {segment_id} {hash_range} is one hash wide and cannot split")
        self.segment_id = segment_id
        self.hash_range = hash_range


class FrameTooLarge(ProtocolError):
    """A frame's length prefix is over the maximum frame size; nothing was allocated for it."""

    def __init__(self, size: int, max_size: int) -> None:
        super().__init__(f"frame of {size} bytes is over the limit of {max_size}")
        self.size = size
        self.max_size = max_size


class BadFrameLength(ProtocolError):
    """A frame's length prefix is negative or smaller than the frame header."""

    def __init__(self, size: int, min_size: int) -> None:
        super().__init__(f"frame length {size} is under the minimum of {min_size}")
        self.size = size
        self.min_size = min_size


class MalformedFrame(ProtocolError):
    """A frame whose inner sizes, magic numbers or protobuf bodies are invalid."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"malformed frame: {reason}")
        self.reason = reason


class UnexpectedCommand(ProtocolError):
    """A well-formed command that is not allowed here (direction, handshake state, unknown)."""

    def __init__(self, command: str, reason: str) -> None:
        super().__init__(f"unexpected {command}: {reason}")
        self.command = command
        self.reason = reason


class InvalidMessage(ProtocolError):
    """A message whose compression, batch layout or declared sizes are invalid."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"invalid message: {reason}")
        self.reason = reason


class NotEmpty(NotAllowed):
    """Delete of a cluster, tenant or namespace that still has children (Pulsar: 409)."""

    http_status = 409

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"{path} is not empty: {reason}")
        self.path = path
        self.reason = reason


# --- transactions (PIP-31 / PIP-473) -------------------------------------------------------


class TransactionError(NotAllowed):
    """Base of the transaction errors; each maps to upstream's ServerError code."""


class TransactionNotFound(TransactionError):
    """No transaction with this id (never created, or finished and collected)."""

    wire_code = "TransactionNotFound"
    http_status = 404


class InvalidTxnStatus(TransactionError):
    """END_TXN asks for the outcome the transaction did not take (commit after abort)."""

    wire_code = "InvalidTxnStatus"
    http_status = 409


class TransactionConflict(TransactionError):
    """A write or ack in a transaction that already left OPEN (committed, aborted, timed
    out), or an ack of a message another transaction holds."""

    wire_code = "TransactionConflict"
    http_status = 409


class TransactionCoordinatorNotFound(TransactionError):
    """Transactions are disabled on this broker (no coordinator serves them)."""

    wire_code = "TransactionCoordinatorNotFound"
    http_status = 503


class TransactionTooLarge(TransactionError):
    """A transaction over a named limit (participants, op records, entries)."""

    wire_code = "NotAllowedError"
    http_status = 413


class TransactionKeyFenced(TransactionError):
    """A newer connection holds the transaction key (or it was deleted): this connection
    and its open transaction are fenced (pip-transaction-key-fencing). The message says
    "fenced", which clients map to ``ExpiredTransactionError``."""

    wire_code = "NotAllowedError"
    http_status = 409


def all_error_classes() -> list[type[AnabranchError]]:
    """Every error class, depth first (used by the registry tests and docs)."""
    out: list[type[AnabranchError]] = []
    stack: list[type[AnabranchError]] = [AnabranchError]
    while stack:
        cls = stack.pop()
        out.append(cls)
        stack.extend(reversed(cls.__subclasses__()))
    return out


WIRE_CODES: dict[type[AnabranchError], str] = {c: c.wire_code for c in all_error_classes()}
HTTP_STATUS: dict[type[AnabranchError], int] = {c: c.http_status for c in all_error_classes()}


# --- broker (produce path) ----------------------------------------------------------------


class ProducerBusy(NotAllowed):
    """A producer id, name or exclusive access already taken on this topic/connection."""

    wire_code = "ProducerBusy"
    http_status = 409


class ProducerFenced(NotAllowed):
    """An exclusive producer was fenced by a newer one (ExclusiveWithFencing)."""

    wire_code = "ProducerFenced"
    http_status = 409


class ProducerBlockedQuotaExceeded(NotAllowed):
    """The topic's backlog is over its quota and the policy is ``producer_exception``:
    producers are refused (Pulsar's ProducerBlockedQuotaExceededException)."""

    wire_code = "ProducerBlockedQuotaExceededException"
    http_status = 412


class QuotaExceedsRetention(NotAllowed):
    """A backlog quota at or over the retention bounds (Pulsar answers 412)."""

    http_status = 412


class ProducerQuotaHoldTimeout(NotAllowed):
    """A send held by ``producer_request_hold`` waited too long for the backlog to shrink
    (Pulsar's ProducerBlockedQuotaExceededError)."""

    wire_code = "ProducerBlockedQuotaExceededError"
    http_status = 412


class NonPersistentUnsupported(NotAllowed):
    """An operation a ``non-persistent://`` topic cannot take part in: transactions (its
    messages are never stored, so there is nothing to commit or abort), seeks, last
    message ids, admin cursor operations. Nothing was done.

    Example:
        >>> NonPersistentUnsupported("transactions").wire_code
        'NotAllowedError'
    """

    def __init__(self, what: str) -> None:
        super().__init__(f"{what}: not supported on a non-persistent topic")


class TopicTerminated(NotAllowed):
    """A send to a topic that was terminated (sealed)."""

    wire_code = "TopicTerminatedError"
    http_status = 409


class ChecksumMismatch(AnabranchError):
    """A SEND whose payload checksum did not match; it is not stored."""

    wire_code = "ChecksumError"
    http_status = 400


class IncompatibleSchema(InvalidArgument):
    """A schema the topic's registry refuses."""

    wire_code = "IncompatibleSchema"
    http_status = 409


class SchemaVersionsExhausted(NotAllowed):
    """A new schema for a topic that already holds ``schema_versions_max`` versions.

    Example:
        >>> err = SchemaVersionsExhausted("persistent://public/default/t", 1000)
        >>> (err.wire_code, err.http_status)
        ('NotAllowedError', 409)
    """

    wire_code = "NotAllowedError"
    http_status = 409

    def __init__(self, topic: str, limit: int) -> None:
        super().__init__(
            f"{topic} already has {limit} schema versions (schema_versions_max); delete its"
            " schema to start a new history"
        )
        self.limit = limit


WIRE_CODES.update({c: c.wire_code for c in all_error_classes()})
HTTP_STATUS.update({c: c.http_status for c in all_error_classes()})


# --- broker (consume path) ----------------------------------------------------------------


class ConsumerBusy(NotAllowed):
    """An Exclusive subscription that has a consumer, a consumer id already used on the
    connection, or an unsubscribe while other consumers are connected."""

    wire_code = "ConsumerBusy"
    http_status = 409


class ConsumerAssignError(NotAllowed):
    """A Key_Shared consumer whose sticky hash ranges overlap another consumer's, or no
    room left to split an auto-split range."""

    wire_code = "ConsumerAssignError"
    http_status = 409


class ConsumerNotFound(NotAllowed):
    """A command naming a consumer id that this connection does not have."""

    wire_code = "ConsumerNotFound"
    http_status = 404

    def __init__(self, consumer_id: int) -> None:
        super().__init__(f"consumer {consumer_id} not found on this connection")
        self.consumer_id = consumer_id


WIRE_CODES.update({c: c.wire_code for c in all_error_classes()})
HTTP_STATUS.update({c: c.http_status for c in all_error_classes()})


# --- scalable topics (controller) ---------------------------------------------------------


class NotLeader(AnabranchError):
    """A scalable-topic mutation sent to a broker whose controller is not the leader.

    ``leader_url`` is the current leader's broker URL (None while no leader is known); the
    admin layer answers HTTP 307 with it as ``Location``. Retriable: ask the leader, or
    again once an election has settled.
    """

    retriable = True
    wire_code = "ServiceNotReady"
    http_status = 307

    def __init__(self, topic: str, leader_url: str | None) -> None:
        where = f"the leader is {leader_url}" if leader_url else "no leader is elected"
        super().__init__(f"this broker is not the controller of {topic}: {where}")
        self.topic = topic
        self.leader_url = leader_url


class NotOwner(NotLeader):
    """A topic request at a broker of a cluster that does not own the topic.

    On the wire it is ServiceNotReady (the client looks the topic up again); over HTTP a
    307 to ``leader_url``, the owner's HTTP address (503 while the topic has no owner or
    is moving). ``owner_url`` is the owner's ``pulsar://`` address when known.

    Example:
        >>> err = NotOwner("persistent://t/ns/x", "http://b2:8080", "pulsar://b2:6650")
        >>> (err.wire_code, err.http_status, err.retriable)
        ('ServiceNotReady', 307, True)
    """

    def __init__(self, topic: str, http_url: str | None, owner_url: str | None = None) -> None:
        AnabranchError.__init__(
            self,
            f"this broker does not own {topic}: "
            + (f"its owner is {owner_url or http_url}" if http_url else "it is moving"),
        )
        self.topic = topic
        self.leader_url = http_url
        self.owner_url = owner_url


WIRE_CODES.update({c: c.wire_code for c in all_error_classes()})
HTTP_STATUS.update({c: c.http_status for c in all_error_classes()})


# --- bounded resources ----------------------------------------------------------------------


class ResourceLimitReached(NotAllowed):
    """A request over a per-connection or per-broker bound of ``limits.py`` (producers,
    consumers, pending lookups, connections, loaded topics, ...). Nothing was created; it
    may succeed once something else closes.

    Example:
        >>> err = ResourceLimitReached("producers on this connection", 10)
        >>> (err.wire_code, err.http_status, err.limit)
        ('TooManyRequests', 429, 10)
    """

    retriable = True
    wire_code = "TooManyRequests"
    http_status = 429

    def __init__(self, what: str, limit: int) -> None:
        super().__init__(f"too many {what} (at most {limit})")
        self.what = what
        self.limit = limit


WIRE_CODES.update({c: c.wire_code for c in all_error_classes()})
HTTP_STATUS.update({c: c.http_status for c in all_error_classes()})


# --- authorization ----------------------------------------------------------------------------


class AuthorizationError(AnabranchError):
    """The (authenticated) role lacks the permission the request needs; nothing was done.

    The message names only what was asked for (the command or route and the resource the
    request itself named), never another tenant, a path or the grants held.

    Example:
        >>> err = AuthorizationError("alice", "produce", "persistent://a/b/c")
        >>> (err.wire_code, err.http_status, str(err))
        ('AuthorizationError', 403, 'role alice is not authorized to produce on persistent://a/b/c')
    """

    wire_code = "AuthorizationError"
    http_status = 403

    def __init__(self, role: str, action: str, resource: str = "") -> None:
        on = f" on {resource}" if resource else ""
        super().__init__(f"role {role} is not authorized to {action}{on}")
        self.role = role
        self.action = action
        self.resource = resource


class SegmentActive(NotAllowed):
    """A destructive operation on a segment the layout still lists as active (only a
    sealed or pruned segment's data may go).

    Example:
        >>> SegmentActive("segment://a/b/c/0000-ffff-0").http_status
        409
    """

    http_status = 409

    def __init__(self, segment: str) -> None:
        super().__init__(f"{segment} is active in its topic's layout; seal it first")
        self.segment = segment


# --- security -------------------------------------------------------------------------------


class AuthenticationError(AnabranchError):
    """Missing, wrong or expired credentials (auth on). On the wire an ERROR with
    ``AuthenticationError`` and the connection is closed; over HTTP a 401. The message
    says what was wrong in general terms ("token expired", "unknown user or wrong
    password"), never which part of a secret failed or where it is kept.

    Example:
        >>> err = AuthenticationError("token expired")
        >>> (err.wire_code, err.http_status, err.retriable, str(err))
        ('AuthenticationError', 401, False, 'authentication failed: token expired')
    """

    wire_code = "AuthenticationError"
    http_status = 401

    def __init__(self, reason: str) -> None:
        super().__init__(f"authentication failed: {reason}")
        self.reason = reason


class ListenerNotFound(AnabranchError):
    """A lookup named an advertised listener the broker does not have (upstream's
    ServiceNotReady "the broker do not have <name> listener"; never a silent fallback to
    the default address).

    Example:
        >>> err = ListenerNotFound("external")
        >>> (err.wire_code, err.http_status, str(err))
        ('ServiceNotReady', 404, 'the broker do not have external listener')
    """

    wire_code = "ServiceNotReady"
    http_status = 404

    def __init__(self, name: str) -> None:
        super().__init__(f"the broker do not have {name} listener")
        self.name = name


WIRE_CODES.update({c: c.wire_code for c in all_error_classes()})
HTTP_STATUS.update({c: c.http_status for c in all_error_classes()})


# --- tiered storage (offload to an object store) --------------------------------------------


class TieredStorageError(StorageError):
    """The object store (S3) tiered storage offloads sealed ledgers to failed us."""


class ObjectStoreUnavailable(TieredStorageError):
    """The object store did not answer or answered with a server error; the operation may
    succeed later (the offloader retries, the ledger stays in the hot tier meanwhile).

    Example:
        >>> err = ObjectStoreUnavailable("put", "connection refused")
        >>> (err.retriable, err.http_status, str(err))
        (True, 503, 'object store unavailable during put: connection refused')
    """

    retriable = True
    http_status = 503

    def __init__(self, operation: str, reason: str) -> None:
        super().__init__(f"object store unavailable during {operation}: {reason}")
        self.operation = operation
        self.reason = reason


class ObjectStoreAccessDenied(TieredStorageError):
    """The object store refused our credentials (wrong access key or secret, or no right
    on the bucket): fix ``s3_access_key_id`` / ``s3_secret_access_key``.

    Example:
        >>> ObjectStoreAccessDenied("put").http_status
        403
    """

    http_status = 403

    def __init__(self, operation: str) -> None:
        super().__init__(
            f"object store refused the credentials during {operation}: check"
            " s3_access_key_id / s3_secret_access_key and the bucket's permissions"
        )
        self.operation = operation


class OffloadNotConfigured(NotAllowed):
    """An offload request to a broker without an offload driver (Pulsar answers 409
    ``offload is not configured`` too).

    Example:
        >>> OffloadNotConfigured().http_status
        409
    """

    http_status = 409

    def __init__(self) -> None:
        super().__init__("offload is not configured: set offload_driver (and the s3_ settings)")


WIRE_CODES.update({c: c.wire_code for c in all_error_classes()})
HTTP_STATUS.update({c: c.http_status for c in all_error_classes()})


# --- topic compaction -----------------------------------------------------------------------


class CompactionInProgress(NotAllowed):
    """A compaction was asked for while one of the same topic is running (upstream's
    ``ConflictException``, 409).

    Example:
        >>> err = CompactionInProgress("persistent://a/b/c")
        >>> (err.http_status, err.topic)
        (409, 'persistent://a/b/c')
    """

    http_status = 409

    def __init__(self, topic: str) -> None:
        super().__init__(f"compaction of {topic} is already in progress")
        self.topic = topic


WIRE_CODES.update({c: c.wire_code for c in all_error_classes()})
HTTP_STATUS.update({c: c.http_status for c in all_error_classes()})
