"""Transaction ownership (Pulsar's rule): with authentication on, only the role that
opened a transaction, or a superuser, may add to it or end it. Anyone else gets
TransactionNotFound, as upstream answers, and the transaction is untouched."""

from __future__ import annotations

from pathlib import Path

from anabranch.aio import Client
from anabranch.client.transaction import TransactionState
from anabranch.protocol import commands
from anabranch.protocol._generated import pulsar_api_pb2 as pb
from anabranch.storage.api import Position
from anabranch.transactions.ids import TxnId
from anabranch.transactions.records import TxnState
from tests.scalable.wire import RawClient
from tests.security.authz_world import CONSUMER, PRODUCER, SUPERUSER, TENANT_ADMIN, TOPIC, world
from tests.transactions.test_txn_bad_input import add_to_txn, end_txn, send_in, txn_ack

T = pb.BaseCommand


async def test_only_the_owner_or_a_superuser_may_add_to_or_end_a_transaction(
    tmp_path: Path,
) -> None:
    async with world(tmp_path) as w:
        url, port = w.broker.service_url, w.broker.port
        coordinator = w.broker.service.txn_coordinator
        assert coordinator is not None
        async with Client(url, auth_token=w.auth.token(PRODUCER)) as owner:
            producer = await owner.create_producer(TOPIC)
            txn = await owner.new_transaction(timeout=60)
            await producer.send(b"in txn", txn=txn)
            ids = (txn.id.most_bits, txn.id.least_bits)
            other = await RawClient.connect(port, token=w.auth.token(CONSUMER))
            try:
                for action in (pb.ABORT, pb.COMMIT):
                    reply = await end_txn(other, 1, ids, action)
                    assert reply.error == pb.TransactionNotFound
                    assert "neither the owner" in reply.message
                for n, partition in enumerate((True, False)):
                    body = await add_to_txn(other, 2 + n, ids, [TOPIC], partition=partition)
                    assert body.error == pb.TransactionNotFound
            finally:
                await other.close()
            header = await coordinator.get(TxnId(*ids))
            assert header is not None and header.state is TxnState.OPEN
            await txn.commit()  # the owner still decides
            assert txn.state is TransactionState.COMMITTED

            second = await owner.new_transaction(timeout=60)
            ids = (second.id.most_bits, second.id.least_bits)
            admin = await RawClient.connect(port, token=w.auth.token(SUPERUSER))
            try:
                body = await add_to_txn(admin, 1, ids, [TOPIC], partition=True)
                assert not body.HasField("error")
                reply = await end_txn(admin, 2, ids, pb.ABORT)
                assert not reply.HasField("error")
            finally:
                await admin.close()
            header = await coordinator.get(TxnId(*ids))
            assert header is not None and header.state is TxnState.ABORTED


async def test_a_send_or_an_ack_in_another_roles_transaction_is_refused(
    tmp_path: Path,
) -> None:
    """A role allowed to produce (or consume) on the topic still may not write into a
    transaction it does not own by sending (acking) with its id: the send is refused and
    not stored, the ack is refused and not pending; the owner's own work commits."""
    async with world(tmp_path) as w:
        url, port = w.broker.service_url, w.broker.port
        async with Client(url, auth_token=w.auth.token(TENANT_ADMIN)) as owner:
            producer = await owner.create_producer(TOPIC)
            stored = await producer.send(b"plain")
            txn = await owner.new_transaction(timeout=60)
            await producer.send(b"mine", txn=txn)
            ids = (txn.id.most_bits, txn.id.least_bits)

            writer = await RawClient.connect(port, token=w.auth.token(PRODUCER))
            reader = await RawClient.connect(port, token=w.auth.token(CONSUMER))
            try:
                await writer.producer(TOPIC, 1, "intruder")
                refused = await send_in(writer, 1, "intruder", 0, ids)
                assert refused.type == T.SEND_ERROR
                assert refused.body.error == pb.TransactionNotFound
                await reader.send(
                    commands.subscribe(TOPIC, "s", pb.CommandSubscribe.Shared, 1, 10,
                                       initial_position=pb.CommandSubscribe.Earliest)
                )  # fmt: skip
                subscribed = await reader.next(lambda f: f.type in (T.SUCCESS, T.ERROR))
                assert subscribed.type == T.SUCCESS, subscribed.command
                position = (stored.ledger_id, stored.entry_id)
                ack = await txn_ack(reader, 1, 11, position, ids)
                assert ack.error == pb.TransactionNotFound
            finally:
                await writer.close()
                await reader.close()
            topic = w.broker.service.loaded_topic(TOPIC)
            assert topic is not None
            assert not topic.subscriptions["s"].pending_acks.is_pending(Position(*position))
            await txn.commit()

        async with Client(url, auth_token=w.auth.token(SUPERUSER)) as admin:
            check = await admin.create_reader(TOPIC, "earliest")
            values = []
            while (msg := await check.read_next(timeout=0.5)) is not None:
                values.append(msg.value)
            assert values == [b"plain", b"mine"]
