"""LogThrottle: every line is logged or counted exactly once, logged lines of one run are
at least an interval apart, and a new kind of message is never held back."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from anabranch.core.log_throttle import LogThrottle

INTERVAL_S = 5.0

events = st.lists(
    st.tuples(st.sampled_from(["a", "b"]), st.floats(min_value=0.0, max_value=3.0)),
    max_size=60,
)


@given(events)
def test_every_line_is_logged_or_counted_once(steps: list[tuple[str, float]]) -> None:
    throttle = LogThrottle(INTERVAL_S)
    now = 0.0
    logged: list[tuple[str, float]] = []
    accounted = 0
    previous_key: str | None = None
    for key, step in steps:
        now += step
        answer = throttle.admit(key, now)
        if key != previous_key:
            assert answer is not None, "a new kind of message is logged at once"
        if answer is not None:
            if logged and logged[-1][0] == key:
                assert now - logged[-1][1] >= INTERVAL_S
            logged.append((key, now))
            accounted += 1 + answer
        previous_key = key
    assert accounted + throttle.left_out == len(steps)


@given(st.integers(min_value=1, max_value=50))
def test_a_steady_stream_logs_one_line_per_interval(count: int) -> None:
    throttle = LogThrottle(INTERVAL_S)
    answers = [throttle.admit("refused", i * 0.25) for i in range(count)]
    logged = [a for a in answers if a is not None]
    assert answers[0] == 0
    assert all(a == INTERVAL_S / 0.25 - 1 for a in logged[1:])  # one line per 20
    assert len(logged) == 1 + int((count - 1) * 0.25 // INTERVAL_S)
    assert sum(logged) + len(logged) + throttle.left_out == count
