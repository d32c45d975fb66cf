"""The harness's small tools: the proxy's partition and delay, the seeded schedule, the
control file, lose-unfsynced and the launcher's seams."""

from __future__ import annotations

import asyncio
import errno
import itertools
import random
import subprocess
import time
from pathlib import Path

import pytest

from anabranch.broker import standalone
from anabranch.testing.broker import BrokerProcess
from anabranch.testing.faults.control import Control, ControlReader, write_control
from anabranch.testing.faults.disk import ControlledOpener, lose_unfsynced
from anabranch.testing.faults.launcher import SEAMS
from anabranch.testing.faults.nemesis import KINDS, Fault, schedule
from anabranch.testing.tcp_proxy import TcpProxy


async def _echo_server() -> asyncio.Server:
    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(1024):
            writer.write(data)
            await writer.drain()
        writer.close()

    return await asyncio.start_server(echo, "127.0.0.1", 0)


async def test_a_partition_swallows_bytes_and_the_heal_drops_the_connection() -> None:
    server = await _echo_server()
    proxy = await TcpProxy.start("127.0.0.1", server.sockets[0].getsockname()[1])
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        writer.write(b"a")
        assert await asyncio.wait_for(reader.read(1), 5.0) == b"a"
        proxy.partition()
        writer.write(b"b")
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(reader.read(1), 0.3)
        proxy.heal()
        assert await asyncio.wait_for(reader.read(1), 5.0) == b""  # dropped
        writer.close()
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        writer.write(b"c")
        assert await asyncio.wait_for(reader.read(1), 5.0) == b"c"
        writer.close()
    finally:
        await proxy.close()
        server.close()


async def test_a_connection_made_during_a_partition_is_accepted_and_never_answered() -> None:
    server = await _echo_server()
    proxy = await TcpProxy.start("127.0.0.1", server.sockets[0].getsockname()[1])
    try:
        proxy.partition()
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        writer.write(b"a")
        with pytest.raises(TimeoutError):  # a cut cable: no reset, no answer
            await asyncio.wait_for(reader.read(1), 0.3)
        assert proxy.connections_total == 0  # nothing reached the server
        proxy.heal()
        assert await asyncio.wait_for(reader.read(1), 5.0) == b""  # dropped at the heal
        writer.close()
    finally:
        await proxy.close()
        server.close()


async def test_a_delayed_link_holds_each_chunk() -> None:
    server = await _echo_server()
    proxy = await TcpProxy.start("127.0.0.1", server.sockets[0].getsockname()[1])
    try:
        proxy.delay_s = 0.2
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        began = time.monotonic()
        writer.write(b"x")
        assert await asyncio.wait_for(reader.read(1), 5.0) == b"x"
        assert time.monotonic() - began >= 0.4  # held once each way
        writer.close()
        await writer.wait_closed()
    finally:
        await proxy.close()
        server.close()


def test_the_schedule_is_a_function_of_the_seed() -> None:
    def draw(seed: int) -> list[Fault]:
        return list(schedule(random.Random(seed), KINDS, 60.0, session_ttl_s=3.0))

    assert draw(5) == draw(5)
    assert draw(5) != draw(6)
    faults = draw(5)
    for before, after in itertools.pairwise(faults):
        assert after.at_s >= before.at_s + before.duration_s  # one fault at a time
    assert all(f.at_s + f.duration_s <= 60.0 for f in faults)


def test_a_disk_fault_fails_writes_and_syncs_until_cleared(tmp_path: Path) -> None:
    control = tmp_path / "control.json"
    opener = ControlledOpener(ControlReader(control, poll_interval_s=0.0), "b1")
    f = opener(tmp_path / "l.log")
    write_control(control, Control(disk_errno="ENOSPC"))
    with pytest.raises(OSError) as err:
        f.write(b"x")
    assert err.value.errno == errno.ENOSPC
    write_control(control, Control())
    f.write(b"x")
    f.sync()
    f.close()


def test_lose_unfsynced_cuts_only_the_crashed_brokers_files(tmp_path: Path) -> None:
    reader = ControlReader(tmp_path / "control.json")
    mine, other = (
        ControlledOpener(reader, "b0")(tmp_path / "a.log"),
        ControlledOpener(reader, "b1")(tmp_path / "b.log"),
    )
    for f in (mine, other):
        f.write(b"synced")
        f.sync()
        f.write(b"-cached")
        f.close()
    assert lose_unfsynced(tmp_path, "b0") == 1
    assert (tmp_path / "a.log").read_bytes() == b"synced"
    assert (tmp_path / "b.log").read_bytes() == b"synced-cached"


def test_the_launcher_seams_exist() -> None:
    assert all(hasattr(standalone, name) for name in SEAMS)


class _SlowSpawn(BrokerProcess):
    """Launches after a pause, so a cancel lands while the launch thread is busy."""

    def _spawn(self, args: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
        time.sleep(0.3)
        return super()._spawn(args, env)


async def test_a_start_cancelled_during_the_launch_leaves_no_process_running(
    tmp_path: Path,
) -> None:
    broker = _SlowSpawn(tmp_path / "b")
    start = asyncio.create_task(broker.start())
    await asyncio.sleep(0.1)
    start.cancel()
    with pytest.raises(asyncio.CancelledError):
        await start
    assert broker.process is not None  # the launched process is owned...
    assert broker.process.poll() is not None  # ...and was killed and reaped


class _CountedSpawn(_SlowSpawn):
    """Counts its launches (slow ones, so two starts overlap in the launch)."""

    launches = 0

    def _spawn(self, args: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
        self.launches += 1
        return super()._spawn(args, env)


async def test_two_starts_at_once_launch_one_broker(tmp_path: Path) -> None:
    """A fault's restart and the heal's may start a broker at the same moment: one process
    is launched, and it is the one remembered (so it is the one stopped)."""
    broker = _CountedSpawn(tmp_path / "b")
    try:
        await asyncio.gather(broker.start(), broker.start())
        assert broker.launches == 1
        assert broker.running
    finally:
        await broker.stop()
    assert broker.process is not None and broker.process.poll() is not None
