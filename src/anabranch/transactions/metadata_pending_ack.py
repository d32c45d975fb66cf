"""A subscription's pending acks with their state in the metadata store (PIP-473).

A transactional ack writes one ACK op record (its positions, or the one cumulative
position; index key ``acks_index_path``) guarded by the header being OPEN, and holds the
positions *pending*: the dispatcher neither delivers nor redelivers them, and no other
transaction (nor a plain ack) may ack them (TransactionConflict). Positions are reserved
before the write, so two concurrent acks cannot both take one position.

When the transaction ends (:class:`~anabranch.transactions.outcomes.TxnOutcomes`), in the
background, once none of its acks is still being written:

- COMMITTED: the acks go to the cursor, the cursor is flushed (a crash cannot lose an ack
  whose op record is gone), ``on_committed(positions, cumulative)`` is called, the op
  records are deleted;
- ABORTED: the positions stop being pending, ``on_aborted(positions, cumulative)`` is
  called (the subscription redelivers them), the op records are deleted.

Recovery lists the subscription's ACK op records and rebuilds the pending positions per
transaction; final ones are applied as above. An op record whose header is gone reads as
ABORTED here (the messages are redelivered rather than lost).

Example:
    >>> import asyncio
    >>> from anabranch.clock import SystemClock
    >>> from anabranch.metadata.memory import MemoryMetadataStore
    >>> from anabranch.storage.api import EARLIEST
    >>> from anabranch.storage.memory import MemoryManagedLedgerFactory
    >>> async def demo() -> None:
    ...     store, clock = MemoryMetadataStore(), SystemClock()
    ...     txn = TxnId(0, 1)
    ...     header = records.TxnHeader(TxnState.OPEN, clock.wall_ms(), timeout_ms=60_000)
    ...     await store.put(records.header_path(txn), records.encode_header(header))
    ...     outcomes = TxnOutcomes(store, clock)
    ...     ml = await MemoryManagedLedgerFactory().open("t")
    ...     pos = await ml.append(b"m")
    ...     cursor = await ml.open_cursor("s", EARLIEST)
    ...     acks = MetadataPendingAckStore("t", "s", cursor, store, outcomes, clock,
    ...                                    on_committed=lambda ps, c: None,
    ...                                    on_aborted=lambda ps, c: None)
    ...     await acks.recover()
    ...     await acks.acknowledge(txn, [pos], cumulative=False)
    ...     assert acks.is_pending(pos) and not cursor.is_acknowledged(pos)
    ...     outcomes.wake(txn, TxnState.COMMITTED)
    ...     await acks.wait_applied()
    ...     assert cursor.is_acknowledged(pos) and not acks.is_pending(pos)
    ...     await acks.close()
    >>> asyncio.run(demo())
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from anabranch import limits
from anabranch.clock import Clock
from anabranch.errors import TransactionConflict, TransactionTooLarge
from anabranch.metadata.api import Delete, MetadataStore
from anabranch.metadata.ownership_fence import OwnershipFence, commit_fenced
from anabranch.storage.api import Cursor, Position
from anabranch.transactions import records
from anabranch.transactions.ids import TxnId
from anabranch.transactions.op_records import (
    OutcomeWork,
    check_owner,
    delete_ops,
    join_and_count,
    write_op,
)
from anabranch.transactions.outcomes import TxnOutcomes
from anabranch.transactions.records import TxnState

log = logging.getLogger(__name__)

AckCallback = Callable[[list[Position], Position | None], None]
"""``(individual positions, cumulative position or None)`` of one transaction."""


@dataclass(slots=True)
class _AckTxn:
    """One transaction's pending acks on this subscription."""

    individual: set[Position] = field(default_factory=set)
    cumulative: Position | None = None
    seqs: list[int] = field(default_factory=list)
    next_seq: int = 0
    records: int = 0
    """Op records of the transaction (all participants) as last counted, plus ours since."""
    writing: int = 0
    """Acks of this transaction whose op record is being written."""
    joined: bool = False
    owner: str | None = None
    """The role that opened the transaction (None: authentication was off)."""
    applied: bool = False
    """The outcome reached memory and callbacks; only the durable cleanup may remain."""


class MetadataPendingAckStore:
    """Implements ``PendingAckStore`` and ``OutcomeListener`` for one subscription."""

    def __init__(  # noqa: PLR0917 (the signature the broker wiring was agreed on)
        self,
        topic: str,
        subscription: str,
        cursor: Cursor,
        store: MetadataStore,
        outcomes: TxnOutcomes,
        clock: Clock,
        *,
        on_committed: AckCallback,
        on_aborted: AckCallback,
        fence: OwnershipFence | None = None,
    ) -> None:
        self._topic = topic
        self._subscription = subscription
        self._cursor = cursor
        self._store = store
        self._fence = fence
        self._outcomes = outcomes
        self._clock = clock
        self._on_committed = on_committed
        self._on_aborted = on_aborted
        self._txns: dict[TxnId, _AckTxn] = {}
        self._held: dict[Position, TxnId] = {}
        self._cumulative: tuple[TxnId, Position] | None = None
        self._joining: dict[TxnId, asyncio.Future[None]] = {}
        self._finished: OrderedDict[TxnId, TxnState] = OrderedDict()
        self._work = OutcomeWork(clock, self._apply, f"pending acks {topic} {subscription}")
        self._closed = False
        self.op_writes = 0
        """ACK op records written (metrics)."""
        self.committed = 0
        """Transactions whose acks reached the cursor (metrics)."""
        self.aborted = 0
        """Transactions whose acks were dropped (metrics)."""
        self.conflicts = 0
        """Acks refused with TransactionConflict (metrics)."""

    # --- PendingAckStore ------------------------------------------------------------------

    def open_count(self) -> int:
        return len(self._txns) + len(self._joining)

    def is_pending(self, position: Position) -> bool:
        if position in self._held:
            return True
        return self._cumulative is not None and position <= self._cumulative[1]

    async def acknowledge(
        self,
        txn_id: TxnId | None,
        positions: Sequence[Position],
        *,
        cumulative: bool,
        role: str | None = None,
    ) -> None:
        """Ack now (``txn_id`` None) or hold the ack pending until ``txn_id`` ends;
        TransactionNotFound when ``role`` may not ack in it (``check_owner``)."""
        if not positions:
            return
        if txn_id is None:
            await self._plain_ack(positions, cumulative)
        elif cumulative:
            await self._txn_ack(txn_id, [], max(positions), role)
        else:
            if len(positions) > limits.TXN_ACK_POSITIONS_PER_RECORD_MAX:
                raise TransactionTooLarge(
                    f"{len(positions)} positions in one transactional ack "
                    f"(limit {limits.TXN_ACK_POSITIONS_PER_RECORD_MAX})"
                )
            await self._txn_ack(txn_id, sorted(set(positions)), None, role)

    async def _plain_ack(self, positions: Sequence[Position], cumulative: bool) -> None:
        if cumulative:
            target = max(positions)
            if self._cumulative is not None or any(p <= target for p in self._held):
                self._conflict("a message pending in a transaction cannot be acked without it")
            await self._cursor.acknowledge_cumulative(target)
        else:
            if any(self.is_pending(p) for p in positions):
                self._conflict("a message pending in a transaction cannot be acked without it")
            await self._cursor.acknowledge(positions)

    def _conflict(self, message: str) -> None:
        self.conflicts += 1
        raise TransactionConflict(message)

    def _check(self, txn: TxnId, individual: list[Position], target: Position | None) -> None:
        """Refuse an ack of ``txn`` that another transaction's pending acks overlap."""
        state = self._finished.get(txn)
        if state is not None:
            self._conflict(f"transaction {txn} is already {state.value}")
        other = "a message pending in one transaction cannot be acked by another"
        held = self._cumulative
        for pos in individual:
            owner = self._held.get(pos)
            if owner is not None and owner != txn:
                self._conflict(other)
            if held is not None and held[0] != txn and pos <= held[1]:
                self._conflict(other)
            if owner is None and self._cursor.is_acknowledged(pos):
                self._conflict(f"{pos.ledger_id}:{pos.entry_id} is already acknowledged")
        if target is not None:
            if held is not None and held[0] != txn:
                self._conflict(other)
            if any(p <= target and t != txn for p, t in self._held.items()):
                self._conflict(other)
            if target <= self._cursor.mark_delete_position:
                self._conflict(f"{target.ledger_id}:{target.entry_id} is already acknowledged")

    async def _txn_ack(
        self, txn: TxnId, individual: list[Position], target: Position | None, role: str | None
    ) -> None:
        self._check(txn, individual, target)
        entry = self._txns.setdefault(txn, _AckTxn())
        if entry.joined:
            check_owner(txn, entry.owner, role)
        fresh = [p for p in individual if p not in entry.individual]
        previous = entry.cumulative
        if target is not None and previous is not None and target <= previous:
            return  # already pending in this transaction
        if target is None and not fresh:
            return
        # Reserve before the first await, so a concurrent ack sees these as taken.
        for pos in fresh:
            self._held[pos] = txn
            entry.individual.add(pos)
        if target is not None:
            entry.cumulative = target
            self._cumulative = (txn, target)
        entry.writing += 1
        try:
            await self._join(txn, entry)
            check_owner(txn, entry.owner, role)
            if entry.records >= limits.TXN_OP_RECORDS_MAX:
                raise TransactionTooLarge(f"transaction {txn} has too many op records")
            op = records.TxnOp(
                records.OpKind.ACK,
                self._topic,
                subscription=self._subscription,
                positions=tuple(fresh) if target is None else (target,),
                cumulative=target is not None,
            )
            seq = await write_op(
                self._store,
                txn,
                op,
                lambda s: records.acks_index_path(self._topic, self._subscription, txn, s),
                next_seq=entry.next_seq,
                fence=self._fence,
            )
        except BaseException:
            self._release(txn, entry, fresh, target, previous)
            raise
        finally:
            entry.writing -= 1
            self._work.wake()
        self.op_writes += 1
        entry.seqs.append(seq)
        entry.next_seq = seq + 1
        entry.records += 1

    def _release(
        self,
        txn: TxnId,
        entry: _AckTxn,
        fresh: list[Position],
        target: Position | None,
        previous: Position | None,
    ) -> None:
        """Undo a reservation whose op record was not written."""
        for pos in fresh:
            entry.individual.discard(pos)
            self._held.pop(pos, None)
        if target is not None and entry.cumulative == target:
            entry.cumulative = previous
            self._cumulative = (txn, previous) if previous is not None else None
        unused = not entry.seqs and not entry.individual and entry.cumulative is None
        if unused and entry.writing <= 1 and self._txns.get(txn) is entry:
            del self._txns[txn]
            self._outcomes.unregister(txn, self)

    async def _join(self, txn: TxnId, entry: _AckTxn) -> None:
        """Read the header once per transaction (concurrent acks share the read)."""
        if entry.joined:
            return
        joining = self._joining.get(txn)
        if joining is None:
            joining = asyncio.get_running_loop().create_future()
            self._joining[txn] = joining
            try:
                header, entry.records, entry.next_seq = await join_and_count(
                    self._store, txn, self._clock.wall_ms()
                )
                entry.owner = header.owner
                # Registered before any guarded write: see MetadataTransactionBuffer._join.
                self._outcomes.register(txn, self)
                entry.joined = True
                joining.set_result(None)
            except BaseException as err:
                joining.set_exception(err)
                joining.exception()
            finally:
                del self._joining[txn]
        await asyncio.shield(joining)

    # --- outcomes -------------------------------------------------------------------------

    def on_outcome(
        self, txn: TxnId, state: TxnState, winners: frozenset[str] | None = None
    ) -> None:
        """Schedule ``txn``'s outcome (applied once none of its acks is being written).
        Acks are not branched: ``winners`` does not concern them."""
        if not state.final or self._closed:
            return
        self._finished[txn] = state
        self._finished.move_to_end(txn)
        while len(self._finished) > limits.TXN_FINISHED_REMEMBERED_MAX:
            self._finished.popitem(last=False)
        if txn in self._txns:
            self._work.submit(txn, state)

    async def _apply(self, txn: TxnId, state: TxnState) -> bool:
        entry = self._txns.get(txn)
        if entry is None:
            self._outcomes.unregister(txn, self)
            return True
        if entry.writing:
            return False
        if not entry.applied:
            if state is TxnState.COMMITTED:
                await self._commit(txn, entry)
            else:
                self._drop(txn, entry)
                self.aborted += 1
                self._call(self._on_aborted, entry)
            entry.applied = True
        if state is TxnState.COMMITTED:
            await self._cursor.flush()
        paths: list[str] = []
        for seq in entry.seqs:
            paths.append(records.op_path(txn, seq))
            paths.append(records.acks_index_path(self._topic, self._subscription, txn, seq))
        await delete_ops(self._store, txn, paths, fence=self._fence)
        del self._txns[txn]
        self._outcomes.unregister(txn, self)
        return True

    async def _commit(self, txn: TxnId, entry: _AckTxn) -> None:
        if entry.individual:
            await self._cursor.acknowledge(sorted(entry.individual))
        if entry.cumulative is not None and entry.cumulative > self._cursor.mark_delete_position:
            await self._cursor.acknowledge_cumulative(entry.cumulative)
        self._drop(txn, entry)  # only now: until the cursor has them they stay pending
        self.committed += 1
        self._call(self._on_committed, entry)

    def _drop(self, txn: TxnId, entry: _AckTxn) -> None:
        for pos in entry.individual:
            if self._held.get(pos) == txn:
                del self._held[pos]
        if self._cumulative is not None and self._cumulative[0] == txn:
            self._cumulative = None

    def _call(self, callback: AckCallback, entry: _AckTxn) -> None:
        try:
            callback(sorted(entry.individual), entry.cumulative)
        except Exception:
            log.exception("%s %s: ack callback failed", self._topic, self._subscription)

    # --- recovery -------------------------------------------------------------------------

    async def recover(self) -> None:
        """Rebuild pending acks from the subscription's ACK op records (before serving)."""
        prefix = records.acks_index_prefix(self._topic, self._subscription)
        start_after: str | None = None
        while True:
            page = await self._store.list_prefix(prefix, start_after=start_after)
            for key in page.records:
                txn, seq = records.parse_op_name(key.path[len(prefix) :])
                record = await self._store.get(records.op_path(txn, seq))
                if record is None:  # an orphan index key: its op record is gone
                    await commit_fenced(self._store, [Delete(key.path)], self._fence)
                    continue
                self._restore(txn, seq, records.decode_op(record.value))
            if not page.more or not page.records:
                break
            start_after = page.records[-1].path
        txns = list(self._txns)
        got = await asyncio.gather(*(self._store.get(records.header_path(t)) for t in txns))
        for txn, header in zip(txns, got, strict=True):
            state = records.decode_header(header.value).state if header else TxnState.ABORTED
            self._txns[txn].joined = header is not None
            if state is TxnState.OPEN:
                self._outcomes.register(txn, self)
            else:
                self.on_outcome(txn, state)

    def _restore(self, txn: TxnId, seq: int, op: records.TxnOp) -> None:
        entry = self._txns.setdefault(txn, _AckTxn())
        entry.seqs.append(seq)
        entry.next_seq = max(entry.next_seq, seq + 1)
        entry.records += 1
        if op.cumulative and op.positions:
            target = max(op.positions)
            entry.cumulative = max(entry.cumulative or target, target)
            self._cumulative = (txn, entry.cumulative)
            return
        for pos in op.positions:
            entry.individual.add(pos)
            self._held.setdefault(pos, txn)

    # --- the rest -------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """Like upstream's TransactionPendingAckStats (admin ``pending-ack-stats``)."""
        cumulative = self._cumulative
        return {
            "state": "Closed" if self._closed else "Ready",
            "ongoingTxnSize": len(self._txns),
            "pendingPositions": len(self._held),
            "cumulativeAckOf": str(cumulative[0]) if cumulative else None,
            "cumulativeAckPosition": (
                f"{cumulative[1].ledger_id}:{cumulative[1].entry_id}" if cumulative else None
            ),
            "outcomesPending": self._work.pending,
            "opWrites": self.op_writes,
            "committed": self.committed,
            "aborted": self.aborted,
            "conflicts": self.conflicts,
        }

    async def wait_applied(self) -> None:
        """Return once every outcome delivered so far is applied and durable."""
        await self._work.wait_idle()

    async def close(self) -> None:
        """Stop listening; try once more to finish pending outcome work. Idempotent."""
        if self._closed:
            return
        self._closed = True
        await self._work.close()
        for txn in list(self._txns):
            self._outcomes.unregister(txn, self)
