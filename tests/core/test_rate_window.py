"""RateWindow against a model: a counter growing at a constant rate reads that rate, from
any number of callers, whenever they call."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from anabranch.core.rate_window import RateWindow


@given(st.integers(0, 1000), st.lists(st.integers(0, 6), min_size=1, max_size=30))
def test_a_constant_rate_reads_as_that_rate(per_step: int, gaps: list[int]) -> None:
    # Time moves in half-second steps; the counter grows per_step per step.
    window = RateWindow(1.0, 0.0, (0,))
    steps = 0
    for gap in gaps:
        steps += gap
        if steps == 0:
            continue
        (rate,) = window.rates(steps * 0.5, (per_step * steps,))
        assert rate == per_step / 0.5


@given(st.lists(st.floats(0.0, 3.0, allow_nan=False), min_size=1, max_size=20))
def test_callers_within_the_window_share_one_answer(gaps: list[float]) -> None:
    window = RateWindow(1.0, 0.0, (0,))
    now, count = 0.0, 0
    for gap in gaps:
        now += gap
        count += 7
        first = window.rates(now, (count,))
        assert window.rates(now, (count,)) == first  # a second caller at the same moment
