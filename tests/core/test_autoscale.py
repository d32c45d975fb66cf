"""The auto-scaling decision against its invariants (hypothesis) and a few fixed cases."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from anabranch.core.autoscale import (
    MERGE,
    SPLIT,
    Action,
    AutoscalePolicy,
    LoadHistory,
    RateSample,
    buddies,
    decide,
    pressure,
)
from anabranch.core.hash_range import HashRange
from anabranch.core.segment_layout import SegmentLayout
from anabranch.errors import InvalidArgument

NOW = 10_000_000
THRESHOLD = 1000.0
STEP_MS = 1_000

# --- strategies -------------------------------------------------------------------------------


@st.composite
def layouts(draw: st.DrawFn) -> SegmentLayout:
    """A layout reached by random splits and buddy merges, changes at random past times."""
    layout = SegmentLayout.initial(draw(st.integers(1, 3)), now_ms=0)
    for _ in range(draw(st.integers(0, 6))):
        at = draw(st.integers(1, NOW))
        pairs = buddies(layout)
        merge = draw(st.booleans())
        if pairs and merge:
            first, second = draw(st.sampled_from(pairs))
            layout = layout.merge(first.segment_id, second.segment_id, at)
        else:
            segment = draw(st.sampled_from(layout.active_segments()))
            layout = layout.split(segment.segment_id, at)
    return layout


@st.composite
def policies(draw: st.DrawFn) -> AutoscalePolicy:
    low = draw(st.integers(1, 4))
    high = draw(st.integers(low, 10))
    return AutoscalePolicy(
        enabled=True,
        split_msg_rate_in=THRESHOLD,
        split_throughput_in=0.0,
        min_segments=low,
        max_segments=high,
        target_segments=draw(st.sampled_from([0, low])),
        merge_low_water=draw(st.sampled_from([0.2, 0.3, 0.5])),
        split_sustain_ms=draw(st.sampled_from([0, 3_000, 10_000])),
        merge_sustain_ms=draw(st.sampled_from([0, 5_000, 20_000])),
        split_cooldown_ms=draw(st.sampled_from([0, 60_000, NOW])),
        merge_cooldown_ms=draw(st.sampled_from([0, 60_000, NOW])),
    ).validate()


def history_of(
    layout: SegmentLayout, loads: dict[int, list[float]]
) -> dict[int, tuple[RateSample, ...]]:
    """Samples one second apart ending at NOW, from per-segment message rates."""
    return {
        sid: tuple(
            RateSample(NOW - (len(rates) - 1 - i) * STEP_MS, msg_rate_in=rate)
            for i, rate in enumerate(rates)
        )
        for sid, rates in loads.items()
    }


@st.composite
def scenarios(
    draw: st.DrawFn,
) -> tuple[SegmentLayout, AutoscalePolicy, dict[int, list[float]]]:
    layout = draw(layouts())
    policy = draw(policies())
    samples = draw(st.integers(1, 30))
    rate = st.floats(0.0, 4 * THRESHOLD, allow_nan=False)
    loads = {
        s.segment_id: draw(st.lists(rate, min_size=samples, max_size=samples))
        for s in layout.active_segments()
    }
    return layout, policy, loads


def applied(layout: SegmentLayout, actions: tuple[Action, ...]) -> SegmentLayout:
    for action in actions:
        ids = action.segment_ids
        if action.kind == SPLIT:
            layout = layout.split(ids[0], NOW)
        else:
            layout = layout.merge(ids[0], ids[1], NOW)
    return layout


# --- invariants -------------------------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(scenarios())
def test_actions_are_legal_and_bounded(
    scenario: tuple[SegmentLayout, AutoscalePolicy, dict[int, list[float]]],
) -> None:
    layout, policy, loads = scenario
    decision = decide(layout, history_of(layout, loads), policy, NOW)
    before = len(layout.active_segments())
    after = len(applied(layout, decision.actions).active_segments())  # raises if illegal
    assert after <= max(before, policy.max_segments)
    assert after >= min(before, policy.floor)
    pairs = {(a.segment_id, b.segment_id) for a, b in buddies(layout)}
    touched: list[int] = []
    for action in decision.actions:
        touched.extend(action.segment_ids)
        if action.kind == MERGE:
            assert action.segment_ids in pairs  # buddies only
            low, high = (layout.segments[sid].hash_range for sid in action.segment_ids)
            assert HashRange(low.start, high.end).split() == (low, high)  # two halves
            for sid in action.segment_ids:
                assert NOW - layout.segments[sid].created_at_ms >= policy.merge_cooldown_ms
        else:
            assert NOW - layout.segments[action.segment_ids[0]].created_at_ms >= (
                policy.split_cooldown_ms
            )
    assert len(touched) == len(set(touched))  # one change per segment per round
    assert set(decision.intents) == {s.segment_id for s in layout.active_segments()}


@settings(max_examples=200, deadline=None)
@given(scenarios())
def test_disabled_policy_never_acts(
    scenario: tuple[SegmentLayout, AutoscalePolicy, dict[int, list[float]]],
) -> None:
    layout, policy, loads = scenario
    off = dataclasses.replace(policy, enabled=False)
    decision = decide(layout, history_of(layout, loads), off, NOW)
    assert decision.actions == ()
    assert all(text.startswith("disabled") for text in decision.intents.values())


@settings(max_examples=200, deadline=None)
@given(scenarios(), st.data())
def test_noise_inside_the_hysteresis_band_causes_nothing(
    scenario: tuple[SegmentLayout, AutoscalePolicy, dict[int, list[float]]],
    data: st.DataObject,
) -> None:
    layout, policy, loads = scenario
    # Above the floor and the target, so neither a merge nor growth is owed.
    policy = dataclasses.replace(policy, target_segments=0, min_segments=1)
    # Each segment's load anywhere in (low water, threshold): buddies' sum is over low water.
    band = st.floats(policy.merge_low_water * THRESHOLD * 1.001, THRESHOLD * 0.999, allow_nan=False)
    noisy = {sid: [data.draw(band) for _ in rates] for sid, rates in loads.items()}
    assert decide(layout, history_of(layout, noisy), policy, NOW).actions == ()


@settings(max_examples=300, deadline=None)
@given(scenarios(), st.floats(1.0, 5.0, allow_nan=False))
def test_monotone_in_load(
    scenario: tuple[SegmentLayout, AutoscalePolicy, dict[int, list[float]]], factor: float
) -> None:
    layout, policy, loads = scenario
    more = {sid: [r * factor for r in rates] for sid, rates in loads.items()}
    low = decide(layout, history_of(layout, loads), policy, NOW).actions
    high = decide(layout, history_of(layout, more), policy, NOW).actions
    assert sum(a.kind == SPLIT for a in high) >= sum(a.kind == SPLIT for a in low)
    assert sum(a.kind == MERGE for a in high) <= sum(a.kind == MERGE for a in low)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.floats(0.0, 10 * THRESHOLD, allow_nan=False), min_size=1, max_size=60))
def test_a_fluctuating_load_never_thrashes(rates: list[float]) -> None:
    """Driving a real layout through a random load, each step applying the decision: a
    range split is never merged back (nor a merged one split) within the cooldown."""
    policy = AutoscalePolicy(
        enabled=True,
        split_msg_rate_in=THRESHOLD,
        split_throughput_in=0.0,
        max_segments=8,
        split_sustain_ms=2_000,
        merge_sustain_ms=5_000,
        split_cooldown_ms=10_000,
        merge_cooldown_ms=30_000,
    )
    layout = SegmentLayout.initial(1, now_ms=0)
    history = LoadHistory(max_samples=64)
    counters: dict[int, int] = {}
    changed_at: dict[int, int] = {0: 0}
    for step, rate in enumerate(rates, start=1):
        now = step * STEP_MS + 60_000
        for segment in layout.active_segments():
            share = segment.hash_range.size / 65536
            counters[segment.segment_id] = counters.get(segment.segment_id, 0) + int(rate * share)
            history.observe(segment.segment_id, now, (counters[segment.segment_id], 0, 0, 0), 0)
        for action in decide(layout, history.history(), policy, now).actions:
            for sid in action.segment_ids:
                # The segment being changed was created by the last change of its range.
                assert now - changed_at[sid] >= min(policy.split_cooldown_ms, 60_000)
            if action.kind == SPLIT:
                layout = layout.split(action.segment_ids[0], now)
            else:
                layout = layout.merge(action.segment_ids[0], action.segment_ids[1], now)
            for child in layout.segment(action.segment_ids[0]).child_ids:
                changed_at[child] = now
        history.retain({s.segment_id for s in layout.active_segments()})
        assert len(layout.active_segments()) <= policy.max_segments


# --- fixed cases ------------------------------------------------------------------------------


def test_split_waits_for_the_sustain_window_then_picks_the_top_metric() -> None:
    policy = AutoscalePolicy(enabled=True, split_msg_rate_in=100.0, split_sustain_ms=5_000)
    layout = SegmentLayout.initial(1, 0)
    short = {0: tuple(RateSample(NOW - i * 1000, msg_rate_in=500.0) for i in (2, 1, 0))}
    decision = decide(layout, short, policy, NOW)
    assert decision.actions == ()
    assert decision.intents[0].startswith("split when sustained")
    full = {0: tuple(RateSample(NOW - i * 1000, msg_rate_in=500.0) for i in range(6, -1, -1))}
    (action,) = decide(layout, full, policy, NOW).actions
    assert (action.kind, action.segment_ids, action.reason) == (SPLIT, (0,), "msgRateIn")


def test_idle_buddies_merge_back_only_after_the_cooldown() -> None:
    policy = AutoscalePolicy(
        enabled=True, merge_sustain_ms=0, merge_cooldown_ms=60_000, split_msg_rate_in=100.0
    )
    layout = SegmentLayout.initial(1, 0).split(0, now_ms=NOW - 30_000)
    idle = {1: (RateSample(NOW),), 2: (RateSample(NOW),)}
    assert decide(layout, idle, policy, NOW).actions == ()
    (action,) = decide(layout, idle, policy, NOW + 30_000).actions
    assert (action.kind, action.segment_ids) == (MERGE, (1, 2))


def test_target_grows_the_topic_and_stops_merges() -> None:
    policy = AutoscalePolicy(enabled=True, target_segments=2, split_cooldown_ms=0)
    layout = SegmentLayout.initial(1, 0)
    (action,) = decide(layout, {}, policy, NOW).actions
    assert action.reason == "target"
    two = layout.split(0, 0)
    idle = {1: (RateSample(NOW),), 2: (RateSample(NOW),)}
    assert decide(two, idle, dataclasses.replace(policy, merge_sustain_ms=0), NOW).actions == ()


def test_pressure_and_overrides() -> None:
    policy = AutoscalePolicy(split_msg_rate_in=0.0, split_backlog=10.0)
    assert pressure(RateSample(0, msg_rate_in=1e9, backlog=25.0), policy) == (2.5, "backlog")
    assert policy.overridden({"splitBacklog": 0, "enabled": True}).split_backlog == 0.0
    for bad in ({"maxSegments": "x"}, {"enabled": 1}, {"mergeLowWater": 1.5}, {"nope": 1}):
        with pytest.raises(InvalidArgument):
            policy.overridden(bad)


def test_history_restarts_on_a_counter_reset_and_forgets_sealed_segments() -> None:
    history = LoadHistory(max_samples=2)
    history.observe(1, 0, (100, 0, 0, 0), 0)
    history.observe(1, 1000, (50, 0, 0, 0), 0)  # the topic was reloaded: no negative rate
    assert history.samples(1) == ()
    for at in (2000, 3000, 4000):
        history.observe(1, at, (50 + at, 0, 0, 0), 0)
    assert len(history.samples(1)) == 2
    assert history.samples(1)[-1].msg_rate_in == 1000.0
    history.retain(set())
    assert history.history() == {}
