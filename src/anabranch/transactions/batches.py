"""Batch transactions of an exactly-once sink (the broker half of the Spark sink, issue 14).

A **batch** is ``(sinkKey, batchId)``: one micro-batch of one streaming sink. Its record at
``/txn/batch/<sinkKey>/<batchId>`` (:class:`~anabranch.transactions.records.BatchRecord`)
points at the ordinary transaction that currently holds it; ``epoch`` counts the
transactions the batch has had (each abort or timeout makes the next one ``epoch + 1``).

Every task attempt writes its messages in the batch's transaction tagged with its
**branch** (message property ``__txn_branch``, e.g. ``"<partitionId>-<attemptUuid>"``).
The driver's commit is ONE header CAS naming the winning branches (one per partition):
participants abort the entries of every other branch (failed or speculative attempts),
so a consumer sees exactly the winners' rows. The same commit marks the batch record
committed, so the decision outlives the header (collected after its retention):

    | call   | record absent | OPEN (same query) | COMMITTED              | ABORTED, timed out |
    |--------|---------------|-------------------|------------------------|--------------------|
    | begin  | new txn, 0    | returned          | returned (tasks skip); | new txn, epoch + 1 |
    |        |               |                   | 409 for another query  |                    |
    | commit | 404           | committed         | no-op (same winners)   | 409 (replay it)    |
    | abort  | 404           | aborted           | nothing (never undone) | nothing            |

An OPEN batch of another query (a new checkpoint location after a crash mid-batch) or an
OPEN one past its deadline is aborted and replaced by ``begin``, as an aborted one is.
A commit whose epoch or queryId is not the record's is 409 (TransactionConflict).

Concurrent ``begin`` calls create one transaction: the record is written with a CAS, the
losers abort their own transaction and return the winner's.

With authentication on, a batch belongs to the role that began it (``owner``, also the
owner of its transactions): another role that is not a superuser gets TransactionNotFound
for it, and for new batches of its sink, as the wire's transaction commands answer.

Example:
    >>> import asyncio
    >>> from anabranch.clock import SystemClock
    >>> from anabranch.metadata.memory import MemoryMetadataStore
    >>> from anabranch.transactions.coordinator import TransactionCoordinator
    >>> async def demo() -> list[object]:
    ...     store, clock = MemoryMetadataStore(), SystemClock()
    ...     tc = TransactionCoordinator(store, clock, partitions=1, sweep_interval_s=0)
    ...     await tc.start()
    ...     batches = TxnBatches(store, tc, clock)
    ...     batch = await batches.begin("query-1/out", 7, "q1", timeout_ms=60_000)
    ...     done = await batches.commit("query-1/out", 7, "q1", batch.epoch, {"0-a"})
    ...     again = await batches.begin("query-1/out", 7, "q1")    # a replay: skip it
    ...     await tc.close()
    ...     return [s.state.value for s in (batch, done, again)] + [again.to_json()["winners"]]
    >>> asyncio.run(demo())
    ['OPEN', 'COMMITTED', 'COMMITTED', ['0-a']]
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from anabranch import limits
from anabranch.clock import Clock
from anabranch.core.txn_header import U64_MAX
from anabranch.core.txn_state import is_expired
from anabranch.errors import (
    BadVersion,
    InvalidArgument,
    InvalidTxnStatus,
    TransactionConflict,
    TransactionNotFound,
)
from anabranch.metadata.api import MUST_NOT_EXIST, Delete, MetadataStore, Put
from anabranch.transactions import records
from anabranch.transactions.coordinator import TransactionCoordinator
from anabranch.transactions.ids import TxnId
from anabranch.transactions.records import BatchRecord, TxnState

log = logging.getLogger(__name__)

ATTEMPTS_MAX = limits.POLICIES_CAS_RETRIES_MAX
"""Read-judge-CAS rounds of one call before it gives up with BadVersion (each lost round
means another caller changed the record: progress)."""


@dataclass(frozen=True, slots=True)
class Batch:
    """A batch as its callers see it: the record and its transaction's state."""

    sink_key: str
    batch_id: int
    record: BatchRecord
    state: TxnState

    @property
    def txn(self) -> TxnId:
        return self.record.txn

    @property
    def epoch(self) -> int:
        return self.record.epoch

    def to_json(self) -> dict[str, Any]:
        """The admin answer: ``txnId`` as ``{mostSigBits, leastSigBits}``, ``winners``
        (sorted) once committed, else null."""
        winners = self.record.winners
        return {
            "sinkKey": self.sink_key,
            "batchId": self.batch_id,
            "txnId": {
                "mostSigBits": self.record.txn.most_bits,
                "leastSigBits": self.record.txn.least_bits,
            },
            "epoch": self.record.epoch,
            "state": self.state.value,
            "queryId": self.record.query_id,
            "winners": None if winners is None else sorted(winners),
            "createdAt": self.record.created_at,
        }


def check_batch(sink_key: str, batch_id: int) -> None:
    """InvalidArgument unless ``(sink_key, batch_id)`` names a batch.

    >>> check_batch("s", -1)
    Traceback (most recent call last):
    ...
    anabranch.errors.InvalidArgument: batchId -1 is not in [0, 2^64)
    """
    if not sink_key or len(sink_key.encode()) > limits.TXN_SINK_KEY_BYTES_MAX:
        raise InvalidArgument(
            f"sinkKey must be 1..{limits.TXN_SINK_KEY_BYTES_MAX} bytes, not {len(sink_key)}"
        )
    if not 0 <= batch_id <= U64_MAX:
        raise InvalidArgument(f"batchId {batch_id} is not in [0, 2^64)")


def _check_owner(sink_key: str, batch_id: int, record: BatchRecord, role: str | None) -> None:
    """The transactions' ownership rule (``op_records.check_owner``) for a batch: unknown
    to a role that neither began it nor is a superuser (``role`` None)."""
    if role is not None and record.owner is not None and record.owner != role:
        raise TransactionNotFound(f"batch {batch_id} of sink {sink_key!r} not found")


def check_winners(winners: Iterable[str]) -> frozenset[str]:
    """The winners as a set; InvalidArgument past the named limits.

    >>> sorted(check_winners(["1-b", "0-a"]))
    ['0-a', '1-b']
    """
    chosen = frozenset(winners)
    if len(chosen) > limits.TXN_BATCH_WINNERS_MAX:
        raise InvalidArgument(f"{len(chosen)} winners are over {limits.TXN_BATCH_WINNERS_MAX}")
    for branch in chosen:
        if not isinstance(branch, str) or not branch:
            raise InvalidArgument(f"a branch id must be a non-empty string: {branch!r}")
        if len(branch.encode()) > limits.TXN_BRANCH_ID_BYTES_MAX:
            raise InvalidArgument(
                f"branch id {branch[:40]!r}... is over {limits.TXN_BRANCH_ID_BYTES_MAX} bytes"
            )
    return chosen


class TxnBatches:
    """Begin, commit, abort and read batches (see the module docstring)."""

    def __init__(self, store: MetadataStore, coordinator: TransactionCoordinator, clock: Clock):
        self._store = store
        self._coordinator = coordinator
        self._clock = clock

    async def get(self, sink_key: str, batch_id: int, *, role: str | None = None) -> Batch:
        """The batch; TransactionNotFound when it was never begun (or ``role``, None for
        any batch, does not own it)."""
        check_batch(sink_key, batch_id)
        got = await self._store.get(records.batch_path(sink_key, batch_id))
        if got is None:
            raise TransactionNotFound(f"batch {batch_id} of sink {sink_key!r} not found")
        record = records.decode_batch(got.value)
        _check_owner(sink_key, batch_id, record, role)
        state, _ = await self._state(record)
        return Batch(sink_key, batch_id, record, state)

    async def begin(
        self,
        sink_key: str,
        batch_id: int,
        query_id: str,
        timeout_ms: int | None = None,
        *,
        owner: str | None = None,
        role: str | None = None,
    ) -> Batch:
        """Get-or-create the batch's transaction (see the module's table). ``owner``: the
        caller's role, recorded as the owner of what this creates; ``role``: the owner
        the caller may act for (None: any, as a superuser or without authentication)."""
        check_batch(sink_key, batch_id)
        if not query_id:
            raise InvalidArgument("queryId is required")
        timeout = limits.TXN_TIMEOUT_DEFAULT_MS if timeout_ms is None else timeout_ms
        path = records.batch_path(sink_key, batch_id)
        for _ in range(ATTEMPTS_MAX):
            got = await self._store.get(path)
            if got is None:
                await self._check_sink_owner(sink_key, query_id, role)
                created = await self._install(path, None, 0, query_id, timeout, owner=owner)
                if created is not None:
                    return Batch(sink_key, batch_id, created, TxnState.OPEN)
                continue  # a concurrent begin created it: take theirs
            record = records.decode_batch(got.value)
            _check_owner(sink_key, batch_id, record, role)
            state, header = await self._state(record)
            if state is TxnState.COMMITTED:
                if record.query_id != query_id:
                    raise TransactionConflict(
                        f"batch {batch_id} of sink {sink_key!r} was committed by query "
                        f"{record.query_id!r}, not {query_id!r}: sink reused with a new "
                        "checkpoint location"
                    )
                return Batch(sink_key, batch_id, record, state)
            expired = header is not None and is_expired(header, self._clock.wall_ms())
            if state is TxnState.OPEN:
                if record.query_id == query_id and not expired:
                    return Batch(sink_key, batch_id, record, state)
                # Timed out (the sweep has not got to it yet) or left by another query:
                # end it for good before the batch moves to a new transaction.
                try:
                    await self._coordinator.end_txn(record.txn, TxnState.ABORTED)
                except InvalidTxnStatus:
                    continue  # committed meanwhile: judge again
                except TransactionNotFound:
                    pass
            replaced = await self._install(
                path, got.stat.version, record.epoch + 1, query_id, timeout, owner=owner
            )
            if replaced is not None:
                return Batch(sink_key, batch_id, replaced, TxnState.OPEN)
        raise BadVersion(path, None, -1)

    async def commit(
        self,
        sink_key: str,
        batch_id: int,
        query_id: str,
        epoch: int,
        winners: Iterable[str],
        *,
        role: str | None = None,
    ) -> Batch:
        """Commit the batch's epoch ``epoch`` keeping only the entries of ``winners``: one
        header CAS, which also marks the record. Idempotent for the same winners. ``role``
        as for :meth:`begin`."""
        check_batch(sink_key, batch_id)
        chosen = check_winners(winners)
        path = records.batch_path(sink_key, batch_id)
        for _ in range(ATTEMPTS_MAX):
            got = await self._store.get(path)
            if got is None:
                raise TransactionNotFound(f"batch {batch_id} of sink {sink_key!r} not found")
            record = records.decode_batch(got.value)
            _check_owner(sink_key, batch_id, record, role)
            if record.query_id != query_id:
                raise TransactionConflict(
                    f"batch {batch_id} of sink {sink_key!r} belongs to query "
                    f"{record.query_id!r}, not {query_id!r}"
                )
            if record.epoch != epoch:
                raise TransactionConflict(
                    f"batch {batch_id} of sink {sink_key!r} is at epoch {record.epoch}, not "
                    f"{epoch}: its transaction was aborted and the batch begun again"
                )
            if record.committed:
                if record.winners != chosen:
                    raise InvalidTxnStatus(
                        f"batch {batch_id} of sink {sink_key!r} is committed with other winners"
                    )
                return Batch(sink_key, batch_id, record, TxnState.COMMITTED)
            marked = dataclasses.replace(record, winners=chosen)
            mark = Put(path, records.encode_batch(marked), got.stat.version)
            try:
                await self._coordinator.end_txn(
                    record.txn, TxnState.COMMITTED, winners=chosen, also=[mark]
                )
            except (InvalidTxnStatus, TransactionNotFound) as err:
                raise TransactionConflict(
                    f"batch {batch_id} of sink {sink_key!r} epoch {epoch} was aborted or timed "
                    f"out ({err}): replay the batch"
                ) from err
            except BadVersion as err:
                if err.path != path:
                    raise
                continue  # the record moved (a concurrent commit or begin): judge again
            await self._prune(sink_key, batch_id)
            return Batch(sink_key, batch_id, marked, TxnState.COMMITTED)
        raise BadVersion(path, None, -1)

    async def _check_sink_owner(self, sink_key: str, query_id: str, role: str | None) -> None:
        """TransactionConflict when the sink's oldest kept record was committed by another
        query: a sink reused with a new checkpoint location fails loudly even once the
        batch ids it starts at again were pruned. TransactionNotFound when another role
        owns that record: a sink is its first owner's."""
        page = await self._store.list_prefix(records.batch_prefix(sink_key), limit=1)
        if not page.records:
            return
        record = records.decode_batch(page.records[0].value)
        if role is not None and record.owner is not None and record.owner != role:
            raise TransactionNotFound(f"sink {sink_key!r} belongs to another role")
        if record.committed and record.query_id != query_id:
            raise TransactionConflict(
                f"sink {sink_key!r} was committed by query {record.query_id!r}, not "
                f"{query_id!r}: sink reused with a new checkpoint location"
            )

    async def _prune(self, sink_key: str, batch_id: int) -> None:
        """Delete the sink's records of batches before the last ``TXN_BATCHES_RETAINED``
        (a few per commit). Best effort: the commit has landed, and the next commit
        deletes what this one left."""
        end = batch_id - limits.TXN_BATCHES_RETAINED + 1
        if end <= 0:
            return
        try:
            page = await self._store.list_range(
                records.batch_prefix(sink_key),
                records.batch_path(sink_key, end),
                limit=limits.TXN_BATCHES_PRUNED_MAX,
            )
            if page.records:
                await self._store.commit([Delete(record.path) for record in page.records])
        except Exception:
            log.warning("pruning old batch records of sink %r failed", sink_key, exc_info=True)

    async def abort(
        self, sink_key: str, batch_id: int, epoch: int, *, role: str | None = None
    ) -> Batch:
        """Abort the batch's epoch ``epoch`` unless it is committed (a committed batch is
        never undone) or the batch has moved on to another epoch. Idempotent. ``role`` as
        for :meth:`begin`."""
        batch = await self.get(sink_key, batch_id, role=role)
        if batch.record.epoch != epoch or batch.state is not TxnState.OPEN:
            return batch
        try:
            await self._coordinator.end_txn(batch.txn, TxnState.ABORTED)
        except (InvalidTxnStatus, TransactionNotFound):
            pass  # committed (or collected) meanwhile: the answer below says which
        return await self.get(sink_key, batch_id)

    # --- helpers ----------------------------------------------------------------------------

    async def _state(self, record: BatchRecord) -> tuple[TxnState, records.TxnHeader | None]:
        """The batch's state: committed if the record says so (written with the header's
        CAS); else the header's; a collected header was aborted (a commit marks the
        record in the same store commit)."""
        if record.committed:
            return TxnState.COMMITTED, None
        header = await self._coordinator.get(record.txn)
        if header is None:
            return TxnState.ABORTED, None
        return header.state, header

    async def _install(
        self,
        path: str,
        version: int | None,
        epoch: int,
        query_id: str,
        timeout_ms: int,
        *,
        owner: str | None,
    ) -> BatchRecord | None:
        """A new transaction for the batch, its record CAS'd in (``version`` None: create);
        None when another caller changed the record first (our transaction is aborted)."""
        txn = await self._coordinator.new_txn(timeout_ms, owner=owner)
        record = BatchRecord(txn, epoch, query_id, self._clock.wall_ms(), owner=owner)
        expected = MUST_NOT_EXIST if version is None else version
        try:
            await self._store.put(path, records.encode_batch(record), expected)
        except BadVersion:
            await self._abort_quietly(txn)
            return None
        return record

    async def _abort_quietly(self, txn: TxnId) -> None:
        try:
            await self._coordinator.end_txn(txn, TxnState.ABORTED)
        except Exception:
            # Nothing was written in it; the timeout sweep ends it anyway.
            log.warning("aborting the unused batch transaction %s failed", txn, exc_info=True)
