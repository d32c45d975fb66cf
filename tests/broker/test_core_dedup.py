"""Deduplication by (producer name, sequence id): duplicates are not stored twice, a
rejected send never advances the state, and the state survives restarts."""

from __future__ import annotations

from pathlib import Path

import msgspec

from anabranch.broker.policies import Policies
from anabranch.broker.service import managed_ledger_name
from anabranch.broker.standalone import open_store
from anabranch.client.errors import from_server_error
from anabranch.core.names import TopicName
from anabranch.protocol import commands
from anabranch.protocol._generated import pulsar_api_pb2 as pb
from anabranch.storage.api import EARLIEST
from anabranch.storage.ledger import FileManagedLedgerFactory
from anabranch.testing.broker import BrokerProcess, InProcessBroker
from tests.broker.test_core_protocol import TOPIC, U64_MAX, RawClient, stored

T = pb.BaseCommand


async def enable_dedup(policies: Policies) -> None:
    await policies.update_namespace_policies(
        "public/default", lambda p: msgspec.structs.replace(p, deduplication_enabled=True)
    )


async def named_producer(client: RawClient, name: str = "dedup-p") -> int:
    await client.send(commands.producer(TOPIC, 1, 1, producer_name=name))
    success = (await client.expect(T.PRODUCER_SUCCESS)).command.producer_success
    return int(success.last_sequence_id)


async def send(
    client: RawClient, seq: int, payload: bytes, name: str = "dedup-p"
) -> pb.BaseCommand:
    await client.send_message(1, seq, payload, name)
    frame = await client.recv()
    assert frame is not None
    return frame.command


async def test_duplicates_are_acknowledged_but_not_stored(tmp_path: Path) -> None:
    async with InProcessBroker(tmp_path, max_message_size=1024) as broker:
        await enable_dedup(broker.service.policies)
        client = await RawClient.open(broker.port)
        try:
            await client.handshake()
            assert await named_producer(client) == -1
            for seq in range(3):
                assert (await send(client, seq, b"m%d" % seq)).type == T.SEND_RECEIPT
            dup = (await send(client, 1, b"again")).send_receipt
            ids = (dup.sequence_id, dup.message_id.ledgerId, dup.message_id.entryId)
            assert ids == (1, U64_MAX, U64_MAX)  # upstream's (-1, -1) for a duplicate
            # Rejected sends (too big) do not advance the state: seq 3 is still new after.
            assert (await send(client, 3, b"x" * 2000)).type == T.SEND_ERROR
            assert (await send(client, 3, b"m3")).type == T.SEND_RECEIPT
            assert len(await stored(broker)) == 4
        finally:
            await client.close()


async def test_in_flight_retry_is_answered_after_the_original(tmp_path: Path) -> None:
    async with InProcessBroker(tmp_path) as broker:
        await enable_dedup(broker.service.policies)
        client = await RawClient.open(broker.port)
        try:
            await client.handshake()
            await named_producer(client)
            md = pb.MessageMetadata(producer_name="dedup-p", sequence_id=0, publish_time=1)
            frame = client.conn.send(commands.send(1, 0), md, b"once")
            await client.raw(frame + frame)  # the retry arrives while the first is written
            first = (await client.expect(T.SEND_RECEIPT)).command.send_receipt
            second = (await client.expect(T.SEND_RECEIPT)).command.send_receipt
            assert first.sequence_id == second.sequence_id == 0
            assert first.message_id.entryId == 0
            assert len(await stored(broker)) == 1
        finally:
            await client.close()


async def test_dedup_state_restored_after_sigkill(tmp_path: Path) -> None:
    data = tmp_path / "data"
    proc = BrokerProcess(data)
    try:
        await proc.start()
        await proc.stop()
        # Enable dedup in the broker's own metadata while it is down.
        store = await open_store(f"sqlite:///{data.resolve() / 'metadata.db'}")
        try:
            await enable_dedup(Policies(store))
        finally:
            await store.close()
        await proc.start()
        client = await RawClient.open(proc.port)
        try:
            await client.handshake()
            await named_producer(client)
            for seq in range(5):
                assert (await send(client, seq, b"m%d" % seq)).type == T.SEND_RECEIPT
        finally:
            await client.close()
        proc.kill()  # no clean shutdown: no snapshot written at close
        await proc.start()
        client = await RawClient.open(proc.port)
        try:
            await client.handshake()
            assert await named_producer(client) == 4  # resumes after the last persisted id
            for seq in (2, 4):
                receipt = (await send(client, seq, b"retry")).send_receipt
                assert receipt.message_id.entryId == U64_MAX  # (-1, -1): a duplicate
            assert (await send(client, 5, b"m5")).type == T.SEND_RECEIPT
        finally:
            await client.close()
    finally:
        await proc.stop()
        proc.kill()
    store = await open_store(f"sqlite:///{data.resolve() / 'metadata.db'}")
    try:
        factory = FileManagedLedgerFactory(data / "ledgers", store)
        ledger = await factory.open(managed_ledger_name(TopicName.parse(TOPIC)))
        payloads = [e.data[-2:] for e in await ledger.read(EARLIEST, 100)]
        await factory.close()
    finally:
        await store.close()
    assert payloads == [b"m0", b"m1", b"m2", b"m3", b"m4", b"m5"]


async def test_a_resend_to_a_sealed_topic_of_what_it_stored_is_a_duplicate(
    tmp_path: Path,
) -> None:
    # A receipt lost with a connection at the moment of a seal: the resend must learn the
    # message is stored (a duplicate), not "terminated" — a scalable producer would
    # otherwise re-route it to a child segment and store it twice.
    async with InProcessBroker(tmp_path) as broker:
        await enable_dedup(broker.service.policies)
        client = await RawClient.open(broker.port)
        try:
            await client.handshake()
            await named_producer(client)
            assert (await send(client, 0, b"m0")).type == T.SEND_RECEIPT
            topic = broker.service.loaded_topic(TOPIC)
            assert topic is not None
            await topic.terminate()
            dup = await send(client, 0, b"m0")
            assert dup.type == T.SEND_RECEIPT
            assert dup.send_receipt.message_id.entryId == U64_MAX
            fresh = await send(client, 1, b"m1")
            assert fresh.type == T.SEND_ERROR and fresh.send_error.error == pb.TopicTerminatedError
        finally:
            await client.close()
        # The usual way: the connection dropped, the producer reconnects to the sealed
        # topic (it may attach: the topic holds its messages) and resends.
        again = await RawClient.open(broker.port)
        try:
            await again.handshake()
            assert await named_producer(again) == 0
            dup = await send(again, 0, b"m0")
            assert dup.type == T.SEND_RECEIPT
            assert dup.send_receipt.message_id.entryId == U64_MAX
            fresh = await send(again, 1, b"m1")
            assert fresh.type == T.SEND_ERROR and fresh.send_error.error == pb.TopicTerminatedError
            # A producer the topic holds nothing of cannot attach to it.
            await again.send(commands.producer(TOPIC, 2, 2, producer_name="stranger"))
            refused = (await again.expect(T.ERROR)).command.error
            assert refused.error == pb.TopicTerminatedError
            assert len(await stored(broker)) == 1
        finally:
            await again.close()


async def test_a_send_to_a_closing_topic_is_retriable_not_terminated(tmp_path: Path) -> None:
    # Closing (an unload, a lost ownership) is not sealed: the answer must make the client
    # reconnect and resend in order. "Terminated" would make a scalable producer hold the
    # message for a child while the reloaded segment stores the later ones (seen by the
    # fault harness as a key's messages out of order).
    async with InProcessBroker(tmp_path) as broker:
        await enable_dedup(broker.service.policies)
        client = await RawClient.open(broker.port)
        try:
            await client.handshake()
            await named_producer(client)
            assert (await send(client, 0, b"m0")).type == T.SEND_RECEIPT
            topic = broker.service.loaded_topic(TOPIC)
            assert topic is not None
            topic._closing = True  # the window between an unload's start and its end
            refused = await send(client, 1, b"m1")
            assert refused.type == T.SEND_ERROR
            assert refused.send_error.error == pb.ServiceNotReady
            assert from_server_error(refused.send_error.error, "").retriable
            await client.send(commands.producer(TOPIC, 2, 2, producer_name="another"))
            assert (await client.expect(T.ERROR)).command.error.error == pb.ServiceNotReady
        finally:
            await client.close()
