"""TxnOutcomes hands each listener a transaction's outcome once per fast path: on the
coordinator's broker a commit arrives both by its header watch and by the coordinator's
wake, and the second must not wake the participant again; a re-list (the safety net)
still delivers to everyone, and a listener that failed to take the outcome gets it
again from the next path."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from anabranch.metadata.memory import MemoryMetadataStore
from anabranch.testing.clock import ManualClock
from anabranch.transactions import records
from anabranch.transactions.ids import TxnId
from anabranch.transactions.outcomes import TxnOutcomes
from anabranch.transactions.records import TxnHeader, TxnState

T1 = TxnId(0, 1)
RECONCILE_S = 60.0


class Listener:
    def __init__(self, failures: int = 0) -> None:
        self.calls: list[TxnState] = []
        self._failures = failures

    def on_outcome(
        self, txn: TxnId, state: TxnState, winners: frozenset[str] | None = None
    ) -> None:
        self.calls.append(state)
        if self._failures:
            self._failures -= 1
            raise RuntimeError("not now")


@pytest.fixture
async def env() -> AsyncIterator[tuple[MemoryMetadataStore, ManualClock, TxnOutcomes]]:
    store = MemoryMetadataStore()
    clock = ManualClock()
    outcomes = TxnOutcomes(store, clock, reconcile_interval_s=RECONCILE_S)
    await outcomes.start()
    yield store, clock, outcomes
    await outcomes.close()


async def commit_header(store: MemoryMetadataStore, clock: ManualClock) -> None:
    header = TxnHeader(TxnState.COMMITTED, clock.wall_ms(), 10_000, finalized_at=clock.wall_ms())
    await store.put(records.header_path(T1), records.encode_header(header))


async def test_watch_then_wake_delivers_once_and_a_relist_again(
    env: tuple[MemoryMetadataStore, ManualClock, TxnOutcomes],
) -> None:
    store, clock, outcomes = env
    listener = Listener()
    outcomes.register(T1, listener)
    await commit_header(store, clock)
    await clock.settle()
    assert outcomes.watch_events == 1
    outcomes.wake(T1, TxnState.COMMITTED)
    assert listener.calls == [TxnState.COMMITTED]

    late = Listener()
    outcomes.register(T1, late)  # registered after both fast paths: the re-list tells it
    clock.advance(RECONCILE_S)
    await clock.settle()
    assert outcomes.reconciles == 1
    assert late.calls == [TxnState.COMMITTED]
    assert listener.calls == [TxnState.COMMITTED] * 2


async def test_wake_then_watch_delivers_once(
    env: tuple[MemoryMetadataStore, ManualClock, TxnOutcomes],
) -> None:
    store, clock, outcomes = env
    listener = Listener()
    outcomes.register(T1, listener)
    outcomes.wake(T1, TxnState.COMMITTED)
    await commit_header(store, clock)
    await clock.settle()
    assert outcomes.watch_events == 0  # skipped before decoding: everyone took it
    assert listener.calls == [TxnState.COMMITTED]


async def test_a_listener_that_failed_gets_the_outcome_from_the_next_path(
    env: tuple[MemoryMetadataStore, ManualClock, TxnOutcomes],
) -> None:
    store, clock, outcomes = env
    flaky, steady = Listener(failures=1), Listener()
    outcomes.register(T1, flaky)
    outcomes.register(T1, steady)
    outcomes.wake(T1, TxnState.COMMITTED)
    await commit_header(store, clock)
    await clock.settle()
    assert flaky.calls == [TxnState.COMMITTED] * 2
    assert steady.calls == [TxnState.COMMITTED]


async def test_unregistering_forgets_who_was_told(
    env: tuple[MemoryMetadataStore, ManualClock, TxnOutcomes],
) -> None:
    _, _, outcomes = env
    listener = Listener()
    outcomes.register(T1, listener)
    outcomes.wake(T1, TxnState.ABORTED)
    outcomes.unregister(T1, listener)
    outcomes.register(T1, listener)  # a participant that joins again starts afresh
    outcomes.wake(T1, TxnState.ABORTED)
    assert listener.calls == [TxnState.ABORTED] * 2
