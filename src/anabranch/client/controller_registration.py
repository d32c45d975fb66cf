"""A consumer's registration with a scalable topic's controller (commands 73-75, 82).

Theory of operation
-------------------
``SCALABLE_TOPIC_SUBSCRIBE{topic, subscription, consumer_name, consumer_id, consumer_type}``
goes to the DAG's ``controller_broker_url`` on a connection of its own, following a
``ServiceNotReady`` redirect to the leader. The answer and every later
``SCALABLE_TOPIC_ASSIGNMENT_UPDATE`` carry the consumer's whole share; each is handed to
``on_assignment``. When the connection drops, the controller keeps the share for its
grace period and the registration re-registers in the background with the same
``consumer_name`` (backoff, new connection). :meth:`ControllerRegistration.close` leaves
cleanly with ``SCALABLE_TOPIC_UNSUBSCRIBE`` (82) so the others get the share at once.

Used by checkpoint consumer groups (``consumer_type=CHECKPOINT``).

Example (with a pool and a DAG session)::

    reg = ControllerRegistration(pool, session, "group", "member-1", pb.CHECKPOINT,
                                 on_assignment=lambda a: print(a.segments))
    await reg.start()
    await reg.close()
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from anabranch.client.backoff import Backoff
from anabranch.client.connection import ClientConnection, ConnectionPool, parse_service_url
from anabranch.client.dag_session import DagSession
from anabranch.client.errors import ServiceNotReady, from_server_error
from anabranch.errors import AnabranchError, Closed
from anabranch.limits import CLIENT_LOOKUP_REDIRECTS_MAX
from anabranch.protocol._generated import pulsar_api_pb2 as pb
from anabranch.protocol.frames import Frame

log = logging.getLogger(__name__)
T = pb.BaseCommand

LEADER_MARK = "the leader is "
"""What precedes the leader's URL in a non-leader's ServiceNotReady message."""


def leader_url(message: str) -> str | None:
    """The leader's URL in a non-leader's ServiceNotReady message, if it names one.

    Example:
        >>> leader_url("this broker is not the controller of topic://t/n/x: "
        ...            "the leader is pulsar://b2:6650")
        'pulsar://b2:6650'
        >>> leader_url("no leader is elected") is None
        True
    """
    _, mark, rest = message.partition(LEADER_MARK)
    url = rest.strip().split()[0] if mark and rest.strip() else ""
    return url or None


class ControllerRegistration:
    """One registered consumer of a scalable subscription (see the module docstring)."""

    def __init__(  # noqa: PLR0917 (one call site per consumer kind)
        self,
        pool: ConnectionPool,
        session: DagSession,
        subscription: str,
        consumer_name: str,
        consumer_type: int,
        on_assignment: Callable[[pb.ScalableConsumerAssignment], None],
    ) -> None:
        self._pool = pool
        self._session = session
        self.topic = str(session.topic)
        self.subscription = subscription
        self.consumer_name = consumer_name
        self.consumer_type = consumer_type
        self._on_assignment = on_assignment
        self._conn: ClientConnection | None = None
        self._consumer_id = 0
        self._again: asyncio.Task[None] | None = None
        self._backoff = Backoff(random=pool.random)
        self._closing = False

    def __repr__(self) -> str:
        return f"ControllerRegistration({self.topic!r}, {self.subscription!r})"

    async def start(self) -> None:
        """Register (retrying retriable errors within the operation timeout)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._pool.operation_timeout_s
        while True:
            try:
                assignment = await self._register()
                break
            except AnabranchError as err:
                delay = self._backoff.next()
                if not err.retriable or loop.time() + delay > deadline:
                    raise
                log.info("%s: registering again in %.2fs: %s", self, delay, err)
                await asyncio.sleep(delay)
        self._backoff.reset()
        self._on_assignment(assignment)

    async def _register(self) -> pb.ScalableConsumerAssignment:
        controller = self._session.controller_url
        address = parse_service_url(controller) if controller else self._pool.service_address
        for _ in range(CLIENT_LOOKUP_REDIRECTS_MAX + 1):
            conn = ClientConnection(
                address,
                keepalive_interval_s=self._pool.keepalive_interval_s,
                operation_timeout_s=self._pool.operation_timeout_s,
            )
            await conn.open()
            consumer_id = self._pool.new_handler_id()
            request_id = conn.new_request_id()
            body = pb.CommandScalableTopicSubscribe(
                request_id=request_id,
                topic=self.topic,
                subscription=self.subscription,
                consumer_name=self.consumer_name,
                consumer_id=consumer_id,
                consumer_type=self.consumer_type,  # type: ignore[arg-type]
            )
            conn.register_consumer(consumer_id, self)
            try:
                frame = await conn.request(
                    pb.BaseCommand(type=T.SCALABLE_TOPIC_SUBSCRIBE, scalableTopicSubscribe=body),
                    request_id,
                )
            except BaseException:
                await conn.close()
                raise
            resp = frame.command.scalableTopicSubscribeResponse
            if not resp.HasField("error"):
                if self._closing:
                    await conn.close()
                    raise Closed(f"{self} was closed while registering")
                self._conn, self._consumer_id = conn, consumer_id
                return resp.assignment
            conn.unregister_consumer(consumer_id)
            await conn.close()
            err = from_server_error(int(resp.error), resp.message)
            redirect = leader_url(resp.message) if isinstance(err, ServiceNotReady) else None
            if redirect is None:
                raise err
            address = parse_service_url(redirect)
        raise ServiceNotReady(f"{self}: over {CLIENT_LOOKUP_REDIRECTS_MAX} controller redirects")

    def on_connection_closed(self, conn: ClientConnection) -> None:
        """The controller connection dropped: register again (same name) in the background."""
        if conn is not self._conn:
            return
        self._conn = None
        if self._closing or self._pool.closed:
            return
        if self._again is None or self._again.done():
            self._again = asyncio.get_running_loop().create_task(self._register_again())

    async def _register_again(self) -> None:
        while not self._closing and not self._pool.closed:
            await asyncio.sleep(self._backoff.next())
            if self._closing:
                return
            try:
                assignment = await self._register()
            except (AnabranchError, OSError) as err:
                log.info("%s: re-registering failed: %s", self, err)
                continue
            self._backoff.reset()
            self._on_assignment(assignment)
            return

    def on_frame(self, frame: Frame) -> None:
        """SCALABLE_TOPIC_ASSIGNMENT_UPDATE from the controller."""
        if frame.type == T.SCALABLE_TOPIC_ASSIGNMENT_UPDATE and not self._closing:
            self._on_assignment(frame.command.scalableTopicAssignmentUpdate.assignment)

    @property
    def connection(self) -> ClientConnection | None:
        """The connection the registration lives on (None while re-registering)."""
        return self._conn

    async def disconnect(self) -> None:
        """Drop the connection without leaving: the controller keeps this consumer's share
        for its grace period (a restart under the same ``consumer_name`` gets it back)."""
        if self._closing:
            return
        self._closing = True
        if self._again is not None:
            self._again.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._again
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.unregister_consumer(self._consumer_id)
            await conn.close()

    async def close(self) -> None:
        """Leave the subscription (UNSUBSCRIBE: the others rebalance now) and disconnect."""
        if self._closing:
            return
        self._closing = True
        if self._again is not None:
            self._again.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._again
        conn, self._conn = self._conn, None
        if conn is None:
            return
        request_id = conn.new_request_id()
        body = pb.CommandScalableTopicUnsubscribe(
            request_id=request_id, consumer_id=self._consumer_id
        )
        with contextlib.suppress(AnabranchError, OSError):
            await conn.request(
                pb.BaseCommand(type=T.SCALABLE_TOPIC_UNSUBSCRIBE, scalableTopicUnsubscribe=body),
                request_id,
            )
        conn.unregister_consumer(self._consumer_id)
        await conn.close()
