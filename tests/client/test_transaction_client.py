"""Client transactions frame by frame against a scripted coordinator (``TxnFakeBroker``):
the wire fields of TC_CLIENT_CONNECT / NEW_TXN / END_TXN / SEND / ACK in a transaction,
commit waiting for its sends and acks, the abort paths, END_TXN retried after a dropped
connection, the client-side timeout and the error mapping."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest

import anabranch
from anabranch.aio import Client, Producer
from anabranch.client.dag_session import scalable_topic_name
from anabranch.client.errors import (
    ExpiredTransactionError,
    TransactionOperationFailed,
    from_server_error,
)
from anabranch.client.message_id import MessageId
from anabranch.client.pending_bound import PendingBound
from anabranch.client.producer import Completion, ProducerOptions
from anabranch.client.scalable_producer import ScalableProducer
from anabranch.client.stream_consumer import DeliveryLog, StreamConsumer
from anabranch.client.transaction import (
    TRANSITIONS,
    TXN_REQUEST_ATTEMPTS_MAX,
    Transaction,
    TransactionCoordinatorClient,
    TransactionState,
    timeout_ms,
)
from anabranch.client.txn_spares import SPARES_MAX
from anabranch.core.segment_layout import SegmentLayout
from anabranch.errors import (
    InvalidArgument,
    InvalidTxnStatus,
    TransactionConflict,
    TransactionCoordinatorNotFound,
    TransactionNotFound,
)
from anabranch.protocol import commands
from anabranch.protocol._generated import pulsar_api_pb2 as pb
from anabranch.protocol.frames import Frame
from anabranch.transactions.ids import TxnId
from tests.client.fake_broker import FakeBroker, Session

T = pb.BaseCommand
TOPIC = "persistent://public/default/txn"
NO_SPARES: dict[str, Any] = {"transaction_spares": 0}
SPARES: dict[str, Any] = {"transaction_spares": SPARES_MAX}
"""Frame-counting tests: every NEW_TXN on the wire is one the test asked for."""


@dataclass
class TxnFakeBroker(FakeBroker):
    """FakeBroker plus a coordinator: NEW_TXN ids from a counter (most bits = tc_id),
    END_TXN answered (or dropped, or refused), transactional ACKs answered."""

    tc_error: int | None = None
    end_errors: list[tuple[int, str]] = field(default_factory=list)
    """Answers for the next END_TXNs (error code, message); then success."""
    drop_end_txn: int = 0
    """Close the connection instead of answering this many END_TXNs."""
    ack_error: tuple[int, str] | None = None
    next_txn: int = 100

    def _answer(self, s: Session, frame: Frame) -> None:
        c, kind = frame.command, frame.type
        if kind == T.TC_CLIENT_CONNECT_REQUEST:
            body = pb.CommandTcClientConnectResponse(request_id=c.tcClientConnectRequest.request_id)
            if self.tc_error is not None:
                body.error = self.tc_error  # type: ignore[assignment]
                body.message = "no coordinator"
            s.write(
                s.conn.send(
                    pb.BaseCommand(type=T.TC_CLIENT_CONNECT_RESPONSE, tcClientConnectResponse=body)
                )
            )
        elif kind == T.NEW_TXN:
            self.next_txn += 1
            reply = commands.new_txn_response(c.newTxn.request_id, self.next_txn, c.newTxn.tc_id)
            s.write(s.conn.send(reply))
        elif kind == T.END_TXN:
            if self.drop_end_txn:
                self.drop_end_txn -= 1
                s.writer.close()
                return
            end = pb.CommandEndTxnResponse(
                request_id=c.endTxn.request_id,
                txnid_most_bits=c.endTxn.txnid_most_bits,
                txnid_least_bits=c.endTxn.txnid_least_bits,
            )
            if self.end_errors:
                end.error, end.message = self.end_errors.pop(0)  # type: ignore[assignment]
            s.write(s.conn.send(pb.BaseCommand(type=T.END_TXN_RESPONSE, endTxnResponse=end)))
        elif kind == T.ACK and c.ack.HasField("request_id"):
            code, message = self.ack_error if self.ack_error else (None, None)
            reply = commands.ack_response(c.ack.consumer_id, c.ack.request_id, code, message)
            s.write(s.conn.send(reply))
        else:
            super()._answer(s, frame)


@pytest.fixture
async def tc() -> AsyncIterator[TxnFakeBroker]:
    broker = TxnFakeBroker()
    await broker.start()
    yield broker
    await broker.stop()


def _txn_bits(body: Any) -> tuple[int, int]:
    return (int(body.txnid_most_bits), int(body.txnid_least_bits))


async def _producer(client: Client, **options: Any) -> Producer:
    producer = await client.create_producer(TOPIC, **options)
    assert isinstance(producer, Producer)
    return producer


# --- coordinator requests --------------------------------------------------------------------


async def test_new_txn_and_end_txn_carry_the_wire_fields(tc: TxnFakeBroker) -> None:
    async with Client(tc.url, **SPARES) as client:
        first = await client.new_transaction(timeout=30)
        second = await client.new_transaction(timeout=0.25)
        assert first.id == TxnId(0, 101) and second.id == TxnId(1, 102)
        assert first.state is TransactionState.OPEN
        await first.commit()
        await second.abort()
    (connect,) = tc.of_type(T.TC_CLIENT_CONNECT_REQUEST)  # once per connection
    assert connect.command.tcClientConnectRequest.scalable
    assert connect.command.tcClientConnectRequest.tc_id == 0
    news = [f.command.newTxn for f in tc.of_type(T.NEW_TXN)]
    assert [(n.txn_ttl_millis, n.tc_id, n.scalable) for n in news[:2]] == [
        (30000, 0, 1),
        (250, 1, 1),
    ]
    # Each call also opened a spare for a next call (its timeout plus the spares' max
    # age); the client's close aborted both unused.
    assert sorted(n.txn_ttl_millis for n in news[2:]) == [2250, 32000]
    ends = [f.command.endTxn for f in tc.of_type(T.END_TXN)]
    assert [(_txn_bits(e), e.txn_action, e.scalable) for e in ends[:2]] == [
        ((0, 101), pb.COMMIT, True),
        ((1, 102), pb.ABORT, True),
    ]
    assert sorted((_txn_bits(e), e.txn_action) for e in ends[2:]) == [
        ((2, 103), pb.ABORT),
        ((3, 104), pb.ABORT),
    ]
    assert not tc.of_type(T.ADD_PARTITION_TO_TXN) and not tc.of_type(T.ADD_SUBSCRIPTION_TO_TXN)
    assert (first.state, second.state) == (TransactionState.COMMITTED, TransactionState.ABORTED)


async def test_disabled_transactions_are_a_typed_error(tc: TxnFakeBroker) -> None:
    tc.tc_error = pb.TransactionCoordinatorNotFound
    async with Client(tc.url, **NO_SPARES) as client:
        with pytest.raises(TransactionCoordinatorNotFound, match="disabled") as info:
            await client.new_transaction()
    assert not info.value.retriable
    assert not tc.of_type(T.NEW_TXN)


async def test_end_txn_is_sent_again_on_a_new_connection_after_a_drop(tc: TxnFakeBroker) -> None:
    tc.drop_end_txn = 2
    async with Client(tc.url, **NO_SPARES, random=lambda: 0.0) as client:
        txn = await client.new_transaction(timeout=30)
        await txn.commit()
        assert txn.state is TransactionState.COMMITTED
    ends = tc.of_type(T.END_TXN)
    assert len(ends) == 3 and {_txn_bits(f.command.endTxn) for f in ends} == {txn.id}
    assert len(tc.of_type(T.CONNECT)) == 3  # each retry on a fresh connection
    assert len(tc.of_type(T.TC_CLIENT_CONNECT_REQUEST)) == 3


async def test_end_txn_retries_are_bounded_by_the_operation_timeout(tc: TxnFakeBroker) -> None:
    # Not by a few quick tries (a broker restart outlasts them): by the operation timeout,
    # with the pause between tries growing to TXN_RETRY_BACKOFF_MAX_S.
    tc.drop_end_txn = 100
    async with Client(tc.url, **NO_SPARES, random=lambda: 0.0, operation_timeout_s=3.0) as client:
        txn = await client.new_transaction(timeout=30)
        with pytest.raises(anabranch.errors.AnabranchError) as info:
            await txn.commit()
        assert info.value.retriable  # the outcome is unknown
        assert txn.state is TransactionState.ERROR
    assert 5 < len(tc.of_type(T.END_TXN)) < TXN_REQUEST_ATTEMPTS_MAX


# --- sends -----------------------------------------------------------------------------------


async def test_sends_carry_the_txn_id_and_batches_never_mix_transactions(
    tc: TxnFakeBroker,
) -> None:
    async with Client(tc.url, **NO_SPARES) as client:
        producer = await _producer(client, batch_delay_s=10, batch_messages_max=100)
        t1 = await client.new_transaction()
        t2 = await client.new_transaction()
        futures = [
            await producer.send_async(b"plain-0"),
            await producer.send_async(b"t1-a", txn=t1),
            await producer.send_async(b"t1-b", txn=t1),
            await producer.send_async(b"t2-a", txn=t2),
            await producer.send_async(b"plain-1"),
        ]
        await producer.flush()
        assert all(f.done() and f.exception() is None for f in futures)
        await t1.commit()
        await t2.commit()
    sends = tc.of_type(T.SEND)
    assert [(f.command.send.num_messages, _txn_bits(f.command.send)) for f in sends] == [
        (1, (0, 0)),
        (2, t1.id),
        (1, t2.id),
        (1, (0, 0)),
    ]
    assert [_txn_bits(f.metadata) for f in sends] == [(0, 0), t1.id, t2.id, (0, 0)]
    assert sends[0].metadata is not None
    assert not sends[0].metadata.HasField("txnid_most_bits")
    seqs = [f.command.send.sequence_id for f in sends]
    assert seqs == sorted(seqs)  # sequence ids unchanged by transactions


async def test_a_partitioned_producer_passes_the_txn_to_its_partition(tc: TxnFakeBroker) -> None:
    tc.partitions[TOPIC] = 2
    async with Client(tc.url, **NO_SPARES) as client:
        producer = await client.create_producer(TOPIC, batching=False)
        async with client.transaction(timeout=30) as txn:
            await producer.send(b"x", key="k", txn=txn)
    (send,) = tc.of_type(T.SEND)
    assert _txn_bits(send.command.send) == txn.id == _txn_bits(send.metadata)
    assert tc.of_type(T.END_TXN)[0].command.endTxn.txn_action == pb.COMMIT


async def test_commit_waits_for_the_pending_sends(tc: TxnFakeBroker) -> None:
    tc.answer_sends = False
    async with Client(tc.url, **NO_SPARES) as client:
        producer = await _producer(client, batching=False)
        txn = await client.new_transaction(timeout=30)
        fut = await producer.send_async(b"x", txn=txn)
        (send,) = await tc.wait_for(T.SEND)
        commit = asyncio.create_task(txn.commit())
        await asyncio.sleep(0.05)
        assert not commit.done() and not tc.of_type(T.END_TXN)
        assert txn.state is TransactionState.COMMITTING
        with pytest.raises(InvalidTxnStatus):  # nothing joins a committing transaction
            await producer.send(b"late", txn=txn)
        s = tc.sessions[-1]
        s.write(s.conn.send(commands.send_receipt(send.command.send.producer_id, 0, 1, 0)))
        await commit
        assert fut.done() and txn.peek_state() is TransactionState.COMMITTED
    assert len(tc.of_type(T.SEND)) == 1
    assert tc.frames.index(tc.of_type(T.END_TXN)[0]) > tc.frames.index(send)


async def test_commit_waits_for_every_producer_whichever_answers_first(
    tc: TxnFakeBroker,
) -> None:
    # The commit waits for the newest unanswered send and then looks again: sends of two
    # producers answered newest first must still all be waited for, and an older send's
    # failure, answered last, must still abort the transaction.
    tc.answer_sends = False
    async with Client(tc.url, **NO_SPARES) as client:
        first = await _producer(client, batching=False)
        second = await client.create_producer(TOPIC + "-2", batching=False)
        txn = await client.new_transaction(timeout=30)
        older = [await first.send_async(b"a%d" % n, txn=txn) for n in range(3)]
        newest = await second.send_async(b"b", txn=txn)
        sends = await tc.wait_for(T.SEND, 4)
        commit = asyncio.create_task(txn.commit())
        s = tc.sessions[-1]
        by_producer: dict[int, list[pb.CommandSend]] = {}
        for frame in sends:
            by_producer.setdefault(frame.command.send.producer_id, []).append(frame.command.send)
        a_sends, (b_send,) = sorted(by_producer.values(), key=len, reverse=True)
        s.write(s.conn.send(commands.send_receipt(b_send.producer_id, b_send.sequence_id, 1, 0)))
        await newest
        for send in a_sends[:2]:
            s.write(s.conn.send(commands.send_receipt(send.producer_id, send.sequence_id, 2, 0)))
        await asyncio.gather(*older[:2])
        await asyncio.sleep(0.05)
        assert not commit.done() and not tc.of_type(T.END_TXN)
        last = a_sends[2]
        s.write(
            s.conn.send(
                commands.send_error(last.producer_id, last.sequence_id, pb.TransactionConflict, "x")
            )
        )
        with pytest.raises(TransactionOperationFailed, match="TransactionConflict"):
            await commit
        assert isinstance(older[2].exception(), TransactionConflict)
    (end,) = tc.of_type(T.END_TXN)
    assert end.command.endTxn.txn_action == pb.ABORT


async def test_a_failed_send_makes_commit_abort_and_raise(tc: TxnFakeBroker) -> None:
    tc.send_error = pb.TransactionConflict
    async with Client(tc.url, **NO_SPARES) as client:
        producer = await _producer(client, batching=False)
        txn = await client.new_transaction(timeout=30)
        fut = await producer.send_async(b"x", txn=txn)
        with pytest.raises(TransactionOperationFailed, match="TransactionConflict") as info:
            await txn.commit()
        assert isinstance(info.value.cause, TransactionConflict)
        assert isinstance(fut.exception(), TransactionConflict)
        assert txn.state is TransactionState.ABORTED
    (end,) = tc.of_type(T.END_TXN)
    assert end.command.endTxn.txn_action == pb.ABORT


# --- acks ------------------------------------------------------------------------------------


async def _received(tc: TxnFakeBroker, client: Client, entries: list[int], **options: Any) -> Any:
    consumer = await client.subscribe(TOPIC, "s", **options)
    await tc.wait_for(T.FLOW)
    cid = tc.of_type(T.SUBSCRIBE)[0].command.subscribe.consumer_id
    messages = []
    for entry in entries:
        md = pb.MessageMetadata(producer_name="p", sequence_id=entry, publish_time=1)
        tc.deliver(cid, entry, md, b"m%d" % entry)
        messages.append(await consumer.receive(timeout=5))
    return consumer, messages


async def test_transactional_acks_carry_the_txn_and_await_their_answer(
    tc: TxnFakeBroker,
) -> None:
    async with Client(tc.url, **NO_SPARES) as client:
        consumer, (m1, m2) = await _received(tc, client, [1, 2])
        txn = await client.new_transaction(timeout=30)
        await consumer.acknowledge(m1, txn=txn)
        await consumer.acknowledge_cumulative(m2, txn=txn)
        await consumer.acknowledge(m2)  # outside any transaction: no request id
        await txn.commit()
    acks = [f.command.ack for f in await tc.wait_for(T.ACK, 3)]
    assert [(a.ack_type, _txn_bits(a), a.HasField("request_id")) for a in acks] == [
        (pb.CommandAck.Individual, txn.id, True),
        (pb.CommandAck.Cumulative, txn.id, True),
        (pb.CommandAck.Individual, (0, 0), False),
    ]
    assert acks[0].request_id != acks[1].request_id
    assert tc.frames.index(tc.of_type(T.END_TXN)[0]) > tc.frames.index(tc.of_type(T.ACK)[1])


async def test_a_refused_ack_raises_and_the_commit_aborts_and_redelivers(
    tc: TxnFakeBroker,
) -> None:
    tc.ack_error = (pb.TransactionConflict, "held by another transaction")
    async with Client(tc.url, **NO_SPARES) as client:
        consumer, (m1,) = await _received(tc, client, [1], subscription_type="shared")
        txn = await client.new_transaction(timeout=30)
        with pytest.raises(TransactionConflict):
            await consumer.acknowledge(m1, txn=txn)
        with pytest.raises(TransactionOperationFailed):
            await txn.commit()
        assert txn.state is TransactionState.ABORTED
        (redeliver,) = await tc.wait_for(T.REDELIVER_UNACKNOWLEDGED_MESSAGES)
    ids = redeliver.command.redeliverUnacknowledgedMessages.message_ids
    assert [m.entryId for m in ids] == [1]


class _SegmentStub:
    def __init__(self) -> None:
        self.acks: list[tuple[MessageId, Transaction | None]] = []

    async def acknowledge_cumulative(self, mid: MessageId, txn: Transaction | None = None) -> None:
        self.acks.append((mid, txn))


async def test_a_stream_consumer_acks_every_segment_in_the_transaction() -> None:
    stream = StreamConsumer.__new__(StreamConsumer)
    stream.topic = "topic://public/default/s"
    stream._log = DeliveryLog()
    stubs = {0: _SegmentStub(), 1: _SegmentStub()}
    stream._segments = stubs  # type: ignore[assignment]
    for seg, entry in [(0, 1), (1, 1), (0, 2), (1, 2)]:  # segment consumers stamp their ids
        stream._log.record((seg, MessageId(7, entry, segment_id=seg)))
    txn = _local_txn()
    await stream.acknowledge_cumulative(MessageId(7, 2, segment_id=0), txn=txn)
    assert stubs[0].acks == [(MessageId(7, 2, segment_id=0), txn)]
    assert stubs[1].acks == [(MessageId(7, 1, segment_id=1), txn)]
    txn._state = TransactionState.ABORTED
    with pytest.raises(InvalidTxnStatus):  # refused before the log forgets anything
        await stream.acknowledge_cumulative(MessageId(7, 2, segment_id=1), txn=txn)
    assert stream._log.pending() == 1


# --- scalable producer -----------------------------------------------------------------------


class _SegmentProducerStub:
    """The segment producer's hand-off surface (``_offer`` / ``_submit``): records what
    it was given; the test answers through the completions."""

    _closing = False

    def __init__(self) -> None:
        self.sent: list[tuple[bytes, TxnId | None]] = []
        self.futures: list[Completion] = []
        self._bound = PendingBound(100)
        self._batch: list[Any] = []

    def _submit(self, completion: Completion, value: bytes, *args: Any) -> None:
        self.sent.append((value, args[4]))  # (key, properties, event time, seq id, txn, ...)
        self.futures.append(completion)

    def _offer(self, completion: Completion, value: bytes, *args: Any) -> bool:
        self._bound.try_enter()
        self._submit(completion, value, *args)
        return True


async def test_a_scalable_producer_hands_the_txn_to_the_segment_producer() -> None:
    session = SimpleNamespace(
        topic=scalable_topic_name("topic://public/default/o"),
        layout=SegmentLayout.initial(1, now_ms=0),
    )
    pool = SimpleNamespace(operation_timeout_s=1.0)
    producer = ScalableProducer(pool, session, ProducerOptions())  # type: ignore[arg-type]
    stub = _SegmentProducerStub()
    producer._producers[0] = stub  # type: ignore[assignment]
    txn = _local_txn()
    fut = await producer.send_async(b"in", key="k", txn=txn)
    plain = await producer.send_async(b"out", key="k")
    assert stub.sent == [(b"in", txn.id), (b"out", None)]
    assert txn.unanswered == 1  # commit waits for the outer (re-routable) future
    stub.futures[0].set_result(MessageId(1, 0))
    stub.futures[1].set_result(MessageId(1, 1))
    await fut
    await plain
    assert txn.unanswered == 0
    producer._closing = True


# --- state, timeout, context managers --------------------------------------------------------


def _local_txn(timeout: float = 30.0) -> Transaction:
    """A transaction with no coordinator behind it (for paths that send nothing)."""
    loop = asyncio.get_running_loop()
    return Transaction(None, TxnId(3, 4), timeout, deadline=loop.time() + timeout)  # type: ignore[arg-type]


async def test_state_transitions_follow_the_table(tc: TxnFakeBroker) -> None:
    assert TRANSITIONS[TransactionState.COMMITTED] == frozenset()
    async with Client(tc.url, **NO_SPARES) as client:
        producer = await _producer(client, batching=False)
        committed = await client.new_transaction()
        await committed.commit()
        await committed.commit()  # idempotent
        with pytest.raises(InvalidTxnStatus):
            await committed.abort()
        with pytest.raises(InvalidTxnStatus, match="COMMITTED"):
            await producer.send(b"x", txn=committed)
        aborted = await client.new_transaction()
        await aborted.abort()
        await aborted.abort()
        with pytest.raises(InvalidTxnStatus):
            await aborted.commit()
        assert aborted.state is TransactionState.ABORTED
    assert not tc.of_type(T.SEND)
    assert len(tc.of_type(T.END_TXN)) == 2


async def test_an_expired_transaction_refuses_use_without_wire_traffic(tc: TxnFakeBroker) -> None:
    async with Client(tc.url, **NO_SPARES) as client:
        producer = await _producer(client, batching=False)
        consumer, (m1,) = await _received(tc, client, [1])
        txn = await client.new_transaction(timeout=0.05)
        await asyncio.sleep(0.1)
        assert txn.state is TransactionState.TIMED_OUT
        before = len(tc.frames)
        with pytest.raises(ExpiredTransactionError):
            await producer.send(b"x", txn=txn)
        with pytest.raises(ExpiredTransactionError):
            await consumer.acknowledge(m1, txn=txn)
        with pytest.raises(ExpiredTransactionError):
            await consumer.acknowledge_cumulative(m1, txn=txn)
        assert len(tc.frames) == before
        with pytest.raises(anabranch.ExpiredTransactionError):
            await txn.commit()
        assert txn.state is TransactionState.TIMED_OUT
    (end,) = tc.of_type(T.END_TXN)  # commit of an expired transaction aborts it
    assert end.command.endTxn.txn_action == pb.ABORT


async def test_a_commit_still_waiting_at_the_deadline_expires(tc: TxnFakeBroker) -> None:
    tc.answer_sends = False
    async with Client(
        tc.url, **NO_SPARES, operation_timeout_s=0.5
    ) as client:  # close's flush: short
        producer = await _producer(client, batching=False)
        txn = await client.new_transaction(timeout=0.2)
        await producer.send_async(b"x", txn=txn)
        with pytest.raises(ExpiredTransactionError, match="unanswered"):
            await txn.commit()
        assert txn.state is TransactionState.TIMED_OUT
    assert [f.command.endTxn.txn_action for f in tc.of_type(T.END_TXN)] == [pb.ABORT]


async def test_broker_answers_map_to_typed_errors(tc: TxnFakeBroker) -> None:
    tc.end_errors = [
        (pb.TransactionConflict, "transaction 0_101 timed out"),
        (pb.InvalidTxnStatus, "already aborted"),
    ]
    async with Client(tc.url, **NO_SPARES) as client:
        expired = await client.new_transaction()
        with pytest.raises(ExpiredTransactionError):
            await expired.commit()
        assert expired.state is TransactionState.TIMED_OUT
        refused = await client.new_transaction()
        with pytest.raises(InvalidTxnStatus):
            await refused.commit()
        assert refused.state is TransactionState.ERROR
        await refused.abort()  # ERROR -> ABORTING -> ABORTED
        assert refused.peek_state() is TransactionState.ABORTED


def test_error_codes_map_to_the_transaction_classes() -> None:
    cases = {
        pb.TransactionConflict: TransactionConflict,
        pb.InvalidTxnStatus: InvalidTxnStatus,
        pb.TransactionNotFound: TransactionNotFound,
        pb.TransactionCoordinatorNotFound: TransactionCoordinatorNotFound,
    }
    for code, cls in cases.items():
        err = from_server_error(code, "no")
        assert type(err) is cls and not err.retriable
    assert isinstance(
        from_server_error(pb.TransactionNotFound, "txn expired"), ExpiredTransactionError
    )
    assert type(from_server_error(pb.TopicNotFound, "timed out")) is not ExpiredTransactionError
    fenced = from_server_error(pb.NotAllowedError, "transaction 0_5 was fenced by epoch 3")
    assert isinstance(fenced, ExpiredTransactionError)
    assert type(from_server_error(pb.NotAllowedError, "quota timeout")).__name__ == "NotAllowed"
    assert timeout_ms(1.5) == 1500
    with pytest.raises(InvalidArgument):
        timeout_ms(0)


async def test_the_async_context_manager_commits_or_aborts(tc: TxnFakeBroker) -> None:
    async with Client(tc.url, **NO_SPARES) as client:
        producer = await _producer(client, batching=False)
        async with client.transaction(timeout=30) as ok:
            await producer.send(b"a", txn=ok)
        with pytest.raises(ValueError, match="boom"):
            async with client.transaction(timeout=30) as failed:
                await producer.send(b"b", txn=failed)
                raise ValueError("boom")
        async with await client.new_transaction() as direct:
            await producer.send(b"c", txn=direct)
    assert (ok.state, failed.state, direct.state) == (
        TransactionState.COMMITTED,
        TransactionState.ABORTED,
        TransactionState.COMMITTED,
    )
    actions = [f.command.endTxn.txn_action for f in tc.of_type(T.END_TXN)]
    assert actions == [pb.COMMIT, pb.ABORT, pb.COMMIT]


def test_the_blocking_client_runs_transactions() -> None:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        tc = asyncio.run_coroutine_threadsafe(TxnFakeBroker().start(), loop).result()
        with anabranch.Client(tc.url, **NO_SPARES) as client:
            producer = client.create_producer(TOPIC, batching=False)
            with client.transaction(timeout=30) as txn:
                producer.send(b"x", key="k", txn=txn)
            assert isinstance(txn, anabranch.Transaction)
            assert txn.state is anabranch.TransactionState.COMMITTED
            with pytest.raises(KeyError), client.transaction(timeout=30) as failed:
                raise KeyError("x")
            assert failed.state is TransactionState.ABORTED
            manual = client.new_transaction(timeout=60)
            producer.send_async(b"y", txn=manual).result(timeout=5)
            manual.commit()
            assert manual.id == TxnId(2, 103) and manual.state is TransactionState.COMMITTED
        sends = [f for f in tc.frames if f.type == T.SEND]
        assert [_txn_bits(f.command.send) for f in sends] == [txn.id, manual.id]
        actions = [f.command.endTxn.txn_action for f in tc.frames if f.type == T.END_TXN]
        assert actions == [pb.COMMIT, pb.ABORT, pb.COMMIT]
        asyncio.run_coroutine_threadsafe(tc.stop(), loop).result()
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        loop.close()


async def test_a_resumed_txn_sends_in_it_and_batches_never_mix_branches(tc: TxnFakeBroker) -> None:
    """A sink task's handle on the driver's batch transaction: no coordinator request, the
    sends carry its id, and each batch holds one ``__txn_branch`` named in its metadata."""
    async with Client(tc.url, **NO_SPARES) as client:
        producer = await _producer(client, batch_delay_s=10, batch_messages_max=100)
        txn = await client.resume_transaction(TxnId(3, 77), timeout=30)
        assert txn.id == TxnId(3, 77) and txn.state is TransactionState.OPEN
        futures = [
            await producer.send_async(b"a1", txn=txn, properties={"__txn_branch": "0-a"}),
            await producer.send_async(b"a2", txn=txn, properties={"__txn_branch": "0-a"}),
            await producer.send_async(b"b1", txn=txn, properties={"__txn_branch": "0-b"}),
        ]
        await producer.flush()
        assert all(f.done() and f.exception() is None for f in futures)
    assert not tc.of_type(T.NEW_TXN)
    sends = tc.of_type(T.SEND)
    assert [(f.command.send.num_messages, _txn_bits(f.command.send)) for f in sends] == [
        (2, (3, 77)),
        (1, (3, 77)),
    ]
    branches = [
        [(p.key, p.value) for p in f.metadata.properties] for f in sends if f.metadata is not None
    ]
    assert branches == [[("__txn_branch", "0-a")], [("__txn_branch", "0-b")]]


# --- spare (pre-opened) transactions ---------------------------------------------------------


async def _until(check: Any) -> None:
    """Wait until ``check()`` holds (the round cap is a hang guard only)."""
    for _ in range(2000):
        if check():
            return
        await asyncio.sleep(0.005)
    raise AssertionError("never happened")


async def test_a_spare_makes_the_next_new_transaction_skip_the_round_trip(
    tc: TxnFakeBroker,
) -> None:
    async with Client(tc.url, **SPARES) as client:
        first = await client.new_transaction(timeout=30)
        await _until(lambda: len(tc.of_type(T.NEW_TXN)) == 2)  # the spare's NEW_TXN
        spare_ttl = tc.of_type(T.NEW_TXN)[1].command.newTxn.txn_ttl_millis
        await asyncio.sleep(0.05)  # let the spare's answer arrive
        sent = len(tc.of_type(T.NEW_TXN))
        second = await client.new_transaction(timeout=30)
        # Handed out without a NEW_TXN of its own: the spare, whose broker-side timeout
        # has the spares' max age on top, so the client's deadline comes first.
        assert len(tc.of_type(T.NEW_TXN)) == sent
        assert second.id == TxnId(1, 102) and first.id == TxnId(0, 101)
        assert spare_ttl == 32_000 and second.timeout == 30
        assert 29 < second._deadline - asyncio.get_running_loop().time() <= 30
        producer = await _producer(client)
        await producer.send(b"x", txn=second)
        await second.commit()
        await first.abort()
        assert client._transaction_coordinator().spares_used == 1
    sends = tc.of_type(T.SEND)
    assert _txn_bits(sends[-1].command.send) == (1, 102)
    ends = [
        (_txn_bits(f.command.endTxn), f.command.endTxn.txn_action) for f in tc.of_type(T.END_TXN)
    ]
    assert ends[:2] == [((1, 102), pb.COMMIT), ((0, 101), pb.ABORT)]
    # Every spare opened was used or aborted: none stays open after close.
    opened = {(n.command.newTxn.tc_id, 101 + i) for i, n in enumerate(tc.of_type(T.NEW_TXN))}
    ended = {bits for bits, _ in ends}
    assert opened == ended


async def test_a_stale_spare_is_aborted_and_never_handed_out(tc: TxnFakeBroker) -> None:
    async with Client(tc.url, **NO_SPARES) as client:
        coordinator = TransactionCoordinatorClient(client._pool, spare_max_age_s=0.2)
        first = await coordinator.new_transaction(timeout=30)
        await _until(lambda: len(tc.of_type(T.END_TXN)) == 1)  # the unused spare, aborted
        (abort,) = tc.of_type(T.END_TXN)
        assert _txn_bits(abort.command.endTxn) == (1, 102)
        assert abort.command.endTxn.txn_action == pb.ABORT
        assert coordinator.spares_aborted == 1
        second = await coordinator.new_transaction(timeout=30)
        assert second.id not in (first.id, TxnId(1, 102))  # a NEW_TXN of its own
        await first.abort()
        await second.abort()
        await coordinator.close()
    news = len(tc.of_type(T.NEW_TXN))
    assert news == 4 and len(tc.of_type(T.END_TXN)) == 4  # 2 asked, 2 spares: all ended


async def test_a_keyed_client_keeps_no_spares(tc: TxnFakeBroker) -> None:
    async with Client(tc.url, transaction_key="etl-1") as client:
        for _ in range(3):
            txn = await client.new_transaction(timeout=30)
            await txn.commit()
    assert len(tc.of_type(T.NEW_TXN)) == 3


async def test_a_call_waits_for_the_spare_on_its_way_instead_of_its_own_new_txn(
    tc: TxnFakeBroker,
) -> None:
    async with Client(tc.url, **SPARES) as client:
        first = await client.new_transaction(timeout=30)
        second = await client.new_transaction(timeout=30)  # the first call's spare
        assert len(tc.of_type(T.NEW_TXN)) == 2
        assert (first.id, second.id) == (TxnId(0, 101), TxnId(1, 102))
        await second.commit()  # its replacement is opened with its END_TXN
        await _until(lambda: len(tc.of_type(T.NEW_TXN)) == 3)
        await first.commit()
