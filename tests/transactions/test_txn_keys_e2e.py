"""Transaction keys end to end: a real in-process broker and our clients (aio and sync).

What an application sees: a second client with the same ``transaction_key`` fences the
first (its open transaction is aborted and never visible, its connection is closed, its
transaction calls raise ``ExpiredTransactionError``); a reconnect keeps the epoch; a key
with ``&`` is refused at construction; the commit-vs-fence race has one winner and each
reply matches the header.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

import anabranch
from anabranch import limits
from anabranch.aio import Client
from anabranch.core.txn_keys import key_id
from anabranch.errors import InvalidArgument
from anabranch.protocol._generated import pulsar_api_pb2 as pb
from anabranch.testing.broker import InProcessBroker
from anabranch.transactions.keys import TransactionKeys
from anabranch.transactions.records import TxnState
from tests.scalable.wire import RawClient

QUIET_S = 0.3
RECEIVE_S = 5.0
E2E_RACE_ROUNDS = 30
E2E_RACE_ROUNDS_MAX = 200
T = pb.BaseCommand


@contextlib.asynccontextmanager
async def running(tmp_path: Path) -> AsyncIterator[InProcessBroker]:
    async with InProcessBroker(tmp_path, metadata="sqlite") as broker:
        yield broker


def keys_of(broker: InProcessBroker) -> TransactionKeys:
    keys = broker.service.txn_keys
    assert keys is not None
    return keys


def topic(name: str) -> str:
    return f"persistent://public/default/{name}"


async def values(consumer: Any) -> list[bytes]:
    out: list[bytes] = []
    while (msg := await consumer.receive(timeout=QUIET_S)) is not None:
        out.append(msg.value)
    return out


async def test_second_client_fences_the_first(tmp_path: Path) -> None:
    async with running(tmp_path) as broker:
        keys = keys_of(broker)
        old = Client(broker.service_url, transaction_key="etl-7")
        new = Client(broker.service_url, transaction_key="etl-7")
        reader = Client(broker.service_url)
        try:
            producer = await old.create_producer(topic("fence"))
            consumer = await reader.subscribe(topic("fence"), "s", initial_position="earliest")
            txn = await old.new_transaction(timeout=30)
            await producer.send(b"zombie", txn=txn)
            (old_binding,) = keys._bindings[key_id("", "etl-7")]

            assert await new.claim_transaction_key() == 1
            assert old_binding.fenced and old_binding.session.closed  # old connection closed
            header = await broker.service.txn_coordinator.get(txn.id)  # type: ignore[union-attr]
            assert header is not None and header.state is TxnState.ABORTED
            with pytest.raises(anabranch.ExpiredTransactionError, match="fenced"):
                await old.new_transaction(timeout=30)
            # Once the client knows, sends in its old transaction fail without the wire.
            with pytest.raises(anabranch.ExpiredTransactionError, match="key was fenced"):
                await producer.send(b"late", txn=txn)
            with pytest.raises(anabranch.ExpiredTransactionError, match="fenced"):
                await txn.commit()

            out = await new.create_producer(topic("fence"))
            async with new.transaction(timeout=30) as fresh:
                await out.send(b"fresh", txn=fresh)
            assert await values(consumer) == [b"fresh"]  # nothing of the fenced txn
            assert keys.connections("", "etl-7") == 1
        finally:
            for client in (old, new, reader):
                await client.close()


async def test_reconnect_keeps_the_epoch_and_the_transaction(tmp_path: Path) -> None:
    async with running(tmp_path) as broker:
        keys = keys_of(broker)
        client = Client(broker.service_url, transaction_key="job")
        reader = Client(broker.service_url)
        try:
            producer = await client.create_producer(topic("again"))
            consumer = await reader.subscribe(topic("again"), "s", initial_position="earliest")
            txn = await client.new_transaction(timeout=30)
            await producer.send(b"kept", txn=txn)
            (binding,) = keys._bindings[key_id("", "job")]
            binding.session.close()  # the connection drops (no fence)
            await txn.commit()  # END_TXN on a new connection: TC_CLIENT_CONNECT epoch 0
            assert await client.claim_transaction_key() == 0
            assert await values(consumer) == [b"kept"]
            info = await keys.describe("", "job")
            assert info["epoch"] == 0 and info["txnStatus"] == "COMMITTED"
        finally:
            await client.close()
            await reader.close()


def test_keys_with_ampersand_are_refused_at_construction() -> None:
    with pytest.raises(InvalidArgument, match="&"):
        Client("pulsar://127.0.0.1:1", transaction_key="a&b")
    with pytest.raises(InvalidArgument, match="&"):
        anabranch.Client("pulsar://127.0.0.1:1", transaction_key="a&b")
    with pytest.raises(InvalidArgument):
        Client("pulsar://127.0.0.1:1", transaction_key="")


async def test_sync_clients_fence(tmp_path: Path) -> None:
    async with running(tmp_path) as broker:
        url = broker.service_url

        def scenario() -> None:
            with anabranch.Client(url, transaction_key="sync-key") as old:
                txn = old.new_transaction(timeout=30)
                with anabranch.Client(url, transaction_key="sync-key") as new:
                    assert new.claim_transaction_key() == 1
                    with pytest.raises(anabranch.ExpiredTransactionError):
                        txn.commit()
                    new.new_transaction(timeout=30).commit()

        await asyncio.to_thread(scenario)


async def test_race_old_owner_commits_while_new_client_fences(tmp_path: Path) -> None:
    """Each round races a commit against a fence of the same key: exactly one wins, and
    the header says which. Which side tends to win depends on the machine's load (a fence
    opens a connection), so the commit's head start shrinks while only commits win and
    grows while only fences do, until both outcomes were seen at least once."""
    async with running(tmp_path) as broker:
        tc = broker.service.txn_coordinator
        assert tc is not None
        rng = random.Random(11)
        outcomes = {"committed": 0, "fenced": 0}
        lead_s = 0.0  # the commit's head start (negative: it starts later)
        for round_ in range(E2E_RACE_ROUNDS_MAX):
            if round_ >= E2E_RACE_ROUNDS and min(outcomes.values()) > 0:
                break
            key = f"race-{round_}"
            old = Client(broker.service_url, transaction_key=key)
            new = Client(broker.service_url, transaction_key=key)
            try:
                txn = await old.new_transaction(timeout=30)
                commit_delay = max(0.0, -lead_s) + rng.random() * 0.004
                fence_delay = max(0.0, lead_s) + rng.random() * 0.004

                async def commit(txn: Any = txn, delay: float = commit_delay) -> str:
                    await asyncio.sleep(delay)
                    try:
                        await txn.commit()
                    except anabranch.ExpiredTransactionError:
                        return "fenced"
                    return "committed"

                async def fence(new: Client = new, delay: float = fence_delay) -> int:
                    await asyncio.sleep(delay)
                    return await new.claim_transaction_key()

                reply, epoch = await asyncio.gather(commit(), fence())
                assert epoch == 1
                header = await tc.get(txn.id)
                assert header is not None
                expected = TxnState.COMMITTED if reply == "committed" else TxnState.ABORTED
                assert header.state is expected, (round_, reply, header)
                outcomes[reply] += 1
                if not outcomes["fenced"]:
                    lead_s -= 0.002
                elif not outcomes["committed"]:
                    lead_s += 0.002
            finally:
                await old.close()
                await new.close()
        assert outcomes["committed"] > 0 and outcomes["fenced"] > 0, outcomes


async def tc_connect(client: Any, request_id: int, key: str, epoch: int | None) -> Any:
    body = pb.CommandTcClientConnectRequest(request_id=request_id, tc_id=0, transaction_key=key)
    if epoch is not None:
        body.epoch = epoch
    await client.send(pb.BaseCommand(type=T.TC_CLIENT_CONNECT_REQUEST, tcClientConnectRequest=body))
    frame = await client.next(
        lambda f: f.type == T.TC_CLIENT_CONNECT_RESPONSE and f.body.request_id == request_id
    )
    return frame.command.tcClientConnectResponse


async def test_wire_bad_keys_and_fenced_epochs(tmp_path: Path) -> None:
    """On the wire: a bad key is a per-request error (nothing written, connection up), the
    epoch travels in field 4 both ways, a stale epoch is NotAllowed "fenced"."""
    async with running(tmp_path) as broker:
        client = await RawClient.connect(broker.port)
        try:
            for rid, key in enumerate(["a&b", "", "k" * (limits.TXN_KEY_BYTES_MAX + 1)], 1):
                answer = await tc_connect(client, rid, key, -1)
                assert answer.HasField("error") and not answer.HasField("epoch"), answer
            assert (await broker.service.store.list_prefix("/txn/key")).records == []
            first = await tc_connect(client, 10, "wire", None)  # epoch absent: a new client
            assert not first.HasField("error") and first.epoch == 0
            second = await tc_connect(client, 11, "wire", -1)
            assert second.epoch == 1
            stale = await tc_connect(client, 12, "wire", 0)
            assert stale.error == pb.NotAllowedError and "fenced" in stale.message
            resumed = await tc_connect(client, 13, "wire", 1)
            assert not resumed.HasField("error") and resumed.epoch == 1
        finally:
            await client.close()
