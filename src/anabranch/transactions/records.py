"""Where transaction state lives in the metadata store, and how it is encoded (PIP-473).

Everything is under ``/txn`` (DESIGN.md §3.4). Numbers in keys are zero-padded to 20
digits so byte order is numeric order, and topic names are percent-encoded so one key
segment never holds a ``/``.

* ``/txn/id/<most>_<least>`` — the **header** (:class:`TxnHeader`), one per transaction.
  It is created at version 1 in state OPEN, and the only later write is the single CAS
  (``expected_version=1``) that finalizes it, so *version 1 means OPEN*: a participant
  guards its op record with ``Check(header, expected_version=1)`` in the same commit.
* ``/txn/op/<txnId>-<seq>`` — the **op records** (:class:`TxnOp`), written by participants
  (a WRITE op when a topic first sees the transaction, an ACK op per transactional ack)
  before the ledger append / cursor change, and deleted once the outcome is applied. The
  ``<txnId>-`` prefix is the by-transaction index.
* Index keys, written in the same atomic commit as the record they index (empty values):
  - ``/txn/idx/writes-by-segment/<topic>/<txnId>-<seq>``
  - ``/txn/idx/acks-by-segment-subscription/<topic>:<subscription>/<txnId>-<seq>``
  - ``/txn/idx/txn-by-deadline/<deadline ms>/<txnId>`` (OPEN transactions)
  - ``/txn/idx/txn-by-final-state/<STATE>:<finalized ms>/<txnId>`` (finished ones)
* ``/txn/segment-state/aborted/<topic>:<txnId>`` — a topic's durable memory of an
  aborted transaction's positions (:class:`AbortedRecord`), kept after the header is
  collected so those entries stay filtered across restarts.
* ``/txn/tc-seq/<partition>`` — the partition's TxnID counter (next unreserved value).
* ``/txn/tc-parallelism`` — the persisted partition count.
* ``/txn/batch/<sinkKey>/<batchId>`` — a **batch** of an exactly-once sink
  (:class:`BatchRecord`): which transaction (and epoch) currently holds the batch.

``TxnState`` and ``TxnHeader`` live in ``core/txn_header.py`` (pure rules use them) and
are re-exported here.

Example:
    >>> txn = TxnId(3, 42)
    >>> header_path(txn)
    '/txn/id/3_42'
    >>> op_path(txn, 7)
    '/txn/op/3_42-00000000000000000007'
    >>> parse_txn_key("3_42") == txn
    True
    >>> h = TxnHeader(state=TxnState.OPEN, created_at=1000, timeout_ms=500)
    >>> decode_header(encode_header(h)) == h and h.deadline == 1500
    True
    >>> w = TxnHeader(TxnState.COMMITTED, 1000, 500, finalized_at=1200, winners=frozenset("ba"))
    >>> import json
    >>> json.loads(encode_header(w))["winners"], decode_header(encode_header(w)) == w
    (['a', 'b'], True)
"""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

import msgspec

from anabranch.core.txn_header import U64_MAX, TxnHeader, TxnState
from anabranch.errors import InvalidArgument
from anabranch.storage.api import Position
from anabranch.transactions.ids import TxnId

ROOT = "/txn"
HEADERS = "/txn/id/"
OPS = "/txn/op/"
IDX_WRITES = "/txn/idx/writes-by-segment/"
IDX_ACKS = "/txn/idx/acks-by-segment-subscription/"
IDX_DEADLINE = "/txn/idx/txn-by-deadline/"
IDX_FINAL = "/txn/idx/txn-by-final-state/"
ABORTED = "/txn/segment-state/aborted/"
SEQ = "/txn/tc-seq/"
PARALLELISM = "/txn/tc-parallelism"
BATCHES = "/txn/batch/"

_DIGITS = 20


class OpKind(enum.Enum):
    WRITE = "WRITE"
    ACK = "ACK"


# --- keys -------------------------------------------------------------------------------------


def _n(value: int) -> str:
    return f"{value:0{_DIGITS}d}"


@functools.lru_cache(maxsize=4096)  # a few names, encoded on every op record and cleanup
def enc(name: str) -> str:
    """A topic or subscription name as one key segment.

    >>> enc("segment://public/default/o/0000-ffff-0")
    'segment%3A%2F%2Fpublic%2Fdefault%2Fo%2F0000-ffff-0'
    """
    return quote(name, safe="")


def txn_key(txn: TxnId) -> str:
    """``<most>_<least>``, the string form of a TxnID (upstream's ``TxnIds.toKey``)."""
    return f"{txn.most_bits}_{txn.least_bits}"


def parse_txn_key(key: str) -> TxnId:
    """The TxnID of ``<most>_<least>``; InvalidArgument for anything else.

    >>> parse_txn_key("0_1")
    TxnId(most_bits=0, least_bits=1)
    """
    most, sep, least = key.partition("_")
    if not sep or not most.isdigit() or not least.isdigit():
        raise InvalidArgument(f"not a transaction id: {key!r}")
    txn = TxnId(int(most), int(least))
    if txn.most_bits > U64_MAX or txn.least_bits > U64_MAX:
        raise InvalidArgument(f"transaction id out of range: {key!r}")
    return txn


def header_path(txn: TxnId) -> str:
    return f"{HEADERS}{txn_key(txn)}"


def op_prefix(txn: TxnId) -> str:
    """Every op record of ``txn`` starts with this (the by-transaction index)."""
    return f"{OPS}{txn_key(txn)}-"


def op_path(txn: TxnId, seq: int) -> str:
    return f"{op_prefix(txn)}{_n(seq)}"


def parse_op_name(name: str) -> tuple[TxnId, int]:
    """``(txn, seq)`` of an op record's (or op index key's) last segment ``<txnId>-<seq>``.

    >>> parse_op_name("1_2-00000000000000000003")
    (TxnId(most_bits=1, least_bits=2), 3)
    """
    key, sep, seq = name.rpartition("-")
    if not sep or not seq.isdigit():
        raise InvalidArgument(f"not an op record name: {name!r}")
    return parse_txn_key(key), int(seq)


def writes_index_prefix(topic: str) -> str:
    """Index keys of every WRITE op record on ``topic``."""
    return f"{IDX_WRITES}{enc(topic)}/"


def writes_index_path(topic: str, txn: TxnId, seq: int) -> str:
    return f"{writes_index_prefix(topic)}{txn_key(txn)}-{_n(seq)}"


def acks_index_prefix(topic: str, subscription: str) -> str:
    """Index keys of every ACK op record on ``topic``'s ``subscription``."""
    return f"{IDX_ACKS}{enc(topic)}:{enc(subscription)}/"


def acks_index_path(topic: str, subscription: str, txn: TxnId, seq: int) -> str:
    return f"{acks_index_prefix(topic, subscription)}{txn_key(txn)}-{_n(seq)}"


def deadline_index_path(deadline_ms: int, txn: TxnId) -> str:
    return f"{IDX_DEADLINE}{_n(deadline_ms)}/{txn_key(txn)}"


def deadline_index_end(now_ms: int) -> str:
    """The end (exclusive) of the deadline index range holding deadlines ``<= now_ms``."""
    return f"{IDX_DEADLINE}{_n(now_ms + 1)}/"


def final_index_path(state: TxnState, finalized_ms: int, txn: TxnId) -> str:
    return f"{IDX_FINAL}{state.value}:{_n(finalized_ms)}/{txn_key(txn)}"


def final_index_range(state: TxnState, before_ms: int) -> tuple[str, str]:
    """``[start, end)`` of the final-state index keys finalized before ``before_ms``."""
    return f"{IDX_FINAL}{state.value}:", f"{IDX_FINAL}{state.value}:{_n(before_ms)}/"


def aborted_prefix(topic: str) -> str:
    return f"{ABORTED}{enc(topic)}:"


def aborted_path(topic: str, txn: TxnId) -> str:
    return f"{aborted_prefix(topic)}{txn_key(txn)}"


def seq_path(partition: int) -> str:
    return f"{SEQ}{partition}"


def index_txn(path: str) -> TxnId:
    """The TxnID at the end of a deadline, final-state or aborted index key.

    >>> index_txn(deadline_index_path(5, TxnId(1, 9)))
    TxnId(most_bits=1, least_bits=9)
    """
    last = path.rsplit("/", 1)[-1]
    return parse_txn_key(last.rsplit(":", 1)[-1])


# --- values -----------------------------------------------------------------------------------

# msgspec: a tenth of the json module's time per record, and a header is encoded and
# decoded several times per transaction (create, commit, the watch). The output is the
# same compact JSON (UTF-8 rather than \u escapes); DecodeError is a ValueError.
_ENCODE = msgspec.json.Encoder().encode
_DECODE = msgspec.json.decode


def encode_header(header: TxnHeader) -> bytes:
    data: dict[str, Any] = {
        "version": 1,
        "state": header.state.value,
        "createdAt": header.created_at,
        "timeout": header.timeout_ms,
    }
    if header.finalized_at is not None:
        data["finalizedAt"] = header.finalized_at
    if header.owner is not None:
        data["owner"] = header.owner
    if header.winners is not None:
        data["winners"] = sorted(header.winners)
    return _ENCODE(data)


def decode_header(value: bytes) -> TxnHeader:
    data = _DECODE(value)
    return TxnHeader(
        state=TxnState(data["state"]),
        created_at=int(data["createdAt"]),
        timeout_ms=int(data["timeout"]),
        finalized_at=data.get("finalizedAt"),
        owner=data.get("owner"),
        winners=None if data.get("winners") is None else frozenset(data["winners"]),
    )


@dataclass(frozen=True, slots=True)
class TxnOp:
    """One op record.

    A WRITE op registers ``segment`` (any topic name) as a participant; ``first_after`` is
    the topic's last confirmed position when it was written, so every entry of the
    transaction on that topic lies after it (a restarted broker pins readers there while
    the transaction is OPEN, and scans from there to find the transaction's entries).
    An ACK op holds ``positions`` acknowledged on ``subscription`` (one position when
    ``cumulative``).
    """

    kind: OpKind
    segment: str
    subscription: str | None = None
    positions: tuple[Position, ...] = ()
    cumulative: bool = False
    first_after: Position | None = None
    extra: dict[str, Any] = field(default_factory=dict, compare=False)


def encode_op(op: TxnOp) -> bytes:
    data: dict[str, Any] = {"version": 1, "kind": op.kind.value, "segment": op.segment}
    if op.subscription is not None:
        data["subscription"] = op.subscription
    if op.positions:
        data["positions"] = [[p.ledger_id, p.entry_id] for p in op.positions]
    if op.cumulative:
        data["cumulative"] = True
    if op.first_after is not None:
        data["firstAfter"] = [op.first_after.ledger_id, op.first_after.entry_id]
    data.update(op.extra)
    return _ENCODE(data)


def decode_op(value: bytes) -> TxnOp:
    data = _DECODE(value)
    first = data.get("firstAfter")
    known = {"version", "kind", "segment", "subscription", "positions", "cumulative", "firstAfter"}
    return TxnOp(
        kind=OpKind(data["kind"]),
        segment=data["segment"],
        subscription=data.get("subscription"),
        positions=tuple(Position(int(a), int(b)) for a, b in data.get("positions", ())),
        cumulative=bool(data.get("cumulative", False)),
        first_after=Position(int(first[0]), int(first[1])) if first else None,
        extra={k: v for k, v in data.items() if k not in known},
    )


@dataclass(frozen=True, slots=True)
class AbortedRecord:
    """The positions of one aborted transaction on one topic (stored as runs of
    consecutive entries, so a large transaction written without interleaving is one run).

    >>> rec = AbortedRecord((Position(1, 0), Position(1, 1), Position(1, 2), Position(2, 5)))
    >>> decode_aborted(encode_aborted(rec)) == rec
    True
    >>> import json
    >>> json.loads(encode_aborted(rec))["runs"]
    [[1, 0, 2], [2, 5, 5]]
    """

    positions: tuple[Position, ...]


def encode_aborted(record: AbortedRecord) -> bytes:
    runs: list[list[int]] = []
    for pos in sorted(record.positions):
        last = runs[-1] if runs else None
        if last is not None and last[0] == pos.ledger_id and last[2] + 1 == pos.entry_id:
            last[2] = pos.entry_id
        else:
            runs.append([pos.ledger_id, pos.entry_id, pos.entry_id])
    return _ENCODE({"version": 1, "runs": runs})


def decode_aborted(value: bytes) -> AbortedRecord:
    data = _DECODE(value)
    positions = [
        Position(int(ledger), entry)
        for ledger, first, last in data.get("runs", ())
        for entry in range(int(first), int(last) + 1)
    ]
    return AbortedRecord(tuple(positions))


def batch_prefix(sink_key: str) -> str:
    """Every batch record of sink ``sink_key`` starts with this.

    >>> batch_prefix("q/out")
    '/txn/batch/q%2Fout/'
    """
    return f"{BATCHES}{enc(sink_key)}/"


def batch_path(sink_key: str, batch_id: int) -> str:
    """The record of batch ``batch_id`` of sink ``sink_key`` (see ``transactions/batches``).

    >>> batch_path("q/out", 7)
    '/txn/batch/q%2Fout/00000000000000000007'
    """
    return f"{batch_prefix(sink_key)}{_n(batch_id)}"


@dataclass(frozen=True, slots=True)
class BatchRecord:
    """Which transaction holds one batch: ``epoch`` counts the transactions the batch has
    had (a new one after each abort or timeout); ``query_id`` names the streaming query
    (its checkpoint) that wrote it. ``winners`` is set (in the same commit as the header's
    CAS) once the batch is committed, so the decision outlives the collected header.

    >>> rec = BatchRecord(TxnId(1, 2), epoch=0, query_id="q", created_at=5)
    >>> decode_batch(encode_batch(rec)) == rec
    True
    >>> done = BatchRecord(TxnId(1, 2), 0, "q", 5, winners=frozenset({"0-a"}), owner="etl")
    >>> again = decode_batch(encode_batch(done))
    >>> again.committed, again.owner
    (True, 'etl')
    """

    txn: TxnId
    epoch: int
    query_id: str
    created_at: int
    winners: frozenset[str] | None = None
    owner: str | None = None
    """The role that began the batch (None: authentication was off)."""

    @property
    def committed(self) -> bool:
        return self.winners is not None


def encode_batch(record: BatchRecord) -> bytes:
    data: dict[str, Any] = {
        "version": 1,
        "txn": txn_key(record.txn),
        "epoch": record.epoch,
        "queryId": record.query_id,
        "createdAt": record.created_at,
    }
    if record.winners is not None:
        data["winners"] = sorted(record.winners)
    if record.owner is not None:
        data["owner"] = record.owner
    return _ENCODE(data)


def decode_batch(value: bytes) -> BatchRecord:
    data = _DECODE(value)
    return BatchRecord(
        txn=parse_txn_key(data["txn"]),
        epoch=int(data["epoch"]),
        query_id=str(data["queryId"]),
        created_at=int(data["createdAt"]),
        winners=None if data.get("winners") is None else frozenset(data["winners"]),
        owner=None if data.get("owner") is None else str(data["owner"]),
    )


__all__ = [
    "U64_MAX",
    "AbortedRecord",
    "BatchRecord",
    "OpKind",
    "TxnHeader",
    "TxnOp",
    "TxnState",
]
