"""The spare-transaction pool's rules (``anabranch.client.txn_spares``) against a model:
a spare handed out is fresh and opened for the timeout asked; every spare leaves the
pool exactly once (handed out, or returned for aborting); the pool stays bounded."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from anabranch.client.txn_spares import Spare, SparePool
from anabranch.core.txn_id import TxnId

MAX_AGE = 1.0
TTLS = (1_000, 30_000)

steps = st.lists(
    st.one_of(
        st.tuples(st.just("refill"), st.sampled_from(TTLS)),
        st.tuples(st.just("answer"), st.booleans()),
        st.tuples(st.just("take"), st.sampled_from(TTLS)),
        st.tuples(st.just("expire"), st.none()),
        st.tuples(st.just("tick"), st.floats(0, 1.5)),
        st.tuples(st.just("drain"), st.none()),
    ),
    max_size=60,
)


@given(steps, st.integers(1, 4))
def test_spares_leave_once_fresh_and_bounded(ops: list[tuple[str, object]], cap: int) -> None:
    pool = SparePool(max_spares=cap, max_age_s=MAX_AGE)
    now = 0.0
    made = 0
    in_flight: list[tuple[int, float]] = []  # (ttl, sent_at) of refills not answered
    gone: list[TxnId] = []
    for kind, arg in ops:
        if kind == "refill" and pool.want_refill():
            assert isinstance(arg, int)
            pool.refill_started()
            in_flight.append((arg, now))
        elif kind == "answer" and in_flight:
            ttl, sent = in_flight.pop(0)
            spare = None
            if arg:
                made += 1
                spare = Spare(TxnId(0, made), ttl, sent)
            returned = pool.refilled(spare, now)
            if spare is not None and (pool.closed or now - sent >= MAX_AGE):
                assert returned == [spare]
            gone += [s.txn_id for s in returned]
        elif kind == "take":
            assert isinstance(arg, int)
            spare, stale = pool.take(arg, now)
            assert all(now - s.sent_at >= MAX_AGE for s in stale)
            gone += [s.txn_id for s in stale]
            if spare is not None:
                assert spare.ttl_ms == arg and now - spare.sent_at < MAX_AGE
                gone.append(spare.txn_id)
        elif kind == "expire":
            gone += [s.txn_id for s in pool.expire(now)]
        elif kind == "tick":
            assert isinstance(arg, float)
            now += arg
        elif kind == "drain":
            gone += [s.txn_id for s in pool.drain()]
            assert not pool.want_refill()
        assert len(pool) + pool.in_flight <= cap
        assert pool.in_flight == len(in_flight)
        expiry = pool.next_expiry()
        assert (expiry is None) == (len(pool) == 0)
    gone += [s.txn_id for s in pool.drain()]  # the close path: answers arrive after it
    while in_flight:
        ttl, sent = in_flight.pop(0)
        made += 1
        gone += [s.txn_id for s in pool.refilled(Spare(TxnId(0, made), ttl, sent), now)]
    gone += [s.txn_id for s in pool.drain()]
    assert len(gone) == len(set(gone)), "a spare left the pool twice"
    assert sorted(t.least_bits for t in gone) == list(range(1, made + 1)), "a spare leaked"
