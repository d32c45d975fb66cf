"""Transaction admin routes (PIP-473 read endpoints, DESIGN.md §3.3).

Upstream serves these under ``/admin/v3/transactions``; DESIGN.md names
``/admin/v2/transactions``. Both prefixes serve the same handlers:

* ``GET coordinatorStats`` — totals plus ``perPartition`` for every coordinator
  partition; ``?coordinatorId=N`` answers partition N alone (404 past the count).
* ``GET transactionMetadata/{mostSigBits}/{leastSigBits}`` — header fields
  (``txnId``, ``status``, ``openTimestamp``, ``timeoutAt``, ``finalizedAt``, ``owner``)
  and the op records (``producedPartitions``, ``ackedPartitions``, ``opRecords``);
  404 TransactionNotFound for an unknown transaction, 400 for ids that are not
  non-negative integers.
* ``GET slowTransactions/{timeout}`` — OPEN transactions created more than ``timeout``
  milliseconds ago, keyed by txnId (``?coordinatorId=N`` keeps partition N's).
* ``GET transactionBufferStats/{tenant}/{namespace}/{topic}`` — a persistent topic's
  transaction buffer; ``GET transactionBufferStats/segment/{tenant}/{namespace}/{topic}/
  {descriptor}`` — a segment topic's (``descriptor`` as in ``/admin/v2/segments/...``:
  ``<start>-<end>-<id>``).
* ``GET pendingAckStats/{tenant}/{namespace}/{topic}/{subName}`` — a durable
  subscription's pending-ack store; ``GET pendingAckStats/segment/{tenant}/{namespace}/
  {topic}/{descriptor}/{subName}`` for a subscription on a segment.

Every route answers 503 (TransactionCoordinatorNotFound) while transactions are disabled.
Topic-scoped routes resolve the topic as ``/stats`` does: in a cluster a persistent topic
owned elsewhere answers 307 to its owner; a segment is only read where it is loaded (a
segment owned by another broker answers 307, an unserved one 404) — reading stats never
loads or creates a segment.

Example:
    >>> sorted({r.tag for r in ROUTES})
    ['transactions']
    >>> len(ROUTES) == 2 * 7
    True
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from aiohttp import web

from anabranch.admin.routes import Handler, Route, int_param, param, topic_param
from anabranch.admin.routes_scalable import segment_param
from anabranch.errors import InvalidArgument

if TYPE_CHECKING:
    from anabranch.admin.service import AdminService

PREFIXES = ("/admin/v2/transactions", "/admin/v3/transactions")
"""DESIGN.md's v2 prefix and upstream's v3 one; both serve every route."""

INTEGER = {"type": "integer"}
STRING = {"type": "string"}
NULLABLE_STRING = {"type": "string", "nullable": True}
COUNTS = {
    "created": INTEGER,
    "committed": INTEGER,
    "aborted": INTEGER,
    "timedOut": INTEGER,
    "open": INTEGER,
}
PARTITION_STATS = {
    "type": "object",
    "properties": {
        **COUNTS,
        "coordinatorId": INTEGER,
        "state": STRING,
        "ongoingTxnSize": INTEGER,
    },
}
COORDINATOR_STATS = {
    "type": "object",
    "description": "Totals plus perPartition; with ?coordinatorId=N one partition's stats.",
    "properties": {
        **COUNTS,
        "partitions": INTEGER,
        "gcCollected": INTEGER,
        "perPartition": {"type": "object", "additionalProperties": PARTITION_STATS},
    },
}
HEADER_FIELDS = {
    "txnId": STRING,
    "status": {"type": "string", "enum": ["OPEN", "COMMITTED", "ABORTED"]},
    "openTimestamp": INTEGER,
    "timeoutAt": INTEGER,
    "finalizedAt": {"type": "integer", "nullable": True},
    "owner": NULLABLE_STRING,
}
TXN_HEADER = {"type": "object", "properties": HEADER_FIELDS}
TXN_METADATA = {
    "type": "object",
    "properties": {
        **HEADER_FIELDS,
        "producedPartitions": {
            "type": "object",
            "additionalProperties": {
                "type": "object",
                "properties": {"startPosition": NULLABLE_STRING, "aborted": {"type": "boolean"}},
            },
        },
        "ackedPartitions": {
            "type": "object",
            "additionalProperties": {
                "type": "object",
                "additionalProperties": {
                    "type": "object",
                    "properties": {"cumulativeAckPosition": NULLABLE_STRING},
                },
            },
        },
        "opRecords": INTEGER,
    },
}
SLOW_TRANSACTIONS = {"type": "object", "additionalProperties": TXN_HEADER}
BUFFER_STATS = {
    "type": "object",
    "properties": {
        "state": STRING,
        "maxReadPosition": STRING,
        "lastConfirmed": STRING,
        "ongoingTxnSize": INTEGER,
        "abortedTxnCount": INTEGER,
        "opWrites": INTEGER,
    },
}
PENDING_ACK_STATS = {
    "type": "object",
    "properties": {"state": STRING, "ongoingTxnSize": INTEGER, "opWrites": INTEGER},
}
TXN_ERRORS = (400, 404, 503)
TOPIC_ERRORS = (307, 400, 404, 503)


def coordinator_id(request: web.Request) -> int | None:
    """``?coordinatorId=N`` (None when absent; InvalidArgument unless a non-negative int)."""
    text = request.query.get("coordinatorId")
    if text is None or text == "":
        return None
    try:
        value = int(text)
    except ValueError:
        raise InvalidArgument(f"coordinatorId {text!r} is not an integer") from None
    if value < 0:
        raise InvalidArgument(f"coordinatorId {value} is negative")
    return value


async def coordinator_stats(admin: AdminService, request: web.Request) -> object:
    return await admin.coordinator_stats(coordinator_id(request))


async def transaction_metadata(admin: AdminService, request: web.Request) -> object:
    most = int_param(request, "mostSigBits")
    least = int_param(request, "leastSigBits")
    return await admin.transaction_metadata(most, least)


async def slow_transactions(admin: AdminService, request: web.Request) -> object:
    timeout_ms = int_param(request, "timeout")
    return await admin.slow_transactions(timeout_ms, coordinator_id(request))


async def transaction_buffer_stats(admin: AdminService, request: web.Request) -> object:
    return await admin.transaction_buffer_stats(topic_param(request))


async def segment_transaction_buffer_stats(admin: AdminService, request: web.Request) -> object:
    return await admin.segment_transaction_buffer_stats(segment_param(request))


async def pending_ack_stats(admin: AdminService, request: web.Request) -> object:
    return await admin.pending_ack_stats(topic_param(request), param(request, "subName"))


async def segment_pending_ack_stats(admin: AdminService, request: web.Request) -> object:
    return await admin.segment_pending_ack_stats(segment_param(request), param(request, "subName"))


def _named(handler: Handler, suffix: str) -> Handler:
    """``handler`` under ``<name><suffix>`` (OpenAPI operationIds must stay unique when
    the v3 prefix repeats the v2 routes)."""
    if not suffix:
        return handler

    async def alias(admin: AdminService, request: web.Request) -> object:
        return await handler(admin, request)

    alias.__name__ = alias.__qualname__ = f"{handler.__name__}{suffix}"
    alias.__doc__ = handler.__doc__
    return alias


def _routes(base: str, suffix: str = "") -> list[Route]:
    """The seven routes under ``base``."""
    (coordinator, metadata, slow, buffer, segment_buffer, pending, segment_pending) = (
        _named(h, suffix)
        for h in (coordinator_stats, transaction_metadata, slow_transactions,
                  transaction_buffer_stats, segment_transaction_buffer_stats,
                  pending_ack_stats, segment_pending_ack_stats)
    )  # fmt: skip
    topic = "{tenant}/{namespace}/{topic}"
    segment = "segment/{tenant}/{namespace}/{topic}/{descriptor}"
    return [
        Route("GET", f"{base}/coordinatorStats", coordinator,
              "Transaction coordinator stats: totals and per partition "
              "(?coordinatorId=N: one partition).", "transactions",
              response_schema=COORDINATOR_STATS, errors=TXN_ERRORS),
        Route("GET", f"{base}/transactionMetadata/{{mostSigBits}}/{{leastSigBits}}",
              metadata, "A transaction's header and op records.",
              "transactions", response_schema=TXN_METADATA, errors=TXN_ERRORS),
        Route("GET", f"{base}/slowTransactions/{{timeout}}", slow,
              "OPEN transactions older than timeout ms, keyed by txnId "
              "(?coordinatorId=N: one partition's).", "transactions",
              response_schema=SLOW_TRANSACTIONS, errors=TXN_ERRORS),
        Route("GET", f"{base}/transactionBufferStats/{topic}", buffer,
              "A persistent topic's transaction buffer stats.", "transactions",
              response_schema=BUFFER_STATS, errors=TOPIC_ERRORS),
        Route("GET", f"{base}/transactionBufferStats/{segment}",
              segment_buffer,
              "A segment topic's transaction buffer stats (descriptor <start>-<end>-<id>).",
              "transactions", response_schema=BUFFER_STATS, errors=TOPIC_ERRORS),
        Route("GET", f"{base}/pendingAckStats/{topic}/{{subName}}", pending,
              "A durable subscription's pending-ack store stats.", "transactions",
              response_schema=PENDING_ACK_STATS, errors=TOPIC_ERRORS),
        Route("GET", f"{base}/pendingAckStats/{segment}/{{subName}}",
              segment_pending,
              "The pending-ack store stats of a subscription on a segment topic.",
              "transactions", response_schema=PENDING_ACK_STATS, errors=TOPIC_ERRORS),
    ]  # fmt: skip


ROUTES: list[Route] = [*_routes(PREFIXES[0]), *_routes(PREFIXES[1], "_v3")]
