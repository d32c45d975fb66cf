"""Scalable-topic commands of the binary protocol (PIP-460/468, commands 70-75).

Wire behaviour (what a client sends and gets back)
--------------------------------------------------
The broker advertises ``FeatureFlags.supports_scalable_topics`` (flag 8) in CONNECTED.

*DAG watch.* ``SCALABLE_TOPIC_LOOKUP{session_id, topic, create_if_missing=true}`` opens a
watch session; ``session_id`` is the client's and is unique per connection. Every answer
is a ``SCALABLE_TOPIC_UPDATE{session_id, ...}``:

* success: ``dag`` (the full DAG: every segment with state, parents, children, epochs and
  times; ``segment_brokers`` = the ``pulsar://`` URL serving each segment;
  ``controller_broker_url`` = the controller leader's ``pulsar://`` URL) and
  ``resolved_topic_name`` (the canonical ``topic://t/ns/x``); pushed at once and again
  after every layout change (split, merge, re-creation). Updates carry the latest DAG
  only: epochs increase, an intermediate one may be skipped;
* ``error=InvalidTopicName``: the name is not a valid scalable topic name (short names
  and ``persistent://t/ns/x`` are read as ``topic://t/ns/x``); nothing is written and no
  session is kept;
* ``error=TopicNotFound``: the topic is missing and was not created (``create_if_missing``
  false, auto-creation off in the broker config or the namespace policy, or no such
  namespace); no session is kept. On a live session, TopicNotFound is pushed when the
  topic is deleted (the session stays: a re-created topic is pushed again);
* ``error=NotAllowedError``: ``session_id`` is already in use on this connection (the
  existing session is untouched); ``error=TooManyRequests``: over
  ``limits.SCALABLE_WATCH_SESSIONS_PER_CONNECTION_MAX`` sessions;
* ``error=ServiceNotReady``: auto-creation needed the controller leader and this broker
  is not it (the message carries the leader's URL, see redirects below).

A missing topic is auto-created with 1 segment. ``SCALABLE_TOPIC_CLOSE{session_id}`` ends a
session (no answer; an unknown id is ignored). A closed connection ends all its sessions.

*Consumer controller.* ``SCALABLE_TOPIC_SUBSCRIBE{request_id, topic, subscription,
consumer_name, consumer_id, consumer_type}`` registers a STREAM or CHECKPOINT consumer with
the topic's controller leader (a missing topic is auto-created with 1 segment as for a
lookup, when allowed; TopicNotFound otherwise). A missing subscription is created with the
consumer's type: STREAM puts a cursor at EARLIEST on every segment of the DAG and assigns
a child segment only once its ancestors are drained for the subscription, or with them to
the one consumer holding them all (which orders them itself; drained sealed segments then
leave the assignment); CHECKPOINT (a group of checkpoint readers) creates no
cursors and deals every segment of the DAG, sealed ones included. A STREAM consumer with
``key_shared_dispatch`` (our field 100) makes it a STREAM_KEY_SHARED subscription: consumers
beyond the segment count share segments, each subscribing Key_Shared to them; every
consumer of a subscription uses the same mode (NotAllowed otherwise, unless nobody consumes
it: then it takes the newcomer's). Where scalable topics are switched off (broker setting
or namespace policy) lookups and subscribes fail with NotAllowed. The answer is
``SCALABLE_TOPIC_SUBSCRIBE_RESPONSE{request_id, assignment}`` with ``assignment{layout_epoch,
segments[{segment_id, hash_start, hash_end, segment_topic}]}``: the segments this consumer
reads, as ``segment://`` topics to subscribe to (in deal order). Later changes of that
consumer's share arrive as ``SCALABLE_TOPIC_ASSIGNMENT_UPDATE{consumer_id, assignment}``
(the full share each time; it may be empty). Errors come in the response's ``error`` and
``message`` (no assignment): InvalidTopicName (bad topic, subscription or consumer name;
nothing written), TopicNotFound, ConsumerBusy (``consumer_id`` already used on this
connection), NotAllowedError (the subscription exists with the other type),
TooManyRequests (over ``limits.SCALABLE_CONSUMERS_PER_CONNECTION_MAX``), ServiceNotReady
(not the leader, below).

When the controller that answered stops leading (its metadata session expired, e.g. after
a pause, or it stepped down), it ends each registration it served with
``CLOSE_CONSUMER{consumer_id}``: the client registers again, with the new leader. A
leader also pushes an ASSIGNMENT_UPDATE to every registered consumer after each layout
change, whether its share changed or not, so an assignment's ``layout_epoch`` keeps up
with the DAG; a consumer whose assignment stays behind the DAG it watches registers again
(its old leader may be unable to tell it anything: paused or cut off).

``SCALABLE_TOPIC_UNSUBSCRIBE{request_id, consumer_id}`` (82) is a clean leave: the
registration is dropped and the others are rebalanced at once; answered with SUCCESS, also
for an unknown ``consumer_id`` (idempotent). When the connection drops instead, each of its
consumers starts its grace period
(``BrokerConfig.consumer_grace_period_s``): a SUBSCRIBE with the same ``consumer_name``
within it gets the same segments and nobody else is told anything; when it expires the
consumer is evicted and the others get updates. A SUBSCRIBE with a ``consumer_name``
registered through another live connection takes the registration over (same share, no
rebalance); the old connection's consumer gets an empty ASSIGNMENT_UPDATE, so it stops.

*Namespace watch.* ``WATCH_SCALABLE_TOPICS{watch_id, namespace, property_filters,
current_hash?}`` (76) follows the namespace's scalable topics whose properties match every
filter (AND; none: all topics). Answers are ``WATCH_SCALABLE_TOPICS_UPDATE{watch_id, ...}``
(77): first a ``snapshot{topics}`` (sorted ``topic://`` names), or an empty ``diff`` when
``current_hash`` equals :func:`topics_hash` of that set (the client's copy is current);
then a ``diff{added, removed}`` on every change (apply ``removed`` first). Errors (no
session kept): InvalidTopicName (bad namespace), TopicNotFound (no such namespace),
NotAllowedError (``watch_id`` in use), TooManyRequests (the per-connection session limit,
shared with DAG watches). ``WATCH_SCALABLE_TOPICS_CLOSE{watch_id}`` (78) ends it.

*Redirects.* A SUBSCRIBE (or an auto-creating LOOKUP) on a broker whose controller is not
the leader answers ``ServiceNotReady`` with the message
``"this broker is not the controller of topic://t/ns/x: the leader is pulsar://host:port"``
(``"...: no leader is elected"`` while there is none: retry). A client takes the URL after
``"the leader is "`` (or the DAG's ``controller_broker_url``) and subscribes there.

Design
------
One :class:`ScalableEndpoint` per broker (``BrokerService.scalable_endpoint``) holds each
connection's watch sessions and consumers, and the registry that routes the controller's
assignment pushes to the consumer's connection. A watch session is a
:class:`~anabranch.scalable.dag_watch.DagWatcher` listener plus one pump task that writes
the latest layout (the listener only records it), so updates stay in order and a burst of
changes costs one write.

Example:
    >>> # session.py dispatches SCALABLE_TOPIC_LOOKUP to handle_scalable_topic_lookup(s, body)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from anabranch import limits
from anabranch.broker.consumer import NO_REQUEST_ID
from anabranch.core.assignment import PushAssignment
from anabranch.core.names import NamespaceName, TopicDomain, TopicName, validate_component
from anabranch.core.segment_layout import Segment, SegmentLayout, segment_name
from anabranch.errors import AlreadyExists, AnabranchError, Closed, Compacted, NotFound, NotLeader
from anabranch.metadata.api import EventKind
from anabranch.protocol import commands
from anabranch.protocol._generated import pulsar_api_pb2 as pb
from anabranch.protocol.checksum import crc32c
from anabranch.scalable.controller import CHECKPOINT, KEY_SHARED_STREAM, STREAM
from anabranch.scalable.dag_watch import ListenerHandle
from anabranch.scalable.paths import namespace_path
from anabranch.scalable.service import scalable_topic_name

if TYPE_CHECKING:
    from anabranch.broker.service import BrokerService
    from anabranch.broker.session import Session

log = logging.getLogger(__name__)
T = pb.BaseCommand

_UNSET = object()


class ScalableRequestError(AnabranchError):
    """A scalable command refused with an explicit wire code (see the module docstring)."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


def parse_scalable_topic(text: str) -> TopicName:
    """The ``topic://`` name a client means (``persistent://`` and short names map to it);
    InvalidArgument when invalid.

    Example:
        >>> str(parse_scalable_topic("persistent://public/default/orders"))
        'topic://public/default/orders'
        >>> str(parse_scalable_topic("orders"))
        'topic://public/default/orders'
    """
    name = TopicName.parse(text, TopicDomain.TOPIC)
    if name.domain is TopicDomain.PERSISTENT and name.partition is None:
        name = TopicName.parse(f"topic://{name.tenant}/{name.namespace}/{name.local_name}")
    return scalable_topic_name(name)


def topics_hash(topics: list[str] | set[str]) -> str:
    """CRC32C over the sorted names (upstream's ``TopicList.calculateHash``: the hash's
    bytes, low byte first, in hex).

    Example:
        >>> topics_hash([])
        '00000000'
    """
    return crc32c("".join(sorted(topics)).encode()).to_bytes(4, "little").hex()


def not_leader_message(topic: TopicName, leader_pulsar_url: str | None) -> str:
    """The ServiceNotReady message of a non-leader (the redirect a client follows).

    Example:
        >>> not_leader_message(TopicName.parse("topic://t/n/x"), "pulsar://b2:6650")
        'this broker is not the controller of topic://t/n/x: the leader is pulsar://b2:6650'
    """
    return str(NotLeader(str(topic), leader_pulsar_url or None))


# --- protobuf builders ----------------------------------------------------------------------


def dag_proto(
    layout: SegmentLayout,
    segment_brokers: dict[int, str],
    controller_url: str | None,
    tls_url_for: Callable[[str], str | None] | None = None,
) -> pb.ScalableTopicDAG:
    """The wire DAG of ``layout`` (segments by id). ``tls_url_for`` maps a broker's
    ``pulsar://`` URL to its ``pulsar+ssl://`` one for the ``*_url_tls`` fields.

    Example:
        >>> dag = dag_proto(SegmentLayout.initial(2, 0), {0: "pulsar://b:1"}, "pulsar://b:1")
        >>> [(s.segment_id, s.hash_start, s.hash_end) for s in dag.segments]
        [(0, 0, 32767), (1, 32768, 65535)]
    """
    dag = pb.ScalableTopicDAG(epoch=layout.epoch)
    for segment in sorted(layout, key=lambda s: s.segment_id):
        info = dag.segments.add(
            segment_id=segment.segment_id,
            hash_start=segment.hash_range.start,
            hash_end=segment.hash_range.end,
            state=pb.ACTIVE if segment.is_active else pb.SEALED,
            parent_ids=segment.parent_ids,
            child_ids=segment.child_ids,
            created_at_epoch=segment.created_at_epoch,
            created_at_ms=max(segment.created_at_ms, 0),
        )
        if not segment.is_active:
            info.sealed_at_epoch = segment.sealed_at_epoch
            info.sealed_at_ms = max(segment.sealed_at_ms, 0)
    for segment_id, url in sorted(segment_brokers.items()):
        broker = dag.segment_brokers.add(segment_id=segment_id, broker_url=url)
        tls = tls_url_for(url) if tls_url_for is not None else None
        if tls:
            broker.broker_url_tls = tls
    if controller_url:
        dag.controller_broker_url = controller_url
        tls = tls_url_for(controller_url) if tls_url_for is not None else None
        if tls:
            dag.controller_broker_url_tls = tls
    return dag


def assignment_proto(
    topic: TopicName, layout: SegmentLayout, segment_ids: tuple[int, ...], epoch: int
) -> pb.ScalableConsumerAssignment:
    """The wire assignment: each segment with its range and ``segment://`` topic.

    Example:
        >>> t = TopicName.parse("topic://public/default/orders")
        >>> a = assignment_proto(t, SegmentLayout.initial(2, 0), (1,), 0)
        >>> a.segments[0].segment_topic
        'segment://public/default/orders/8000-ffff-1'
    """
    assignment = pb.ScalableConsumerAssignment(layout_epoch=epoch)
    for segment_id in segment_ids:
        segment = layout.segments.get(segment_id)
        if segment is None:
            continue  # pruned meanwhile: nothing left to read
        assignment.segments.add(
            segment_id=segment_id,
            hash_start=segment.hash_range.start,
            hash_end=segment.hash_range.end,
            segment_topic=str(segment_name(topic, segment)),
        )
    return assignment


def _update(session_id: int, **fields: Any) -> pb.BaseCommand:
    body = pb.CommandScalableTopicUpdate(session_id=session_id, **fields)
    return pb.BaseCommand(type=T.SCALABLE_TOPIC_UPDATE, scalableTopicUpdate=body)


def _update_error(session_id: int, code: int, message: str) -> pb.BaseCommand:
    return _update(session_id, error=code, message=message)


def _subscribe_response(request_id: int, **fields: Any) -> pb.BaseCommand:
    body = pb.CommandScalableTopicSubscribeResponse(request_id=request_id, **fields)
    return pb.BaseCommand(
        type=T.SCALABLE_TOPIC_SUBSCRIBE_RESPONSE, scalableTopicSubscribeResponse=body
    )


def _assignment_update(
    consumer_id: int, assignment: pb.ScalableConsumerAssignment
) -> pb.BaseCommand:
    body = pb.CommandScalableTopicAssignmentUpdate(consumer_id=consumer_id, assignment=assignment)
    return pb.BaseCommand(
        type=T.SCALABLE_TOPIC_ASSIGNMENT_UPDATE, scalableTopicAssignmentUpdate=body
    )


def client_message(err: BaseException) -> str:
    from anabranch.broker.error_codes import client_message

    return client_message(err)


def _code(err: BaseException) -> int:
    from anabranch.broker.error_codes import server_error

    if isinstance(err, ScalableRequestError):
        return err.code
    return server_error(err)


# --- per-connection state -------------------------------------------------------------------


@dataclass(eq=False)
class _Watch:
    """One DAG-watch session: the latest layout waits in ``latest`` for the pump."""

    session_id: int
    topic: TopicName
    handle: ListenerHandle | None = None
    pump: asyncio.Task[None] | None = None
    latest: object = _UNSET
    wakeup: asyncio.Event = field(default_factory=asyncio.Event)
    closed: bool = False

    def offer(self, layout: SegmentLayout | None) -> None:
        self.latest = layout
        self.wakeup.set()


@dataclass(eq=False)
class _NamespaceWatch:
    watch_id: int
    namespace: NamespaceName
    filters: dict[str, str]
    task: asyncio.Task[None] | None = None
    closed: bool = False


@dataclass(frozen=True, slots=True)
class _Consumer:
    topic: TopicName
    subscription: str
    name: str
    consumer_id: int
    consumer_type: int
    key_shared: bool = False


@dataclass(eq=False)
class _Connection:
    watches: dict[int, _Watch] = field(default_factory=dict)
    namespace_watches: dict[int, _NamespaceWatch] = field(default_factory=dict)
    consumers: dict[int, _Consumer] = field(default_factory=dict)


class ScalableEndpoint:
    """The broker's scalable-topic sessions and consumer registry (module docstring)."""

    def __init__(self, service: BrokerService) -> None:
        self.service = service
        self._connections: dict[Session, _Connection] = {}
        self._consumers: dict[tuple[TopicName, str, str], tuple[Session, int]] = {}
        self._closed = False

    def _connection(self, session: Session) -> _Connection:
        conn = self._connections.get(session)
        if conn is None:
            conn = self._connections[session] = _Connection()
        return conn

    def watch_count(self) -> int:
        """Open DAG-watch sessions on this broker."""
        return sum(len(c.watches) for c in self._connections.values())

    def namespace_watch_count(self) -> int:
        """Open namespace watches on this broker."""
        return sum(len(c.namespace_watches) for c in self._connections.values())

    def consumer_count(self) -> int:
        """Scalable consumers connected to this broker."""
        return len(self._consumers)

    # --- DAG watch ---------------------------------------------------------------------------

    async def lookup(self, session: Session, cmd: pb.CommandScalableTopicLookup) -> None:
        session_id = int(cmd.session_id)
        conn = self._connection(session)
        if session_id in conn.watches:
            session.write(
                _update_error(
                    session_id,
                    pb.NotAllowedError,
                    f"watch session {session_id} is already open on this connection",
                )
            )
            return
        if _sessions(conn) >= limits.SCALABLE_WATCH_SESSIONS_PER_CONNECTION_MAX:
            limit = limits.SCALABLE_WATCH_SESSIONS_PER_CONNECTION_MAX
            session.write(
                _update_error(session_id, pb.TooManyRequests, f"over {limit} watch sessions")
            )
            return
        try:
            topic = parse_scalable_topic(cmd.topic)
        except AnabranchError as err:
            session.write(_update_error(session_id, _code(err), client_message(err)))
            return
        watch = _Watch(session_id, topic)
        conn.watches[session_id] = watch  # reserved before any await: no duplicate race
        try:
            await self._ensure_topic(watch.topic, cmd.create_if_missing)
            await self.service.scalable.controller(watch.topic)  # an election is running
            if watch.closed or session.closed:
                return
            watch.pump = asyncio.ensure_future(self._pump(session, watch))
            watch.handle = await self.service.dag_watcher.add_listener(watch.topic, watch.offer)
        except Exception as err:
            if conn.watches.get(session_id) is watch:
                del conn.watches[session_id]
            await self._end_watch(watch)
            if not isinstance(err, AnabranchError):
                log.error("%s: scalable lookup failed", session.remote_address, exc_info=err)
            message = (
                not_leader_message(watch.topic, await self._leader_url_for(session, watch.topic))
                if isinstance(err, NotLeader)
                else client_message(err)
            )
            session.write(_update_error(session_id, _code(err), message))
            return
        if watch.closed:
            await self._end_watch(watch)

    async def _ensure_topic(self, topic: TopicName, create_if_missing: bool) -> None:
        await self.service.check_scalable_enabled(topic)
        scalable = self.service.scalable
        try:
            await scalable.get_metadata(topic)
            return
        except NotFound:
            pass
        ns = await self.service.policies.namespace_policies(f"{topic.tenant}/{topic.namespace}")
        auto = self.service.config.allow_auto_topic_creation and ns.allow_auto_topic_creation
        if not (create_if_missing and auto):
            raise NotFound(f"scalable topic {topic}")
        guard = await self.service.policies.namespace_guard(topic.namespace_name)
        try:
            await scalable.create(topic, 1, guard=[guard])
        except AlreadyExists:
            pass  # another lookup created it meanwhile
        log.info("auto-created scalable topic %s with 1 segment", topic)

    async def _pump(self, session: Session, watch: _Watch) -> None:
        while not watch.closed and not session.closed:
            await watch.wakeup.wait()
            watch.wakeup.clear()
            layout = watch.latest
            if layout is _UNSET:
                continue
            try:
                if layout is None:
                    command = _update_error(
                        watch.session_id, pb.TopicNotFound, f"scalable topic {watch.topic} deleted"
                    )
                else:
                    assert isinstance(layout, SegmentLayout)
                    command = _update(
                        watch.session_id,
                        dag=await self._dag(watch.topic, layout),
                        resolved_topic_name=str(watch.topic),
                    )
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception(
                    "%s: building the DAG of %s failed", session.remote_address, watch.topic
                )
                await self.service.clock.sleep(limits.SCALABLE_WATCH_RETRY_S)
                watch.wakeup.set()
                continue
            if watch.latest is layout and not watch.closed:
                session.write(command)
            elif not watch.closed:
                watch.wakeup.set()  # a newer layout arrived while building: send that one

    async def _dag(self, topic: TopicName, layout: SegmentLayout) -> pb.ScalableTopicDAG:
        resolve = self.service.segment_broker_url

        async def owner(segment: Segment) -> str | None:
            # A hint for clients (they look a segment up themselves before using it): a
            # segment whose owner cannot be told now (moving, the store unreachable) is
            # left out rather than holding back the whole DAG, layout and all.
            name = segment_name(topic, segment)
            try:
                return await asyncio.wait_for(resolve(name), limits.SCALABLE_DAG_RESOLVE_S)
            except (AnabranchError, TimeoutError) as err:
                log.info("%s: no owner for the DAG of %s: %s", name, topic, err)
                return None

        segments = list(layout)
        urls = await asyncio.gather(*(owner(s) for s in segments))
        brokers = {s.segment_id: url for s, url in zip(segments, urls, strict=True) if url}
        leader = await self._leader_pulsar_url(topic)
        return dag_proto(layout, brokers, leader, self.service.tls_url_for)

    async def _leader_url_for(self, session: Session, topic: TopicName) -> str | None:
        """The leader's URL as ``session``'s client can reach it: the ``pulsar+ssl://``
        one on a TLS connection (when known)."""
        url = await self._leader_pulsar_url(topic)
        if url is not None and session.is_tls:
            return self.service.tls_url_for(url) or url
        return url

    async def _leader_pulsar_url(self, topic: TopicName) -> str | None:
        address = await self.service.scalable.leader_address(topic)
        return address.pulsar if address is not None and address.pulsar else None

    async def close_watch(self, session: Session, cmd: pb.CommandScalableTopicClose) -> None:
        conn = self._connections.get(session)
        watch = conn.watches.pop(int(cmd.session_id), None) if conn is not None else None
        if watch is not None:
            await self._end_watch(watch)

    @staticmethod
    async def _end_watch(watch: _Watch) -> None:
        watch.closed = True
        watch.wakeup.set()
        if watch.handle is not None:
            await watch.handle.remove()
        if watch.pump is not None and watch.pump is not asyncio.current_task():
            watch.pump.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watch.pump

    # --- namespace watch -------------------------------------------------------------------

    async def watch_namespace(self, session: Session, cmd: pb.CommandWatchScalableTopics) -> None:
        watch_id = int(cmd.watch_id)
        conn = self._connection(session)

        def refuse(code: int, message: str) -> None:
            body = pb.CommandWatchScalableTopicsUpdate(watch_id=watch_id, message=message)
            body.error = code  # type: ignore[assignment]
            session.write(T(type=T.WATCH_SCALABLE_TOPICS_UPDATE, watchScalableTopicsUpdate=body))

        if watch_id in conn.namespace_watches:
            refuse(pb.NotAllowedError, f"namespace watch {watch_id} is already open")
            return
        if _sessions(conn) >= limits.SCALABLE_WATCH_SESSIONS_PER_CONNECTION_MAX:
            limit = limits.SCALABLE_WATCH_SESSIONS_PER_CONNECTION_MAX
            refuse(pb.TooManyRequests, f"over {limit} watch sessions")
            return
        try:
            namespace = NamespaceName.parse(cmd.namespace)
            await self.service.policies.namespace_policies(namespace)
        except AnabranchError as err:
            refuse(_code(err), client_message(err))
            return
        if session.closed:
            return
        filters = {kv.key: kv.value for kv in cmd.property_filters}
        watch = _NamespaceWatch(watch_id, namespace, filters)
        conn.namespace_watches[watch_id] = watch
        current = cmd.current_hash if cmd.HasField("current_hash") else None
        watch.task = asyncio.ensure_future(self._run_namespace_watch(session, watch, current))

    async def _matching(self, watch: _NamespaceWatch) -> set[str]:
        ns = watch.namespace
        names = await self.service.store.list_children(namespace_path(ns))
        topics = set()
        for local in names:
            topic = f"topic://{ns.tenant}/{ns.namespace}/{local}"
            if watch.filters:
                record = await self.service.store.get(f"{namespace_path(ns)}/{local}")
                if record is None or not _matches(
                    SegmentLayout.from_json(record.value), watch.filters
                ):
                    continue
            topics.add(topic)
        return topics

    async def _run_namespace_watch(
        self, session: Session, watch: _NamespaceWatch, current_hash: str | None
    ) -> None:
        store = self.service.store
        ns = watch.namespace
        prefix = namespace_path(ns) + "/"

        def send(**fields: Any) -> None:
            body = pb.CommandWatchScalableTopicsUpdate(watch_id=watch.watch_id, **fields)
            session.write(T(type=T.WATCH_SCALABLE_TOPICS_UPDATE, watchScalableTopicsUpdate=body))

        def send_diff(added: set[str], removed: set[str]) -> None:
            diff = pb.ScalableTopicsDiff(added=sorted(added), removed=sorted(removed))
            send(diff=diff)

        sent: set[str] | None = None
        while not watch.closed and not session.closed:
            try:
                revision = await store.current_revision()
                topics = await self._matching(watch)
                if sent is None:
                    if current_hash is not None and current_hash == topics_hash(topics):
                        send_diff(set(), set())
                    else:
                        send(snapshot=pb.ScalableTopicsSnapshot(topics=sorted(topics)))
                elif topics != sent:
                    send_diff(topics - sent, sent - topics)
                sent = topics
                events = store.watch(prefix, prefix=True, start_revision=revision + 1)
                try:
                    async for event in events:
                        local = event.path[len(prefix) :]
                        if "/" in local or not local:
                            continue  # a controller, subscription or session key
                        topic = f"topic://{ns.tenant}/{ns.namespace}/{local}"
                        member = event.kind is EventKind.PUT and (
                            not watch.filters
                            or _matches(SegmentLayout.from_json(event.value), watch.filters)
                        )
                        if member and topic not in sent:
                            sent = sent | {topic}
                            send_diff({topic}, set())
                        elif not member and topic in sent:
                            sent = sent - {topic}
                            send_diff(set(), {topic})
                finally:
                    await events.close()
                return  # the store ended the watch: it is closing
            except Compacted:
                continue  # history gone: re-list and send the difference
            except (Closed, asyncio.CancelledError):
                return
            except Exception:
                log.exception(
                    "%s: namespace watch of %s failed; re-listing", session.remote_address, ns
                )
                await self.service.clock.sleep(limits.SCALABLE_WATCH_RETRY_S)

    async def close_namespace_watch(
        self, session: Session, cmd: pb.CommandWatchScalableTopicsClose
    ) -> None:
        conn = self._connections.get(session)
        watch = conn.namespace_watches.pop(int(cmd.watch_id), None) if conn is not None else None
        if watch is not None:
            await _end_namespace_watch(watch)

    # --- consumer controller -----------------------------------------------------------------

    async def subscribe(self, session: Session, cmd: pb.CommandScalableTopicSubscribe) -> None:
        request_id = int(cmd.request_id)
        consumer_id = int(cmd.consumer_id)
        conn = self._connection(session)
        try:
            if consumer_id in conn.consumers:
                raise ScalableRequestError(
                    pb.ConsumerBusy, f"consumer id {consumer_id} is already in use"
                )
            if len(conn.consumers) >= limits.SCALABLE_CONSUMERS_PER_CONNECTION_MAX:
                limit = limits.SCALABLE_CONSUMERS_PER_CONNECTION_MAX
                raise ScalableRequestError(pb.TooManyRequests, f"over {limit} scalable consumers")
            topic = parse_scalable_topic(cmd.topic)
            validate_component("subscription", cmd.subscription)
            validate_component("consumer", cmd.consumer_name)
        except Exception as err:
            session.write(
                _subscribe_response(request_id, error=_code(err), message=client_message(err))
            )
            return
        consumer = _Consumer(
            topic,
            cmd.subscription,
            cmd.consumer_name,
            consumer_id,
            int(cmd.consumer_type),
            cmd.key_shared_dispatch,
        )
        conn.consumers[consumer_id] = consumer  # reserved before any await
        try:
            await self._ensure_topic(topic, create_if_missing=True)
            controller = await self.service.scalable.controller(topic)
            controller.add_leadership_listener(self.controller_lost)
            kind = CHECKPOINT if consumer.consumer_type == pb.CHECKPOINT else STREAM
            if kind == STREAM and consumer.key_shared:
                kind = KEY_SHARED_STREAM
            segments = await controller.register_consumer(
                consumer.subscription, consumer.name, consumer_id, kind=kind
            )
            if not controller.is_leader:
                # Leadership ended while registering: controller_lost has already run, so
                # this registration would be served by no one.
                raise NotLeader(str(topic), None)
            # No await from here on: no push can slip between the state read and the answer.
            state = controller.assignment(consumer.subscription)
            assert state is not None
            assignment = assignment_proto(topic, state.layout, segments, state.layout.epoch)
        except Exception as err:
            if conn.consumers.get(consumer_id) is consumer:
                del conn.consumers[consumer_id]
            if not isinstance(err, AnabranchError):
                log.error("%s: scalable subscribe failed", session.remote_address, exc_info=err)
            message = (
                not_leader_message(topic, await self._leader_url_for(session, topic))
                if isinstance(err, NotLeader)
                else client_message(err)
            )
            session.write(_subscribe_response(request_id, error=_code(err), message=message))
            return
        if session.closed or conn.consumers.get(consumer_id) is not consumer:
            await self._disconnect(consumer)
            return
        key = (topic, consumer.subscription, consumer.name)
        previous = self._consumers.get(key)
        if previous is not None and previous != (session, consumer_id) and not previous[0].closed:
            # The name moved to this connection: the old one must stop reading its segments.
            empty = pb.ScalableConsumerAssignment(layout_epoch=assignment.layout_epoch)
            previous[0].write(_assignment_update(previous[1], empty))
        self._consumers[key] = (session, consumer_id)
        session.write(_subscribe_response(request_id, assignment=assignment))

    async def unsubscribe(self, session: Session, cmd: pb.CommandScalableTopicUnsubscribe) -> None:
        conn = self._connections.get(session)
        consumer = conn.consumers.pop(int(cmd.consumer_id), None) if conn is not None else None
        if consumer is not None:
            key = (consumer.topic, consumer.subscription, consumer.name)
            if self._consumers.get(key) == (session, consumer.consumer_id):
                del self._consumers[key]
            controller = await self.service.scalable.controller(consumer.topic)
            await controller.unregister_consumer(
                consumer.subscription, consumer.name, consumer.consumer_id
            )
        session.write(commands.success(int(cmd.request_id)))

    def deliver_assignment(self, topic: TopicName, subscription: str, push: PushAssignment) -> None:
        """The controller's push: write it on the consumer's connection, if it is here."""
        entry = self._consumers.get((topic, subscription, push.consumer))
        if entry is None:
            return  # registering (the response carries it), or connected elsewhere
        session, consumer_id = entry
        if session.closed or (push.consumer_id is not None and push.consumer_id != consumer_id):
            return
        state = self.service.scalable.assignment(topic, subscription)
        if state is None:
            return
        assignment = assignment_proto(topic, state.layout, push.segments, push.epoch)
        session.write(_assignment_update(consumer_id, assignment))

    def controller_lost(self, topic: TopicName) -> None:
        """This broker's controller of ``topic`` stopped leading (its session expired while
        it was paused or cut off, or it stepped down): end every registration it served with
        CLOSE_CONSUMER, so each client registers with the new leader now instead of waiting
        here for updates that will never come. They are forgotten, not disconnected: the
        new leader keeps their sessions (restored with a fresh grace period)."""
        for key, (session, consumer_id) in list(self._consumers.items()):
            if key[0] != topic:
                continue
            del self._consumers[key]
            conn = self._connections.get(session)
            if conn is not None:
                conn.consumers.pop(consumer_id, None)
            if not session.closed:
                log.info("%s: %s must register with the new controller", topic, key[2])
                session.write(commands.close_consumer(consumer_id, NO_REQUEST_ID))

    async def _disconnect(self, consumer: _Consumer) -> None:
        key = (consumer.topic, consumer.subscription, consumer.name)
        entry = self._consumers.get(key)
        if entry is not None and entry[1] == consumer.consumer_id:
            del self._consumers[key]
        try:
            controller = await self.service.scalable.controller(consumer.topic)
            await controller.disconnect_consumer(
                consumer.subscription, consumer.name, consumer.consumer_id
            )
        except AnabranchError as err:
            log.debug("disconnect of %s/%s not recorded: %s", consumer.topic, consumer.name, err)

    # --- lifecycle ---------------------------------------------------------------------------

    async def session_closed(self, session: Session) -> None:
        """The connection closed: end its watches; its consumers start their grace period."""
        conn = self._connections.pop(session, None)
        if conn is None:
            return
        for watch in list(conn.watches.values()):
            await self._end_watch(watch)
        for namespace_watch in list(conn.namespace_watches.values()):
            await _end_namespace_watch(namespace_watch)
        for consumer in list(conn.consumers.values()):
            key = (consumer.topic, consumer.subscription, consumer.name)
            if self._consumers.get(key) == (session, consumer.consumer_id):
                del self._consumers[key]
            if not self._closed:
                await self._disconnect(consumer)

    async def close(self) -> None:
        """End every watch session (the broker is stopping). Idempotent."""
        self._closed = True
        for conn in list(self._connections.values()):
            for watch in list(conn.watches.values()):
                await self._end_watch(watch)
            conn.watches.clear()
            for namespace_watch in list(conn.namespace_watches.values()):
                await _end_namespace_watch(namespace_watch)
            conn.namespace_watches.clear()


def _sessions(conn: _Connection) -> int:
    return len(conn.watches) + len(conn.namespace_watches)


def _matches(layout: SegmentLayout, filters: dict[str, str]) -> bool:
    return all(layout.properties.get(k) == v for k, v in filters.items())


async def _end_namespace_watch(watch: _NamespaceWatch) -> None:
    watch.closed = True
    task = watch.task
    if task is not None and task is not asyncio.current_task():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


# --- the handlers session.py finds by name --------------------------------------------------


async def handle_scalable_topic_lookup(
    session: Session, cmd: pb.CommandScalableTopicLookup
) -> None:
    """SCALABLE_TOPIC_LOOKUP → SCALABLE_TOPIC_UPDATE now and on every layout change."""
    await session.service.scalable_endpoint.lookup(session, cmd)


async def handle_scalable_topic_close(session: Session, cmd: pb.CommandScalableTopicClose) -> None:
    """SCALABLE_TOPIC_CLOSE: end a watch session (no answer)."""
    await session.service.scalable_endpoint.close_watch(session, cmd)


async def handle_scalable_topic_subscribe(
    session: Session, cmd: pb.CommandScalableTopicSubscribe
) -> None:
    """SCALABLE_TOPIC_SUBSCRIBE → SCALABLE_TOPIC_SUBSCRIBE_RESPONSE, then assignment pushes."""
    await session.service.scalable_endpoint.subscribe(session, cmd)


async def handle_scalable_topic_unsubscribe(
    session: Session, cmd: pb.CommandScalableTopicUnsubscribe
) -> None:
    """SCALABLE_TOPIC_UNSUBSCRIBE → SUCCESS: a consumer leaves, the others rebalance now."""
    await session.service.scalable_endpoint.unsubscribe(session, cmd)


async def handle_watch_scalable_topics(
    session: Session, cmd: pb.CommandWatchScalableTopics
) -> None:
    """WATCH_SCALABLE_TOPICS → a snapshot, then diffs (WATCH_SCALABLE_TOPICS_UPDATE)."""
    await session.service.scalable_endpoint.watch_namespace(session, cmd)


async def handle_watch_scalable_topics_close(
    session: Session, cmd: pb.CommandWatchScalableTopicsClose
) -> None:
    """WATCH_SCALABLE_TOPICS_CLOSE: end a namespace watch (no answer)."""
    await session.service.scalable_endpoint.close_namespace_watch(session, cmd)


async def on_session_closed(session: Session) -> None:
    """Connection closed: watches end, consumers enter their grace period."""
    await session.service.scalable_endpoint.session_closed(session)
