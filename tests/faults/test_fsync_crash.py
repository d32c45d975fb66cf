"""Proof of fsync-before-ack (issue 15): a crash that loses every write not fsynced.

SIGKILL keeps the page cache, so a killed broker's unsynced writes still reach the disk
and a plain crash test cannot tell an ack sent after the fdatasync from one sent before.
Here the broker's ledger files go through the fault layer
(:class:`~anabranch.testing.faults.standalone.FaultyBrokerProcess`), which records each
file's last fsynced length; the "crash" is SIGKILL plus truncating every file the broker
wrote to that length (what a power cut leaves). The broker then restarts on the same data
and a reader must find every acknowledged message.

The second test proves the check has teeth: the same run with ``fsync="never"`` (acks
without fdatasync), or with the ``ack-before-fsync`` failpoint (the group commit skips its
fdatasync), must lose acknowledged messages, and the checker must say so.
"""

from __future__ import annotations

import asyncio
import functools
from pathlib import Path

import pytest

from anabranch import failpoints
from anabranch.aio import Client
from anabranch.client.message_id import MessageId
from anabranch.errors import AnabranchError
from anabranch.testing.faults.standalone import FaultyBrokerProcess

pytestmark = pytest.mark.timeout(300)

TOPIC = "persistent://public/default/power-cut"
KILL_AFTER = 400
"""Acknowledged sends before the crash (more are in flight when it comes)."""


async def produce_then_crash(broker: FaultyBrokerProcess) -> tuple[list[bytes], int]:
    """Pipeline sends; once ``KILL_AFTER`` are acknowledged, crash the broker with sends
    still in flight. (The acknowledged values at the crash, files that lost bytes.)"""
    acked: list[bytes] = []
    enough = asyncio.Event()

    def record(value: bytes, fut: asyncio.Future[MessageId]) -> None:
        if not fut.cancelled() and fut.exception() is None:
            acked.append(value)
            if len(acked) >= KILL_AFTER:
                enough.set()

    client = Client(broker.service_url, operation_timeout_s=5.0)
    try:
        producer = await client.create_producer(TOPIC)
        i = 0
        while not enough.is_set():
            value = f"m-{i}".encode()
            fut = await producer.send_async(value)
            fut.add_done_callback(functools.partial(record, value))
            i += 1
            if i % 50 == 0:
                await asyncio.sleep(0)  # let receipts arrive
        snapshot = list(acked)
        cut = broker.crash()
    finally:
        await client.close()
    return snapshot, cut


async def read_all(url: str) -> list[bytes]:
    """Every message of TOPIC, from the earliest (stops after 3 s with nothing new)."""
    async with Client(url) as client:
        reader = await client.create_reader(TOPIC, "earliest")
        values: list[bytes] = []
        try:
            while (msg := await reader.read_next(timeout=3.0)) is not None:
                values.append(msg.value)
        except AnabranchError:
            pass  # e.g. a closed ledger whose entries are gone: the checker counts the loss
        return values


async def crash_and_check(
    tmp_path: Path, fsync: str, failpoints: str = ""
) -> tuple[list[bytes], set[bytes], int]:
    broker = FaultyBrokerProcess(tmp_path / "data", fsync=fsync, failpoints=failpoints)
    await broker.start()
    try:
        acked, cut = await produce_then_crash(broker)
        await broker.start()  # recovery on the truncated files
        stored = await read_all(broker.service_url)
    finally:
        await broker.stop()
    lost = set(acked) - set(stored)
    return acked, lost, cut


async def test_every_acknowledged_message_survives_a_power_cut(tmp_path: Path) -> None:
    acked, lost, _ = await crash_and_check(tmp_path, "always")
    assert len(acked) >= KILL_AFTER
    assert not lost, f"{len(lost)} acknowledged messages lost, e.g. {sorted(lost)[:5]}"


@pytest.mark.parametrize(
    ("fsync", "failpoint"), [("never", ""), ("always", failpoints.ACK_BEFORE_FSYNC)]
)
async def test_the_check_notices_acks_sent_before_fsync(
    tmp_path: Path, fsync: str, failpoint: str
) -> None:
    acked, lost, cut = await crash_and_check(tmp_path, fsync, failpoint)
    assert len(acked) >= KILL_AFTER
    assert cut >= 1  # the crash did drop unsynced bytes
    assert len(lost) >= KILL_AFTER // 2, f"only {len(lost)} of {len(acked)} lost"
