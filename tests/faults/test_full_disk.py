"""A full disk (issue 15): sends fail with a typed error, nothing acknowledged is lost, and
writing resumes when space returns, without restarting the broker.

The broker's whole data directory (ledgers and the SQLite metadata store) sits on a real
16 MiB tmpfs when this process may mount one (root in the test container); the test
fills it with a ballast file and later deletes the ballast. Where mounting is not allowed
the same test runs against the fault layer instead: every ledger write and fsync fails
with ENOSPC while the control file says so (``FaultyBrokerProcess.set_disk_errno``), and
the same assertions hold.

A SEND on the full disk is answered SEND_ERROR(PersistenceError, "... No space left on
device ..."): the broker's ``StorageFull``. Clients treat PersistenceError as retriable
(upstream's and ours reconnect and resend), so a producer's sends wait while the disk is
full and are acknowledged once space returns.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import subprocess
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from anabranch.aio import Client
from anabranch.broker.error_codes import server_error
from anabranch.client.producer import Producer
from anabranch.errors import StorageFull, StorageIOError
from anabranch.protocol import commands
from anabranch.protocol._generated import pulsar_api_pb2 as pb
from anabranch.storage.ledger import io_error
from anabranch.testing.faults.standalone import FaultyBrokerProcess
from tests.broker.test_core_protocol import RawClient

pytestmark = pytest.mark.timeout(300)

T = pb.BaseCommand
TOPIC = "persistent://public/default/full-disk"
DISK_SIZE = "16m"


@contextlib.contextmanager
def small_tmpfs(where: Path, wanted: bool) -> Iterator[bool]:
    """Mount a 16 MiB tmpfs at ``where`` if ``wanted`` and this process may; whether it
    did."""
    where.mkdir(parents=True, exist_ok=True)
    if not wanted:
        yield False
        return
    try:
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={DISK_SIZE}", "tmpfs", str(where)],
            check=True,
            capture_output=True,
        )
    except (OSError, subprocess.CalledProcessError):
        yield False
        return
    try:
        yield True
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False, capture_output=True)


class Disk:
    """Fills and frees the broker's disk: a real one (ballast file) or the fault layer."""

    def __init__(self, broker: FaultyBrokerProcess, real: Path | None) -> None:
        self.broker = broker
        self.ballast = real / "ballast" if real is not None else None

    async def fill(self) -> None:
        if self.ballast is None:
            await self.broker.set_disk_errno("ENOSPC")
            return
        fd = os.open(self.ballast, os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            for chunk in (1 << 20, 1 << 12, 1):
                with contextlib.suppress(OSError):
                    while True:
                        os.write(fd, b"\0" * chunk)
        finally:
            os.close(fd)
        with pytest.raises(OSError) as full:  # really full now
            self.ballast.with_name("probe").write_bytes(b"\0" * (1 << 16))
        assert full.value.errno == errno.ENOSPC

    async def free(self) -> None:
        if self.ballast is None:
            await self.broker.set_disk_errno(None)
        else:
            self.ballast.unlink()
            self.ballast.with_name("probe").unlink(missing_ok=True)


@pytest.fixture(params=["tmpfs", "fault-layer"])
async def disk(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Disk]:
    """The broker on a real small disk ("tmpfs", the fault layer if mounting is not
    allowed here) or on the fault layer's ENOSPC."""
    with small_tmpfs(tmp_path / "disk", request.param == "tmpfs") as mounted:
        root = tmp_path / "disk" if mounted else tmp_path
        broker = FaultyBrokerProcess(root / "data")
        await broker.start()
        try:
            yield Disk(broker, root if mounted else None)
        finally:
            await broker.stop()


async def send_error_on_full_disk(port: int) -> pb.CommandSendError:
    """A raw producer's SEND of 64 KiB (more than any free tail of a page) on the full disk."""
    raw = await RawClient.open(port)
    try:
        await raw.handshake()
        await raw.send(commands.producer(TOPIC, 1, 1))
        await raw.expect(T.PRODUCER_SUCCESS)
        md = pb.MessageMetadata(producer_name="raw", sequence_id=1, publish_time=1)
        await raw.send(commands.send(1, 1), md, b"x" * (1 << 16))
        while True:
            frame = await raw.recv()
            assert frame is not None, "closed without an answer to the SEND"
            assert frame.type != T.SEND_RECEIPT, "a SEND was acknowledged on a full disk"
            if frame.type == T.SEND_ERROR:
                error: pb.CommandSendError = frame.command.send_error
                return error
    finally:
        await raw.close()


async def read_all(url: str) -> list[bytes]:
    async with Client(url) as client:
        reader = await client.create_reader(TOPIC, "earliest")
        values = []
        while (msg := await reader.read_next(timeout=3.0)) is not None:
            values.append(msg.value)
        return values


async def test_a_full_disk_refuses_sends_loses_nothing_and_recovers(disk: Disk) -> None:
    broker = disk.broker
    pid = broker.pid
    async with Client(broker.service_url) as client:
        producer = await client.create_producer(TOPIC)
        assert isinstance(producer, Producer)
        acked = [f"before-{i}".encode() for i in range(50)]
        for value in acked:
            await producer.send(value)

        await disk.fill()
        error = await send_error_on_full_disk(broker.port)
        assert error.error == pb.PersistenceError
        assert "No space left on device" in error.message
        # Sends made while the disk is full wait (the producer reconnects and resends)...
        waiting = [await producer.send_async(f"during-{i}".encode()) for i in range(20)]
        await asyncio.sleep(1.0)
        early = [f for f in waiting if f.done()]
        if disk.ballast is None:  # the fault layer fails every write: nothing got through
            assert not early
        await disk.free()
        # ... and are acknowledged once space returns, by the same broker process.
        await asyncio.gather(*waiting)
        acked += [f"during-{i}".encode() for i in range(20)]
        for i in range(50):
            value = f"after-{i}".encode()
            await producer.send(value)
            acked.append(value)
    assert broker.running and broker.pid == pid
    stored = await read_all(broker.service_url)
    missing = [v for v in acked if v not in set(stored)]
    assert not missing, f"{len(missing)} acknowledged messages lost, e.g. {missing[:5]}"


@pytest.mark.parametrize(
    ("code", "full"), [(errno.ENOSPC, True), (errno.EDQUOT, True), (errno.EIO, False)]
)
def test_a_disk_error_is_typed_and_names_no_path(code: int, full: bool) -> None:
    err = io_error(OSError(code, os.strerror(code), "/data/secret/ledger.log"), "ledger 3 write")
    assert isinstance(err, StorageIOError) and err.retriable
    assert isinstance(err, StorageFull) == full
    assert err.http_status == (507 if full else 500)
    assert server_error(err) == pb.PersistenceError  # what clients see, and resend on
    assert "/data" not in str(err) and os.strerror(code) in str(err)
