"""Tail caches and the broker-wide budget they share: a stateful test against a model,
and file ledgers of one factory that stay within the budget and read right past it."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from anabranch.metadata.memory import MemoryMetadataStore
from anabranch.storage.api import EARLIEST, ManagedLedgerConfig
from anabranch.storage.ledger import FileManagedLedgerFactory
from anabranch.storage.tail_cache import TailCache, TailCacheBudget

BUDGET = 40
LIMITS = (0, 15, 25)


@dataclass
class _Model:
    """Live batches in the order they came: (cache index, ledger id, size)."""

    live: list[tuple[int, int, int]] = field(default_factory=list)
    evicted: int = 0
    """Bytes the budget (not a cache itself) evicted."""

    def add(self, cache: int, ledger: int, size: int) -> None:
        if LIMITS[cache] <= 0:
            return
        self.live.append((cache, ledger, size))
        # The budget first: the oldest anywhere, never the batch just added.
        while sum(s for _, _, s in self.live) > BUDGET and len(self.live) > 1:
            self.evicted += self.live.pop(0)[2]
        # Then the cache's own limit: its oldest, never its newest.
        while True:
            own = [b for b in self.live if b[0] == cache]
            if sum(s for _, _, s in own) <= LIMITS[cache] or len(own) <= 1:
                break
            self.live.remove(own[0])

    def clear(self, cache: int) -> None:
        self.live = [b for b in self.live if b[0] != cache]


class TailCacheMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.budget = TailCacheBudget(BUDGET)
        self.budget.stale_slack = 2  # sweep often
        self.caches = [TailCache(limit, self.budget) for limit in LIMITS]
        self.model = _Model()
        self.ledgers = 0
        self.added: list[tuple[int, int]] = []

    @rule(cache=st.integers(0, len(LIMITS) - 1), size=st.integers(1, 50))
    def add(self, cache: int, size: int) -> None:
        self.ledgers += 1  # one batch per ledger id, so every batch is told apart
        self.caches[cache].add(self.ledgers, 0, [bytes([self.ledgers % 256])], size)
        self.model.add(cache, self.ledgers, size)
        self.added.append((cache, self.ledgers))

    @rule(cache=st.integers(0, len(LIMITS) - 1))
    def clear(self, cache: int) -> None:
        self.caches[cache].clear()
        self.model.clear(cache)

    @invariant()
    def same_batches_as_the_model(self) -> None:
        live = {(c, ledger) for c, ledger, _ in self.model.live}
        for cache, ledger in self.added:
            got = self.caches[cache].get(ledger, 0, 1)
            assert (got is not None) == ((cache, ledger) in live), (cache, ledger)
            if got is not None:
                assert got == [bytes([ledger % 256])]

    @invariant()
    def bytes_add_up(self) -> None:
        for i, cache in enumerate(self.caches):
            assert cache.held == sum(s for c, _, s in self.model.live if c == i)
        assert self.budget.held == sum(cache.held for cache in self.caches)
        assert self.budget.evicted_bytes == self.model.evicted
        live = len(self.model.live)
        assert self.budget.held <= BUDGET or live == 1

    @invariant()
    def order_stays_as_long_as_the_cache(self) -> None:
        assert len(self.budget._order) <= 2 * len(self.model.live) + 3


TestTailCacheMachine = TailCacheMachine.TestCase
TestTailCacheMachine.settings = settings(max_examples=60, stateful_step_count=60, deadline=None)


def test_stale_marks_are_swept() -> None:
    """A cache that keeps evicting its own batches leaves marks behind; they never pile
    up past the live ones plus a constant."""
    budget = TailCacheBudget(10**9)
    cache = TailCache(1, budget)
    for i in range(10_000):
        cache.add(1, i, [b"x"], 1)
    assert cache.held == 1 and budget.held == 1
    assert len(budget._order) <= 1 + 1025


async def test_file_ledgers_share_one_budget(tmp_path: Path) -> None:
    """Many topics hold the budget in all; reads of evicted entries go to disk and are
    right; a closed ledger gives its share back."""
    factory = FileManagedLedgerFactory(tmp_path, MemoryMetadataStore(), tail_cache_bytes=4096)
    config = ManagedLedgerConfig(cursor_persist_interval_ms=10_000)
    try:
        ledgers = [await factory.open(f"t{i}", config) for i in range(8)]
        for i, ledger in enumerate(ledgers):
            for n in range(20):
                await ledger.append(f"{i}:{n}".encode() + b"." * 100)
            assert factory.tail_budget.held <= 4096
        assert factory.tail_budget.held > 2048  # the newest writes are cached
        for i, ledger in enumerate(ledgers):
            entries = await ledger.read(EARLIEST, 100)
            assert [e.data[: len(f"{i}:{n}")] for n, e in enumerate(entries)] == [
                f"{i}:{n}".encode() for n in range(20)
            ]
        held = factory.tail_budget.held
        await ledgers[-1].close()
        assert factory.tail_budget.held < held
    finally:
        await factory.close()
