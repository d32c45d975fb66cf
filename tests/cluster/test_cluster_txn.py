"""Transactions on the three-broker etcd cluster: any broker serves every coordinator
partition, participants on other brokers learn outcomes from their header watch, and the
broker a client opened its transaction through can die without taking the transaction
with it (its state is in etcd, not in the broker).
"""

from __future__ import annotations

from anabranch.aio import Client
from anabranch.protocol._generated import pulsar_api_pb2 as pb
from anabranch.testing.cluster import LocalCluster
from tests.cluster.local_cluster import fresh_name, others, read_all
from tests.scalable.wire import RawClient

T = pb.BaseCommand


async def end_via(
    port: int, txn: tuple[int, int], action: pb.TxnAction
) -> pb.CommandEndTxnResponse:
    raw = await RawClient.connect(port)
    try:
        body = pb.CommandEndTxn(
            request_id=1, txnid_most_bits=txn[0], txnid_least_bits=txn[1], txn_action=action
        )
        await raw.send(T(type=T.END_TXN, endTxn=body))
        frame = await raw.next(lambda f: f.type == T.END_TXN_RESPONSE)
        return frame.command.endTxnResponse
    finally:
        await raw.close()


async def test_a_commit_through_one_broker_reaches_participants_on_the_others(
    three_brokers: LocalCluster,
) -> None:
    cluster = three_brokers
    topics = [f"persistent://public/default/{fresh_name('txn-x')}" for _ in range(6)]
    first = cluster.brokers[0]
    async with Client(first.service_url) as client:
        producers = [await client.create_producer(t) for t in topics]
        txn = await client.new_transaction(timeout=60)
        for producer in producers:
            await producer.send(b"in-txn", txn=txn)
        for t in topics:
            assert await read_all(cluster.brokers[1].service_url, t) == []
        await txn.commit()
    owners = {(await cluster.owner_of(t)).broker_id for t in topics}
    assert len(owners) > 1, "the topics should spread over brokers for this test to mean much"
    for t in topics:
        assert await read_all(cluster.brokers[2].service_url, t) == [b"in-txn"], t


async def test_the_coordinators_broker_killed_before_the_commit(
    three_brokers: LocalCluster,
) -> None:
    cluster = three_brokers
    topics = [f"persistent://public/default/{fresh_name('txn-kill')}" for _ in range(3)]
    doomed = cluster.brokers[0]
    async with Client(doomed.service_url) as client:
        producers = [await client.create_producer(t) for t in topics]
        txn = await client.new_transaction(timeout=120)
        for producer in producers:
            await producer.send(b"in-txn", txn=txn)
            await producer.send(b"after")
        txn_id = (txn.id[0], txn.id[1])
        doomed.kill()
    survivor = others(cluster, doomed)[0]
    reply = await end_via(survivor.port, txn_id, pb.COMMIT)
    assert not reply.HasField("error"), reply
    # A retry through the other survivor is idempotent; the opposite action is refused.
    again = await end_via(others(cluster, doomed)[1].port, txn_id, pb.COMMIT)
    assert not again.HasField("error")
    refused = await end_via(survivor.port, txn_id, pb.ABORT)
    assert refused.error == pb.InvalidTxnStatus
    for t in topics:
        assert await read_all(survivor.service_url, t) == [b"in-txn", b"after"], t
