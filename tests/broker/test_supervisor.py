"""Supervised background loops: a loop that dies is restarted; one that keeps dying stops
the broker loudly (a real broker process exits non-zero)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from anabranch import failpoints
from anabranch.supervisor import Fatal, Supervised
from anabranch.testing.broker import BrokerProcess, InProcessBroker


async def until(predicate: object, what: str) -> None:
    for _ in range(2000):
        if callable(predicate) and predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"never: {what}")


async def test_a_dead_loop_is_restarted_through_again() -> None:
    calls: list[str] = []
    go_on = asyncio.Event()

    async def first() -> None:
        calls.append("first")
        raise RuntimeError("boom")

    async def again() -> None:
        calls.append("again")
        await go_on.wait()

    loop = Supervised("t", first, again=again, restart_delay_s=0).start()
    await until(lambda: calls == ["first", "again"], "restarted through again")
    assert loop.restarts == 1 and loop.running and not loop.gave_up
    await loop.stop()
    assert not loop.running


async def test_a_loop_that_returns_is_finished_not_restarted() -> None:
    runs: list[int] = []

    async def once() -> None:
        runs.append(1)

    loop = Supervised("t", once, restart_delay_s=0).start()
    await until(lambda: not loop.running, "the loop ended")
    assert runs == [1] and loop.restarts == 0


async def test_a_loop_that_keeps_dying_gives_up_with_its_error() -> None:
    fatal = Fatal()

    async def broken() -> None:
        raise OSError("disk gone")

    loop = Supervised(
        "broken", broken, on_give_up=fatal.fail, restart_delay_s=0, max_restarts=3
    ).start()
    reason = await asyncio.wait_for(fatal.wait(), 10)
    assert reason == "broken: disk gone"
    assert loop.gave_up and loop.restarts == 3 and not loop.running


async def test_stop_cancels_a_sleeping_loop() -> None:
    async def forever() -> None:
        await asyncio.sleep(3600)

    loop = Supervised("t", forever).start()
    await asyncio.sleep(0)
    await loop.stop()
    assert not loop.running and loop.restarts == 0


async def test_the_connection_timer_killed_in_a_live_broker_comes_back(tmp_path: Path) -> None:
    async with InProcessBroker(tmp_path, metadata="memory", handshake_timeout_s=0.5) as broker:
        timer = broker._node().server._timer
        assert timer is not None
        failpoints.activate({failpoints.BREAK_CONNECTION_TIMER})
        try:
            await until(lambda: timer.restarts >= 1, "the timer died and was restarted")
        finally:
            failpoints.activate(())
        assert timer.running and not broker.service.fatal.failed
        # The restarted timer does its job: a connection that never completes its
        # handshake is closed by the timeout the timer enforces.
        reader, writer = await asyncio.open_connection("127.0.0.1", broker.port)
        try:
            writer.write(b"\x00\x00")  # a partial frame, then silence
            closed = await asyncio.wait_for(reader.read(), 30)
            assert closed == b"" or reader.at_eof()
        finally:
            writer.close()


@pytest.mark.parametrize("label", ["standalone"])
async def test_a_loop_that_keeps_dying_stops_the_broker_process(tmp_path: Path, label: str) -> None:
    broker = BrokerProcess(tmp_path / "data", failpoints=failpoints.BREAK_CONNECTION_TIMER)
    await broker.start()
    try:
        assert broker.process is not None
        code = await asyncio.to_thread(broker.process.wait, 120)
    finally:
        broker.kill()
    assert code == 70
    log = broker.log_path.read_text()
    assert "connection-timer keeps dying" in log
    assert f"anabranch {label} stopped: connection-timer" in log
