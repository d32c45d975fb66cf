"""The transaction coordinator (PIP-473): every decision is one CAS in the metadata store.

There is no transaction log and nothing to replay: a transaction is its header at
``/txn/id/<txnId>`` (``records.py``), and any broker's coordinator can serve any
transaction, because each change is a compare-and-set on that header. The rules live
in :mod:`anabranch.core.txn_state`; this module reads, judges and writes.

* ``new_txn`` takes a least-bits id from a block reserved by one CAS of
  ``/txn/tc-seq/<partition>`` and creates the OPEN header (version 1) together with its
  deadline index key, in one commit.
* ``end_txn`` CASes the header from version 1 to its final state, deleting the deadline
  key and adding the final-state key in the same commit; a lost race re-reads and
  judges again. The broker learns of the outcome through ``on_final`` (its local
  wake-up of participants); other brokers' participants watch the header.
* The sweep leader (``/txn/tc/leader/sweep``) aborts transactions past their deadline
  and collects final headers once retention has passed and no op records remain.
  Leadership only avoids duplicate work: every change it makes is a CAS anyway.

Example:
    >>> import asyncio
    >>> from anabranch.clock import SystemClock
    >>> from anabranch.metadata.memory import MemoryMetadataStore
    >>> async def demo() -> TxnState:
    ...     tc = TransactionCoordinator(MemoryMetadataStore(), SystemClock(), partitions=2,
    ...                                 sweep_interval_s=0)
    ...     await tc.start()
    ...     txn = await tc.new_txn(10_000)
    ...     state = await tc.end_txn(txn, TxnState.COMMITTED)
    ...     await tc.close()
    ...     return state
    >>> asyncio.run(demo())
    <TxnState.COMMITTED: 'COMMITTED'>
"""

from __future__ import annotations

import asyncio
import bisect
import collections
import dataclasses
import heapq
import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from anabranch import limits
from anabranch.clock import Clock
from anabranch.core.txn_state import (
    FINAL_VERSION,
    OPEN_VERSION,
    EndVerdict,
    IdBlock,
    JoinVerdict,
    clamp_timeout,
    finalized,
    judge_end,
    judge_join,
    reserve_block,
    target_state,
)
from anabranch.errors import (
    BadVersion,
    InvalidArgument,
    InvalidTxnStatus,
    MetadataUnavailable,
    ResourceLimitReached,
    SessionExpired,
    TransactionConflict,
    TransactionCoordinatorNotFound,
    TransactionNotFound,
)
from anabranch.metadata.api import MUST_NOT_EXIST, Delete, MetadataStore, Op, Put, Record
from anabranch.metadata.coordination import LeaderElection, Leadership
from anabranch.supervisor import GiveUp, Supervised
from anabranch.transactions import records
from anabranch.transactions.ids import TxnId
from anabranch.transactions.records import OpKind, TxnHeader, TxnState

log = logging.getLogger(__name__)

SWEEP_LEADER_PATH = "/txn/tc/leader/sweep"
"""Election key of the broker that runs the timeout and GC sweeps."""

CAS_ATTEMPTS_MAX = limits.POLICIES_CAS_RETRIES_MAX
"""Read-judge-CAS rounds of one counter reservation or END_TXN before it gives up with
BadVersion: every lost round means another writer made progress, and after a header's
one CAS there is nothing left to race, so a handful of rounds always suffices."""

SWEEP_SESSION_TTL_S = limits.SCALABLE_SESSION_TTL_S
"""TTL of the session holding the sweep leadership: a dead leader's sweeps move to another
broker within about this long (the same bound the scalable controllers use)."""

SWEEP_RETRY_S = limits.SCALABLE_WATCH_RETRY_S
"""Pause before the sweep loop retries after a store error, so a failing store is not
hammered."""

LATENCY_BUCKETS_S = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0)
"""END_TXN latency buckets: one metadata round trip is milliseconds, a slow etcd seconds."""

FinalCallback = Callable[..., None]
"""Called as ``(txn, state)`` once a header is final, plus ``winners`` (a frozenset of
branch ids) as a third argument when a batch commit named them."""

CommitCleanup = Callable[[TxnId], tuple[Sequence[Op], Callable[[bool], None]]]
"""``txn → (ops, settle)``: deletions this broker's participants let a COMMIT's own CAS do
(their op records: a committed entry needs none), and ``settle``, called exactly once
with whether that CAS landed with them. See :meth:`TxnOutcomes.commit_cleanup`."""


# --- metrics -------------------------------------------------------------------------------


@dataclass
class LatencyHistogram:
    """Fixed-bucket latency observations, rendered as a Prometheus histogram.

    ``counts[i]`` counts observations ``<= buckets[i]`` (not cumulative); observations
    above the last bucket count only in ``count`` (the ``+Inf`` bucket).

    >>> h = LatencyHistogram()
    >>> h.observe(0.002); h.observe(9.0)
    >>> h.count, h.counts[1], round(h.sum, 3)
    (2, 1, 9.002)
    """

    buckets: tuple[float, ...] = LATENCY_BUCKETS_S
    counts: list[int] = field(default_factory=list)
    sum: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * len(self.buckets)

    def observe(self, seconds: float) -> None:
        index = bisect.bisect_left(self.buckets, seconds)
        if index < len(self.buckets):
            self.counts[index] += 1
        self.sum += seconds
        self.count += 1


@dataclass
class TxnMetrics:
    """Plain counters of one coordinator, for ``/metrics``.

    ``header_cas``: ``ok`` final CASes that landed, ``conflict`` ones that lost a race
    (re-judged), ``reject`` END_TXNs refused (unknown transaction or the other outcome).
    """

    created: int = 0
    committed: int = 0
    aborted: int = 0
    timed_out: int = 0
    header_cas: dict[str, int] = field(
        default_factory=lambda: {"ok": 0, "conflict": 0, "reject": 0}
    )
    gc_collected: int = 0
    open: int = 0
    commit_latency: LatencyHistogram = field(default_factory=LatencyHistogram)


@dataclass
class _PartitionStats:
    created: int = 0
    committed: int = 0
    aborted: int = 0
    timed_out: int = 0


# --- the coordinator -----------------------------------------------------------------------


class TransactionCoordinator:
    """NEW_TXN, END_TXN and the sweeps over one metadata store.

    ``sweep_interval_s <= 0`` runs no background sweeps (callers, e.g. tests, call
    :meth:`sweep_timeouts` / :meth:`sweep_gc` themselves); ``gc_interval_s <= 0`` runs
    only the timeout sweep.
    """

    def __init__(
        self,
        store: MetadataStore,
        clock: Clock,
        *,
        partitions: int = limits.TXN_COORDINATOR_PARTITIONS,
        owner_id: str = "",
        sweep_interval_s: float = limits.TXN_SWEEP_INTERVAL_S,
        gc_interval_s: float = limits.TXN_GC_INTERVAL_S,
        gc_retention_s: float = limits.TXN_GC_RETENTION_S,
        on_final: FinalCallback | None = None,
        on_give_up: GiveUp | None = None,
        max_open: int = limits.TXN_OPEN_PER_BROKER_MAX,
        max_open_per_owner: int = limits.TXN_OPEN_PER_ROLE_MAX,
        commit_cleanup: CommitCleanup | None = None,
    ) -> None:
        self._max_open = max_open
        self._max_open_per_owner = max_open_per_owner
        self._commit_cleanup = commit_cleanup
        if partitions < 1:
            raise InvalidArgument(f"transaction coordinator partitions must be >= 1: {partitions}")
        self._store = store
        self._clock = clock
        self._partitions = partitions
        self._owner_id = owner_id
        self._sweep_interval_s = sweep_interval_s
        self._gc_interval_s = gc_interval_s
        self._gc_retention_ms = round(gc_retention_s * 1000)
        self._on_final = on_final
        self.metrics = TxnMetrics()
        self._per_partition = [_PartitionStats() for _ in range(partitions)]
        self._blocks: dict[int, IdBlock] = {}
        self._block_locks = [asyncio.Lock() for _ in range(partitions)]
        self._round_robin = 0
        # OPEN transactions created here, for the ``open`` gauge: pruned once seen final
        # or past their deadline (then the sweep, perhaps another broker's, ends them).
        # The header as written (version 1) lets END_TXN try its CAS without reading it
        # first; a header changed meanwhile fails that CAS, which then reads and judges.
        self._open: dict[TxnId, TxnHeader] = {}
        self._open_by_owner: collections.Counter[str] = collections.Counter()
        self._open_deadlines: list[tuple[int, TxnId]] = []
        self._gc_cursor: dict[TxnState, str | None] = {}
        self._loop: Supervised | None = None
        self._on_give_up = on_give_up
        self._started = False

    @property
    def partitions(self) -> int:
        return self._partitions

    # --- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Check the persisted partition count (the first broker writes it), then start
        the sweep loop. Reads nothing else: a restart replays no transactions."""
        if self._started:
            return
        await self._check_parallelism()
        self._started = True
        if self._sweep_interval_s > 0:
            self._loop = Supervised(
                "txn-sweeps", self._sweep_leader_loop, on_give_up=self._on_give_up
            ).start()

    async def close(self) -> None:
        """Stop the sweep loop (resigning the leadership). Idempotent."""
        loop, self._loop = self._loop, None
        if loop is not None:
            await loop.stop()
        self._started = False

    async def _check_parallelism(self) -> None:
        wanted = str(self._partitions).encode()
        for _ in range(CAS_ATTEMPTS_MAX):
            record = await self._store.get(records.PARALLELISM)
            if record is None:
                try:
                    await self._store.put(records.PARALLELISM, wanted, MUST_NOT_EXIST)
                    return
                except BadVersion:
                    continue  # another broker wrote it first: compare with theirs
            persisted = int(record.value)
            if persisted != self._partitions:
                raise InvalidArgument(
                    f"transaction coordinator partitions {self._partitions} differ from the "
                    f"persisted {persisted}: every broker must use the same value"
                )
            return
        raise BadVersion(records.PARALLELISM, MUST_NOT_EXIST, -1)

    # --- NEW_TXN -------------------------------------------------------------------------------

    async def new_txn(
        self, timeout_ms: int, *, tc_id: int | None = None, owner: str | None = None
    ) -> TxnId:
        """Create an OPEN transaction; ``tc_id`` picks the partition (else round robin).

        The header and its deadline index key are written in one commit, so the timeout
        sweep sees every OPEN transaction.
        """
        now = self._clock.wall_ms()
        self._prune_open(now)
        if len(self._open) >= self._max_open:
            raise ResourceLimitReached("open transactions on this broker", self._max_open)
        if owner is not None and self._open_by_owner[owner] >= self._max_open_per_owner:
            raise ResourceLimitReached(
                f"open transactions of role {owner} on this broker", self._max_open_per_owner
            )
        partition = self._pick_partition(tc_id)
        least = await self._next_least_bits(partition)
        txn = TxnId(partition, least)
        now = self._clock.wall_ms()
        header = TxnHeader(
            state=TxnState.OPEN, created_at=now, timeout_ms=clamp_timeout(timeout_ms), owner=owner
        )
        await self._store.commit(
            [
                Put(records.header_path(txn), records.encode_header(header), MUST_NOT_EXIST),
                Put(records.deadline_index_path(header.deadline, txn), b""),
            ]
        )
        self.metrics.created += 1
        self._per_partition[partition].created += 1
        self._note_open(txn, header, now)
        return txn

    def _pick_partition(self, tc_id: int | None) -> int:
        if tc_id is None:
            partition = self._round_robin % self._partitions
            self._round_robin = partition + 1
            return partition
        if not 0 <= tc_id < self._partitions:
            raise TransactionCoordinatorNotFound(
                f"no transaction coordinator {tc_id} (there are {self._partitions})"
            )
        return tc_id

    async def _next_least_bits(self, partition: int) -> int:
        block = self._blocks.get(partition)
        taken = None if block is None else block.take()
        if taken is not None:
            return taken
        # One refill per partition at a time: concurrent NEW_TXNs share the new block
        # instead of each reserving (and mostly wasting) one.
        async with self._block_locks[partition]:
            block = self._blocks.get(partition)
            taken = None if block is None else block.take()
            if taken is None:
                block = await self._reserve_block(partition)
                self._blocks[partition] = block
                taken = block.take()
        assert taken is not None, "a fresh block is never empty"
        return taken

    async def _reserve_block(self, partition: int) -> IdBlock:
        path = records.seq_path(partition)
        for _ in range(CAS_ATTEMPTS_MAX):
            record = await self._store.get(path)
            counter = 0 if record is None else _decode_counter(record.value)
            block, after = reserve_block(counter)
            try:
                await self._store.put(
                    path,
                    _encode_counter(after),
                    MUST_NOT_EXIST if record is None else record.stat.version,
                )
            except BadVersion:
                continue  # another broker took that block: take the next one
            return block
        raise BadVersion(path, None, -1)

    # --- ADD_PARTITION / ADD_SUBSCRIPTION --------------------------------------------------

    async def check_open(self, txn: TxnId) -> TxnHeader:
        """The header of an OPEN, unexpired transaction, else TransactionNotFound (unknown)
        or TransactionConflict (final or timed out). ADD_PARTITION_TO_TXN and
        ADD_SUBSCRIPTION_TO_TXN do only this: participants register themselves."""
        header = await self.get(txn)
        verdict = judge_join(header, self._clock.wall_ms())
        if verdict is JoinVerdict.NOT_FOUND or header is None:
            raise TransactionNotFound(f"transaction {txn} not found")
        if verdict is JoinVerdict.CONFLICT:
            raise TransactionConflict(f"transaction {txn} is already {header.state.value}")
        if verdict is JoinVerdict.EXPIRED:
            raise TransactionConflict(f"transaction {txn} timed out")
        return header

    def open_header(self, txn: TxnId) -> TxnHeader | None:
        """The header of ``txn`` as this broker created it, while it is OPEN here (not
        seen final, not past its deadline); None otherwise. A hint: the store decides."""
        return self._open.get(txn)

    async def get(self, txn: TxnId) -> TxnHeader | None:
        """The transaction's header, or None (never created, or collected)."""
        record = await self._store.get(records.header_path(txn))
        return None if record is None else records.decode_header(record.value)

    # --- END_TXN -------------------------------------------------------------------------------

    async def end_txn(
        self,
        txn: TxnId,
        state: TxnState,
        *,
        winners: frozenset[str] | None = None,
        also: Sequence[Op] = (),
    ) -> TxnState:
        """Commit or abort ``txn``; returns ``state`` once the header says so.

        ``winners`` (a batch commit) commits only the entries of those branches; the header
        keeps them, so every participant aborts the other entries. Committing again with
        other winners is InvalidTxnStatus (the first decision stands). ``also`` goes into
        the same commit as the header's CAS (a batch record marks itself committed); when
        one of its conditions fails, that BadVersion is raised and nothing changed.

        Asking again for the outcome it already has succeeds (and wakes participants
        again); the other outcome is InvalidTxnStatus; an unknown transaction is
        TransactionNotFound; a COMMIT past the deadline aborts it and raises
        InvalidTxnStatus.
        """
        if winners is not None:
            _check_winners(state, winners)
        return await self._end(txn, state, by_timeout=False, winners=winners, also=also)

    async def _end(
        self,
        txn: TxnId,
        state: TxnState,
        *,
        by_timeout: bool,
        winners: frozenset[str] | None = None,
        also: Sequence[Op] = (),
    ) -> TxnState:
        started = self._clock.monotonic()
        # First try: the header as this broker created it, if it did (no read).
        header: TxnHeader | None = self._open.get(txn)
        for _ in range(CAS_ATTEMPTS_MAX):
            if header is None:
                record = await self._store.get(records.header_path(txn))
                header = None if record is None else records.decode_header(record.value)
            now = self._clock.wall_ms()
            verdict = judge_end(header, state, now)
            if verdict is EndVerdict.ALREADY:
                assert header is not None
                self._forget_open(txn)
                if winners is not None and header.winners != winners:
                    self.metrics.header_cas["reject"] += 1
                    raise InvalidTxnStatus(
                        f"transaction {txn} is already committed with other winners"
                    )
                self._notify(txn, state, header.winners)
                return state
            if header is None:
                self.metrics.header_cas["reject"] += 1
                raise TransactionNotFound(f"transaction {txn} not found")
            if verdict is EndVerdict.INVALID_STATUS:
                self._forget_open(txn)
                self.metrics.header_cas["reject"] += 1
                raise InvalidTxnStatus(
                    f"transaction {txn} is already {header.state.value}, cannot be {state.value}"
                )
            target = target_state(verdict, state)
            timed_out = by_timeout or verdict is EndVerdict.EXPIRED
            chosen = winners if target is TxnState.COMMITTED else None
            if not await self._finalize(
                txn,
                header,
                target,
                now,
                timed_out=timed_out,
                winners=chosen,
                also=also if target is state else (),
            ):
                header = None
                continue  # raced the sweep or another broker: judge the new header
            if target is TxnState.COMMITTED:
                self.metrics.commit_latency.observe(self._clock.monotonic() - started)
            if verdict is EndVerdict.EXPIRED:
                raise InvalidTxnStatus(f"transaction {txn} timed out and was aborted")
            return state
        raise BadVersion(records.header_path(txn), OPEN_VERSION, -1)

    async def _finalize(
        self,
        txn: TxnId,
        header: TxnHeader,
        state: TxnState,
        now: int,
        *,
        timed_out: bool,
        winners: frozenset[str] | None = None,
        also: Sequence[Op] = (),
    ) -> bool:
        """The one CAS of an OPEN header to ``state`` (with ``also``); False when it lost
        a race on the header."""
        final = dataclasses.replace(finalized(header, state, now), winners=winners)
        ops: list[Op] = [
            Put(records.header_path(txn), records.encode_header(final), OPEN_VERSION),
            Delete(records.deadline_index_path(header.deadline, txn)),
            Put(records.final_index_path(state, now, txn), b""),
            *also,
        ]
        settle: Callable[[bool], None] | None = None
        if state is TxnState.COMMITTED and winners is None and self._commit_cleanup is not None:
            # One metadata write less per participant on this broker: its op records go
            # with the decision instead of in a commit of their own afterwards.
            cleanup, settle = self._commit_cleanup(txn)
            if cleanup and len(ops) + len(cleanup) <= limits.METADATA_TXN_OPS_MAX:
                ops += cleanup
            else:
                settle(False)
                settle = None
        landed = False
        try:
            await self._store.commit(ops)
            landed = True
        except BadVersion as err:
            if also and err.path != records.header_path(txn):
                raise  # the caller's own condition failed
            self.metrics.header_cas["conflict"] += 1
            return False
        finally:
            if settle is not None:
                settle(landed)
        self.metrics.header_cas["ok"] += 1
        self._count_final(txn, state, timed_out=timed_out)
        self._forget_open(txn)
        self._notify(txn, state, winners)
        return True

    def _count_final(self, txn: TxnId, state: TxnState, *, timed_out: bool) -> None:
        stats = self._per_partition[txn.most_bits] if txn.most_bits < self._partitions else None
        if state is TxnState.COMMITTED:
            self.metrics.committed += 1
            if stats is not None:
                stats.committed += 1
        else:
            self.metrics.aborted += 1
            if stats is not None:
                stats.aborted += 1
        if timed_out:
            self.metrics.timed_out += 1
            if stats is not None:
                stats.timed_out += 1

    def _notify(self, txn: TxnId, state: TxnState, winners: frozenset[str] | None = None) -> None:
        if self._on_final is None:
            return
        try:
            if winners is None:
                self._on_final(txn, state)
            else:
                self._on_final(txn, state, winners)
        except Exception:
            # The outcome is durable already and participants also watch the header;
            # a failing local wake-up must not turn a successful END_TXN into an error.
            log.exception("on_final(%s, %s) failed", txn, state.value)

    # --- sweeps --------------------------------------------------------------------------------

    async def sweep_timeouts(self) -> int:
        """Abort OPEN transactions past their deadline (at most ``TXN_SWEEP_BATCH`` per
        pass); returns how many this pass aborted. Races with END_TXN are harmless: the
        loser of the header CAS re-judges."""
        now = self._clock.wall_ms()
        # Expired means now > deadline (core.txn_state.is_expired): deadlines <= now - 1.
        page = await self._store.list_range(
            records.IDX_DEADLINE, records.deadline_index_end(now - 1), limit=limits.TXN_SWEEP_BATCH
        )
        aborted = 0
        for entry in page.records:
            aborted += await self._expire(entry)
        return aborted

    async def _expire(self, entry: Record) -> int:
        txn = records.index_txn(entry.path)
        before = self.metrics.timed_out
        try:
            await self._end(txn, TxnState.ABORTED, by_timeout=True)
        except TransactionNotFound:
            # An index key without its header cannot come from our commits; drop it so
            # the sweep does not trip over it forever.
            await self._store.delete(entry.path)
        except InvalidTxnStatus:
            pass  # committed between our listing and our read: not expired after all
        return self.metrics.timed_out - before

    async def sweep_gc(self) -> int:
        """Collect final transactions finalized more than the retention ago: delete the
        header and its index key when no op records remain; otherwise wake participants
        again (they re-apply and delete theirs) and keep it. Returns headers deleted.

        A pass goes page after page (up to ``TXN_GC_PASS_MAX`` per outcome) and deletes
        in multi-op commits: one page per pass and one commit per header would collect
        about 17 transactions a second, and any steadier rate would grow the store.
        """
        cutoff = self._clock.wall_ms() - self._gc_retention_ms
        collected = 0
        for state in (TxnState.COMMITTED, TxnState.ABORTED):
            examined = 0
            while examined < limits.TXN_GC_PASS_MAX:
                page = await self._gc_page(state, cutoff)
                collected += await self._collect_page(page, state)
                examined += len(page)
                if self._gc_cursor.get(state) is None:
                    break  # the last page: the next pass starts over
        self.metrics.gc_collected += collected
        return collected

    async def _gc_page(self, state: TxnState, cutoff: int) -> Sequence[Record]:
        # A cursor per state: headers kept for their op records would otherwise fill
        # every page and starve the ones behind them.
        start, end = records.final_index_range(state, cutoff)
        cursor = self._gc_cursor.get(state)
        page = await self._store.list_range(
            start if cursor is None or cursor >= end else cursor, end, limit=limits.TXN_SWEEP_BATCH
        )
        self._gc_cursor[state] = page.records[-1].path + "\x00" if page.more else None
        return page.records

    async def _collect_page(self, entries: Sequence[Record], state: TxnState) -> int:
        """Collect what ``entries`` (final-state index keys) name; returns headers deleted."""
        txns = [records.index_txn(entry.path) for entry in entries]
        leftovers: list[bool] = []
        step = limits.TXN_GC_READS_IN_FLIGHT
        for start in range(0, len(txns), step):
            pages = await asyncio.gather(
                *(
                    self._store.list_prefix(records.op_prefix(txn), limit=1)
                    for txn in txns[start : start + step]
                )
            )
            leftovers += [bool(page.records) for page in pages]
        done: list[tuple[Record, TxnId]] = []
        for entry, txn, leftover in zip(entries, txns, leftovers, strict=True):
            if leftover:
                # Participants need the whole decision again, winners included.
                header = await self.get(txn)
                self._notify(txn, state, None if header is None else header.winners)
            else:
                done.append((entry, txn))
        # No op record can appear now: participants guard theirs with Check(header,
        # version 1), and these headers are final (version 2).
        collected = 0
        per_commit = limits.METADATA_TXN_OPS_MAX // 2
        for start in range(0, len(done), per_commit):
            chunk = done[start : start + per_commit]
            ops: list[Op] = []
            for entry, txn in chunk:
                ops += [Delete(records.header_path(txn), FINAL_VERSION), Delete(entry.path)]
            try:
                await self._store.commit(ops)
                collected += len(chunk)
            except BadVersion:
                # One of them is gone (another broker's pass) or odd: one by one.
                for entry, txn in chunk:
                    collected += await self._collect_one(entry, txn)
        return collected

    async def _collect_one(self, entry: Record, txn: TxnId) -> int:
        try:
            await self._store.commit(
                [Delete(records.header_path(txn), FINAL_VERSION), Delete(entry.path)]
            )
        except BadVersion:
            # The header is gone (or not final, which our commits never leave behind an
            # index key for): drop the stray index key alone.
            await self._store.delete(entry.path)
            return 0
        return 1

    async def _sweep_leader_loop(self) -> None:
        """Campaign for the sweep leadership; while leading, run the sweeps on schedule."""
        while True:
            try:
                session = await self._store.open_session(SWEEP_SESSION_TTL_S)
                try:
                    election = LeaderElection(
                        self._store, SWEEP_LEADER_PATH, self._owner_id.encode(), session
                    )
                    leadership = await election.campaign()
                    await self._lead(leadership)
                finally:
                    await session.close()
            except asyncio.CancelledError:
                raise
            except SessionExpired:
                continue  # a new session campaigns again
            except MetadataUnavailable as err:
                # etcd out of reach (paused, failing over) while opening the session,
                # campaigning or resigning: expected, retried; one line, no traceback.
                log.warning("transaction sweep leadership deferred: %s", err)
                await self._clock.sleep(SWEEP_RETRY_S)
            except Exception:
                log.exception("transaction sweep loop failed; retrying")
                await self._clock.sleep(SWEEP_RETRY_S)

    async def _lead(self, leadership: Leadership) -> None:
        sweeps = asyncio.create_task(self._run_sweeps(), name="txn-sweeps-leading")
        lost = asyncio.create_task(leadership.lost())
        try:
            await asyncio.wait({sweeps, lost}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (sweeps, lost):
                task.cancel()
            # _run_sweeps logs its own failures, so only cancellations end up here.
            await asyncio.gather(sweeps, lost, return_exceptions=True)
            await leadership.resign()

    async def _run_sweeps(self) -> None:
        next_gc = self._clock.monotonic() + self._gc_interval_s
        while True:
            await self._clock.sleep(self._sweep_interval_s)
            try:
                await self.sweep_timeouts()
                if self._gc_interval_s > 0 and self._clock.monotonic() >= next_gc:
                    next_gc = self._clock.monotonic() + self._gc_interval_s
                    await self.sweep_gc()
            except MetadataUnavailable as err:
                # etcd out of reach for a moment (paused, failing over): expected, and the
                # next tick tries again; no traceback per tick.
                log.warning("transaction sweep deferred: %s", err)
            except Exception:
                # Store trouble or a bad record: logged, and the next tick tries again
                # (every step is a CAS, so a half-done pass leaves nothing to repair).
                log.exception("transaction sweep failed")

    # --- admin ---------------------------------------------------------------------------------

    async def transaction_metadata(self, txn: TxnId) -> dict[str, Any]:
        """The header and op records of ``txn``, with Pulsar's admin field names."""
        header = await self.get(txn)
        if header is None:
            raise TransactionNotFound(f"transaction {txn} not found")
        page = await self._store.list_prefix(
            records.op_prefix(txn), limit=limits.TXN_OP_RECORDS_MAX
        )
        ops = [records.decode_op(record.value) for record in page.records]
        produced: dict[str, dict[str, Any]] = {}
        acked: dict[str, dict[str, dict[str, Any]]] = {}
        for op in ops:
            if op.kind is OpKind.WRITE:
                start = op.first_after
                produced[op.segment] = {
                    "startPosition": None
                    if start is None
                    else f"{start.ledger_id}:{start.entry_id}",
                    "aborted": header.state is TxnState.ABORTED,
                }
            elif op.subscription is not None:
                last = max(op.positions) if op.cumulative and op.positions else None
                acked.setdefault(op.segment, {})[op.subscription] = {
                    "cumulativeAckPosition": None
                    if last is None
                    else f"{last.ledger_id}:{last.entry_id}",
                }
        return {
            **_header_fields(txn, header),
            "producedPartitions": produced,
            "ackedPartitions": acked,
            "opRecords": len(ops),
        }

    async def slow_transactions(
        self, older_than_ms: int, limit: int = 1000
    ) -> list[dict[str, Any]]:
        """OPEN transactions created more than ``older_than_ms`` ago (oldest deadline first).

        Scans only the deadline index up to ``now - older_than_ms + TXN_TIMEOUT_MAX_MS``:
        a transaction created earlier than the cutoff has its deadline before that.
        """
        now = self._clock.wall_ms()
        cutoff = now - older_than_ms
        end = records.deadline_index_end(max(cutoff + limits.TXN_TIMEOUT_MAX_MS, 0))
        start = records.IDX_DEADLINE
        found: list[dict[str, Any]] = []
        while len(found) < limit:
            page = await self._store.list_range(start, end, limit=limits.TXN_SWEEP_BATCH)
            for entry in page.records:
                txn = records.index_txn(entry.path)
                header = await self.get(txn)
                if (
                    header is not None
                    and header.state is TxnState.OPEN
                    and header.created_at < cutoff
                ):
                    found.append(_header_fields(txn, header))
                    if len(found) >= limit:
                        break
            if not page.more:
                break
            start = page.records[-1].path + "\x00"
        return found

    def stats(self) -> dict[str, Any]:
        """Coordinator stats, aggregate and per partition (counts since this start)."""
        self._prune_open(self._clock.wall_ms())
        open_per_partition = [0] * self._partitions
        for txn in self._open:
            open_per_partition[txn.most_bits] += 1
        return {
            "partitions": self._partitions,
            "created": self.metrics.created,
            "committed": self.metrics.committed,
            "aborted": self.metrics.aborted,
            "timedOut": self.metrics.timed_out,
            "open": len(self._open),
            "gcCollected": self.metrics.gc_collected,
            "perPartition": {
                str(p): {
                    "created": s.created,
                    "committed": s.committed,
                    "aborted": s.aborted,
                    "timedOut": s.timed_out,
                    "open": open_per_partition[p],
                }
                for p, s in enumerate(self._per_partition)
            },
        }

    # --- the open gauge ------------------------------------------------------------------------

    def _note_open(self, txn: TxnId, header: TxnHeader, now: int) -> None:
        self._prune_open(now)
        self._drop_open(txn)
        self._open[txn] = header
        if header.owner is not None:
            self._open_by_owner[header.owner] += 1
        heapq.heappush(self._open_deadlines, (header.deadline, txn))
        self.metrics.open = len(self._open)

    def _forget_open(self, txn: TxnId) -> None:
        # The heap entry stays until its deadline passes; _prune_open skips it then.
        self._drop_open(txn)
        self.metrics.open = len(self._open)

    def _prune_open(self, now: int) -> None:
        while self._open_deadlines and self._open_deadlines[0][0] < now:
            _, txn = heapq.heappop(self._open_deadlines)
            self._drop_open(txn)
        self.metrics.open = len(self._open)

    def _drop_open(self, txn: TxnId) -> None:
        header = self._open.pop(txn, None)
        if header is not None and header.owner is not None:
            self._open_by_owner[header.owner] -= 1
            if not self._open_by_owner[header.owner]:
                del self._open_by_owner[header.owner]  # roles come and go: keep no zeros


def _header_fields(txn: TxnId, header: TxnHeader) -> dict[str, Any]:
    return {
        "txnId": str(txn),
        "status": header.state.value,
        "openTimestamp": header.created_at,
        "timeoutAt": header.deadline,
        "finalizedAt": header.finalized_at,
        "owner": header.owner,
    }


def _check_winners(state: TxnState, winners: frozenset[str]) -> None:
    """InvalidArgument unless ``winners`` fits a commit's header (named limits)."""
    if state is not TxnState.COMMITTED:
        raise InvalidArgument("only a commit names winners")
    if len(winners) > limits.TXN_BATCH_WINNERS_MAX:
        raise InvalidArgument(f"{len(winners)} winners are over {limits.TXN_BATCH_WINNERS_MAX}")
    for branch in winners:
        if not branch or len(branch.encode()) > limits.TXN_BRANCH_ID_BYTES_MAX:
            raise InvalidArgument(
                f"branch id {branch[:40]!r} is empty or over {limits.TXN_BRANCH_ID_BYTES_MAX} bytes"
            )


def _encode_counter(next_id: int) -> bytes:
    return json.dumps({"next": next_id}, separators=(",", ":")).encode()


def _decode_counter(value: bytes) -> int:
    next_id = json.loads(value)["next"]
    if not isinstance(next_id, int) or next_id < 0:
        raise InvalidArgument(f"transaction id counter holds {next_id!r}")
    return next_id
