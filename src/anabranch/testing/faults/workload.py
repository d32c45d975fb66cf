"""The workloads of a fault run, each logging to the history as it goes.

- :meth:`Workload.producer` -- a scalable-topic producer: keyed values
  ``p=producer-i;k=key-j;c=n`` (unique per key), up to ``inflight`` sends in flight, a
  send unanswered after ``SEND_TIMEOUT_S`` is ``info`` (indeterminate); a producer whose
  sends fail is replaced by a new one (a fresh client-side session).
- :meth:`Workload.idempotent` -- sends straight to the key's active segment under one
  producer name with explicit sequence ids and, when the key's segment has changed since
  its last acknowledged send, first re-sends that send (same name, sequence id and value)
  to the new segment: the retry after an ambiguous timeout that crosses a split. With
  deduplication (carried across splits) the broker stores it once.
- :meth:`Workload.stream` / :meth:`Workload.queue` / :meth:`Workload.checkpoint` -- a
  stream consumer (cumulative ack after every message), a queue consumer (individual
  acks) and a checkpoint consumer from the earliest position; an error ends the session
  and a new one starts (a new ``process`` name in the history).
- :meth:`Workload.transactions` -- transactions of 2-5 unique values
  (:class:`~anabranch.testing.faults.values.TxnValue`) over 2-3 topics (the run's plain
  ``persistent://`` topics and its scalable topic), committed or (about one in five)
  aborted; ops ``f="txn"``: ``ok`` (with the ``outcome``), ``fail`` (it never committed:
  an error before the decision, or a commit the client turned into an abort) or
  ``info`` (the outcome is unknown); a failed or unknown one replaces the client.
- :meth:`Workload.storm` -- splits and merges through the admin API at seeded moments.
- :meth:`Workload.probe` -- after the heal: a split, retried until it succeeds.
- :meth:`Workload.final_read` -- a new client reads the whole DAG from the earliest
  position: what is stored; :meth:`Workload.final_read_txn` reads the plain
  transactional topics likewise (ops ``f="txn-read"``).

Example (inside a run, see :mod:`~anabranch.testing.faults.run`)::

    workload = Workload(cluster, history, topic, random.Random(seed))
    tasks = [asyncio.create_task(workload.producer(0)), asyncio.create_task(workload.stream())]
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp

from anabranch.aio import Client, Message, MessageId
from anabranch.client.checkpoint import Checkpoint
from anabranch.client.errors import TransactionOperationFailed
from anabranch.client.producer import Producer
from anabranch.client.transaction import Transaction
from anabranch.core.hash_range import segment_hash
from anabranch.core.names import TopicName
from anabranch.core.segment_layout import SegmentLayout, segment_name
from anabranch.errors import AnabranchError
from anabranch.testing.faults.cluster import FaultCluster
from anabranch.testing.faults.history import History
from anabranch.testing.faults.values import TxnValue, Value

log = logging.getLogger(__name__)

SEND_TIMEOUT_S = 30.0
"""A send unanswered this long is logged ``info`` (the client may still store it)."""
RECEIVE_POLL_S = 0.5
ADMIN_TIMEOUT_S = 10.0
"""One admin request; a split or merge that takes longer is ``info``."""
RESTART_PAUSE_S = 0.5
"""Between a failed client session and the next one."""
SEGMENTS_MAX = 6
"""The storm merges instead of splitting once this many segments are active."""
PROBE_INTERVAL_S = 0.2
"""Between the probe's attempts: short, since heal -> split is a figure and an attempt
refused for naming a segment that was sealed meanwhile says nothing of availability."""
TXN_TIMEOUT_S = 10.0
"""A transaction's TTL: short, so that one a fault left open (a client cut, a commit
unanswered) is aborted by the broker's sweep soon; an open transaction holds back every
later message of its topics from readers (read-committed), the final reads included."""
TXN_SEND_TIMEOUT_S = 8.0
"""A transaction's sends unanswered this long: it fails (and is aborted), within its TTL."""
TXN_END_TIMEOUT_S = 20.0
"""A commit or abort unanswered this long is ``info``: above the client's own END_TXN
retries (its operation timeout) only when those hang."""
TXN_PAUSE_MAX_S = 0.1
"""At most this long between two sends of a transaction (drawn per transaction)."""
TXN_ABORT_SHARE = 0.2
"""How many transactions the workload aborts on purpose."""
TXN_READ_QUIET_MAX_S = 8.0
"""The final read of a plain topic ends after this long without a message even when a
committed value is missing (waiting longer cannot bring it: no transaction is open by
then, their TTL passed)."""
STREAM_SUBSCRIPTION = "faults-stream"
QUEUE_SUBSCRIPTION = "faults-queue"
_ERRORS = (AnabranchError, OSError, TimeoutError, aiohttp.ClientError, RuntimeError)


def message_position(message_id: MessageId, segment: int | None = None) -> list[int]:
    """``[segment, ledger, entry, batch]`` as the checker wants it."""
    seg = message_id.segment_id if message_id.segment_id is not None else segment
    return [
        -1 if seg is None else int(seg),
        message_id.ledger_id,
        message_id.entry_id,
        message_id.batch_index,
    ]


class Workload:
    """The clients of one run (see the module docstring)."""

    def __init__(
        self,
        cluster: FaultCluster,
        history: History,
        topic: str,
        rng: random.Random,
        *,
        keys: int = 8,
        rate_per_producer: float = 25.0,
        inflight: int = 4,
    ) -> None:
        self.cluster = cluster
        self.history = history
        self.topic = topic
        self.topic_name = TopicName.parse(topic)
        self.rng = rng
        self.keys = [f"key-{i}" for i in range(keys)]
        self.rate = rate_per_producer
        self.inflight = inflight
        self.producing = True
        self.consuming = True
        self.acked: set[str] = set()
        self.last_ack_t = 0.0
        """History time of the latest acknowledgement (the drain's deadline counts from it)."""
        self.seen: dict[str, set[str]] = {}
        """Values received per managed kind, for the kinds this run consumes (stream,
        queue): :meth:`drain` waits for these only."""
        self._clients: list[Client] = []
        self.txn_topics = [
            f"persistent://{self.topic_name.tenant}/{self.topic_name.namespace}/"
            f"{self.topic_name.local_name}-txn-{i}"
            for i in range(2)
        ]
        """The plain topics transactions write to (besides the scalable one)."""
        self.txn_committed: dict[str, set[str]] = {}
        """Values of committed transactions by plain topic: the final read waits for them."""
        self.healed_at: float | None = None
        """History time of the heal (the run sets it): transactions go on after the
        producers stopped until one commits after it (bounded)."""
        self.last_txn_commit_t = float("-inf")

    # --- helpers -----------------------------------------------------------------------------

    def client(self) -> Client:
        client = Client(self.cluster.service_url)
        self._clients.append(client)
        return client

    async def _drop_client(self, client: Client) -> None:
        """Close a client a workload replaces (a failed session)."""
        if client in self._clients:
            self._clients.remove(client)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(client.close(), 10.0)

    async def close(self) -> None:
        for client in self._clients:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(client.close(), 10.0)
        self._clients.clear()

    @property
    def _admin_path(self) -> str:
        t = self.topic_name
        return f"/admin/v2/scalable/{t.tenant}/{t.namespace}/{t.local_name}"

    async def layout(self) -> SegmentLayout | None:
        """The topic's layout from any live broker (None if none answers)."""
        for broker in self.cluster.live():
            with contextlib.suppress(*_ERRORS):
                status, body = await asyncio.wait_for(
                    self.cluster.http("GET", self._admin_path, via=broker), ADMIN_TIMEOUT_S
                )
                if status == 200:
                    return SegmentLayout.from_dict(body)
        return None

    async def admin(self, method: str, suffix: str) -> tuple[int, Any]:
        """A request at a random live broker, following redirects to the leader."""
        live = self.cluster.live()
        via = live[self.rng.randrange(len(live))] if live else None
        status, body, _ = await asyncio.wait_for(
            self.cluster.http_follow(method, self._admin_path + suffix, via=via),
            ADMIN_TIMEOUT_S,
        )
        return status, body

    # --- producers ---------------------------------------------------------------------------

    async def producer(self, index: int) -> None:
        name = f"producer-{index}"
        rng = random.Random(self.rng.random())
        counters = dict.fromkeys(self.keys, 0)
        slots = asyncio.Semaphore(self.inflight)
        pending: set[asyncio.Task[None]] = set()
        client = self.client()
        producer: Any = None
        while self.producing:
            if producer is None:
                try:
                    producer = await asyncio.wait_for(client.create_producer(self.topic), 30.0)
                except _ERRORS as err:
                    self.history.record(name, "info", "open", {"error": repr(err)})
                    await asyncio.sleep(RESTART_PAUSE_S)
                    continue
            key = rng.choice(self.keys)
            value = Value(name, key, counters[key]).text()
            counters[key] += 1
            await slots.acquire()
            self.history.record(name, "invoke", "send", {"key": key, "value": value})
            try:
                fut = await asyncio.wait_for(
                    producer.send_async(value.encode(), key=key), SEND_TIMEOUT_S
                )
            except _ERRORS as err:
                slots.release()
                self.history.record(name, "info", "send", _failed(key, value, err))
                producer = None  # a new producer: the old one may be wedged
                await asyncio.sleep(RESTART_PAUSE_S)
                continue
            task = asyncio.create_task(self._await_send(name, key, value, fut, slots))
            pending.add(task)
            task.add_done_callback(pending.discard)
            await asyncio.sleep(1.0 / self.rate)
        if pending:
            await asyncio.wait(pending)

    async def _await_send(
        self,
        name: str,
        key: str,
        value: str,
        fut: Awaitable[MessageId],
        slots: asyncio.Semaphore,
    ) -> None:
        try:
            message_id = await asyncio.wait_for(fut, SEND_TIMEOUT_S)
        except _ERRORS as err:
            self.history.record(name, "info", "send", _failed(key, value, err))
        else:
            self.acked.add(value)
            done = {"key": key, "value": value, "id": message_position(message_id)}
            self.last_ack_t = self.history.record(name, "ok", "send", done).t
        finally:
            slots.release()

    async def idempotent(self, interval_s: float = 0.2) -> None:
        name = "idem-0"
        rng = random.Random(self.rng.random())
        keys = [f"idem-key-{i}" for i in range(4)]
        counters = dict.fromkeys(keys, 0)
        last: dict[str, tuple[int, str, int]] = {}  # key -> (segment, value, sequence id)
        producers: dict[int, Producer] = {}
        sequence = 0
        client = self.client()
        while self.producing:
            await asyncio.sleep(interval_s)
            layout = await self.layout()
            if layout is None:
                continue
            key = rng.choice(keys)
            segment = layout.find_active(segment_hash(key))
            f = "send"
            op: dict[str, Any] = {"key": key}
            try:
                producer = producers.get(segment.segment_id)
                if producer is None:
                    topic = str(segment_name(self.topic_name, segment))
                    created = await asyncio.wait_for(
                        client.create_producer(topic, producer_name=name, batching=False), 30.0
                    )
                    assert isinstance(created, Producer)
                    producer = producers[segment.segment_id] = created
                previous = last.get(key)
                if previous is not None and previous[0] != segment.segment_id:
                    # The key moved since its last ack: retry that send on the new segment.
                    _, value, sequence_id = previous
                    f = "resend"
                else:
                    value = Value(name, key, counters[key]).text()
                    counters[key] += 1
                    sequence_id = sequence
                    sequence += 1
                op.update(value=value, sequence_id=sequence_id)
                self.history.record(name, "invoke", f, op)
                message_id = await asyncio.wait_for(
                    producer.send(value.encode(), key=key, sequence_id=sequence_id),
                    SEND_TIMEOUT_S,
                )
                if f == "send":
                    self.acked.add(value)
                op["id"] = message_position(message_id, segment.segment_id)
                self.last_ack_t = self.history.record(name, "ok", f, op).t
                last[key] = (segment.segment_id, value, sequence_id)
            except _ERRORS as err:
                if "value" in op:
                    self.history.record(name, "info", f, {**op, "error": repr(err)[:300]})
                stale = producers.pop(segment.segment_id, None)
                if stale is not None:
                    with contextlib.suppress(Exception):
                        await asyncio.wait_for(stale.close(), 5.0)

    # --- transactions ------------------------------------------------------------------------

    async def transactions(
        self, name: str = "txn-0", *, interval_s: float = 0.2, after_heal_bound_s: float = 30.0
    ) -> None:
        """Transactions one after the other (see the module docstring) while producing
        and, after that, until one commits after the heal (at most ``after_heal_bound_s``
        past it: the checker's ``txn-unavailable`` otherwise). A transaction that fails or
        whose outcome is unknown ends the client session; the next one is a new client."""
        rng = random.Random(self.rng.random())
        topics = [*self.txn_topics, self.topic]
        sequence = 0
        while self._txn_go_on(after_heal_bound_s):
            client = self.client()
            producers: dict[str, Any] = {}
            try:
                for topic in topics:
                    producers[topic] = await asyncio.wait_for(client.create_producer(topic), 30.0)
            except _ERRORS as err:
                self.history.record(name, "info", "txn-open", {"error": repr(err)[:300]})
                await self._drop_client(client)
                await asyncio.sleep(RESTART_PAUSE_S)
                continue
            while self._txn_go_on(after_heal_bound_s):
                sequence += 1
                if not await self._one_txn(name, f"{name}.{sequence}", client, producers, rng):
                    break
                await asyncio.sleep(interval_s)
            await self._drop_client(client)
            await asyncio.sleep(RESTART_PAUSE_S)

    def _txn_go_on(self, after_heal_bound_s: float) -> bool:
        if self.producing:
            return True
        if self.healed_at is None or self.last_txn_commit_t >= self.healed_at:
            return False
        return self.history.now() < self.healed_at + after_heal_bound_s

    def _txn_writes(self, rng: random.Random, label: str, txn_id: str) -> list[dict[str, str]]:
        """2-5 values over 2-3 topics, at least one of them plain, each topic written."""
        plain = rng.sample(self.txn_topics, rng.choice((1, 2)))
        topics = [*plain, self.topic] if len(plain) == 1 or rng.random() < 0.5 else plain
        count = rng.randint(max(2, len(topics)), 5)
        where = topics + [rng.choice(topics) for _ in range(count - len(topics))]
        return [
            {"topic": topic, "key": f"txn-key-{rng.randrange(8)}",
             "value": TxnValue(label, txn_id, index).text()}
            for index, topic in enumerate(where)
        ]  # fmt: skip

    async def _one_txn(
        self,
        name: str,
        label: str,
        client: Client,
        producers: dict[str, Any],
        rng: random.Random,
    ) -> bool:
        """One transaction, logged; True if it ended as decided (``ok``)."""
        try:
            txn = await asyncio.wait_for(
                client.new_transaction(timeout=TXN_TIMEOUT_S), TXN_END_TIMEOUT_S
            )
        except _ERRORS as err:
            # Nothing was written: no invoke, like a producer that could not open.
            self.history.record(name, "info", "txn-open", {"txn": label, "error": repr(err)[:300]})
            return False
        txn_id = f"{txn.id.most_bits}:{txn.id.least_bits}"
        writes = self._txn_writes(rng, label, txn_id)
        decision = "abort" if rng.random() < TXN_ABORT_SHARE else "commit"
        op = {"txn": label, "id": txn_id, "decision": decision, "writes": writes}
        self.history.record(name, "invoke", "txn", op)
        try:
            sends = self._txn_sends(txn, producers, writes, rng.uniform(0.0, TXN_PAUSE_MAX_S))
            await asyncio.wait_for(sends, TXN_SEND_TIMEOUT_S)
        except _ERRORS as err:
            # Never committed: the commit was not sent. Abort now rather than at its TTL.
            self.history.record(name, "fail", "txn", _txn_error(label, "send", err))
            with contextlib.suppress(*_ERRORS):
                await asyncio.wait_for(txn.abort(), TXN_END_TIMEOUT_S)
            return False
        try:
            end = txn.commit() if decision == "commit" else txn.abort()
            await asyncio.wait_for(end, TXN_END_TIMEOUT_S)
        except TransactionOperationFailed as err:
            # The client aborted instead of committing (a send failed): it never committed.
            self.history.record(name, "fail", "txn", _txn_error(label, decision, err))
            return False
        except _ERRORS as err:
            # END_TXN may or may not have taken effect (commit: all or nothing of it shows).
            self.history.record(name, "info", "txn", _txn_error(label, decision, err))
            return False
        done = self.history.record(name, "ok", "txn", {"txn": label, "outcome": decision})
        if decision == "commit":
            self.last_txn_commit_t = done.t
            for write in writes:
                if write["topic"] != self.topic:
                    self.txn_committed.setdefault(write["topic"], set()).add(write["value"])
        return True

    @staticmethod
    async def _txn_sends(
        txn: Transaction, producers: dict[str, Any], writes: list[dict[str, str]], pause_s: float
    ) -> None:
        """Send every write in ``txn`` and wait for all acks (raises the first error)."""
        futures = []
        for write in writes:
            producer = producers[write["topic"]]
            fut = await producer.send_async(write["value"].encode(), key=write["key"], txn=txn)
            # Retrieved whenever it ends: after a timeout nobody awaits it any more, and its
            # error (the transaction was aborted meanwhile) is expected, not news.
            fut.add_done_callback(_retrieve)
            futures.append(fut)
            # Spread the sends: a transaction open for a while is one a fault can hit
            # between its writes, or between its writes and its commit.
            await asyncio.sleep(pause_s)
        # wait(), not gather(): the caller's timeout must not cancel the producer's futures.
        await asyncio.wait(futures)
        if any(fut.cancelled() for fut in futures):
            raise RuntimeError("a send of the transaction was cancelled (its producer closed)")
        errors = [fut.exception() for fut in futures]  # each retrieved, not logged as lost
        first = next((err for err in errors if err is not None), None)
        if first is not None:
            raise first

    async def final_read_txn(self, deadline_s: float, idle_s: float = 3.0) -> int:
        """Read each plain transactional topic from the earliest position with a new
        client (session ``final``, ops ``f="txn-read"``) until nothing came for
        ``idle_s`` and every committed value was read, or nothing came for
        ``TXN_READ_QUIET_MAX_S``, or ``deadline_s`` passed; a reader that fails is opened
        again from the earliest position. Returns the number of messages read."""
        client = Client(self.cluster.service_url)
        try:
            # Side by side: each read ends with a quiet period, which need not add up.
            counts = await asyncio.gather(
                *(self._read_plain(client, topic, deadline_s, idle_s) for topic in self.txn_topics)
            )
            return sum(counts)
        finally:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(client.close(), 10.0)

    async def _read_plain(
        self, client: Client, topic: str, deadline_s: float, idle_s: float
    ) -> int:
        loop = asyncio.get_running_loop()
        end = loop.time() + deadline_s
        expected = self.txn_committed.get(topic, set())
        seen: set[str] = set()
        count = 0
        complete = False
        while not complete and loop.time() < end:
            reader: Any = None
            try:
                reader = await asyncio.wait_for(client.create_reader(topic, "earliest"), 30.0)
                idle_since = loop.time()
                while loop.time() < end:
                    msg = await reader.read_next(timeout=RECEIVE_POLL_S)
                    if msg is None:
                        quiet = loop.time() - idle_since
                        if (quiet > idle_s and expected <= seen) or quiet > TXN_READ_QUIET_MAX_S:
                            complete = True
                            break
                        continue
                    idle_since = loop.time()
                    count += 1
                    value = msg.value.decode(errors="replace")
                    seen.add(value)
                    got = {"topic": topic, "value": value, "id": message_position(msg.message_id)}
                    self.history.record("final", "ok", "txn-read", got)
            except _ERRORS as err:
                self.history.record(
                    "final", "info", "txn-read", {"topic": topic, "error": repr(err)}
                )
                await asyncio.sleep(RESTART_PAUSE_S)
            finally:
                if reader is not None:
                    with contextlib.suppress(Exception):
                        await asyncio.wait_for(reader.close(), 10.0)
        done = {"topic": topic, "read": count, "complete": complete}
        self.history.record("final", "info", "txn-read-done", done)
        return count

    # --- consumers ---------------------------------------------------------------------------

    def _received(self, session: str, kind: str, subscription: str, msg: Message) -> None:
        value = msg.value.decode(errors="replace")
        if kind in self.seen:
            self.seen[kind].add(value)
        self.history.record(
            session,
            "ok",
            "recv",
            {
                "key": msg.key or "",
                "value": value,
                "id": message_position(msg.message_id),
                "kind": kind,
                "subscription": subscription,
            },
        )

    async def stream(self, name: str = "stream-0") -> None:
        """A stream consumer, acknowledging cumulatively after each message."""

        async def open_stream(client: Client) -> Any:
            return await client.subscribe_stream(
                self.topic, subscription=STREAM_SUBSCRIPTION, consumer_name=name
            )

        self.seen.setdefault("stream", set())
        await self._consume(name, "stream", STREAM_SUBSCRIPTION, open_stream, "cumulative")

    async def queue(self, name: str = "queue-0") -> None:
        """A queue consumer, acknowledging each message."""

        async def open_queue(client: Client) -> Any:
            # Earliest: the producers start with this consumer, and the checker wants
            # every acknowledged send on the subscription, also one acknowledged before
            # the subscription existed on its segment (a queue's default is latest).
            return await client.subscribe_queue(
                self.topic, QUEUE_SUBSCRIPTION, initial_position="earliest"
            )

        self.seen.setdefault("queue", set())
        await self._consume(name, "queue", QUEUE_SUBSCRIPTION, open_queue, "individual")

    async def checkpoint(self, name: str = "checkpoint-0") -> None:
        """A checkpoint consumer from the earliest position; a new session restarts from
        the earliest position again (it is an unmanaged reader)."""

        async def open_reader(client: Client) -> Any:
            return await client.create_checkpoint_consumer(self.topic)

        await self._consume(name, "checkpoint", "-", open_reader, None)

    async def _consume(
        self,
        name: str,
        kind: str,
        subscription: str,
        open_consumer: Callable[[Client], Awaitable[Any]],
        ack: str | None,
    ) -> None:
        """Receive (and acknowledge per ``ack``: ``cumulative``, ``individual`` or None)
        until consuming stops; an error ends the session, the next one is a new consumer
        (``<name>#<n>``: the checker's unit of order)."""
        client = self.client()
        incarnation = 0
        while self.consuming:
            session = f"{name}#{incarnation}"
            incarnation += 1
            consumer: Any = None
            try:
                consumer = await asyncio.wait_for(open_consumer(client), 30.0)
                while self.consuming:
                    msg = await consumer.receive(timeout=RECEIVE_POLL_S)
                    if msg is None:
                        continue
                    self._received(session, kind, subscription, msg)
                    if ack == "cumulative":
                        await consumer.acknowledge_cumulative(msg)
                    elif ack == "individual":
                        await consumer.acknowledge(msg)
            except _ERRORS as err:
                self.history.record(session, "info", "recv", {"error": repr(err)})
                await asyncio.sleep(RESTART_PAUSE_S)
            finally:
                if consumer is not None:
                    with contextlib.suppress(Exception):
                        await asyncio.wait_for(consumer.close(), 10.0)

    async def drain(self, deadline_s: float) -> bool:
        """Wait until the stream and queue consumers this run started saw every
        acknowledged value (True), or ``deadline_s`` seconds passed (False)."""
        loop = asyncio.get_running_loop()
        end = loop.time() + deadline_s
        while loop.time() < end:
            if all(self.acked <= seen for seen in self.seen.values()):
                return True
            await asyncio.sleep(0.5)
        return False

    async def final_read(self, deadline_s: float, idle_s: float = 3.0) -> int:
        """Read the whole DAG from the earliest position with a new client (session
        ``final``) until nothing came for ``idle_s`` and either every acknowledged value
        was read or the reader got past where every segment ended when the read began
        (the rest of the acknowledged values is not stored: waiting cannot bring it), or
        ``deadline_s`` passed. Returns the number of messages read.

        Call it once the producers stopped: the end is taken when the read begins."""
        loop = asyncio.get_running_loop()
        end = loop.time() + deadline_s
        seen: set[str] = set()
        count = 0
        client = Client(self.cluster.service_url)
        try:
            stored_end = await self._stored_end(client)
            consumer = await asyncio.wait_for(client.create_checkpoint_consumer(self.topic), 30.0)
            idle_since = loop.time()
            while loop.time() < end:
                msg = await consumer.receive(timeout=RECEIVE_POLL_S)
                if msg is None:
                    if loop.time() - idle_since <= idle_s:
                        continue
                    if self.acked <= seen:
                        break
                    if stored_end is not None and consumer.checkpoint().covers(stored_end):
                        break
                    continue
                idle_since = loop.time()
                count += 1
                seen.add(msg.value.decode(errors="replace"))
                self._received("final", "final", "-", msg)
        except _ERRORS as err:
            self.history.record("final", "info", "recv", {"error": repr(err)})
        finally:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(client.close(), 10.0)
        self.history.record("final", "info", "final-done", {"read": count})
        return count

    async def _stored_end(self, client: Client) -> Checkpoint | None:
        """Where every segment ends now (sealed ones complete, active ones at their last
        message); None if that could not be learnt (the read then waits out its
        deadline when a value is missing, as if it might still come)."""
        try:
            reader = await asyncio.wait_for(
                client.create_checkpoint_consumer(self.topic, start=Checkpoint.latest()), 30.0
            )
        except _ERRORS as err:
            self.history.record("final", "info", "stored-end", {"error": repr(err)})
            return None
        try:
            return reader.checkpoint()
        finally:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(reader.close(), 10.0)

    # --- the controller ----------------------------------------------------------------------

    async def storm(
        self,
        interval_s: tuple[float, float],
        crash_every_s: float = 0.0,
        crash_delay_s: float = 0.0,
    ) -> None:
        """Splits and merges at random intervals; with ``crash_every_s``, at most that often
        the broker owning a parent is SIGKILLed (lose-unfsynced) ``crash_delay_s`` after the
        change succeeds and restarted 2 s later: a crash just after a seal (or, delayed,
        just after the parent drained), in the window where the parent's lazily saved
        cursor may not be durable yet."""
        rng = random.Random(self.rng.random())
        last_crash = float("-inf")
        restarts: set[asyncio.Task[None]] = set()
        while self.producing:
            await asyncio.sleep(rng.uniform(*interval_s))
            layout = await self.layout()
            if layout is None:
                continue
            loop = asyncio.get_running_loop()
            crash = crash_every_s > 0 and loop.time() - last_crash > crash_every_s
            crash = crash and len(self.cluster.live()) == len(self.cluster.brokers)
            owner = await self.change(layout, rng, "storm", find_owner=crash)
            if crash and owner is not None:
                last_crash = loop.time()
                info = {"fault": "kill-after-change", "target": owner}
                await asyncio.sleep(crash_delay_s)
                self.history.nemesis("start", info)
                await self.cluster.crash(owner)
                task = asyncio.create_task(self._restart(owner, info))
                restarts.add(task)
                task.add_done_callback(restarts.discard)
        await asyncio.gather(*restarts, return_exceptions=True)

    async def _restart(self, index: int, info: dict[str, Any], after_s: float = 2.0) -> None:
        await asyncio.sleep(after_s)
        with contextlib.suppress(*_ERRORS):
            await self.cluster.brokers[index].start()
        self.history.nemesis("stop", info)

    async def change(
        self, layout: SegmentLayout, rng: random.Random, process: str, find_owner: bool = False
    ) -> int | None:
        """One split (or merge, with many segments or by chance) logged under
        ``process``; None if it failed, else the index of the broker that owned the first
        parent segment (with ``find_owner``; else -1)."""
        active = sorted(layout.active_segments(), key=lambda s: s.hash_range.start)
        merge = len(active) > 1 and (len(active) >= SEGMENTS_MAX or rng.random() < 0.4)
        if merge:
            i = rng.randrange(len(active) - 1)
            ids = [active[i].segment_id, active[i + 1].segment_id]
            f, suffix = "merge", f"/merge/{ids[0]}/{ids[1]}"
        else:
            ids = [rng.choice(active).segment_id]
            f, suffix = "split", f"/split/{ids[0]}"
        owner = -1
        if find_owner:
            parent = str(segment_name(self.topic_name, layout.segment(ids[0])))
            with contextlib.suppress(*_ERRORS):
                found = await asyncio.wait_for(self.cluster.segment_owner(parent), 5.0)
                owner = found.index if found is not None else -1
        self.history.record(process, "invoke", f, {"segments": ids, "epoch": layout.epoch})
        try:
            status, body = await self.admin("POST", suffix)
        except _ERRORS as err:
            self.history.record(process, "info", f, {"segments": ids, "error": repr(err)})
            return None
        if status == 200:
            epoch = body.get("epoch") if isinstance(body, dict) else None
            self.history.record(process, "ok", f, {"segments": ids, "epoch": epoch})
            return owner if owner >= 0 or not find_owner else None
        error = {"segments": ids, "status": status, "error": str(body)[:300]}
        self.history.record(process, "fail", f, error)
        return None

    async def probe(self, deadline_s: float, interval_s: float = PROBE_INTERVAL_S) -> bool:
        """After the heal: request splits (or merges) until one succeeds or
        ``deadline_s`` passes, reading the layout again before each attempt (a change
        still finishing at the heal seals what the first attempt named: a refusal the
        controller is right to give, not a sign it is unavailable)."""
        loop = asyncio.get_running_loop()
        end = loop.time() + deadline_s
        rng = random.Random(self.rng.random())
        while loop.time() < end:
            layout = await self.layout()
            if layout is not None and await self.change(layout, rng, "probe") is not None:
                return True
            await asyncio.sleep(interval_s)
        return False


def _failed(key: str, value: str, err: BaseException) -> dict[str, Any]:
    return {"key": key, "value": value, "error": repr(err)[:300]}


def _retrieve(fut: asyncio.Future[Any]) -> None:
    if not fut.cancelled():
        fut.exception()


def _txn_error(label: str, phase: str, err: BaseException) -> dict[str, Any]:
    return {"txn": label, "phase": phase, "error": repr(err)[:300]}
