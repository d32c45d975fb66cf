"""Transaction commands a client gets wrong, on the wire (DESIGN.md §3.2): each gets its
own typed answer in the command's response, nothing is written, the connection and the
broker stay up, and no message of the transaction becomes visible."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from anabranch import limits
from anabranch.protocol import commands
from anabranch.protocol._generated import pulsar_api_pb2 as pb
from anabranch.protocol.frames import Frame
from anabranch.testing.broker import InProcessBroker
from anabranch.transactions import records
from anabranch.transactions.ids import TxnId
from tests.scalable.wire import RawClient

T = pb.BaseCommand
TOPIC = "persistent://public/default/bad"


@contextlib.asynccontextmanager
async def wire(tmp_path: Path, **config: Any) -> AsyncIterator[tuple[InProcessBroker, RawClient]]:
    async with InProcessBroker(tmp_path, metadata="sqlite", **config) as broker:
        client = await RawClient.connect(broker.port)
        try:
            yield broker, client
        finally:
            await client.close()


async def new_txn(client: RawClient, request_id: int, ttl_ms: int = 30_000) -> tuple[int, int]:
    body = pb.CommandNewTxn(request_id=request_id, txn_ttl_millis=ttl_ms, tc_id=0)
    await client.send(T(type=T.NEW_TXN, newTxn=body))
    frame = await client.next(
        lambda f: f.type == T.NEW_TXN_RESPONSE and f.body.request_id == request_id
    )
    reply = frame.command.newTxnResponse
    assert not reply.HasField("error"), reply
    return reply.txnid_most_bits, reply.txnid_least_bits


async def end_txn(
    client: RawClient, request_id: int, txn: tuple[int, int], action: pb.TxnAction
) -> pb.CommandEndTxnResponse:
    body = pb.CommandEndTxn(
        request_id=request_id, txnid_most_bits=txn[0], txnid_least_bits=txn[1], txn_action=action
    )
    await client.send(T(type=T.END_TXN, endTxn=body))
    frame = await client.next(
        lambda f: f.type == T.END_TXN_RESPONSE and f.body.request_id == request_id
    )
    return frame.command.endTxnResponse


async def send_in(
    client: RawClient, producer_id: int, name: str, seq: int, txn: tuple[int, int]
) -> Frame:
    md = pb.MessageMetadata(producer_name=name, sequence_id=seq, publish_time=1)
    cmd = commands.send(producer_id, seq)
    cmd.send.txnid_most_bits, cmd.send.txnid_least_bits = txn
    await client.send(cmd, md, b"payload")
    return await client.next(
        lambda f: f.type in (T.SEND_RECEIPT, T.SEND_ERROR) and f.body.sequence_id == seq
    )


async def add_to_txn(
    client: RawClient, request_id: int, txn: tuple[int, int], topics: list[str], *, partition: bool
) -> Any:
    """ADD_PARTITION_TO_TXN of ``topics`` (or ADD_SUBSCRIPTION_TO_TXN of subscription "s"
    on each); returns the response body."""
    most, least = txn
    if partition:
        body = pb.CommandAddPartitionToTxn(
            request_id=request_id, txnid_most_bits=most, txnid_least_bits=least, partitions=topics
        )
        await client.send(T(type=T.ADD_PARTITION_TO_TXN, addPartitionToTxn=body))
        kind = T.ADD_PARTITION_TO_TXN_RESPONSE
    else:
        body2 = pb.CommandAddSubscriptionToTxn(
            request_id=request_id, txnid_most_bits=most, txnid_least_bits=least,
            subscription=[pb.Subscription(topic=t, subscription="s") for t in topics],
        )  # fmt: skip
        await client.send(T(type=T.ADD_SUBSCRIPTION_TO_TXN, addSubscriptionToTxn=body2))
        kind = T.ADD_SUBSCRIPTION_TO_TXN_RESPONSE
    frame = await client.next(lambda f: f.type == kind and f.body.request_id == request_id)
    return frame.body


async def test_end_of_an_unknown_transaction_is_transaction_not_found(tmp_path: Path) -> None:
    async with wire(tmp_path) as (broker, client):
        reply = await end_txn(client, 1, (0, 987654), pb.COMMIT)
        assert reply.error == pb.TransactionNotFound
        reply = await end_txn(client, 2, (2**64 - 1, 2**64 - 1), pb.ABORT)
        assert reply.error == pb.TransactionNotFound
        assert await broker.service.store.get(records.header_path(TxnId(0, 987654))) is None


async def test_end_is_idempotent_for_the_same_action_and_refuses_the_other(
    tmp_path: Path,
) -> None:
    async with wire(tmp_path) as (_, client):
        txn = await new_txn(client, 1)
        assert not (await end_txn(client, 2, txn, pb.COMMIT)).HasField("error")
        assert not (await end_txn(client, 3, txn, pb.COMMIT)).HasField("error")
        assert (await end_txn(client, 4, txn, pb.ABORT)).error == pb.InvalidTxnStatus


async def test_a_send_in_a_finished_transaction_is_refused_and_not_stored(tmp_path: Path) -> None:
    async with wire(tmp_path) as (broker, client):
        await client.producer(TOPIC, 1, "p")
        txn = await new_txn(client, 10)
        assert (await send_in(client, 1, "p", 0, txn)).type == T.SEND_RECEIPT
        assert not (await end_txn(client, 11, txn, pb.ABORT)).HasField("error")
        late = await send_in(client, 1, "p", 1, txn)
        assert late.type == T.SEND_ERROR
        assert late.command.send_error.error == pb.TransactionConflict
        topic = broker.service.loaded_topic(TOPIC)
        assert topic is not None and topic.ledger.entry_count == 1
        # The connection still works: a plain send is stored.
        assert (await client.produce(1, "p", 2, b"plain")).type == T.SEND_RECEIPT


async def test_a_send_in_an_unknown_transaction_is_refused(tmp_path: Path) -> None:
    async with wire(tmp_path) as (broker, client):
        await client.producer(TOPIC, 1, "p")
        reply = await send_in(client, 1, "p", 0, (0, 424242))
        assert reply.type == T.SEND_ERROR
        assert reply.command.send_error.error in (pb.TransactionNotFound, pb.TransactionConflict)
        topic = broker.service.loaded_topic(TOPIC)
        assert topic is not None and topic.ledger.entry_count == 0


async def test_a_send_after_the_timeout_is_refused(tmp_path: Path) -> None:
    async with wire(tmp_path) as (_, client):
        await client.producer(TOPIC, 1, "p")
        txn = await new_txn(client, 1, ttl_ms=1)
        await asyncio.sleep(0.05)
        reply = await send_in(client, 1, "p", 0, txn)
        assert reply.type == T.SEND_ERROR
        assert reply.command.send_error.error == pb.TransactionConflict
        assert (await end_txn(client, 2, txn, pb.COMMIT)).error == pb.InvalidTxnStatus


async def test_transactions_disabled_answers_coordinator_not_found(tmp_path: Path) -> None:
    async with wire(tmp_path, transactions_enabled=False) as (_, client):
        body = pb.CommandTcClientConnectRequest(request_id=1, tc_id=0)
        await client.send(T(type=T.TC_CLIENT_CONNECT_REQUEST, tcClientConnectRequest=body))
        frame = await client.next(lambda f: f.type == T.TC_CLIENT_CONNECT_RESPONSE)
        assert frame.command.tcClientConnectResponse.error == pb.TransactionCoordinatorNotFound
        body2 = pb.CommandNewTxn(request_id=2, txn_ttl_millis=1000)
        await client.send(T(type=T.NEW_TXN, newTxn=body2))
        frame = await client.next(lambda f: f.type == T.NEW_TXN_RESPONSE)
        assert frame.command.newTxnResponse.error == pb.TransactionCoordinatorNotFound
        await client.producer(TOPIC, 1, "p")
        reply = await send_in(client, 1, "p", 0, (0, 1))
        assert reply.command.send_error.error == pb.TransactionCoordinatorNotFound


async def test_a_coordinator_partition_that_does_not_exist(tmp_path: Path) -> None:
    async with wire(tmp_path) as (_, client):
        body = pb.CommandTcClientConnectRequest(request_id=1, tc_id=10_000)
        await client.send(T(type=T.TC_CLIENT_CONNECT_REQUEST, tcClientConnectRequest=body))
        frame = await client.next(lambda f: f.type == T.TC_CLIENT_CONNECT_RESPONSE)
        assert frame.command.tcClientConnectResponse.error == pb.TransactionCoordinatorNotFound
        body2 = pb.CommandNewTxn(request_id=2, txn_ttl_millis=1000, tc_id=10_000)
        await client.send(T(type=T.NEW_TXN, newTxn=body2))
        frame = await client.next(lambda f: f.type == T.NEW_TXN_RESPONSE)
        assert frame.command.newTxnResponse.error == pb.TransactionCoordinatorNotFound


async def test_too_many_participants_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(limits, "TXN_OP_RECORDS_MAX", 3)
    async with wire(tmp_path) as (_, client):
        txn = await new_txn(client, 1)
        answers = []
        for i in range(5):
            await client.producer(f"{TOPIC}-{i}", i + 1, f"p{i}")
            answers.append(await send_in(client, i + 1, f"p{i}", 0, txn))
        assert [a.type for a in answers[:3]] == [T.SEND_RECEIPT] * 3
        refused = answers[3].command.send_error
        assert answers[3].type == T.SEND_ERROR and refused.error == pb.NotAllowedError
        assert "transaction" in refused.message.lower()


async def subscribed(client: RawClient, consumer_id: int, *, durable: bool = True) -> None:
    cmd = commands.subscribe(
        TOPIC, f"sub-{durable}", pb.CommandSubscribe.Shared, consumer_id, 100 + consumer_id,
        initial_position=pb.CommandSubscribe.Earliest,
    )  # fmt: skip
    cmd.subscribe.durable = durable
    await client.send(cmd)
    frame = await client.next(lambda f: f.type in (T.SUCCESS, T.ERROR))
    assert frame.type == T.SUCCESS, frame.command


async def txn_ack(
    client: RawClient, consumer_id: int, request_id: int, position: tuple[int, int],
    txn: tuple[int, int],
) -> pb.CommandAckResponse:  # fmt: skip
    msg_id = pb.MessageIdData(ledgerId=position[0], entryId=position[1])
    cmd = commands.ack(consumer_id, [msg_id], request_id=request_id)
    cmd.ack.txnid_most_bits, cmd.ack.txnid_least_bits = txn
    await client.send(cmd)
    frame = await client.next(
        lambda f: f.type == T.ACK_RESPONSE and f.command.ackResponse.request_id == request_id
    )
    return frame.command.ackResponse


async def stored_position(client: RawClient) -> tuple[int, int]:
    await client.producer(TOPIC, 1, "p")
    receipt = await client.produce(1, "p", 0, b"m")
    assert receipt.type == T.SEND_RECEIPT
    mid = receipt.command.send_receipt.message_id
    return mid.ledgerId, mid.entryId


async def test_an_ack_pending_in_one_transaction_conflicts_with_another(tmp_path: Path) -> None:
    async with wire(tmp_path) as (_, client):
        position = await stored_position(client)
        await subscribed(client, 7)
        first, second = await new_txn(client, 1), await new_txn(client, 2)
        assert not (await txn_ack(client, 7, 3, position, first)).HasField("error")
        refused = await txn_ack(client, 7, 4, position, second)
        assert refused.error == pb.TransactionConflict
        # A plain ack of the held message is refused too; after the abort it is free.
        assert not (await end_txn(client, 5, first, pb.ABORT)).HasField("error")
        assert not (await txn_ack(client, 7, 6, position, second)).HasField("error")


async def test_an_ack_after_the_timeout_is_refused(tmp_path: Path) -> None:
    async with wire(tmp_path) as (_, client):
        position = await stored_position(client)
        await subscribed(client, 7)
        txn = await new_txn(client, 1, ttl_ms=1)
        await asyncio.sleep(0.05)
        refused = await txn_ack(client, 7, 2, position, txn)
        assert refused.error == pb.TransactionConflict
        assert "timed out" in refused.message


async def test_a_non_durable_subscription_cannot_ack_in_a_transaction(tmp_path: Path) -> None:
    async with wire(tmp_path) as (_, client):
        position = await stored_position(client)
        await subscribed(client, 8, durable=False)
        txn = await new_txn(client, 1)
        refused = await txn_ack(client, 8, 2, position, txn)
        assert refused.error == pb.TransactionConflict
        assert "non-durable" in refused.message


async def test_add_partition_and_subscription_check_that_the_transaction_is_open(
    tmp_path: Path,
) -> None:
    async with wire(tmp_path) as (_, client):
        txn = await new_txn(client, 1)

        async def add(request_id: int, txn: tuple[int, int], partition: bool) -> Any:
            return await add_to_txn(client, request_id, txn, [TOPIC], partition=partition)

        for partition in (True, False):
            ok = await add(2 if partition else 3, txn, partition)
            assert not ok.HasField("error") and ok.txnid_least_bits == txn[1]
            unknown = await add(4 if partition else 5, (0, 99999), partition)
            assert unknown.error == pb.TransactionNotFound
        assert not (await end_txn(client, 6, txn, pb.COMMIT)).HasField("error")
        finished = await add(7, txn, True)
        assert finished.error == pb.TransactionConflict


async def test_a_request_naming_more_participants_than_a_transaction_may_have(
    tmp_path: Path,
) -> None:
    # Refused from the count, before any per-name work: repeating a produced topic's name
    # a million times must not cost a million name parses (nor a million joins).
    async with wire(tmp_path) as (_, client):
        await client.producer(TOPIC, 1, "p")
        txn = await new_txn(client, 1)
        too_many = [TOPIC] * (limits.TXN_OP_RECORDS_MAX + 1)
        for request_id, partition in ((2, True), (3, False)):
            refused = await add_to_txn(client, request_id, txn, too_many, partition=partition)
            assert refused.error == pb.NotAllowedError
            assert "participants" in refused.message
        # The limit itself is fine, a name repeated joins once, and the txn is still usable.
        at_limit = too_many[: limits.TXN_OP_RECORDS_MAX]
        assert not (await add_to_txn(client, 4, txn, at_limit, partition=True)).HasField("error")
        assert not (await end_txn(client, 5, txn, pb.COMMIT)).HasField("error")
