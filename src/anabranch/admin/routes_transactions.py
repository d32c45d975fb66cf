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

Batches of an exactly-once sink (``transactions/batches.py``; v2 prefix only; ``sinkKey``
percent-encoded in the path). Each answers the batch as JSON ``{sinkKey, batchId,
txnId: {mostSigBits, leastSigBits}, epoch, state, queryId, winners, createdAt}``:

* ``PUT batches/{sinkKey}/{batchId}?queryId=Q&timeoutMs=T`` — get-or-create the batch's
  transaction (409 when a batch committed by another queryId: sink reused with a new
  checkpoint location);
* ``POST batches/{sinkKey}/{batchId}/commit`` with ``{"queryId", "epoch", "winners"}`` —
  commit keeping only the winners' entries (idempotent; 409 when the epoch was aborted,
  timed out or replaced);
* ``POST batches/{sinkKey}/{batchId}/abort`` with ``{"epoch"}`` — abort unless committed;
* ``GET batches/{sinkKey}/{batchId}`` — the batch (404 when never begun).

Transaction keys (the key-fencing PIP's admin API):

* ``GET transaction-keys`` — every key: ``owner``, ``transactionKey``, ``epoch``,
  ``txnId`` (the key's last transaction or null), ``createdAt``, ``updatedAt``, ``ageMs``.
* ``GET transaction-keys/{key}`` — one key, plus ``txnStatus`` (its transaction's state)
  and ``connections`` (this broker's connections holding it); 404 when unknown.
* ``DELETE transaction-keys/{key}`` — abort the key's open transaction and delete the
  record; a connection holding it is fenced (its next transaction command gets
  NotAllowed "fenced"). Answers the deleted record; 404 when unknown.

The path names the key of the owner "" (the owner while authentication is off); a key
claimed by an authenticated role is named with ``?owner=<role>``. A key with ``&`` (or
empty, or over ``limits.TXN_KEY_BYTES_MAX``) is 400.

Every route answers 503 (TransactionCoordinatorNotFound) while transactions are disabled.
Topic-scoped routes resolve the topic as ``/stats`` does: in a cluster a persistent topic
owned elsewhere answers 307 to its owner; a segment is only read where it is loaded (a
segment owned by another broker answers 307, an unserved one 404) — reading stats never
loads or creates a segment.

Example:
    >>> sorted({r.tag for r in ROUTES})
    ['transactions']
    >>> len(ROUTES) == 2 * 10 + 4
    True
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec
from aiohttp import web

from anabranch.admin.access import ROLE_KEY
from anabranch.admin.routes import Handler, Route, int_param, json_body, param, topic_param
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
KEY_FIELDS = {
    "owner": STRING,
    "transactionKey": STRING,
    "epoch": INTEGER,
    "txnId": NULLABLE_STRING,
    "createdAt": INTEGER,
    "updatedAt": INTEGER,
    "ageMs": INTEGER,
}
TRANSACTION_KEYS = {"type": "array", "items": {"type": "object", "properties": KEY_FIELDS}}
TRANSACTION_KEY = {
    "type": "object",
    "properties": {**KEY_FIELDS, "txnStatus": NULLABLE_STRING, "connections": INTEGER},
}
TRANSACTION_KEY_RECORD = {"type": "object", "properties": KEY_FIELDS}
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


# --- batches of an exactly-once sink -------------------------------------------------------

BATCH = {
    "type": "object",
    "properties": {
        "sinkKey": STRING,
        "batchId": INTEGER,
        "txnId": {
            "type": "object",
            "properties": {"mostSigBits": INTEGER, "leastSigBits": INTEGER},
        },
        "epoch": INTEGER,
        "state": {"type": "string", "enum": ["OPEN", "COMMITTED", "ABORTED"]},
        "queryId": STRING,
        "winners": {"type": "array", "items": STRING, "nullable": True},
        "createdAt": INTEGER,
    },
}
BATCH_COMMIT = {
    "type": "object",
    "required": ["queryId", "epoch", "winners"],
    "properties": {
        "queryId": STRING,
        "epoch": INTEGER,
        "winners": {"type": "array", "items": STRING},
    },
}
BATCH_ABORT = {"type": "object", "required": ["epoch"], "properties": {"epoch": INTEGER}}
BATCH_ERRORS = (400, 404, 409, 503)


class BatchCommitBody(msgspec.Struct, rename="camel", kw_only=True):
    """``POST .../commit``: the driver's commit of one batch."""

    query_id: str
    epoch: int
    winners: list[str]


class BatchAbortBody(msgspec.Struct, kw_only=True):
    """``POST .../abort``: abort this epoch of the batch (unless committed)."""

    epoch: int


def _batch(request: web.Request) -> tuple[str, int]:
    return param(request, "sinkKey"), int_param(request, "batchId")


def _caller(request: web.Request) -> str | None:
    """The caller's role (None: authentication is off)."""
    role: str | None = request.get(ROLE_KEY)
    return role


def _acting_for(admin: AdminService, request: web.Request) -> str | None:
    """The batch owner the caller may act for (None: any, a superuser or no auth)."""
    return admin.broker.authorizer.txn_role(_caller(request))


async def begin_batch(admin: AdminService, request: web.Request) -> object:
    """Get-or-create the batch's transaction (``?queryId=Q&timeoutMs=T``)."""
    sink_key, batch_id = _batch(request)
    query_id = request.query.get("queryId", "")
    text = request.query.get("timeoutMs")
    try:
        timeout_ms = None if not text else int(text)
    except ValueError:
        raise InvalidArgument(f"timeoutMs {text!r} is not an integer") from None
    batch = await admin.txn_batches().begin(
        sink_key,
        batch_id,
        query_id,
        timeout_ms,
        owner=_caller(request),
        role=_acting_for(admin, request),
    )
    return batch.to_json()


async def commit_batch(admin: AdminService, request: web.Request) -> object:
    sink_key, batch_id = _batch(request)
    body = await json_body(request, BatchCommitBody, "batch commit", None)
    if body is None:
        raise InvalidArgument("a batch commit needs a body {queryId, epoch, winners}")
    role = _acting_for(admin, request)
    batch = await admin.txn_batches().commit(
        sink_key, batch_id, body.query_id, body.epoch, body.winners, role=role
    )
    return batch.to_json()


async def abort_batch(admin: AdminService, request: web.Request) -> object:
    sink_key, batch_id = _batch(request)
    body = await json_body(request, BatchAbortBody, "batch abort", None)
    if body is None:
        raise InvalidArgument("a batch abort needs a body {epoch}")
    role = _acting_for(admin, request)
    return (await admin.txn_batches().abort(sink_key, batch_id, body.epoch, role=role)).to_json()


async def get_batch(admin: AdminService, request: web.Request) -> object:
    sink_key, batch_id = _batch(request)
    role = _acting_for(admin, request)
    return (await admin.txn_batches().get(sink_key, batch_id, role=role)).to_json()


def _batch_routes(base: str) -> list[Route]:
    path = f"{base}/batches/{{sinkKey}}/{{batchId}}"
    return [
        Route("PUT", path, begin_batch,
              "Get or create a sink batch's transaction (?queryId=Q&timeoutMs=T).",
              "transactions", response_schema=BATCH, errors=BATCH_ERRORS),
        Route("POST", f"{path}/commit", commit_batch,
              "Commit a sink batch keeping only the winning branches' entries.",
              "transactions", request_schema=BATCH_COMMIT, response_schema=BATCH,
              errors=BATCH_ERRORS),
        Route("POST", f"{path}/abort", abort_batch,
              "Abort a sink batch's epoch unless it is committed.", "transactions",
              request_schema=BATCH_ABORT, response_schema=BATCH, errors=BATCH_ERRORS),
        Route("GET", path, get_batch, "A sink batch and its transaction's state.",
              "transactions", response_schema=BATCH, errors=BATCH_ERRORS),
    ]  # fmt: skip


def owner_query(request: web.Request) -> str:
    """``?owner=<role>``: the owner of the key the path names ("" when absent)."""
    return request.query.get("owner", "")


async def list_transaction_keys(admin: AdminService, request: web.Request) -> object:
    return await admin.list_transaction_keys()


async def get_transaction_key(admin: AdminService, request: web.Request) -> object:
    return await admin.get_transaction_key(param(request, "transactionKey"), owner_query(request))


async def delete_transaction_key(admin: AdminService, request: web.Request) -> object:
    return await admin.delete_transaction_key(
        param(request, "transactionKey"), owner_query(request)
    )


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
    """The ten routes under ``base``."""
    (coordinator, metadata, slow, buffer, segment_buffer, pending, segment_pending,
     list_keys, get_key, delete_key) = (
        _named(h, suffix)
        for h in (coordinator_stats, transaction_metadata, slow_transactions,
                  transaction_buffer_stats, segment_transaction_buffer_stats,
                  pending_ack_stats, segment_pending_ack_stats,
                  list_transaction_keys, get_transaction_key, delete_transaction_key)
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
        Route("GET", f"{base}/transaction-keys", list_keys,
              "Every transaction key with its epoch and last transaction.", "transactions",
              response_schema=TRANSACTION_KEYS, errors=TXN_ERRORS),
        Route("GET", f"{base}/transaction-keys/{{transactionKey}}", get_key,
              "A transaction key's epoch, transaction (and its status), owner and age "
              "(?owner=<role> for a key of an authenticated role).", "transactions",
              response_schema=TRANSACTION_KEY, errors=TXN_ERRORS),
        Route("DELETE", f"{base}/transaction-keys/{{transactionKey}}", delete_key,
              "Abort a transaction key's open transaction and delete the key; its holder "
              "is fenced (?owner=<role> for a key of an authenticated role).",
              "transactions", response_schema=TRANSACTION_KEY_RECORD, errors=TXN_ERRORS),
    ]  # fmt: skip


ROUTES: list[Route] = [
    *_routes(PREFIXES[0]),
    *_routes(PREFIXES[1], "_v3"),
    *_batch_routes(PREFIXES[0]),
]
