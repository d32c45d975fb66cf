"""The offload planner (core/offload.py): Pulsar's thresholds and deletion lag, as properties."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from anabranch.core.offload import (
    DISABLED,
    OffloadCandidate,
    OffloadPolicy,
    first_unoffloaded,
    plan_offload,
)
from anabranch.errors import InvalidArgument

NOW = 1_000_000


@st.composite
def ledger_lists(draw: st.DrawFn) -> list[OffloadCandidate]:
    """Oldest first; every ledger but the last is sealed; offloaded ones may be cold."""
    count = draw(st.integers(0, 8))
    out = []
    for i in range(count):
        last = i == count - 1
        closed = None if last else draw(st.integers(0, NOW))
        offloaded = None if last else draw(st.none() | st.integers(0, NOW))
        hot = True if offloaded is None else draw(st.booleans())
        entries = draw(st.integers(0, 50))
        size = entries * draw(st.integers(1, 100))
        out.append(OffloadCandidate(i + 1, size, closed, offloaded, hot, entries))
    return out


policies = st.builds(
    OffloadPolicy,
    threshold_bytes=st.integers(-1, 5000),
    threshold_s=st.integers(-1, NOW // 1000),
    deletion_lag_ms=st.integers(-1, NOW),
)


@given(ledger_lists(), policies, st.none() | st.integers(0, 10))
def test_plan_only_touches_what_it_may(
    ledgers: list[OffloadCandidate], policy: OffloadPolicy, before: int | None
) -> None:
    plan = plan_offload(ledgers, policy, NOW, before)
    by_id = {i.ledger_id: i for i in ledgers}
    for ledger_id in plan.offload:
        info = by_id[ledger_id]
        assert info.closed_ms is not None  # never the open ledger
        assert info.offloaded_ms is None  # never twice
        assert info.entries > 0
    for ledger_id in plan.delete_hot:
        info = by_id[ledger_id]
        assert info.offloaded_ms is not None and info.hot  # only a complete offload's copy
        assert policy.deletion_lag_ms != DISABLED
        assert info.offloaded_ms + policy.deletion_lag_ms <= NOW
    assert list(plan.offload) == sorted(plan.offload)  # oldest first
    assert not set(plan.offload) & set(plan.delete_hot)


@given(ledger_lists(), st.integers(0, 10))
def test_manual_trigger_offloads_every_sealed_ledger_before_it(
    ledgers: list[OffloadCandidate], before: int
) -> None:
    plan = plan_offload(ledgers, OffloadPolicy(), NOW, before)
    expected = [
        i.ledger_id
        for i in ledgers
        if i.ledger_id < before and i.closed_ms is not None and i.offloaded_ms is None and i.entries
    ]
    assert list(plan.offload) == expected


@given(ledger_lists())
def test_disabled_policy_offloads_nothing(ledgers: list[OffloadCandidate]) -> None:
    plan = plan_offload(ledgers, OffloadPolicy(deletion_lag_ms=DISABLED), NOW)
    assert plan.offload == () and plan.delete_hot == ()


@given(ledger_lists(), st.integers(0, 5000))
def test_size_threshold_leaves_at_most_threshold_hot_past_the_open_ledger(
    ledgers: list[OffloadCandidate], threshold: int
) -> None:
    plan = plan_offload(ledgers, OffloadPolicy(threshold_bytes=threshold), NOW)
    chosen = set(plan.offload)
    # Counting from the newest, every sealed ledger not offloaded (and not chosen) fits
    # under the threshold together with everything newer that stays hot.
    newer = 0
    for info in reversed(ledgers):
        if info.hot:
            newer += info.size
        eligible = info.closed_ms is not None and info.offloaded_ms is None and info.entries
        if eligible and info.ledger_id not in chosen:
            assert newer <= threshold


@given(ledger_lists(), st.integers(0, NOW // 1000))
def test_time_threshold_is_age_since_close(ledgers: list[OffloadCandidate], seconds: int) -> None:
    plan = plan_offload(ledgers, OffloadPolicy(threshold_s=seconds), NOW)
    for info in ledgers:
        eligible = info.closed_ms is not None and info.offloaded_ms is None and info.entries
        old = info.closed_ms is not None and NOW - info.closed_ms >= seconds * 1000
        assert (info.ledger_id in plan.offload) == bool(eligible and old)


def test_examples_and_validation() -> None:
    ledgers = [
        OffloadCandidate(1, 100, closed_ms=0),
        OffloadCandidate(2, 100, closed_ms=0),
        OffloadCandidate(3, 100, closed_ms=None),
    ]
    assert plan_offload(ledgers, OffloadPolicy(threshold_bytes=150), NOW).offload == (1, 2)
    assert plan_offload(ledgers, OffloadPolicy(threshold_bytes=250), NOW).offload == (1,)
    assert plan_offload(ledgers, OffloadPolicy(threshold_bytes=0), NOW).offload == (1, 2)
    assert first_unoffloaded(ledgers) == 1
    with pytest.raises(InvalidArgument):
        OffloadPolicy(threshold_bytes=-2)


def test_policy_in_force_precedence() -> None:
    from anabranch.broker.config import BrokerConfig
    from anabranch.broker.offload import policy_of
    from anabranch.broker.policies import NamespacePolicies, OffloadPoliciesRecord
    from anabranch.broker.topic_policies import TopicPolicies

    config = BrokerConfig.model_validate({"offload_deletion_lag_ms": 7})
    assert policy_of(config, None) == OffloadPolicy(DISABLED, DISABLED, 7)
    record = OffloadPoliciesRecord(
        managed_ledger_offload_threshold_in_bytes=100,
        managed_ledger_offload_deletion_lag_in_millis=50,
    )
    ns = NamespacePolicies(offload_policies=record, offload_threshold_in_seconds=60)
    assert policy_of(config, ns) == OffloadPolicy(100, 60, 50)
    ns = NamespacePolicies(offload_policies=record, offload_threshold=5, offload_deletion_lag_ms=9)
    assert policy_of(config, ns) == OffloadPolicy(5, DISABLED, 9)  # the plain fields win
    topic = TopicPolicies(
        offload_policies=OffloadPoliciesRecord(managed_ledger_offload_threshold_in_bytes=-1)
    )
    assert policy_of(config, topic.over(ns)) == OffloadPolicy(DISABLED, DISABLED, 9)


def test_an_offload_driver_needs_a_bucket() -> None:
    from pydantic import ValidationError

    from anabranch.broker.config import BrokerConfig

    with pytest.raises(ValidationError, match="offload_driver needs s3_bucket"):
        BrokerConfig.model_validate({"offload_driver": "aws-s3"})
    config = BrokerConfig.model_validate(
        {"offload_driver": "s3", "s3_bucket": "b", "s3_secret_access_key": "hidden"}
    )
    assert "hidden" not in repr(config)
