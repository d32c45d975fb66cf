"""The Spark sink: ``writeStream.format("anabranch")`` and ``df.write.format("anabranch")``.

``deliveryGuarantee=exactly_once`` (the default) writes each micro-batch in one **batch
transaction** of the broker, keyed by ``(sinkKey, batchId)``: ``sinkKey`` is the ``sinkId``
option, else the streaming query id (stable across restarts from one checkpoint).

- ``write`` (executors): reads batchId and query id from the task's local properties
  (``streaming.sql.batchId``, ``sql.streaming.queryId``: Spark gives a Python writer no
  batchId), gets or creates the batch's transaction, and produces every row into it tagged with
  the message property ``__txn_branch = "<partitionId>-<attempt uuid>"`` (its **branch**).
  It flushes and returns ``{branch, epoch, rows}``; it never commits. If the batch is already
  COMMITTED (a replay after the driver died between the broker commit and Spark's commit log)
  it drains its input and returns a *skipped* message.
- ``commit`` (driver, on a fresh writer): one CAS on the batch's header names the winning
  branches (those in the messages). Read-committed readers then see exactly those branches;
  a failed or speculative attempt's branch stays invisible. A replay of a committed batch is a
  no-op. A batch that was aborted or timed out raises, and Spark replays it (a new epoch).
- ``abort`` (driver): aborts the batch unless it is COMMITTED (Spark calls ``abort`` even after
  a commit that succeeded before a crash; that commit stands).

Batch ``df.write`` runs the same protocol with one batch transaction per job: its key is
``<sinkId or "spark-job">.<uuid of the job>`` with batchId 0, so the rows of all partitions of
one ``save()`` become visible together or not at all.

``deliveryGuarantee=at_least_once`` produces plainly (no transaction): a retried task or a
replayed batch can write its rows again.

Example::

    (df.writeStream.format("anabranch")
       .option("serviceUrl", "pulsar://localhost:6650").option("topic", "out")
       .option("checkpointLocation", "/tmp/cp").start())
"""

from __future__ import annotations

import logging
import os
import signal
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from pyspark import TaskContext
from pyspark.sql.datasource import (
    DataSourceArrowWriter,
    DataSourceStreamArrowWriter,
    WriterCommitMessage,
)

from anabranch.admin.client import AdminHttpError
from anabranch.client.transaction import Transaction
from anabranch.errors import AnabranchError
from anabranch.transactions.ids import TxnId
from pyspark_anabranch import _io
from pyspark_anabranch.options import SinkOptions, check_sink_key, topic_key

log = logging.getLogger("pyspark_anabranch")

SINK_CHUNK_ROWS = 4096
"""Rows handed to the loop thread per call by the sink."""

BATCH_JOB_PREFIX = "spark-job"
"""Sink key prefix of a batch ``df.write`` without ``sinkId``."""

CRASH_AFTER_COMMIT_ENV = "ANABRANCH_SPARK_CRASH_AFTER_COMMIT"
"""Test hook: ``<sinkKey>:<batchId>:<pid file>``; right after the commit CAS of that batch,
``commit`` SIGKILLs the pids listed in the file (the driver) and exits."""
CRASH_BEFORE_COMMIT_ENV = "ANABRANCH_SPARK_CRASH_BEFORE_COMMIT"
"""Test hook: the same, right before the commit CAS (the batch stays OPEN)."""
FAIL_WRITE_ENV = "ANABRANCH_SPARK_FAIL_WRITE"
"""Test hook: ``<sinkKey>:<rows>``; a task's first attempt fails after producing that many
rows of its partition."""


class BatchCommitFailed(AnabranchError):
    """The batch's transaction could not be committed (aborted, timed out, or a stale epoch):
    Spark fails the batch and replays it on restart."""


# --- commit messages --------------------------------------------------------------------------


@dataclass
class SinkCommit(WriterCommitMessage):
    """What an at-least-once task reports to the driver: how many rows it stored."""

    rows: int


@dataclass
class BranchCommit(WriterCommitMessage):
    """What an exactly-once task reports: its branch (None when the batch was committed
    already and the task skipped it), the batch's epoch and identity, and its row count."""

    sink_key: str
    batch_id: int
    query_id: str
    epoch: int
    branch: str | None
    rows: int

    @property
    def skipped(self) -> bool:
        return self.branch is None


@dataclass(frozen=True)
class TaskIdentity:
    """Where a ``write`` runs: the batch's key and id, the query, the task's partition and
    attempt (a fresh uuid per attempt: Spark's attempt numbers restart after a restart)."""

    sink_key: str
    batch_id: int
    query_id: str
    partition: int
    attempt: str

    @property
    def branch(self) -> str:
        return f"{self.partition}-{self.attempt}"


def stream_task_identity(opts: SinkOptions) -> TaskIdentity:
    """The identity of a streaming ``write`` from Spark's TaskContext."""
    ctx = TaskContext.get()
    if ctx is None:
        raise AnabranchError("the exactly-once sink's write() runs only inside a Spark task")
    batch_id = ctx.getLocalProperty("streaming.sql.batchId")
    query_id = ctx.getLocalProperty("sql.streaming.queryId")
    if batch_id is None or query_id is None:
        raise AnabranchError("no streaming batchId/queryId in the task's local properties")
    sink_key = opts.sink_id or check_sink_key(query_id, "the query id")
    return TaskIdentity(sink_key, int(batch_id), query_id, ctx.partitionId(), uuid.uuid4().hex)


# --- writing ----------------------------------------------------------------------------------


def _column(batch: pa.RecordBatch, name: str) -> pa.Array | None:
    index = batch.schema.get_field_index(name)
    return None if index < 0 else batch.column(index)


def rows_of(opts: SinkOptions, batch: pa.RecordBatch) -> list[_io.Row]:
    """The rows to produce from one Arrow batch of the sink's input columns."""
    value = _column(batch, "value")
    if value is None:
        raise ValueError("the anabranch sink needs a 'value' column (binary or string)")
    n = batch.num_rows
    values = [v if isinstance(v, bytes) else str(v).encode() for v in value.to_pylist()]
    key_col = _column(batch, "key")
    keys: list[Any] = key_col.to_pylist() if key_col is not None else [None] * n
    keys = [k.decode() if isinstance(k, bytes) else k for k in keys]
    prop_col = _column(batch, "properties")
    props: list[Any] = prop_col.to_pylist() if prop_col is not None else [None] * n
    props = [dict(p) if p is not None else None for p in props]
    ev_col = _column(batch, "eventTime")
    if ev_col is not None:
        micros = pc.cast(ev_col, pa.int64())
        events: list[Any] = [None if e is None else e // 1000 for e in micros.to_pylist()]
    else:
        events = [None] * n
    if opts.topic is not None:
        topics = [opts.topic] * n
    else:
        topic_col = _column(batch, "topic")
        if topic_col is None:
            raise ValueError("the anabranch sink needs the topic option or a 'topic' column")
        topics = [topic_key(t) for t in topic_col.to_pylist()]
    return list(zip(topics, values, keys, props, events, strict=True))


def _produce(
    opts: SinkOptions,
    batches: Iterator[pa.RecordBatch],
    txn: Transaction | None = None,
    branch: str | None = None,
    fail_after: int | None = None,
) -> int:
    client = _io.client_for(opts.service_url, **opts.client)
    sink = _io.TopicSink(client, txn, branch)
    sent = 0
    try:
        for batch in batches:
            rows = rows_of(opts, batch)
            for start in range(0, len(rows), SINK_CHUNK_ROWS):
                chunk = rows[start : start + SINK_CHUNK_ROWS]
                if fail_after is not None and sent + len(chunk) >= fail_after:
                    _io.run(sink.send(chunk[: fail_after - sent]))
                    _io.run(sink.finish())
                    raise AnabranchError(f"test hook: write failed after {fail_after} rows")
                _io.run(sink.send(chunk))
                sent += len(chunk)
        return _io.run(sink.finish())
    finally:
        _io.run(sink.close())


def write_at_least_once(opts: SinkOptions, batches: Iterator[pa.RecordBatch]) -> SinkCommit:
    """Produce every row (routed by ``key`` over the topic's active segments by the client's
    scalable producer) and wait until all are stored."""
    return SinkCommit(_produce(opts, batches))


def _fail_after(sink_key: str) -> int | None:
    hook = os.environ.get(FAIL_WRITE_ENV)
    if not hook:
        return None
    key, _, rows = hook.rpartition(":")
    ctx = TaskContext.get()
    if key != sink_key or ctx is None or ctx.attemptNumber() != 0:
        return None
    return int(rows)


def write_branch(
    opts: SinkOptions, batches: Iterator[pa.RecordBatch], task: TaskIdentity
) -> BranchCommit:
    """One task attempt's branch of the batch transaction (see the module docstring)."""
    admin = _io.admin_for(opts.admin_url)
    state = _io.run(
        _io.begin_batch(admin, task.sink_key, task.batch_id, task.query_id, opts.txn_timeout_ms)
    )
    if state.state == "COMMITTED":
        for _ in batches:  # a replay of a committed batch: nothing to write
            pass
        log.info("anabranch sink: batch %s/%d committed already", task.sink_key, task.batch_id)
        return BranchCommit(task.sink_key, task.batch_id, task.query_id, state.epoch, None, 0)
    if state.state != "OPEN":
        raise BatchCommitFailed(
            f"batch {task.sink_key}/{task.batch_id} is {state.state} (epoch {state.epoch})"
        )
    client = _io.client_for(opts.service_url, **opts.client)
    txn = _io.run(client.resume_transaction(TxnId(*state.txn_id), opts.txn_timeout_ms / 1000))
    rows = _produce(opts, batches, txn, task.branch, _fail_after(task.sink_key))
    return BranchCommit(task.sink_key, task.batch_id, task.query_id, state.epoch, task.branch, rows)


# --- committing (driver) ----------------------------------------------------------------------


def _crash_hook(env: str, sink_key: str, batch_id: int) -> None:
    hook = os.environ.get(env)
    if not hook:
        return
    key, batch, pid_file = hook.split(":", 2)
    if key != sink_key or int(batch) != batch_id:
        return
    for pid in Path(pid_file).read_text().split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass
    os._exit(1)


def commit_branches(opts: SinkOptions, messages: list[WriterCommitMessage | None]) -> int:
    """Commit the batch of ``messages`` naming their branches as the winners; returns the rows
    committed (0 for a replay of a committed batch). Raises :class:`BatchCommitFailed`."""
    mine = [m for m in messages if isinstance(m, BranchCommit)]
    if not mine:
        return 0  # no task wrote: no transaction began
    first = mine[0]
    sink_key, batch_id, query_id = first.sink_key, first.batch_id, first.query_id
    admin = _io.admin_for(opts.admin_url)
    if any(m.skipped for m in mine):
        state = _io.run(_io.get_batch(admin, sink_key, batch_id))
        if state is None or state.state != "COMMITTED" or state.query_id != query_id:
            raise BatchCommitFailed(f"batch {sink_key}/{batch_id}: replay of an uncommitted batch")
        if not all(m.skipped for m in mine):
            # a task began after the commit was seen by another: its branch never wins
            log.warning("anabranch sink: batch %s/%d mixed replay", sink_key, batch_id)
        return 0
    epochs = {m.epoch for m in mine}
    if len(epochs) != 1:
        raise BatchCommitFailed(
            f"batch {sink_key}/{batch_id}: branches of epochs {sorted(epochs)} (it was reopened "
            "while tasks wrote); Spark replays it"
        )
    winners = sorted({m.branch for m in mine if m.branch is not None})
    _crash_hook(CRASH_BEFORE_COMMIT_ENV, sink_key, batch_id)
    try:
        _io.run(_io.commit_batch(admin, sink_key, batch_id, query_id, epochs.pop(), winners))
    except AdminHttpError as err:
        if err.status == 409:
            raise BatchCommitFailed(
                f"batch {sink_key}/{batch_id} cannot commit: {err.reason}"
            ) from err
        raise
    _crash_hook(CRASH_AFTER_COMMIT_ENV, sink_key, batch_id)
    return sum(m.rows for m in mine)


def abort_branches(opts: SinkOptions, messages: list[WriterCommitMessage | None]) -> None:
    """Abort the batch of ``messages`` unless it is COMMITTED (best effort: the broker's
    timeout aborts it otherwise)."""
    mine = [m for m in messages if isinstance(m, BranchCommit)]
    if not mine:
        return
    first = mine[0]
    try:
        _io.run(
            _io.abort_batch(
                _io.admin_for(opts.admin_url),
                first.sink_key,
                first.batch_id,
                max(m.epoch for m in mine),
            )
        )
    except Exception as err:
        log.warning("anabranch sink: abort of %s/%d: %s", first.sink_key, first.batch_id, err)


# --- Spark's writer classes -------------------------------------------------------------------


class AnabranchStreamWriter(DataSourceStreamArrowWriter):
    """Streaming sink (exactly-once by default; see the module docstring)."""

    def __init__(self, opts: SinkOptions) -> None:
        self.opts = opts

    def write(self, iterator: Iterator[pa.RecordBatch]) -> WriterCommitMessage:
        if not self.opts.exactly_once:
            return write_at_least_once(self.opts, iterator)
        return write_branch(self.opts, iterator, stream_task_identity(self.opts))

    def commit(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        if not self.opts.exactly_once:
            rows = sum(m.rows for m in messages if isinstance(m, SinkCommit))
            log.info("anabranch sink: batch %d stored %d rows", batchId, rows)
            return
        rows = commit_branches(self.opts, messages)
        log.info("anabranch sink: batch %d committed %d rows", batchId, rows)

    def abort(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        if not self.opts.exactly_once:
            log.warning("anabranch sink: batch %d aborted (rows already stored stay)", batchId)
            return
        abort_branches(self.opts, messages)


class AnabranchBatchWriter(DataSourceArrowWriter):
    """Batch sink (``df.write.format("anabranch")``): exactly-once writes are one batch
    transaction per job, under the key ``<sinkId or "spark-job">.<job uuid>``."""

    def __init__(self, opts: SinkOptions) -> None:
        self.opts = opts
        self.job = uuid.uuid4().hex  # made on the driver; the pickled copies share it
        self.sink_key = f"{opts.sink_id or BATCH_JOB_PREFIX}.{self.job}"

    def write(self, iterator: Iterator[pa.RecordBatch]) -> WriterCommitMessage:
        if not self.opts.exactly_once:
            return write_at_least_once(self.opts, iterator)
        ctx = TaskContext.get()
        partition = ctx.partitionId() if ctx is not None else 0
        task = TaskIdentity(self.sink_key, 0, self.job, partition, uuid.uuid4().hex)
        return write_branch(self.opts, iterator, task)

    def commit(self, messages: list[WriterCommitMessage | None]) -> None:
        if self.opts.exactly_once:
            commit_branches(self.opts, messages)

    def abort(self, messages: list[WriterCommitMessage | None]) -> None:
        if self.opts.exactly_once:
            abort_branches(self.opts, messages)


__all__ = [
    "AnabranchBatchWriter",
    "AnabranchStreamWriter",
    "BatchCommitFailed",
    "BranchCommit",
    "SinkCommit",
    "TaskIdentity",
]
