"""A topic's transaction buffer with its state in the metadata store (PIP-473).

Writes: the first time the topic sees a transaction it writes one WRITE op record
(``first_after`` = the ledger's last confirmed position then; index key
``writes_index_path``) guarded by the header being OPEN, *before* the first ledger
append, so a ledger entry never exists without its op record. Every entry of the
transaction is stamped with its TxnID (``entry_stamp``); positions are kept in memory.

Reads: :class:`~anabranch.core.txn_buffer_state.TxnBufferState` decides
``max_read_position`` and ``is_aborted``.

Outcomes (via :class:`~anabranch.transactions.outcomes.TxnOutcomes`): applied in memory
at once, ``on_change`` is called, then in the background the op record goes (COMMITTED)
or is replaced by the topic's aborted record holding the positions (ABORTED), written
only when no append of the transaction is in flight. A COMMIT decided by this broker's
coordinator deletes the op records in its own CAS (``commit_cleanup``): nothing is left
to write then, and a crash right after that CAS recovers the entries as committed.

Branches (batch transactions): each entry's branch is read from its ``__txn_branch``
property when it is appended (and by the recovery scan); a commit naming ``winners``
aborts the other entries of the transaction, which go to the aborted record like an
aborted transaction's (so they stay filtered after a restart).

Recovery (before serving): the topic's WRITE op records are listed; OPEN transactions
are pinned at ``first_after`` and the ledger after it is scanned for their stamped
entries; COMMITTED (or unknown: upstream reads unknown as committed) ones lose their op
records; ABORTED ones get their aborted record from the same scan; aborted records are
loaded.

In a cluster each of these writes carries ``fence``, this broker's claim on the topic
(``metadata/ownership_fence.py``): once another broker owns it, they fail with NotOwner.

Example:
    >>> import asyncio
    >>> from anabranch.clock import SystemClock
    >>> from anabranch.metadata.memory import MemoryMetadataStore
    >>> from anabranch.protocol.frames import encode_entry
    >>> from anabranch.protocol._generated import pulsar_api_pb2 as pb
    >>> from anabranch.storage.memory import MemoryManagedLedgerFactory
    >>> async def demo() -> None:
    ...     store, clock = MemoryMetadataStore(), SystemClock()
    ...     txn = TxnId(0, 1)
    ...     header = records.TxnHeader(TxnState.OPEN, clock.wall_ms(), timeout_ms=60_000)
    ...     await store.put(records.header_path(txn), records.encode_header(header))
    ...     outcomes = TxnOutcomes(store, clock)
    ...     ml = await MemoryManagedLedgerFactory().open("t")
    ...     buf = MetadataTransactionBuffer("t", ml, store, outcomes, clock, on_change=lambda: None)
    ...     await buf.recover()
    ...     md = pb.MessageMetadata(producer_name="p", sequence_id=0, publish_time=0)
    ...     pos = await buf.append(txn, encode_entry(md, b"x"))
    ...     assert buf.max_read_position() < pos            # open: not readable
    ...     outcomes.wake(txn, TxnState.COMMITTED)
    ...     assert buf.max_read_position() == pos           # committed: readable
    ...     await buf.close()
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
from anabranch.core.txn_buffer_state import TxnBufferState
from anabranch.errors import TransactionConflict, TransactionTooLarge
from anabranch.metadata.api import MUST_NOT_EXIST, Delete, MetadataStore, Op, Put
from anabranch.metadata.ownership_fence import OwnershipFence, commit_fenced
from anabranch.storage.api import ManagedLedger, Position
from anabranch.transactions import records
from anabranch.transactions.entry_stamp import entry_txn_branch, stamp_txn_branch
from anabranch.transactions.ids import TxnId
from anabranch.transactions.op_records import (
    OutcomeWork,
    check_joinable,
    check_owner,
    delete_ops,
    join_and_count,
    op_count,
    write_op,
)
from anabranch.transactions.outcomes import TxnOutcomes
from anabranch.transactions.records import TxnState

log = logging.getLogger(__name__)

_SCAN_BATCH = 500
"""Entries read per ledger read while recovering (bounded memory per read)."""


@dataclass(slots=True)
class _Participant:
    """This topic's part in one transaction."""

    seqs: list[int] = field(default_factory=list)
    """Sequence numbers of this topic's op records of the transaction."""
    entries: int = 0
    cleaned: bool = False
    """The COMMIT's own CAS deleted the op records (this broker's coordinator)."""
    offered: bool = False
    """Those deletions ride on a COMMIT's CAS whose result is not known yet."""
    owner: str | None = None
    """The role that opened the transaction (None: authentication was off)."""


class MetadataTransactionBuffer:
    """Implements ``TransactionBuffer`` and ``OutcomeListener`` for one topic."""

    def __init__(
        self,
        topic: str,
        ledger: ManagedLedger,
        store: MetadataStore,
        outcomes: TxnOutcomes,
        clock: Clock,
        *,
        on_change: Callable[[], None],
        fence: OwnershipFence | None = None,
    ) -> None:
        self._topic = topic
        self._ledger = ledger
        self._store = store
        self._fence = fence
        self._outcomes = outcomes
        self._clock = clock
        self._on_change = on_change
        self._state = TxnBufferState()
        self._participants: dict[TxnId, _Participant] = {}
        self._joining: dict[TxnId, asyncio.Future[_Participant]] = {}
        self._finished: OrderedDict[TxnId, TxnState] = OrderedDict()
        self._work = OutcomeWork(clock, self._persist, f"buffer {topic}")
        self._last_max = ledger.last_confirmed
        self._closed = False
        self.op_writes = 0
        """WRITE op records written (metrics)."""
        self.op_deletes = 0
        """Transactions whose op records were removed after their outcome (metrics)."""
        self.aborted_writes = 0
        """Aborted records written (metrics)."""
        self.committed = 0
        """Commit outcomes applied (metrics)."""
        self.aborted = 0
        """Abort outcomes applied (metrics)."""
        self.conflicts = 0
        """Appends refused because the transaction had ended (metrics)."""
        self.recovered_open = 0
        """Transactions found OPEN by the last recovery (metrics)."""

    # --- TransactionBuffer ----------------------------------------------------------------

    def open_count(self) -> int:
        return len(self._participants) + len(self._joining)

    def max_read_position(self) -> Position:
        return Position(*self._state.max_read_position(self._ledger.last_confirmed))

    def is_aborted(self, position: Position) -> bool:
        return self._state.is_aborted(position)

    async def append(self, txn_id: TxnId | None, data: bytes) -> Position:
        """Append ``data``; in ``txn_id`` when given (its op record first)."""
        if txn_id is None:
            return await self._ledger.append(data)
        return (await self.append_many(txn_id, [data]))[0]

    async def append_many(self, txn_id: TxnId, entries: Sequence[bytes]) -> list[Position]:
        """Append ``entries`` of ``txn_id`` in order with one group commit (a pipelining
        producer's sends of one transaction arrive together)."""
        participant = await self._participant(txn_id)
        self._refuse_if_finished(txn_id)
        if participant.entries + len(entries) > limits.TXN_ENTRIES_PER_PARTICIPANT_MAX:
            raise TransactionTooLarge(
                f"transaction {txn_id} has {participant.entries} entries on {self._topic}"
            )
        stamped = [stamp_txn_branch(data, txn_id) for data in entries]
        participant.entries += len(entries)
        lac = self._ledger.last_confirmed
        tokens = [self._state.begin_append(txn_id, lac, branch) for _, branch in stamped]
        try:
            positions = await self._ledger.append_many([data for data, _ in stamped])
        except BaseException:
            for token in tokens:
                self._state.fail_append(token)
            participant.entries -= len(entries)
            self._after_append()
            raise
        for token, position in zip(tokens, positions, strict=True):
            self._state.end_append(token, position)
        self._after_append()
        return list(positions)

    async def prepare(self, txn_id: TxnId, role: str | None = None) -> None:
        """Join ``txn_id`` now (its op record), ahead of its first append (a producer's
        ADD_PARTITION_TO_TXN); raises as that append would (not found, conflict, too
        large), and TransactionNotFound when ``role`` may not write in it (``check_owner``;
        None: no check)."""
        if role is not None and txn_id not in self._participants:
            await self._check_owner_first(txn_id, role)
        participant = await self._participant(txn_id)
        check_owner(txn_id, participant.owner, role)

    async def _check_owner_first(self, txn: TxnId, role: str) -> None:
        """Ownership judged before this topic's op record is written: a role that may not
        write in ``txn`` must not add its topics to it (it could fill another role's
        transaction up to TXN_OP_RECORDS_MAX, or name its topics there). Checked here,
        not in the join that concurrent first appends share, so that a refused role
        cannot fail the owner's join."""
        header = self._outcomes.local_header(txn)
        if header is None:
            record = await self._store.get(records.header_path(txn))
            if record is None:
                return  # the join answers TransactionNotFound
            header = records.decode_header(record.value)
        check_owner(txn, header.owner, role)

    def _refuse_if_finished(self, txn: TxnId) -> None:
        state = self._finished.get(txn)
        if state is not None:
            self.conflicts += 1
            raise TransactionConflict(f"transaction {txn} is already {state.value}")

    def _after_append(self) -> None:
        self._changed()
        self._work.wake()  # an outcome may have waited for this append to end

    async def _participant(self, txn: TxnId) -> _Participant:
        """This topic's part in ``txn``, joining it (one op record) the first time;
        concurrent first appends share one join."""
        self._refuse_if_finished(txn)
        known = self._participants.get(txn)
        if known is not None:
            return known
        joining = self._joining.get(txn)
        if joining is None:
            joining = asyncio.get_running_loop().create_future()
            self._joining[txn] = joining
            try:
                joining.set_result(await self._join(txn))
            except BaseException as err:
                joining.set_exception(err)
                joining.exception()  # retrieved: waiters get it too, nobody else must
            finally:
                del self._joining[txn]
        return await asyncio.shield(joining)

    async def _join(self, txn: TxnId) -> _Participant:
        # A transaction this broker created is judged from its header in memory and
        # takes a guessed sequence number: no read before the guarded write, which
        # still checks the stored header (and lists after a sequence collision).
        known = self._outcomes.local_header(txn)
        next_seq = -1
        if known is None:
            known, _, next_seq = await join_and_count(self._store, txn, self._clock.wall_ms())
        else:
            check_joinable(txn, known, self._clock.wall_ms())
        # Registered before the guarded write: an outcome decided after it can only be
        # seen by a listener that was already there.
        self._outcomes.register(txn, self)
        if next_seq < 0:
            next_seq = self._outcomes.seq_hint(txn)
            if next_seq >= limits.TXN_OP_RECORDS_MAX:
                try:  # near the limit: count exactly (TransactionTooLarge at it)
                    _, next_seq = await op_count(self._store, txn)
                except BaseException:
                    self._outcomes.unregister(txn, self)
                    raise
        op = records.TxnOp(
            records.OpKind.WRITE, self._topic, first_after=self._ledger.last_confirmed
        )
        try:
            seq = await write_op(
                self._store,
                txn,
                op,
                lambda s: records.writes_index_path(self._topic, txn, s),
                next_seq=next_seq,
                fence=self._fence,
            )
        except BaseException:
            self._outcomes.unregister(txn, self)
            self._work.wake()
            raise
        self.op_writes += 1
        participant = self._participants[txn] = _Participant([seq], owner=known.owner)
        if txn not in self._finished:  # an outcome can arrive while the write returns
            self._state.open_txn(txn)
        self._work.wake()  # an outcome delivered during the write can be persisted now
        return participant

    # --- outcomes -------------------------------------------------------------------------

    def on_outcome(
        self, txn: TxnId, state: TxnState, winners: frozenset[str] | None = None
    ) -> None:
        """Apply ``txn``'s outcome in memory now; persist it in the background."""
        if not state.final or self._closed:
            return
        self._remember(txn, state)
        committed = state is TxnState.COMMITTED
        if self._state.apply_outcome(txn, committed=committed, winners=winners):
            if committed:
                self.committed += 1
            else:
                self.aborted += 1
        # Aborted positions are skipped by dispatchers already past them: tell them.
        self._changed(force=not committed or winners is not None)
        self._work.submit(txn, state)

    def commit_cleanup(self, txn: TxnId) -> list[Op]:
        """The op records and index keys a plain COMMIT of ``txn`` may delete with its
        CAS: a committed entry is read as any other once they are gone, so nothing else
        is left to persist here (an abort must record positions first: not offered)."""
        participant = self._participants.get(txn)
        if participant is None or txn in self._joining:
            return []
        participant.offered = True
        return [Delete(path) for path in self._op_paths(txn, participant)]

    def cleanup_settled(self, txn: TxnId, landed: bool) -> None:
        participant = self._participants.get(txn)
        if participant is not None:
            participant.offered = False
            participant.cleaned = participant.cleaned or landed
        self._work.wake()  # a commit learnt from the watch may have waited for this

    def _remember(self, txn: TxnId, state: TxnState) -> None:
        self._finished[txn] = state
        self._finished.move_to_end(txn)
        while len(self._finished) > limits.TXN_FINISHED_REMEMBERED_MAX:
            self._finished.popitem(last=False)

    async def _persist(self, txn: TxnId, state: TxnState) -> bool:
        """The durable half of an outcome; False while an append or join is in flight."""
        if self._state.in_flight(txn) or txn in self._joining:
            return False
        participant = self._participants.get(txn)
        if participant is None:
            self._outcomes.unregister(txn, self)
            return True  # nothing written here (the join failed, or already cleaned)
        if participant.offered and state is TxnState.COMMITTED:
            return False  # the COMMIT's CAS may be deleting them: its answer decides
        if not (participant.cleaned and state is TxnState.COMMITTED):
            first: list[Op] = []
            # ABORTED, or COMMITTED with winners: the entries of losing branches.
            positions = {Position(*p) for p in self._state.aborted_positions(txn)}
            if positions:
                first.append(await self._aborted_record_put(txn, positions))
            await delete_ops(self._store, txn, self._op_paths(txn, participant), first, self._fence)
            self.aborted_writes += bool(first)
        self.op_deletes += 1
        del self._participants[txn]
        self._outcomes.unregister(txn, self)
        return True

    async def _aborted_record_put(self, txn: TxnId, positions: set[Position]) -> Put:
        """The write of ``txn``'s aborted record holding ``positions`` and those already
        recorded, guarded by the version read. Another owner of the topic may have written
        it: a new one while this broker was paused, which took later entries of the
        transaction, and then this one, late (its work runs when it resumes, before it
        learns it lost the topic). A plain put would shrink the record to what this one
        knew, and the new owner's entries would be read as committed after the next load.
        An aborted entry stays aborted: the union is always right."""
        path = records.aborted_path(self._topic, txn)
        existing = await self._store.get(path)
        version = MUST_NOT_EXIST
        if existing is not None:
            positions |= set(records.decode_aborted(existing.value).positions)
            version = existing.stat.version
        value = records.encode_aborted(records.AbortedRecord(tuple(sorted(positions))))
        return Put(path, value, expected_version=version)

    def _op_paths(self, txn: TxnId, participant: _Participant) -> list[str]:
        """This topic's op records of ``txn`` and their index keys."""
        paths: list[str] = []
        for seq in participant.seqs:
            paths += [records.op_path(txn, seq), records.writes_index_path(self._topic, txn, seq)]
        return paths

    def _changed(self, *, force: bool = False) -> None:
        current = self.max_read_position()
        if force or current != self._last_max:
            self._last_max = current
            try:
                self._on_change()
            except Exception:
                log.exception("%s: on_change failed", self._topic)

    # --- recovery -------------------------------------------------------------------------

    async def recover(self) -> None:
        """Rebuild the state from the metadata store and the ledger (before serving)."""
        ops = await self._list_write_ops()
        headers = await self._headers(list(ops))
        await self._load_aborted_records()
        scan: dict[TxnId, Position] = {}
        for txn, (seqs, first_after) in ops.items():
            header = headers.get(txn)
            self._participants[txn] = _Participant(seqs)
            state = TxnState.COMMITTED if header is None else header.state
            if state is TxnState.COMMITTED and (header is None or header.winners is None):
                self._remember(txn, state)
                self._work.submit(txn, state)
                continue
            scan[txn] = first_after
            if state is TxnState.OPEN:
                self._state.recover_unfinished(txn, first_after)
                self._outcomes.register(txn, self)
        self.recovered_open = sum(1 for t in scan if self._state.is_ongoing(t))
        if scan:
            await self._scan(scan, headers)
        self._last_max = self.max_read_position()

    async def _list_write_ops(self) -> dict[TxnId, tuple[list[int], Position]]:
        """``txn → (op seqs, smallest first_after)`` of this topic's WRITE op records."""
        found: dict[TxnId, tuple[list[int], Position]] = {}
        prefix = records.writes_index_prefix(self._topic)
        start_after: str | None = None
        while True:
            page = await self._store.list_prefix(prefix, start_after=start_after)
            for key in page.records:
                txn, seq = records.parse_op_name(key.path[len(prefix) :])
                record = await self._store.get(records.op_path(txn, seq))
                if record is None:  # an orphan index key: its op record is gone
                    await commit_fenced(self._store, [Delete(key.path)], self._fence)
                    continue
                op = records.decode_op(record.value)
                first = op.first_after if op.first_after is not None else Position(-1, -1)
                seqs, earliest = found.get(txn, ([], first))
                seqs.append(seq)
                found[txn] = (seqs, min(earliest, first))
            if not page.more or not page.records:
                return found
            start_after = page.records[-1].path

    async def _headers(self, txns: list[TxnId]) -> dict[TxnId, records.TxnHeader]:
        got = await asyncio.gather(*(self._store.get(records.header_path(t)) for t in txns))
        return {t: records.decode_header(r.value) for t, r in zip(txns, got, strict=True) if r}

    async def _load_aborted_records(self) -> None:
        prefix = records.aborted_prefix(self._topic)
        start_after: str | None = None
        while True:
            page = await self._store.list_prefix(prefix, start_after=start_after)
            for record in page.records:
                txn = records.index_txn(record.path)
                positions = records.decode_aborted(record.value).positions
                self._state.load_aborted(txn, positions)
                self._remember(txn, TxnState.ABORTED)
            if not page.more or not page.records:
                return
            start_after = page.records[-1].path

    async def _scan(
        self, txns: dict[TxnId, Position], headers: dict[TxnId, records.TxnHeader]
    ) -> None:
        """Find the stamped entries of open and aborted ``txns`` after their first_after."""
        start = min(txns.values())
        lac = self._ledger.last_confirmed
        # Aborted, and committed with winners (their losers), must be found in full.
        aborted = {t for t, h in headers.items() if t in txns and h.state.final}
        found: dict[TxnId, list[tuple[Position, str | None]]] = {t: [] for t in txns}
        read = 0
        position = start.next()
        complete = True
        while position <= lac:
            if read >= limits.TXN_RECOVERY_SCAN_ENTRIES_MAX and not aborted:
                complete = False
                break
            entries = await self._ledger.read(position, _SCAN_BATCH)
            if not entries:
                break
            for entry in entries:
                if entry.position > lac:
                    break
                txn, branch = entry_txn_branch(entry.data)
                if txn is not None and txn in found and entry.position > txns[txn]:
                    found[txn].append((entry.position, branch))
            read += len(entries)
            position = entries[-1].position.next()
        for txn, positions in found.items():
            if txn in aborted:
                header = headers[txn]
                losers = [pos for pos, branch in positions if not header.committed(branch)]
                self._state.load_aborted(txn, losers)
                self._remember(txn, header.state)
                self._work.submit(txn, header.state)
                continue
            for pos, branch in positions:
                self._state.found(txn, pos, branch)
            self._participants[txn].entries = len(positions)
            if complete:
                self._state.end_scan(txn)

    # --- the rest -------------------------------------------------------------------------

    async def prune_trimmed(self, first_valid: Position) -> int:
        """Forget aborted transactions whose every entry lies before ``first_valid`` (the
        ledger trimmed them) and delete their aborted records; returns how many."""
        gone = self._state.prune_aborted(first_valid)
        for txn in gone:
            path = records.aborted_path(self._topic, TxnId(*txn))
            await commit_fenced(self._store, [Delete(path)], self._fence)
        return len(gone)

    def stats(self) -> dict[str, Any]:
        """Like upstream's TransactionBufferStats (admin ``transaction-buffer-stats``)."""
        max_read = self.max_read_position()
        lac = self._ledger.last_confirmed
        return {
            "state": "Closed" if self._closed else "Ready",
            "maxReadPosition": f"{max_read.ledger_id}:{max_read.entry_id}",
            "lastConfirmed": f"{lac.ledger_id}:{lac.entry_id}",
            "ongoingTxnSize": self._state.open_count,
            "abortedTxnCount": self._state.aborted_txn_count,
            "recoveredOpen": self._state.recovered_count,
            "appendsInFlight": self._state.in_flight_count,
            "outcomesPending": self._work.pending,
            "opWrites": self.op_writes,
            "opDeletes": self.op_deletes,
            "committed": self.committed,
            "aborted": self.aborted,
            "conflicts": self.conflicts,
        }

    async def wait_persisted(self) -> None:
        """Return once every applied outcome is durable (tests, graceful shutdown)."""
        await self._work.wait_idle()

    async def close(self) -> None:
        """Stop listening; try once more to persist what is pending (recovery redoes the
        rest). Idempotent."""
        if self._closed:
            return
        self._closed = True
        await self._work.close()
        for txn in list(self._participants):
            self._outcomes.unregister(txn, self)
