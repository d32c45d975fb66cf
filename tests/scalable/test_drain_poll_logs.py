"""A drain poll that cannot reach the store or the segment's owner logs one line.

Under etcd outages and broker pauses every poll failed with a full traceback at ERROR
(seen in soak logs): an expected, retried condition, not a bug.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

import pytest

from anabranch.clock import SystemClock
from anabranch.core.assignment import SubscriptionAssignment
from anabranch.core.names import TopicName, parse_name
from anabranch.core.segment_layout import SegmentLayout
from anabranch.errors import MetadataUnavailable
from anabranch.metadata.api import CommitResult, Op
from anabranch.scalable.paths import TopicPaths
from anabranch.scalable.subscription_coordinator import SubscriptionCoordinator


async def test_an_unreachable_backlog_is_a_warning_and_the_next_poll_drains(
    caplog: pytest.LogCaptureFixture,
) -> None:
    layout = SegmentLayout.initial(1, 0).split(0, 1)  # segment 0 sealed: polled for drains
    state, instructions = SubscriptionAssignment.create("s", layout, 1000)
    calls = 0
    drained = asyncio.Event()

    async def backlog(segment_id: int, subscription: str) -> int:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise MetadataUnavailable("etcd at 127.0.0.1:1: Socket closed")
        drained.set()
        return 0

    async def commit(ops: Sequence[Op]) -> CommitResult:
        raise AssertionError("no session to persist")

    topic = parse_name("topic://public/default/t")
    assert isinstance(topic, TopicName)
    coordinator = SubscriptionCoordinator(
        state,
        paths=TopicPaths(topic),
        commit=commit,
        backlog=backlog,
        clock=SystemClock(),
        on_assignment=lambda sub, push: None,
        drain_poll_interval_s=0.01,
    )
    with caplog.at_level(logging.WARNING, logger="anabranch.scalable.subscription_coordinator"):
        await coordinator.start(instructions)
        await drained.wait()
        await coordinator.close()
    lines = [r for r in caplog.records if "drain poll" in r.getMessage()]
    assert [r.levelno for r in lines] == [logging.WARNING]
    assert "Socket closed" in lines[0].getMessage() and not lines[0].exc_info
