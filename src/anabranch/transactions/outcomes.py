"""How a broker's participants learn that a transaction ended (PIP-473: no RPC to them).

The coordinator's single CAS that moves a header from OPEN to COMMITTED or ABORTED is the
decision. One :class:`TxnOutcomes` per broker tells every participant (transaction
buffers, pending-ack stores) that registered for the transaction, three ways:

- **wake** — the local fast path: the coordinator on this broker calls :meth:`wake`
  right after its CAS; delivery is synchronous;
- **watch** — one prefix watch on ``/txn/id/`` from the revision at start: a PUT of a
  final header is delivered to that transaction's listeners (other brokers' commits);
- **re-list** — on ``Compacted`` or any watch failure, and every
  ``reconcile_interval_s``: the header of every registered transaction is read again,
  and final ones are delivered (a missed event cannot leave a transaction open here).

A batch commit's header names its ``winners`` (branches); every way delivers them, so a
listener learns the whole decision. They are passed (as ``winners=``) only when set, so
a listener of ordinary transactions may take just ``(txn, state)``.

Listeners are called with no lock held and must be idempotent and never block: they
apply the outcome in memory and schedule the durable work (see ``op_records``).

Example:
    >>> import asyncio
    >>> from anabranch.metadata.memory import MemoryMetadataStore
    >>> from anabranch.clock import SystemClock
    >>> class Printer:
    ...     def on_outcome(self, txn: TxnId, state: TxnState) -> None:
    ...         print(txn, state.value)
    >>> async def demo() -> None:
    ...     outcomes = TxnOutcomes(MemoryMetadataStore(), SystemClock())
    ...     await outcomes.start()
    ...     outcomes.register(TxnId(0, 1), Printer())
    ...     outcomes.wake(TxnId(0, 1), TxnState.COMMITTED)
    ...     await outcomes.close()
    >>> asyncio.run(demo())
    0_1 COMMITTED
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, Protocol, cast, runtime_checkable

from anabranch import failpoints, limits
from anabranch.clock import Clock
from anabranch.errors import Closed, Compacted, InvalidArgument, MetadataUnavailable
from anabranch.metadata.api import EventKind, MetadataStore, Op
from anabranch.supervisor import GiveUp, Supervised
from anabranch.transactions import records
from anabranch.transactions.ids import TxnId
from anabranch.transactions.records import TxnHeader, TxnState

log = logging.getLogger(__name__)

_RELIST_CONCURRENCY = 32
"""Header reads in flight at once during a re-list (a bounded batch, not one per txn)."""


Loop = Callable[[], Coroutine[Any, Any, None]]
"""A supervised background loop's coroutine factory."""


class OutcomeListener(Protocol):
    """A participant waiting for transactions to end."""

    def on_outcome(
        self, txn: TxnId, state: TxnState, winners: frozenset[str] | None = None
    ) -> None:
        """``txn`` ended in ``state`` (final), committing only the entries of ``winners``
        when set. Idempotent; never blocks (schedules work)."""
        ...


@runtime_checkable
class CommitCleaner(Protocol):
    """A listener whose durable work for a plain COMMIT is only deleting its records, so
    the coordinator's CAS on this broker may do it (a transaction buffer)."""

    def commit_cleanup(self, txn: TxnId) -> list[Op]:
        """The deletions a COMMIT of ``txn`` may carry for this participant ([]: none);
        offered ones are settled by exactly one :meth:`cleanup_settled`."""
        ...

    def cleanup_settled(self, txn: TxnId, landed: bool) -> None:
        """Whether the COMMIT's CAS carried :meth:`commit_cleanup`'s deletions (skip
        them) or not (delete them as usual). Until then a participant that learnt the
        commit another way (a watch can be faster than the CAS's own answer) waits."""
        ...


@functools.cache
def _cleans_commits(kind: type) -> bool:
    """Whether listeners of ``kind`` are :class:`CommitCleaner` (once per class: an
    ``isinstance`` against a runtime-checkable protocol walks its members every call,
    2% of the broker's time in a loop of transactions)."""
    return issubclass(kind, CommitCleaner)


def _no_header(txn: TxnId) -> TxnHeader | None:
    """No coordinator on this broker: every join reads the header."""
    return None


@dataclass(slots=True)
class _Told:
    """Who took a transaction's outcome already (by watch or wake)."""

    state: TxnState
    winners: frozenset[str] | None
    listeners: list[OutcomeListener]


class TxnOutcomes:
    """Delivers final transaction states to the participants registered for them."""

    def __init__(
        self,
        store: MetadataStore,
        clock: Clock,
        *,
        reconcile_interval_s: float = limits.TXN_RECONCILE_INTERVAL_S,
        on_give_up: GiveUp | None = None,
    ) -> None:
        self._on_give_up = on_give_up
        self._store = store
        self._clock = clock
        self._interval = reconcile_interval_s
        self._listeners: dict[TxnId, list[OutcomeListener]] = {}
        self._loops: list[Supervised] = []
        self._closed = False
        self.watch_events = 0
        """Final headers seen by the watch (metrics)."""
        self.relists = 0
        """Re-lists done after a watch gap or failure (metrics)."""
        self.reconciles = 0
        """Periodic re-reads done (metrics)."""
        self.deliveries = 0
        """Outcomes handed to listeners (metrics)."""
        self.local_header: Callable[[TxnId], TxnHeader | None] = _no_header
        """The header of an OPEN transaction this broker's coordinator created (the
        broker sets it): a participant joins such a one without reading its header."""
        self._seq_hints: dict[TxnId, int] = {}
        self._told: dict[TxnId, _Told] = {}

    async def start(self) -> None:
        """Watch headers from the current revision, and start the periodic re-read."""
        if self._closed:
            raise Closed("transaction outcomes are closed")
        revision = await self._store.current_revision()
        self._supervise(
            "txn-outcomes-watch", lambda: self._watch_loop(revision + 1), again=self._rewatch
        )
        self._supervise("txn-outcomes-reconcile", self._reconcile_loop)

    def _supervise(self, name: str, make: Loop, *, again: Loop | None = None) -> None:
        """Run ``make()`` kept alive: one that dies of an exception is logged and restarted
        with ``again`` (default ``make``): the watch restarts by re-listing, so nothing is
        missed meanwhile."""
        loop = Supervised(name, make, again=again, on_give_up=self._on_give_up)
        self._loops.append(loop.start())

    async def _rewatch(self) -> None:
        await self._watch_loop(await self._relist() + 1)

    def register(self, txn: TxnId, listener: OutcomeListener) -> None:
        """Deliver ``txn``'s outcome to ``listener`` (once per way it is learnt)."""
        listeners = self._listeners.setdefault(txn, [])
        if listener not in listeners:
            listeners.append(listener)

    def unregister(self, txn: TxnId, listener: OutcomeListener) -> None:
        """Stop delivering ``txn`` to ``listener`` (idempotent)."""
        listeners = self._listeners.get(txn)
        if listeners is not None and listener in listeners:
            listeners.remove(listener)
            if not listeners:
                del self._listeners[txn]
                self._seq_hints.pop(txn, None)
                self._told.pop(txn, None)

    def seq_hint(self, txn: TxnId) -> int:
        """A guess at ``txn``'s next free op record sequence number, for a registered
        listener: distinct for this broker's participants, so they do not collide with
        each other (another broker's may: the write then lists and takes the next)."""
        if txn not in self._listeners:
            return 0
        seq = self._seq_hints.get(txn, 0)
        self._seq_hints[txn] = seq + 1
        return seq

    def commit_cleanup(self, txn: TxnId) -> tuple[list[Op], Callable[[bool], None]]:
        """``(ops, settle)`` for this broker's coordinator committing ``txn``: the
        deletions of the registered participants that can go in the COMMIT's CAS, and
        what tells them whether it did (call ``settle`` exactly once: True once that CAS
        landed with ``ops``, False when it failed or went without them)."""
        ops: list[Op] = []
        cleaners: list[CommitCleaner] = []
        for listener in self._listeners.get(txn, ()):
            if _cleans_commits(type(listener)):
                cleaner = cast(CommitCleaner, listener)
                mine = cleaner.commit_cleanup(txn)
                if mine:
                    ops += mine
                    cleaners.append(cleaner)

        def settle(landed: bool) -> None:
            for cleaner in cleaners:
                cleaner.cleanup_settled(txn, landed)

        return ops, settle

    def registered(self, txn: TxnId) -> int:
        """How many listeners wait for ``txn``."""
        return len(self._listeners.get(txn, ()))

    def wake(self, txn: TxnId, state: TxnState, winners: frozenset[str] | None = None) -> None:
        """The local fast path: ``txn`` just ended in ``state`` (the caller's own CAS;
        ``winners`` as its header says)."""
        if not state.final:
            raise InvalidArgument(f"wake with a non-final state {state.value}")
        self._deliver(txn, state, winners)

    async def close(self) -> None:
        """Stop watching; nothing more is delivered. Idempotent."""
        self._closed = True
        loops, self._loops = self._loops, []
        await asyncio.gather(*(loop.stop() for loop in loops))
        self._listeners.clear()
        self._seq_hints.clear()
        self._told.clear()

    # --- delivery -------------------------------------------------------------------------

    def _deliver(
        self,
        txn: TxnId,
        state: TxnState,
        winners: frozenset[str] | None,
        *,
        again: bool = False,
    ) -> None:
        """Hand the outcome to ``txn``'s listeners. On this broker a commit reaches them
        twice at once, by its watch event and by the coordinator's wake: the second
        skips the listeners that took the same outcome already (each delivery costs a
        dispatcher wake-up and a work item). ``again`` (a re-list) delivers to all."""
        if failpoints.enabled(failpoints.TXN_HOLD_OUTCOMES):
            return  # the crash tests' window between a commit's CAS and its apply
        listeners = self._listeners.get(txn)
        if not listeners:
            return
        told = self._told.get(txn)
        if told is None or again or told.state is not state or told.winners != winners:
            told = self._told[txn] = _Told(state, winners, [])
        for listener in list(listeners):
            if listener in told.listeners:
                continue
            self.deliveries += 1
            try:
                if winners is None:
                    listener.on_outcome(txn, state)
                else:
                    listener.on_outcome(txn, state, winners=winners)
            except Exception:
                log.exception("transaction %s: a participant failed to take its outcome", txn)
            else:
                told.listeners.append(listener)

    async def _watch_loop(self, start: int) -> None:
        while not self._closed:
            try:
                watch = self._store.watch(records.HEADERS, prefix=True, start_revision=start)
                try:
                    async for event in watch:
                        start = event.revision + 1
                        if event.kind is EventKind.PUT:
                            self._on_put(event.path, event.value)
                finally:
                    await watch.close()
                return  # the store ended the watch: it is closing
            except Closed:
                return
            except Compacted:
                pass
            except Exception:
                log.exception("transaction header watch failed; re-listing")
                await self._clock.sleep(limits.TXN_PARTICIPANT_RETRY_MIN_S)
            try:
                start = await self._relist() + 1
                self.relists += 1
            except Closed:
                return
            except Exception:
                log.exception("re-reading transaction headers failed; retrying")
                await self._clock.sleep(limits.TXN_PARTICIPANT_RETRY_MAX_S)

    def _on_put(self, path: str, value: bytes) -> None:
        try:
            txn = records.parse_txn_key(path[len(records.HEADERS) :])
        except InvalidArgument:
            return  # not a header key
        listeners = self._listeners.get(txn)
        if not listeners:
            return
        told = self._told.get(txn)
        if told is not None and all(listener in told.listeners for listener in listeners):
            return  # a final header never changes: they took this outcome already
        header = records.decode_header(value)
        if header.state.final:
            self.watch_events += 1
            self._deliver(txn, header.state, header.winners)

    async def _relist(self) -> int:
        """Read every registered transaction's header; returns the revision taken *before*
        reading, so a watch from it + 1 misses no change made after the reads."""
        revision = await self._store.current_revision()
        txns = list(self._listeners)
        for start in range(0, len(txns), _RELIST_CONCURRENCY):
            batch = txns[start : start + _RELIST_CONCURRENCY]
            found = await asyncio.gather(*(self._store.get(records.header_path(t)) for t in batch))
            for txn, record in zip(batch, found, strict=True):
                if record is not None:
                    header = records.decode_header(record.value)
                    if header.state.final:
                        self._deliver(txn, header.state, header.winners, again=True)
        return revision

    async def _reconcile_loop(self) -> None:
        while not self._closed:
            await self._clock.sleep(self._interval)
            try:
                await self._relist()
                self.reconciles += 1
            except Closed:
                return
            except MetadataUnavailable as err:
                # etcd out of reach for a moment: expected, the next period re-reads.
                log.warning("periodic re-read of transaction headers deferred: %s", err)
            except Exception:
                log.exception("periodic re-read of transaction headers failed")
