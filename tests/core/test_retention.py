"""Retention, TTL, backlog-quota and prune decisions against simple models (hypothesis)."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from anabranch.core.retention import (
    UNBOUNDED,
    BacklogQuota,
    LedgerSpan,
    Retention,
    SealedSegment,
    age_quota_exceeded,
    backlog_bytes,
    eviction_position,
    expired_prefix,
    prunable_segments,
    quota_fits_retention,
    storage_quota_exceeded,
    trimmable_ledgers,
    ttl_cutoff_ms,
)
from anabranch.core.segment_layout import SegmentLayout
from anabranch.errors import InvalidArgument, SegmentNotPrunable

# --- strategies -------------------------------------------------------------------------------


@st.composite
def ledger_lists(draw: st.DrawFn) -> list[LedgerSpan]:
    n = draw(st.integers(1, 8))
    closed = sorted(draw(st.lists(st.integers(0, 1000), min_size=n - 1, max_size=n - 1)))
    spans = []
    for i in range(n):
        entries = draw(st.integers(0, 6))
        size = entries * draw(st.integers(1, 50))
        spans.append(LedgerSpan(10 + i, entries, size, closed[i] if i < n - 1 else None))
    return spans


bounds = st.one_of(st.just(UNBOUNDED), st.integers(0, 2000))
retentions = st.builds(Retention, time_ms=bounds, size_bytes=bounds)


def positions(spans: list[LedgerSpan]) -> st.SearchStrategy[tuple[int, int] | None]:
    points: list[tuple[int, int] | None] = [None, (-1, -1)]
    for s in spans:
        points += [(s.ledger_id, e) for e in range(-1, s.entries)]
    return st.sampled_from(points)


# --- trimming ----------------------------------------------------------------------------------


def model_trim(
    spans: list[LedgerSpan], slowest: tuple[int, int] | None, r: Retention, now: int
) -> int:
    """The rule stated naively: walk the prefix; a ledger goes when closed, consumed, and
    retention says so for what would be kept with it."""
    kept = sum(s.size for s in spans)
    count = 0
    for s in spans[:-1]:
        consumed = s.entries == 0 or slowest is None or (s.ledger_id, s.entries - 1) <= slowest
        assert s.closed_ms is not None
        over = r.size_bytes != UNBOUNDED and kept > r.size_bytes
        old = r.time_ms != UNBOUNDED and now - s.closed_ms >= r.time_ms
        if not (consumed and (over or old)):
            break
        count += 1
        kept -= s.size
    return count


@settings(max_examples=300)
@given(st.data())
def test_trim_matches_model_and_never_deletes_unconsumed_or_retained(data: st.DataObject) -> None:
    spans = data.draw(ledger_lists())
    slowest = data.draw(positions(spans))
    retention = data.draw(retentions)
    now = data.draw(st.integers(0, 3000))
    count = trimmable_ledgers(spans, slowest, retention, now)
    assert count == model_trim(spans, slowest, retention, now)
    assert count <= len(spans) - 1  # the open ledger stays
    for s in spans[:count]:
        # Never an entry some subscription has not consumed.
        assert slowest is None or s.entries == 0 or (s.ledger_id, s.entries - 1) <= slowest
    if retention.is_infinite:
        assert count == 0
    # Monotone: later, or with cursors further on, never fewer.
    assert trimmable_ledgers(spans, slowest, retention, now + 500) >= count
    if slowest is not None:
        assert trimmable_ledgers(spans, (10**9, 0), retention, now) >= count


def test_trim_examples() -> None:
    spans = [LedgerSpan(1, 2, 20, 0), LedgerSpan(2, 2, 20, 100), LedgerSpan(3, 1, 10, None)]
    assert trimmable_ledgers(spans, (3, 0), Retention(0, 0), now_ms=100) == 2
    assert trimmable_ledgers(spans, (2, 0), Retention(0, 0), now_ms=100) == 1  # 2:1 unacked
    assert trimmable_ledgers(spans, (3, 0), Retention(50, UNBOUNDED), now_ms=100) == 1
    assert trimmable_ledgers(spans, (3, 0), Retention(UNBOUNDED, 25), now_ms=100) == 2
    assert trimmable_ledgers(spans, (3, 0), Retention(UNBOUNDED, 30), now_ms=100) == 1


def test_retention_of_pulsar_units() -> None:
    assert Retention.of(minutes=-1, mb=-1).is_infinite
    assert Retention.of(minutes=1, mb=2) == Retention(60_000, 2 * 1024 * 1024)
    with pytest.raises(InvalidArgument):
        Retention.of(minutes=-2, mb=0)
    with pytest.raises(InvalidArgument):
        Retention(time_ms=0, size_bytes=-5)


# --- TTL -------------------------------------------------------------------------------------


@given(st.lists(st.integers(0, 100)), st.integers(0, 100))
def test_expired_prefix_is_the_longest_prefix_older_than_the_cutoff(
    times: list[int], cutoff: int
) -> None:
    count = expired_prefix(times, cutoff)
    assert all(t < cutoff for t in times[:count])
    assert count == len(times) or times[count] >= cutoff
    assert expired_prefix(times, cutoff + 10) >= count  # monotone in time


def test_ttl_cutoff() -> None:
    assert ttl_cutoff_ms(10_000, None) is None
    assert ttl_cutoff_ms(10_000, 0) is None
    assert ttl_cutoff_ms(10_000, 2) == 8_000


# --- backlog quotas ------------------------------------------------------------------------------


def test_quota_checks() -> None:
    assert not storage_quota_exceeded(10**12, None)
    assert not storage_quota_exceeded(10**12, BacklogQuota(limit_size=UNBOUNDED))
    assert storage_quota_exceeded(11, BacklogQuota(limit_size=10))
    assert not age_quota_exceeded(0, 10**9, BacklogQuota(limit_time_s=UNBOUNDED))
    assert age_quota_exceeded(0, 2001, BacklogQuota(limit_time_s=2))
    assert not age_quota_exceeded(0, 2000, BacklogQuota(limit_time_s=2))


def entry_model(spans: list[LedgerSpan]) -> list[tuple[tuple[int, int], float]]:
    return [
        ((s.ledger_id, e), s.size / s.entries) for s in spans if s.entries for e in range(s.entries)
    ]


@settings(max_examples=300)
@given(st.data())
def test_backlog_and_eviction_against_per_entry_model(data: st.DataObject) -> None:
    spans = data.draw(ledger_lists())
    md = data.draw(positions(spans).filter(lambda p: p is not None))
    assert md is not None
    limit = data.draw(st.integers(0, 400))
    model = entry_model(spans)
    expected = sum(w for p, w in model if p > md)
    assert abs(backlog_bytes(spans, md) - expected) <= len(spans)  # rounding per ledger
    target = eviction_position(spans, md, limit)
    assert target >= md  # never moves back
    if model:
        assert target <= max(md, model[-1][0])  # never past the last entry
        assert target == md or target in {p for p, _ in model}
    if target != md:
        # It evicted because it had to, and got under 90% of the limit unless it ran out.
        assert backlog_bytes(spans, md) > int(limit * 0.9)
        assert backlog_bytes(spans, target) <= int(limit * 0.9) or target == model[-1][0]
    else:
        assert backlog_bytes(spans, md) <= int(limit * 0.9) or not [p for p, _ in model if p > md]


# --- pruning sealed segments --------------------------------------------------------------------


@st.composite
def layouts(draw: st.DrawFn) -> SegmentLayout:
    layout = SegmentLayout.initial(draw(st.integers(1, 3)), now_ms=0)
    for now in range(1, draw(st.integers(1, 10)) + 1):
        active = layout.active_segments()
        pairs = list(itertools.pairwise(active))
        merge: bool = bool(pairs) and draw(st.booleans())
        if merge:
            a, b = draw(st.sampled_from(pairs))
            layout = layout.merge(a.segment_id, b.segment_id, now_ms=now * 10)
        else:
            target = draw(st.sampled_from(active))
            layout = layout.split(target.segment_id, now_ms=now * 10)
    return layout


def sealed_view(layout: SegmentLayout) -> dict[int, SealedSegment]:
    return {
        s.segment_id: SealedSegment(s.segment_id, s.parent_ids, s.child_ids, s.sealed_at_ms)
        for s in layout.sealed_segments()
    }


@settings(max_examples=150)
@given(layouts(), st.data())
def test_prune_to_a_fixpoint_keeps_the_dag_valid(
    layout: SegmentLayout, data: st.DataObject
) -> None:
    sealed_ids = sorted(s.segment_id for s in layout.sealed_segments())
    drained = set(data.draw(st.lists(st.sampled_from(sealed_ids or [0]), unique=True)))
    retention = data.draw(st.sampled_from([Retention(0, 0), Retention(25, UNBOUNDED)]))
    now = data.draw(st.integers(0, 150))
    active_before = [(s.segment_id, s.hash_range) for s in layout.active_segments()]
    pruned: set[int] = set()
    while True:
        doomed = prunable_segments(sealed_view(layout), drained, retention, now, 0)
        if not doomed:
            break
        for segment_id in doomed:
            seg = layout.segments[segment_id]
            # Only drained, sealed segments out of retention go.
            assert segment_id in drained and not seg.is_active
            assert retention.expired(seg.sealed_at_ms, now, 0)
        for segment_id in doomed:
            if segment_id in layout.segments:
                epoch = layout.epoch
                block = layout.prune_block(segment_id)
                assert set(block) <= set(doomed)
                layout = layout.prune(segment_id)
                assert layout.epoch == epoch + 1
                pruned.update(block)
        layout.validate()
        # Routing never changes.
        assert [(s.segment_id, s.hash_range) for s in layout.active_segments()] == active_before
    assert SegmentLayout.from_json(layout.to_json()) == layout
    # At the fixpoint, no sealed root that qualifies alone is left behind.
    for s in layout.sealed_segments():
        if (
            not s.parent_ids
            and s.segment_id in drained
            and retention.expired(s.sealed_at_ms, now, 0)
        ):
            parents = {p for c in s.child_ids for p in layout.segments[c].parent_ids}
            assert not parents <= drained or any(layout.segments[p].parent_ids for p in parents)
    assert pruned.isdisjoint(layout.segments)


def test_prune_block_rules() -> None:
    layout = SegmentLayout.initial(2, 0).merge(0, 1, now_ms=1).split(2, now_ms=2)
    with pytest.raises(SegmentNotPrunable):
        layout.prune(3)  # ACTIVE
    with pytest.raises(SegmentNotPrunable):
        layout.prune(2)  # its parents 0 and 1 remain
    pruned = layout.prune(1)  # the merge's two parents go together
    assert sorted(pruned.segments) == [2, 3, 4]
    assert pruned.segments[2].parent_ids == ()
    assert [s.segment_id for s in pruned.prune(2).roots] == [3, 4]
    # Not drained by every subscription: kept; a merge block needs both parents drained.
    view = sealed_view(layout)
    assert prunable_segments(view, {0}, Retention(0, 0), 10, 0) == []
    assert prunable_segments(view, {0, 1}, Retention(0, 0), 10, 0) == [0, 1]
    assert prunable_segments(view, {0, 1}, Retention(60_000, UNBOUNDED), 10, 0) == []
    assert prunable_segments(view, {0, 1}, Retention(UNBOUNDED, UNBOUNDED), 10**9, 0) == []


@given(
    st.integers(-1, 5000),
    st.integers(-1, 5000),
    st.integers(-1, 100),
    st.integers(-1, 100),
)
def test_quota_fits_retention_is_pulsars_rule(
    limit_size: int, limit_time: int, minutes: int, mb: int
) -> None:
    quota = BacklogQuota(limit_size=limit_size * 1024, limit_time_s=limit_time)
    fits = quota_fits_retention(quota, minutes, mb)
    too_big = mb > 0 and limit_size * 1024 >= mb * 1024 * 1024
    too_old = minutes > 0 and limit_time >= minutes * 60
    assert fits == (not too_big and not too_old)
