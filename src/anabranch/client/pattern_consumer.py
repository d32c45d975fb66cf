"""``PatternConsumer``: one subscription over every topic of a namespace whose name matches
a regular expression (Pulsar's regex subscription), following topics as they come and go.

Theory of operation
-------------------
The pattern names its namespace (``persistent://public/default/orders-.*``; a pattern
without a domain is read as ``persistent://``). The consumer asks the broker for the
namespace's topics (GET_TOPICS_OF_NAMESPACE with the pattern, in the
``regex_subscription_mode``) and subscribes one :class:`~anabranch.client.consumer.Consumer`
per matching topic (partitions are topics of their own), all feeding one inbox. It then
follows the list:

* when the broker advertises ``supports_topic_watchers`` and the mode is ``persistent``,
  with a topic-list watcher (PIP-145): WATCH_TOPIC_UPDATE pushes new and deleted topics at
  once; a lost connection re-creates the watcher (and re-lists);
* and in every case by polling every ``pattern_auto_discovery_period_s`` with the last
  ``topics_hash`` (an unchanged list costs the broker a hash and an empty answer).

New topics are subscribed without auto-creation (``force_topic_creation=false``, as the
official clients do, so a deleted topic is not re-created by its own consumer); a topic
no longer listed has its consumer closed and its queued messages dropped. Names are also
matched here (the broker may leave a costly pattern unfiltered: ``filtered=false``).

Acks go to the consumer of the message's topic: pass the ``Message`` (a bare
``MessageId`` names no topic).

Example::

    consumer = await client.subscribe(re.compile("persistent://public/default/orders-.*"),
                                      "billing", pattern_auto_discovery_period_s=5)
    msg = await consumer.receive(timeout=5)
    await consumer.acknowledge(msg)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections.abc import Callable, Iterable

from anabranch.client.connection import ClientConnection, ConnectionPool
from anabranch.client.consumer import Consumer, ConsumerOptions, Inbox, RoutedAcks
from anabranch.client.message import Message
from anabranch.client.message_id import MessageId
from anabranch.core import topic_patterns
from anabranch.core.names import NamespaceName, TopicName
from anabranch.errors import AnabranchError, Closed, InvalidArgument, NotAllowed
from anabranch.protocol._generated import pulsar_api_pb2 as pb
from anabranch.protocol.frames import Frame

log = logging.getLogger(__name__)
T = pb.BaseCommand

MODES = {
    "persistent": pb.CommandGetTopicsOfNamespace.PERSISTENT,
    "non-persistent": pb.CommandGetTopicsOfNamespace.NON_PERSISTENT,
    "all": pb.CommandGetTopicsOfNamespace.ALL,
}
"""``regex_subscription_mode`` values (the official client's PersistentOnly,
NonPersistentOnly, AllTopics)."""

DISCOVERY_PERIOD_S = 60.0
"""Default ``pattern_auto_discovery_period_s`` (upstream's one minute)."""


def pattern_namespace(pattern: str) -> NamespaceName:
    """The namespace a topic pattern names (InvalidArgument if it names none).

    Example:
        >>> str(pattern_namespace("persistent://public/default/orders-.*"))
        'public/default'
        >>> str(pattern_namespace("acme/ns/x.*"))
        'acme/ns'
    """
    body = pattern.split("://", 1)[1] if "://" in pattern else pattern
    parts = body.split("/")
    if len(parts) < 3:
        raise InvalidArgument(f"pattern {pattern!r} names no tenant/namespace/")
    return NamespaceName.parse(f"{parts[0]}/{parts[1]}")


class _SharedInbox(Inbox):
    """A topic consumer's view of the pattern consumer's inbox: closing one topic's
    consumer must not close the inbox the other topics feed."""

    def __init__(self, shared: Inbox) -> None:
        super().__init__()
        self._shared = shared

    def __len__(self) -> int:
        return len(self._shared)

    def put(self, messages: list[Message]) -> None:
        self._shared.put(messages)

    async def get(self, timeout: float | None) -> Message | None:  # noqa: ASYNC109
        return await self._shared.get(timeout)

    def remove_where(self, predicate: Callable[[Message], bool]) -> int:
        return self._shared.remove_where(predicate)

    def close(self) -> None:
        return None


class _TopicConsumer(Consumer):
    """One matched topic's consumer: never auto-creates its topic, and a terminal error
    drops this topic rather than failing the pattern consumer."""

    def __init__(
        self,
        pool: ConnectionPool,
        topic: str,
        subscription: str,
        options: ConsumerOptions,
        *,
        shared: Inbox,
        on_lost: Callable[[_TopicConsumer], None],
    ) -> None:
        name = TopicName.parse(topic)
        partition = -1 if name.partition is None else name.partition
        super().__init__(
            pool, topic, subscription, options, partition=partition, inbox=_SharedInbox(shared)
        )
        self._on_lost = on_lost

    def _subscribe_command(self, request_id: int) -> pb.BaseCommand:
        cmd = super()._subscribe_command(request_id)
        cmd.subscribe.force_topic_creation = False
        return cmd

    def _on_terminal_error(self, error: AnabranchError) -> None:
        self._closing = True
        self._on_lost(self)


class PatternConsumer(RoutedAcks):
    """A subscription over the topics matching a pattern (see the module docstring)."""

    def __init__(
        self,
        pool: ConnectionPool,
        pattern: str,
        subscription: str,
        options: ConsumerOptions,
        *,
        mode: str = "persistent",
        discovery_period_s: float = DISCOVERY_PERIOD_S,
    ) -> None:
        if mode not in MODES:
            raise InvalidArgument(f"regex_subscription_mode must be one of {sorted(MODES)}")
        if discovery_period_s <= 0:
            raise InvalidArgument("pattern_auto_discovery_period_s must be > 0")
        self.pattern = pattern if "://" in pattern else f"persistent://{pattern}"
        self.topic = self.pattern
        self.namespace = pattern_namespace(self.pattern)
        self.subscription = subscription
        self.options = options
        self.mode = mode
        self.discovery_period_s = discovery_period_s
        try:
            self._matcher = re.compile(self.pattern.split("://", 1)[1])
        except re.error as err:
            raise InvalidArgument(f"bad topic pattern: {err}") from err
        self._pool = pool
        self._inbox = Inbox()
        self._consumers: dict[str, _TopicConsumer] = {}
        self._by_id: dict[int, _TopicConsumer] = {}
        self._hash: str | None = None
        self._known: set[str] = set()
        """The matching topics as last listed or pushed (what the consumers follow)."""
        self._watch_refused = False
        self._watcher_id = pool.new_handler_id()
        self._watch_conn: ClientConnection | None = None
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()
        self._closed = False

    def __repr__(self) -> str:
        return f"PatternConsumer({self.pattern!r}, {self.subscription!r})"

    @property
    def topics(self) -> list[str]:
        """The topics subscribed now, sorted."""
        return sorted(self._consumers)

    async def _start(self) -> None:
        self._known = await self._list() or set()
        await self._reconcile(set(self._known))
        self._task = asyncio.ensure_future(self._follow())

    # --- discovery -------------------------------------------------------------------------

    async def _list(self) -> set[str] | None:
        """The matching topics (None: unchanged since the last listing's hash)."""
        conn = await self._pool.get()
        request_id = conn.new_request_id()
        body = pb.CommandGetTopicsOfNamespace(
            request_id=request_id,
            namespace=str(self.namespace),
            mode=MODES[self.mode],
            topics_pattern=self.pattern,
        )
        if self._hash is not None:
            body.topics_hash = self._hash
        frame = await conn.request(
            T(type=T.GET_TOPICS_OF_NAMESPACE, getTopicsOfNamespace=body), request_id
        )
        answer = frame.command.getTopicsOfNamespaceResponse
        if answer.HasField("topics_hash"):
            self._hash = answer.topics_hash
        if not answer.changed:
            return None
        return self._matching(answer.topics)

    def _matching(self, topics: Iterable[str]) -> set[str]:
        return {t for t in topics if topic_patterns.matches(t, self._matcher)}

    async def _watch(self) -> bool:
        """Open the topic-list watcher on the service connection; False when the broker
        (or the mode) does not allow one."""
        if self.mode != "persistent" or self._watch_refused:
            return False
        conn = await self._pool.get()
        if not conn.supports_topic_watchers:
            return False
        request_id = conn.new_request_id()
        body = pb.CommandWatchTopicList(
            request_id=request_id,
            watcher_id=self._watcher_id,
            namespace=str(self.namespace),
            topics_pattern=self.pattern,
        )
        conn.register_watch(self._watcher_id, self)
        try:
            frame = await conn.request(T(type=T.WATCH_TOPIC_LIST, watchTopicList=body), request_id)
        except NotAllowed as err:  # a pattern the broker will not evaluate: poll instead
            conn.unregister_watch(self._watcher_id)
            log.info("%s: no topic list watcher: %s", self, err)
            self._watch_refused = True
            return False
        except BaseException:
            conn.unregister_watch(self._watcher_id)
            raise
        self._watch_conn = conn
        success = frame.command.watchTopicListSuccess
        self._hash = success.topics_hash
        self._known = self._matching(success.topic)
        return True

    def on_frame(self, frame: Frame) -> None:
        """WATCH_TOPIC_UPDATE: subscribe the new topics, drop the deleted ones."""
        if frame.type != T.WATCH_TOPIC_UPDATE or self._closed:
            return
        update = frame.command.watchTopicUpdate
        self._hash = update.topics_hash
        self._known = (self._known | self._matching(update.new_topics)) - set(update.deleted_topics)
        self._wakeup.set()

    def on_connection_closed(self, conn: ClientConnection) -> None:
        """The watcher's connection is gone: re-create it (and re-list) from the loop."""
        if conn is self._watch_conn:
            self._watch_conn = None
            self._wakeup.set()

    async def _follow(self) -> None:
        loop = asyncio.get_running_loop()
        next_poll = loop.time() + self.discovery_period_s
        while not self._closed:
            try:
                if self._watch_conn is None or not self._watch_conn.is_open:
                    self._watch_conn = None
                    await self._watch()  # False: polling alone
                if loop.time() >= next_poll:
                    next_poll = loop.time() + self.discovery_period_s
                    listed = await self._list()
                    if listed is not None:
                        self._known = listed
                if self._known != set(self._consumers):
                    await self._reconcile(set(self._known))
                if self._closed:
                    return
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wakeup.wait(), max(0.0, next_poll - loop.time()))
                self._wakeup.clear()
            except asyncio.CancelledError:
                raise
            except Closed:
                return
            except (AnabranchError, OSError) as err:
                log.info("%s: topic discovery failed, retrying: %s", self, err)
                await asyncio.sleep(min(self.discovery_period_s, 1.0))

    async def _reconcile(self, wanted: set[str]) -> None:
        async with self._lock:
            if self._closed:
                return
            for topic in sorted(set(self._consumers) - wanted):
                await self._drop(self._consumers[topic])
            added = sorted(wanted - set(self._consumers))
            for topic in added:
                consumer = _TopicConsumer(
                    self._pool,
                    topic,
                    self.subscription,
                    self.options,
                    shared=self._inbox,
                    on_lost=self._lost,
                )
                try:
                    await consumer._start()
                except AnabranchError as err:
                    log.info("%s: cannot subscribe %s yet: %s", self, topic, err)
                    self._hash = None  # list again in full next time
                    continue
                self._consumers[topic] = consumer
                self._by_id[consumer._id] = consumer

    async def _drop(self, consumer: _TopicConsumer) -> None:
        self._consumers.pop(consumer.topic, None)
        self._by_id.pop(consumer._id, None)
        await consumer.close()
        self._inbox.remove_where(consumer._owns)

    def _lost(self, consumer: _TopicConsumer) -> None:
        if self._consumers.get(consumer.topic) is consumer:
            self._consumers.pop(consumer.topic, None)
            self._by_id.pop(consumer._id, None)
            self._inbox.remove_where(consumer._owns)
            self._hash = None
            self._wakeup.set()

    # --- the consumer API ------------------------------------------------------------------

    def _owner(self, message: Message | MessageId) -> _TopicConsumer:
        if not isinstance(message, Message):
            raise InvalidArgument("a pattern consumer acks a Message (a MessageId names no topic)")
        consumer = self._by_id.get(message._consumer_id)
        if consumer is None:
            raise InvalidArgument(f"{message.topic} is no longer subscribed by {self}")
        return consumer

    async def receive(self, timeout: float | None = None) -> Message | None:  # noqa: ASYNC109 (fixed API)
        """The next message from any matched topic, or None after ``timeout`` seconds."""
        while True:
            msg = await self._inbox.get(timeout)
            if msg is None:
                return None
            consumer = self._by_id.get(msg._consumer_id)
            if consumer is not None:
                consumer._on_dequeued(msg)
                return msg
            # From a topic dropped meanwhile: its subscription redelivers it if it returns.

    async def seek(self, target: MessageId | int) -> None:
        """Seek every matched topic to a publish time (ms); a MessageId names one topic's
        position only, so it is refused here."""
        if isinstance(target, MessageId):
            raise InvalidArgument("a pattern consumer seeks by publish time only")
        await asyncio.gather(*(c.seek(target) for c in list(self._consumers.values())))

    async def unsubscribe(self) -> None:
        """Unsubscribe every matched topic, then close."""
        await self._stop()
        consumers = list(self._consumers.values())
        await asyncio.gather(*(c.unsubscribe() for c in consumers))
        await self.close()

    async def _stop(self) -> None:
        self._closed = True
        # Woken as well as cancelled: a cancellation that lands as a request's answer
        # does may be swallowed by wait_for (Python 3.11), and the loop must still end.
        self._wakeup.set()
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        conn, self._watch_conn = self._watch_conn, None
        if conn is not None:
            conn.unregister_watch(self._watcher_id)
            if conn.is_open:
                request_id = conn.new_request_id()
                body = pb.CommandWatchTopicListClose(
                    request_id=request_id, watcher_id=self._watcher_id
                )
                with contextlib.suppress(AnabranchError):
                    await conn.request(
                        T(type=T.WATCH_TOPIC_LIST_CLOSE, watchTopicListClose=body), request_id
                    )

    async def close(self) -> None:
        """Close every topic's consumer and stop following the list. Idempotent."""
        await self._stop()
        async with self._lock:
            consumers = list(self._consumers.values())
            self._consumers.clear()
            self._by_id.clear()
        await asyncio.gather(*(c.close() for c in consumers), return_exceptions=True)
        self._inbox.close()


async def subscribe_pattern(
    pool: ConnectionPool,
    pattern: re.Pattern[str] | str,
    subscription: str,
    options: ConsumerOptions,
    *,
    mode: str = "persistent",
    discovery_period_s: float = DISCOVERY_PERIOD_S,
) -> PatternConsumer:
    """Subscribe to every topic matching ``pattern``; returns once the topics matching now
    are subscribed."""
    text = pattern.pattern if isinstance(pattern, re.Pattern) else pattern
    consumer = PatternConsumer(
        pool, text, subscription, options, mode=mode, discovery_period_s=discovery_period_s
    )
    try:
        await consumer._start()
    except BaseException:
        await consumer.close()
        raise
    return consumer
