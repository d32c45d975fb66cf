"""The async client: one connection pool, and factories for producers, consumers, readers.

Example::

    from anabranch.aio import Client

    async with Client("pulsar://127.0.0.1:6650") as client:
        producer = await client.create_producer("persistent://public/default/t")
        consumer = await client.subscribe("persistent://public/default/t", "sub",
                                          initial_position="earliest")
        await producer.send(b"hi", key="k")
        msg = await consumer.receive(timeout=5)
"""

from __future__ import annotations

import asyncio
import random as _random
import re
from collections.abc import Callable
from types import TracebackType
from typing import Any, overload

from anabranch.client.auth import Authentication, AuthenticationToken
from anabranch.client.checkpoint import Checkpoint
from anabranch.client.checkpoint_consumer import CheckpointConsumer
from anabranch.client.connection import ConnectionPool
from anabranch.client.consumer import Consumer, ConsumerOptions, PartitionedConsumer, subscribe
from anabranch.client.dag_session import DagSession, is_scalable_name, scalable_topic_name
from anabranch.client.message_id import MessageId
from anabranch.client.pattern_consumer import (
    DISCOVERY_PERIOD_S,
    PatternConsumer,
    subscribe_pattern,
)
from anabranch.client.producer import (
    PartitionedProducer,
    Producer,
    ProducerOptions,
    create_producer,
)
from anabranch.client.queue_consumer import LayoutSource, QueueConsumer, QueueConsumerOptions
from anabranch.client.reader import Reader, start_position
from anabranch.client.scalable_producer import ScalableProducer
from anabranch.client.stream_consumer import StreamConsumer, StreamConsumerOptions
from anabranch.client.tls import TlsOptions
from anabranch.client.transaction import (
    DEFAULT_TIMEOUT_S,
    Transaction,
    TransactionCoordinatorClient,
    TransactionScope,
)
from anabranch.core.names import SegmentName, TopicDomain, parse_name
from anabranch.core.txn_id import TxnId
from anabranch.core.txn_keys import validate_key
from anabranch.errors import InvalidArgument
from anabranch.limits import (
    CLIENT_OPERATION_STUCK_S,
    CLIENT_OPERATION_TIMEOUT_S,
    CLIENT_PROBE_TIMEOUT_S,
    CONSUMER_RECEIVER_QUEUE_MESSAGES,
    KEEPALIVE_INTERVAL_S,
)


def _persistent_topic(topic: str) -> str:
    # A segment of a scalable topic is a persistent topic on the wire: readers (the Spark
    # source) and the scalable-topic handlers address segments directly. Non-persistent
    # topics speak the same protocol (what they cannot do, the broker refuses).
    name = parse_name(topic)
    if isinstance(name, SegmentName):
        return str(name)
    if name.domain not in (TopicDomain.PERSISTENT, TopicDomain.NON_PERSISTENT):
        raise InvalidArgument(
            f"{topic!r}: this client handles persistent:// and non-persistent:// topics only"
        )
    return str(name)


class Client:
    """An async Pulsar client (see the module docstring).

    Options: ``operation_timeout_s`` (requests), ``keepalive_interval_s`` (PING period),
    ``operation_stuck_s`` (a send or request waiting this long makes the client PING its
    connection), ``probe_timeout_s`` (how long that PING may go unanswered before the
    connection is dropped and its producers move to the topic's current owner),
    ``random`` (the reconnect jitter source, injectable for tests), ``transaction_key``
    (the key-fencing PIP: one live owner per key; a newer client with the same key fences
    this one, whose transaction calls then raise ``ExpiredTransactionError``; a key has
    one open transaction, so a new one aborts the key's previous open one; a key with
    ``&``, empty, or over ``limits.TXN_KEY_BYTES_MAX`` is InvalidArgument here);
    ``transaction_spares`` (how many transactions ``new_transaction`` may keep opened
    ahead of use, so that it returns without a round trip, up to
    ``client.txn_spares.SPARES_MAX``; 0, the default: none, every call sends its own NEW_TXN.
    Spares suit a loop of short transactions: an unused one is aborted after two
    seconds, and shows in the broker's open and aborted transaction counts; a keyed
    client keeps none).

    Security, named as the official client names it: ``auth`` (an
    :class:`~anabranch.client.auth.AuthenticationToken`, ``AuthenticationBasic`` or
    ``AuthenticationTLS``) or ``auth_token`` (a token string or a callable returning one);
    with a ``pulsar+ssl://`` URL, ``tls_trust_certs_file_path`` (CA bundle),
    ``tls_allow_insecure_connection`` and ``tls_validate_hostname``; ``listener_name``
    (the broker's advertised listener whose URLs lookups answer; an unknown one raises
    ``ListenerNotFound`` at once).

    Example (a broker across a slow WAN link: probe later, wait longer for the PONG)::

        client = Client("pulsar://broker:6650", operation_stuck_s=5.0, probe_timeout_s=3.0)
    """

    def __init__(
        self,
        service_url: str,
        *,
        operation_timeout_s: float = CLIENT_OPERATION_TIMEOUT_S,
        keepalive_interval_s: float = KEEPALIVE_INTERVAL_S,
        operation_stuck_s: float = CLIENT_OPERATION_STUCK_S,
        probe_timeout_s: float = CLIENT_PROBE_TIMEOUT_S,
        random: Callable[[], float] = _random.random,
        transaction_key: str | None = None,
        auth: Authentication | None = None,
        auth_token: str | Callable[[], str] | None = None,
        tls_trust_certs_file_path: str | None = None,
        tls_allow_insecure_connection: bool = False,
        tls_validate_hostname: bool = False,
        listener_name: str | None = None,
        transaction_spares: int = 0,
    ) -> None:
        self.service_url = service_url
        self._transaction_spares = transaction_spares
        if auth_token is not None:
            if auth is not None:
                raise InvalidArgument("give auth or auth_token, not both")
            auth = AuthenticationToken(auth_token)
        tls = TlsOptions(
            trust_certs_file_path=tls_trust_certs_file_path,
            allow_insecure_connection=tls_allow_insecure_connection,
            validate_hostname=tls_validate_hostname,
        )
        # Refused here, before any connection: a key with '&' could never be claimed.
        self.transaction_key = None if transaction_key is None else validate_key(transaction_key)
        self._pool = ConnectionPool(
            service_url,
            operation_timeout_s=operation_timeout_s,
            keepalive_interval_s=keepalive_interval_s,
            operation_stuck_s=operation_stuck_s,
            probe_timeout_s=probe_timeout_s,
            random=random,
            auth=auth,
            tls=tls,
            listener_name=listener_name,
        )
        self._handlers: list[
            Producer
            | PartitionedProducer
            | Consumer
            | PartitionedConsumer
            | PatternConsumer
            | Reader
            | QueueConsumer
            | CheckpointConsumer
            | ScalableProducer
            | StreamConsumer
        ] = []
        self._coordinator: TransactionCoordinatorClient | None = None

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def create_producer(
        self, topic: str, **options: Any
    ) -> Producer | PartitionedProducer | ScalableProducer:
        """A connected producer; options are the fields of ``ProducerOptions``.

        A ``topic://`` name gives a :class:`ScalableProducer` (routing by key over the
        active segments, re-routing across splits and merges; the topic is created with one
        segment on first use where allowed).

        Example::

            producer = await client.create_producer(topic, compression="lz4", batching=False)
            orders = await client.create_producer("topic://public/default/orders")
        """
        opts = ProducerOptions.from_kwargs(options)
        producer: Producer | PartitionedProducer | ScalableProducer
        if is_scalable_name(topic):
            session = await DagSession.open(self._pool, scalable_topic_name(topic))
            producer = ScalableProducer(self._pool, session, opts)
        else:
            producer = await create_producer(self._pool, _persistent_topic(topic), opts)
        self._handlers.append(producer)
        return producer

    @overload
    async def subscribe(
        self, topic: str, subscription: str, **options: Any
    ) -> Consumer | PartitionedConsumer: ...

    @overload
    async def subscribe(
        self, topic: re.Pattern[str], subscription: str, **options: Any
    ) -> PatternConsumer: ...

    async def subscribe(
        self, topic: str | re.Pattern[str], subscription: str, **options: Any
    ) -> Consumer | PartitionedConsumer | PatternConsumer:
        """A subscribed consumer; options are the fields of ``ConsumerOptions``.

        A compiled regular expression subscribes to every topic of its namespace whose
        name matches (a :class:`PatternConsumer`, following topics created and deleted
        later), with ``regex_subscription_mode`` (``"persistent"``, ``"non-persistent"``
        or ``"all"``) and ``pattern_auto_discovery_period_s`` (the polling period; the
        broker's topic-list watcher pushes changes sooner where it offers one).

        Example::

            consumer = await client.subscribe(topic, "jobs", subscription_type="shared",
                                              ack_timeout_s=30)
            orders = await client.subscribe(re.compile("persistent://public/default/o-.*"),
                                            "billing", regex_subscription_mode="all")
        """
        if isinstance(topic, re.Pattern):
            mode = options.pop("regex_subscription_mode", "persistent")
            period = options.pop("pattern_auto_discovery_period_s", DISCOVERY_PERIOD_S)
            pattern_consumer = await subscribe_pattern(
                self._pool,
                topic,
                subscription,
                ConsumerOptions.from_kwargs(options),
                mode=str(mode),
                discovery_period_s=float(period),
            )
            self._handlers.append(pattern_consumer)
            return pattern_consumer
        opts = ConsumerOptions.from_kwargs(options)
        consumer = await subscribe(self._pool, _persistent_topic(topic), subscription, opts)
        self._handlers.append(consumer)
        return consumer

    async def create_reader(
        self,
        topic: str,
        start: MessageId | str = "earliest",
        *,
        start_inclusive: bool = False,
        reader_name: str | None = None,
        receiver_queue_size: int | None = None,
        read_compacted: bool = False,
    ) -> Reader:
        """A reader from ``start``: a MessageId, ``"earliest"`` or ``"latest"``.

        Example::

            reader = await client.create_reader(topic, "earliest")
        """
        reader = Reader(
            self._pool,
            _persistent_topic(topic),
            start_position(start),
            start_inclusive=start_inclusive,
            reader_name=reader_name,
            receiver_queue_size=receiver_queue_size,
            read_compacted=read_compacted,
        )
        await reader._start()
        self._handlers.append(reader)
        return reader

    async def subscribe_stream(
        self, topic: str, subscription: str, **options: Any
    ) -> StreamConsumer:
        """A stream consumer of a scalable topic: segments dealt by the controller, one
        ordered receive queue, cumulative acks (parent segments before children).

        Options are the fields of ``StreamConsumerOptions`` (``consumer_name``: the
        identity kept for the grace period; ``receiver_queue_size``; ``properties``;
        ``dispatch_mode="key_shared"``: more consumers than segments share segments by
        key hash, acknowledged one by one with ``acknowledge``).

        Example::

            stream = await client.subscribe_stream("topic://public/default/orders",
                                                   subscription="billing",
                                                   consumer_name="worker-1")
        """
        opts = StreamConsumerOptions.from_kwargs(options)
        session = await DagSession.open(self._pool, scalable_topic_name(topic))
        consumer = StreamConsumer(self._pool, session, subscription, opts)
        await consumer._start()
        self._handlers.append(consumer)
        return consumer

    async def subscribe_queue(self, topic: str, subscription: str, **options: Any) -> QueueConsumer:
        """A queue consumer of a scalable topic: Shared on every segment, individual acks.

        Options are the fields of ``QueueConsumerOptions`` (``initial_position``,
        ``ack_timeout_s``, ``nack_redelivery_delay_s``, ``max_redeliveries``,
        ``dead_letter_topic``, ...).

        Example::

            queue = await client.subscribe_queue("topic://public/default/jobs", "work",
                                                 max_redeliveries=5)
        """
        opts = QueueConsumerOptions.from_kwargs(options)
        source = await self._layout_source(topic)
        consumer = QueueConsumer(self._pool, source, subscription, opts, self._plain_producer)
        await consumer._start()
        self._handlers.append(consumer)
        return consumer

    async def create_checkpoint_consumer(
        self,
        topic: str,
        start: Checkpoint | None = None,
        *,
        consumer_name: str | None = None,
        receiver_queue_size: int = CONSUMER_RECEIVER_QUEUE_MESSAGES,
        consumer_group: str | None = None,
    ) -> CheckpointConsumer:
        """An unmanaged reader of a scalable topic's whole DAG from ``start`` (default
        ``Checkpoint.earliest()``); ``checkpoint()`` tells where it is. With
        ``consumer_group``, the topic's controller shares the segments out among the
        group's members (each with its own ``consumer_name``).

        Example::

            reader = await client.create_checkpoint_consumer(topic, Checkpoint.latest())
        """
        source = await self._layout_source(topic)
        consumer = CheckpointConsumer(
            self._pool,
            source,
            Checkpoint.earliest() if start is None else start,
            consumer_name=consumer_name,
            receiver_queue_size=receiver_queue_size,
            consumer_group=consumer_group,
        )
        await consumer._start()
        self._handlers.append(consumer)
        return consumer

    # --- transactions ----------------------------------------------------------------------

    def _transaction_coordinator(self) -> TransactionCoordinatorClient:
        if self._coordinator is None:
            self._coordinator = TransactionCoordinatorClient(
                self._pool,
                transaction_key=self.transaction_key,
                spares=self._transaction_spares,
            )
        return self._coordinator

    async def claim_transaction_key(self) -> int:
        """Claim ``transaction_key`` now and return its epoch (the key-fencing PIP).

        A keyed client otherwise claims its key at its first transaction. Claiming fences
        the key's previous holder: its open transaction is aborted, its connection closed,
        and its transaction calls raise ``ExpiredTransactionError`` from then on.

        Example::

            worker = Client("pulsar://localhost:6650", transaction_key="etl-7")
            epoch = await worker.claim_transaction_key()   # 0, then 1 for the next worker
        """
        if self.transaction_key is None:
            raise InvalidArgument("this client has no transaction_key")
        return await self._transaction_coordinator().claim_transaction_key()

    async def new_transaction(self, timeout: float = DEFAULT_TIMEOUT_S) -> Transaction:  # noqa: ASYNC109 (the txn's TTL)
        """An open transaction that the broker aborts ``timeout`` seconds from now unless
        committed; sends (``txn=``) and acks (``txn=``) join it.

        Raises ``TransactionCoordinatorNotFound`` when transactions are disabled on the
        broker.

        Example::

            txn = await client.new_transaction(timeout=60)
            await producer.send(b"x", key="k", txn=txn)
            await txn.commit()          # or: await txn.abort()
            print(txn.id, txn.state)    # TxnId(most_bits=.., least_bits=..) COMMITTED
        """
        return await self._transaction_coordinator().new_transaction(timeout)

    async def resume_transaction(
        self,
        txn_id: tuple[int, int],
        timeout: float = DEFAULT_TIMEOUT_S,  # noqa: ASYNC109 (the txn's remaining TTL)
    ) -> Transaction:
        """A handle on an OPEN transaction created elsewhere (an exactly-once sink's batch
        transaction, from ``PUT /admin/v2/transactions/batches/...``), to send in with
        ``txn=``; ``timeout`` is roughly the time it has left (the broker's deadline
        decides). Its commit and abort work, but a sink's tasks never call them: the
        driver commits the batch naming the winning branches. Nothing is sent here.

        Example::

            batch = await admin.begin_batch("q1/out", 7, "q1")
            ids = batch["txnId"]
            txn = await client.resume_transaction(
                TxnId(ids["mostSigBits"], ids["leastSigBits"]), timeout=60
            )
            await producer.send(b"row", txn=txn, properties={"__txn_branch": "3-a1"})
        """
        most, least = txn_id
        loop = asyncio.get_running_loop()
        return Transaction(
            self._transaction_coordinator(),
            TxnId(int(most), int(least)),
            timeout,
            deadline=loop.time() + timeout,
        )

    def transaction(self, timeout: float = DEFAULT_TIMEOUT_S) -> TransactionScope:
        """``async with client.transaction(timeout=30) as txn:``: a new transaction that
        commits when the block ends normally and aborts when it raises.

        Example::

            async with client.transaction(timeout=30) as txn:
                await out.send(b"x", key="k", txn=txn)
                await stream.acknowledge_cumulative(msg, txn=txn)
        """
        return TransactionScope(self._transaction_coordinator, timeout)

    async def _layout_source(self, topic: str) -> LayoutSource:
        return await DagSession.open(self._pool, scalable_topic_name(topic))

    async def _plain_producer(self, topic: str) -> Producer:
        producer = await self.create_producer(topic)
        if not isinstance(producer, Producer):
            raise InvalidArgument(f"{topic} is partitioned: not usable as a dead-letter topic")
        return producer

    async def close(self) -> None:
        """Close every producer, consumer and reader, then the connections. Idempotent."""
        handlers, self._handlers = self._handlers, []
        await asyncio.gather(*(h.close() for h in handlers), return_exceptions=True)
        if self._coordinator is not None:
            await self._coordinator.close()  # aborts its spare transactions
        await self._pool.close()
