"""Helpers the segment-reading consumers share."""

from __future__ import annotations

import asyncio
import contextlib

from anabranch.client.segment_consumers import wake_or_change


async def test_a_cancelled_wait_leaves_no_waiter_behind() -> None:
    # A consumer closing cancels its follower task mid-wait; the event waiter it started
    # must end with it (it used to linger until garbage: "Task was destroyed but it is
    # pending").
    wake = asyncio.Event()
    change = asyncio.ensure_future(asyncio.sleep(3600))
    before = asyncio.all_tasks()
    waiter = asyncio.ensure_future(wake_or_change(change, wake, None))
    await asyncio.sleep(0)
    assert len(asyncio.all_tasks() - before) == 2  # the wait and its event waiter
    waiter.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await waiter
    await asyncio.sleep(0)
    assert asyncio.all_tasks() - before == set()
    change.cancel()


async def test_a_wake_ends_the_wait_and_clears_the_event() -> None:
    wake = asyncio.Event()
    change = asyncio.ensure_future(asyncio.sleep(3600))
    waiter = asyncio.ensure_future(wake_or_change(change, wake, None))
    await asyncio.sleep(0)
    wake.set()
    await waiter
    assert not wake.is_set() and not change.done()
    change.cancel()
