"""The blocking API: a thin facade over the async client, run on one event-loop thread.

Each sync ``Client`` starts a :class:`Portal` (a daemon thread running an asyncio loop,
modelled on anyio's blocking portal); every method submits the async twin's coroutine to
that loop and waits for its result. Method names mirror ``anabranch.aio``.

Example::

    from anabranch import Client

    with Client("pulsar://127.0.0.1:6650") as client:
        producer = client.create_producer("persistent://public/default/t")
        producer.send(b"hi", key="k")
        consumer = client.subscribe("persistent://public/default/t", "sub",
                                    initial_position="earliest")
        msg = consumer.receive(timeout=1.0)          # None on timeout
        if msg is not None:
            consumer.acknowledge(msg)
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import re
import threading
from collections.abc import Callable, Coroutine, Mapping
from types import TracebackType
from typing import Any, Generic, TypeVar, overload

from anabranch.client import client as aclient
from anabranch.client.checkpoint import Checkpoint
from anabranch.client.checkpoint_consumer import CheckpointConsumer as AsyncCheckpointConsumer
from anabranch.client.consumer import Consumer as AsyncConsumer
from anabranch.client.consumer import PartitionedConsumer
from anabranch.client.message import Message
from anabranch.client.message_id import MessageId
from anabranch.client.pattern_consumer import PatternConsumer
from anabranch.client.producer import PartitionedProducer
from anabranch.client.producer import Producer as AsyncProducer
from anabranch.client.queue_consumer import QueueConsumer as AsyncQueueConsumer
from anabranch.client.reader import Reader as AsyncReader
from anabranch.client.scalable_producer import ScalableProducer
from anabranch.client.stream_consumer import StreamConsumer as AsyncStreamConsumer
from anabranch.client.transaction import DEFAULT_TIMEOUT_S, TransactionState, finish
from anabranch.client.transaction import Transaction as AsyncTransaction
from anabranch.core.txn_id import TxnId
from anabranch.errors import Closed

R = TypeVar("R")
InnerT = TypeVar("InnerT")


class Portal:
    """An event loop on a daemon thread that runs coroutines for blocking callers.

    Example:
        >>> async def add(a: int, b: int) -> int:
        ...     return a + b
        >>> portal = Portal()
        >>> portal.call(add, 1, 2)
        3
        >>> portal.stop()
    """

    def __init__(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name="anabranch-client", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_forever()
        self._loop.close()

    def call(self, func: Callable[..., Coroutine[Any, Any, R]], *args: Any, **kwargs: Any) -> R:
        """Run ``func(*args, **kwargs)`` on the loop and wait for its result."""
        return self.start(func, *args, **kwargs).result()

    def start(
        self, func: Callable[..., Coroutine[Any, Any, R]], *args: Any, **kwargs: Any
    ) -> concurrent.futures.Future[R]:
        """Run ``func(*args, **kwargs)`` on the loop; returns a concurrent future."""
        if not self._thread.is_alive() or self._loop.is_closed():
            raise Closed("the client is closed")
        return asyncio.run_coroutine_threadsafe(func(*args, **kwargs), self._loop)

    def stop(self) -> None:
        """Stop the loop (after cancelling what still runs) and join the thread."""
        if not self._thread.is_alive():
            return
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()


def _chain(source: asyncio.Future[R], target: concurrent.futures.Future[R]) -> None:
    def copy(fut: asyncio.Future[R]) -> None:
        if fut.cancelled():
            target.cancel()
        elif (err := fut.exception()) is not None:
            target.set_exception(err)
        else:
            target.set_result(fut.result())

    source.add_done_callback(copy)


class _Facade(Generic[InnerT]):
    """A blocking twin of one async object (``inner``), whose coroutines run on ``portal``."""

    def __init__(self, portal: Portal, inner: InnerT) -> None:
        self._portal = portal
        self.inner = inner


class _InnerStr:
    """A read-only property of a facade: the same-named ``str`` attribute of its ``inner``."""

    def __init__(self, doc: str) -> None:
        self.__doc__ = doc
        self._name = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self._name = name

    @overload
    def __get__(self, obj: None, objtype: type | None = None) -> _InnerStr: ...
    @overload
    def __get__(self, obj: _Facade[Any], objtype: type | None = None) -> str: ...
    def __get__(self, obj: _Facade[Any] | None, objtype: type | None = None) -> _InnerStr | str:
        if obj is None:
            return self
        value: str = getattr(obj.inner, self._name)
        return value


FacadeT = TypeVar("FacadeT", bound=_Facade[Any])


class Transaction(_Facade[AsyncTransaction]):
    """Blocking twin of :class:`anabranch.client.transaction.Transaction`; a context
    manager that commits on a normal exit and aborts on an exception.

    Example::

        with client.transaction(timeout=30) as txn:
            producer.send(b"x", key="k", txn=txn)
            stream.acknowledge_cumulative(msg, txn=txn)
        assert txn.state is TransactionState.COMMITTED
    """

    @property
    def id(self) -> TxnId:
        """The transaction id ``(most_bits, least_bits)``."""
        return self.inner.id

    @property
    def state(self) -> TransactionState:
        """The current :class:`TransactionState` (TIMED_OUT once past the timeout)."""
        return self.inner.peek_state()

    @property
    def timeout(self) -> float:
        """The timeout in seconds."""
        return self.inner.timeout

    def commit(self) -> None:
        """Wait for the transaction's sends and acks, then commit (see the async twin)."""
        self._portal.call(self.inner.commit)

    def abort(self) -> None:
        """Abort the transaction."""
        self._portal.call(self.inner.abort)

    def commit_async(self) -> concurrent.futures.Future[None]:
        """Start the commit and return at once (Pulsar's ``commit()`` is asynchronous too):
        a future that holds what :meth:`commit` would return or raise. The transaction is
        COMMITTING from this call on (later sends in it are refused), so a loop can take
        its next transaction while this one commits::

            pending = []
            for batch in batches:
                txn = client.new_transaction(timeout=30)
                for value in batch:
                    producer.send_async(value, txn=txn)
                pending.append(txn.commit_async())
            for done in pending:
                done.result()   # raises what that commit raised
        """
        return self._portal.call(_started, self.inner.commit)

    def abort_async(self) -> concurrent.futures.Future[None]:
        """Start the abort and return at once; a future of its outcome."""
        return self._portal.call(_started, self.inner.abort)

    def __repr__(self) -> str:
        return f"Transaction({self.id}, {self.state.name})"

    def __enter__(self) -> Transaction:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._portal.call(finish, self.inner, exc)


async def _started(
    operation: Callable[[], Coroutine[Any, Any, None]],
) -> concurrent.futures.Future[None]:
    """Run ``operation`` as a task on the loop, returned once it has taken its first step
    (a commit or abort moves the state before its first wait), with a future of its end."""
    result: concurrent.futures.Future[None] = concurrent.futures.Future()
    task = asyncio.ensure_future(operation())
    _chain(task, result)
    await asyncio.sleep(0)  # the task's first step runs before this caller returns
    return result


def _txn(txn: Transaction | AsyncTransaction | None) -> AsyncTransaction | None:
    return txn.inner if isinstance(txn, Transaction) else txn


class Producer(_Facade[AsyncProducer | PartitionedProducer | ScalableProducer]):
    """Blocking twin of :class:`anabranch.client.producer.Producer`."""

    topic = _InnerStr("The topic this producer writes to.")
    producer_name = _InnerStr("The producer name (assigned by the broker unless given).")

    def send(
        self,
        value: bytes,
        *,
        key: str | None = None,
        properties: Mapping[str, str] | None = None,
        event_time: int | None = None,
        sequence_id: int | None = None,
        txn: Transaction | None = None,
        deliver_at: int | None = None,
        deliver_after: float | None = None,
    ) -> MessageId:
        """Send and wait until stored; returns the message id (``txn``: in that
        transaction; ``deliver_at`` ms since the epoch or ``deliver_after`` seconds: delayed
        delivery)."""
        return self._portal.call(
            self.inner.send,
            value,
            key=key,
            properties=properties,
            event_time=event_time,
            sequence_id=sequence_id,
            txn=_txn(txn),
            deliver_at=deliver_at,
            deliver_after=deliver_after,
        )

    def send_async(
        self,
        value: bytes,
        *,
        key: str | None = None,
        properties: Mapping[str, str] | None = None,
        event_time: int | None = None,
        sequence_id: int | None = None,
        txn: Transaction | None = None,
        deliver_at: int | None = None,
        deliver_after: float | None = None,
    ) -> concurrent.futures.Future[MessageId]:
        """Queue a message (blocking while the queue is full); returns a future of its id."""
        result: concurrent.futures.Future[MessageId] = concurrent.futures.Future()

        async def queue() -> None:
            fut = await self.inner.send_async(
                value, key=key, properties=properties, event_time=event_time,
                sequence_id=sequence_id, txn=_txn(txn), deliver_at=deliver_at,
                deliver_after=deliver_after,
            )  # fmt: skip
            _chain(fut, result)

        self._portal.call(queue)
        return result

    def flush(self) -> None:
        """Wait until every message sent so far is acknowledged."""
        self._portal.call(self.inner.flush)

    def close(self) -> None:
        """Flush and close."""
        self._portal.call(self.inner.close)


class Consumer(_Facade[AsyncConsumer | PartitionedConsumer | PatternConsumer]):
    """Blocking twin of the async Consumer (or PartitionedConsumer, PatternConsumer)."""

    topic = _InnerStr("The subscribed topic.")
    subscription = _InnerStr("The subscription name.")

    def receive(self, timeout: float | None = 1.0) -> Message | None:
        """The next message, or None after ``timeout`` seconds (None: wait forever)."""
        return self._portal.call(self.inner.receive, timeout)

    def acknowledge(self, message: Message | MessageId, txn: Transaction | None = None) -> None:
        """Acknowledge one message (``txn``: as part of that transaction)."""
        self._portal.call(self.inner.acknowledge, message, _txn(txn))

    def acknowledge_cumulative(
        self, message: Message | MessageId, txn: Transaction | None = None
    ) -> None:
        """Acknowledge this message and all before it (``txn``: in that transaction)."""
        self._portal.call(self.inner.acknowledge_cumulative, message, _txn(txn))

    def negative_acknowledge(self, message: Message | MessageId) -> None:
        """Ask for a later redelivery."""
        self._portal.call(self.inner.negative_acknowledge, message)

    def seek(self, target: MessageId | int) -> None:
        """Move to a message id or a publish time (ms)."""
        self._portal.call(self.inner.seek, target)

    def unsubscribe(self) -> None:
        """Delete the subscription and close."""
        self._portal.call(self.inner.unsubscribe)

    def close(self) -> None:
        """Close the consumer."""
        self._portal.call(self.inner.close)


class Reader(_Facade[AsyncReader]):
    """Blocking twin of :class:`anabranch.client.reader.Reader`."""

    topic = _InnerStr("The topic being read.")

    def read_next(self, timeout: float | None = 1.0) -> Message | None:
        """The next message, or None after ``timeout`` seconds."""
        return self._portal.call(self.inner.read_next, timeout)

    def has_message_available(self) -> bool:
        """True if a message after the last one read exists."""
        return self._portal.call(self.inner.has_message_available)

    def seek(self, target: MessageId | int) -> None:
        """Move to a message id or a publish time (ms)."""
        self._portal.call(self.inner.seek, target)

    def close(self) -> None:
        """Close the reader."""
        self._portal.call(self.inner.close)


class StreamConsumer(_Facade[AsyncStreamConsumer]):
    """Blocking twin of :class:`anabranch.client.stream_consumer.StreamConsumer`."""

    topic = _InnerStr("The scalable topic.")
    subscription = _InnerStr("The subscription name.")
    consumer_name = _InnerStr("The identity the controller keeps for the grace period.")

    def receive(self, timeout: float | None = 1.0) -> Message | None:
        """The next message from any assigned segment, or None after ``timeout`` seconds."""
        return self._portal.call(self.inner.receive, timeout)

    def acknowledge_cumulative(
        self, message: Message | MessageId, txn: Transaction | None = None
    ) -> None:
        """Acknowledge this message and everything received before it, on every segment
        (``txn``: as part of that transaction)."""
        self._portal.call(self.inner.acknowledge_cumulative, message, _txn(txn))

    def acknowledge(self, message: Message | MessageId, txn: Transaction | None = None) -> None:
        """Acknowledge this one message (the way to ack in Key_Shared dispatch mode)."""
        self._portal.call(self.inner.acknowledge, message, _txn(txn))

    def close(self, *, leave: bool = True) -> None:
        """Close the consumer; ``leave=False`` keeps its segments for the grace period."""
        self._portal.call(self.inner.close, leave=leave)


class QueueConsumer(_Facade[AsyncQueueConsumer]):
    """Blocking twin of :class:`anabranch.client.queue_consumer.QueueConsumer`."""

    topic = _InnerStr("The scalable topic.")
    subscription = _InnerStr("The subscription name.")

    def receive(self, timeout: float | None = 1.0) -> Message | None:
        """The next message from any segment, or None after ``timeout`` seconds."""
        return self._portal.call(self.inner.receive, timeout)

    def acknowledge(self, message: Message | MessageId, txn: Transaction | None = None) -> None:
        """Acknowledge one message (``txn``: as part of that transaction)."""
        self._portal.call(self.inner.acknowledge, message, _txn(txn))

    def negative_acknowledge(self, message: Message | MessageId) -> None:
        """Ask for a later redelivery (or dead-letter it past ``max_redeliveries``)."""
        self._portal.call(self.inner.negative_acknowledge, message)

    def close(self) -> None:
        """Close the consumer."""
        self._portal.call(self.inner.close)


class CheckpointConsumer(_Facade[AsyncCheckpointConsumer]):
    """Blocking twin of :class:`anabranch.client.checkpoint_consumer.CheckpointConsumer`."""

    topic = _InnerStr("The scalable topic.")

    def receive(self, timeout: float | None = 1.0) -> Message | None:
        """The next message in DAG order, or None after ``timeout`` seconds."""
        return self._portal.call(self.inner.receive, timeout)

    def seek(self, position: Checkpoint) -> None:
        """Read from ``position`` next."""
        self._portal.call(self.inner.seek, position)

    def checkpoint(self) -> Checkpoint:
        """Where the consumer is now (a value to resume from)."""
        return self._portal.call(self._checkpoint)

    async def _checkpoint(self) -> Checkpoint:
        # Read on the loop thread: the consumer's state is only touched there.
        return self.inner.checkpoint()

    def close(self) -> None:
        """Close the consumer."""
        self._portal.call(self.inner.close)


class Client:
    """The blocking client (see the module docstring); a context manager."""

    def __init__(self, service_url: str, **options: Any) -> None:
        self._portal = Portal()

        async def make() -> aclient.Client:
            return aclient.Client(service_url, **options)

        try:
            self._inner = self._portal.call(make)
        except BaseException:
            self._portal.stop()
            raise

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def create_producer(self, topic: str, **options: Any) -> Producer:
        """A connected producer (options as ``anabranch.aio.Client.create_producer``)."""
        return self._open(Producer, self._inner.create_producer, topic, **options)

    def subscribe(
        self, topic: str | re.Pattern[str], subscription: str, **options: Any
    ) -> Consumer:
        """A subscribed consumer (options as ``anabranch.aio.Client.subscribe``; a
        compiled pattern subscribes to every matching topic)."""

        async def make() -> AsyncConsumer | PartitionedConsumer | PatternConsumer:
            if isinstance(topic, re.Pattern):
                return await self._inner.subscribe(topic, subscription, **options)
            return await self._inner.subscribe(topic, subscription, **options)

        return Consumer(self._portal, self._portal.call(make))

    def create_reader(
        self, topic: str, start: MessageId | str = "earliest", **options: Any
    ) -> Reader:
        """A reader from a MessageId, ``"earliest"`` or ``"latest"``."""
        return self._open(Reader, self._inner.create_reader, topic, start, **options)

    def subscribe_stream(self, topic: str, subscription: str, **options: Any) -> StreamConsumer:
        """A stream consumer of a scalable topic (options as in ``anabranch.aio``)."""
        return self._open(
            StreamConsumer, self._inner.subscribe_stream, topic, subscription, **options
        )

    def subscribe_queue(self, topic: str, subscription: str, **options: Any) -> QueueConsumer:
        """A queue consumer of a scalable topic (options as in ``anabranch.aio``)."""
        return self._open(
            QueueConsumer, self._inner.subscribe_queue, topic, subscription, **options
        )

    def create_checkpoint_consumer(
        self, topic: str, start: Checkpoint | None = None, **options: Any
    ) -> CheckpointConsumer:
        """A checkpoint consumer of a scalable topic from ``start`` (default earliest)."""
        return self._open(
            CheckpointConsumer, self._inner.create_checkpoint_consumer, topic, start, **options
        )

    def new_transaction(self, timeout: float = DEFAULT_TIMEOUT_S) -> Transaction:
        """An open transaction that times out ``timeout`` seconds from now.

        Example::

            txn = client.new_transaction(timeout=60)
            producer.send(b"x", txn=txn)
            txn.commit()                    # or txn.abort()
        """
        return self._open(Transaction, self._inner.new_transaction, timeout)

    def claim_transaction_key(self) -> int:
        """Claim the client's ``transaction_key`` now (fencing its previous holder) and
        return the key's epoch; without it the first transaction claims the key.

        Example::

            client = Client("pulsar://localhost:6650", transaction_key="etl-7")
            client.claim_transaction_key()      # 0 for the first client, then 1, 2, ...
        """
        return int(self._portal.call(self._inner.claim_transaction_key))

    def resume_transaction(
        self, txn_id: tuple[int, int], timeout: float = DEFAULT_TIMEOUT_S
    ) -> Transaction:
        """A handle on an OPEN transaction created elsewhere (a sink's batch), to send in
        with ``txn=`` (see the async twin).

        Example::

            txn = client.resume_transaction(TxnId(0, 12), timeout=60)
            producer.send(b"row", txn=txn, properties={"__txn_branch": "3-a1"})
        """
        return self._open(Transaction, self._inner.resume_transaction, txn_id, timeout)

    def transaction(self, timeout: float = DEFAULT_TIMEOUT_S) -> Transaction:
        """A new transaction to use as ``with client.transaction(timeout=30) as txn:``
        (commits on a normal exit, aborts on an exception)."""
        return self.new_transaction(timeout)

    def _open(
        self,
        facade: Callable[[Portal, InnerT], FacadeT],
        make: Callable[..., Coroutine[Any, Any, InnerT]],
        *args: Any,
        **kwargs: Any,
    ) -> FacadeT:
        # Make the async object on the loop and wrap it in its blocking twin.
        return facade(self._portal, self._portal.call(make, *args, **kwargs))

    def close(self) -> None:
        """Close everything and stop the loop thread. Idempotent."""
        try:
            self._portal.call(self._shutdown)
        except Closed:
            return
        self._portal.stop()

    async def _shutdown(self) -> None:
        await self._inner.close()
        # Let the tasks that closing cancelled finish before the loop stops.
        current = asyncio.current_task()
        tasks = [t for t in asyncio.all_tasks() if t is not current]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


__all__ = [
    "CheckpointConsumer",
    "Client",
    "Consumer",
    "Portal",
    "Producer",
    "QueueConsumer",
    "Reader",
    "StreamConsumer",
    "Transaction",
]
