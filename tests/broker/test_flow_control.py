"""Producer flow control: a connection flooding SENDs at a stalled disk is held at
``SESSION_PENDING_APPENDS_MAX`` pending appends (its socket is no longer read), other
connections go on, and once the disk moves every send is receipted, in order.

The disk is stalled deterministically: the slow topic's ledger files come from an opener
whose ``sync`` waits on a gate the test opens (no sleeps, no timing assumptions).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from anabranch import limits
from anabranch.broker.producer import Producer
from anabranch.broker.session import Session
from anabranch.protocol import commands
from anabranch.protocol._generated import pulsar_api_pb2 as pb
from anabranch.storage.files import OsFile, StorageFile
from anabranch.storage.ledger import FileManagedLedgerFactory
from anabranch.testing.broker import InProcessBroker
from tests.broker.test_core_protocol import RawClient

T = pb.BaseCommand
SLOW = "persistent://public/default/slow-disk"
FAST = "persistent://public/default/fast-disk"
BOUND = 40
FLOOD = 400


class GatedFile(OsFile):
    """An OsFile whose fdatasync of written data waits until ``gate`` is set (a stalled
    disk); creating the file (a sync with nothing written) goes through."""

    def __init__(self, path: Path, gate: threading.Event) -> None:
        super().__init__(path)
        self._gate = gate
        self._dirty = False

    def write(self, data: bytes) -> None:
        super().write(data)
        self._dirty = True

    def sync(self) -> None:
        if self._dirty:
            self._gate.wait()
        super().sync()


@pytest.fixture
async def broker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[InProcessBroker]:
    monkeypatch.setattr(limits, "SESSION_PENDING_APPENDS_MAX", BOUND)
    async with InProcessBroker(tmp_path, metadata="memory") as b:
        yield b


def stall_slow_topic(broker: InProcessBroker) -> threading.Event:
    """From now on, ledger files of the slow topic sync only once the gate opens."""
    factory = broker.service.ledgers
    assert isinstance(factory, FileManagedLedgerFactory)
    gate = threading.Event()
    plain = factory.opener

    def opener(path: Path) -> StorageFile:
        return GatedFile(path, gate) if "slow-disk" in str(path) else plain(path)

    factory.opener = opener
    return gate


def session_of(broker: InProcessBroker, producer_name: str) -> Session:
    assert broker.node is not None
    [session] = [
        s
        for s in broker.node.server.sessions
        if any(p.name == producer_name for p in s.producers.values())
    ]
    return session


async def until(condition: Callable[[], bool], what: str) -> None:
    """Let the broker run until ``condition()`` holds; fail with ``what`` if it never does."""
    for _ in range(2000):  # 10 s of 5 ms polls: a readable failure instead of a hang
        if condition():
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"never happened: {what}")


async def test_flooding_producer_is_held_at_the_bound_and_others_go_on(
    broker: InProcessBroker, monkeypatch: pytest.MonkeyPatch
) -> None:
    peak = {"pending": 0}
    original_send = Producer.send

    def counting_send(self: Producer, frame: object) -> None:
        original_send(self, frame)  # type: ignore[arg-type]
        peak["pending"] = max(peak["pending"], self.session.pending_appends)

    monkeypatch.setattr(Producer, "send", counting_send)
    gate = stall_slow_topic(broker)
    flooder = await RawClient.open(broker.port)
    other = await RawClient.open(broker.port)
    try:
        await flooder.handshake()
        await flooder.send(commands.producer(SLOW, 1, 1, "flooder"))
        await flooder.expect(T.PRODUCER_SUCCESS)
        session = session_of(broker, "flooder")

        # Every SEND goes out at once; the broker may stop reading before it has them all.
        frames = b"".join(
            flooder.conn.send(
                commands.send(1, seq),
                pb.MessageMetadata(producer_name="flooder", sequence_id=seq, publish_time=1),
                b"m",
            )
            for seq in range(FLOOD)
        )
        flood = asyncio.ensure_future(flooder.raw(frames))
        await until(
            lambda: session.reading_paused and session.pending_appends >= BOUND,
            "the flooder's connection paused at the bound",
        )

        # Held at the bound while the disk is stalled: nothing more is taken on.
        for _ in range(20):
            await asyncio.sleep(0.005)
            assert session.pending_appends == BOUND
            assert session.reading_paused
        assert peak["pending"] == BOUND

        # Another connection (another topic, a working disk) is unaffected.
        await other.handshake()
        await other.send(commands.producer(FAST, 7, 1, "other"))
        await other.expect(T.PRODUCER_SUCCESS)
        for seq in range(10):
            await other.send_message(7, seq, b"fine", name="other")
        receipts = [await other.expect(T.SEND_RECEIPT) for _ in range(10)]
        assert [r.command.send_receipt.sequence_id for r in receipts] == list(range(10))
        await other.send(commands.ping())
        await other.expect(T.PONG)

        # The disk moves: every flooded send is receipted, in order, and reading resumes.
        gate.set()
        await flood
        got = [await flooder.expect(T.SEND_RECEIPT) for _ in range(FLOOD)]
        assert [r.command.send_receipt.sequence_id for r in got] == list(range(FLOOD))
        assert peak["pending"] == BOUND  # never above it, all the way through
        await until(
            lambda: session.pending_appends == 0 and not session.reading_paused,
            "reading resumed with nothing pending",
        )
        topic = broker.service.loaded_topic(SLOW)
        assert topic is not None and topic.ledger.entry_count == FLOOD
    finally:
        gate.set()
        await flooder.close()
        await other.close()
