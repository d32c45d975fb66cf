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

*Following the controller.* Leadership can move while the old leader's connection stays
open: a paused or cut-off leader loses its metadata session, another broker leads, and
the old one tells nobody (it may not even run). So the registration does not wait for the
connection to drop; it registers again (same name, same share) when

- the controller closes it (``CLOSE_CONSUMER``: the old leader noticed it was deposed);
- the DAG watch names another controller than the broker it registered with;
- the DAG watch shows a layout epoch above the last assignment's and no assignment update
  catches up within ``limits.SCALABLE_ASSIGNMENT_REFRESH_S`` (a live leader pushes every
  new epoch to every consumer at once; :class:`AssignmentFreshness` keeps that clock);
- its connection goes silent: it is kept alive with a short PING interval
  (``limits.SCALABLE_REGISTRATION_KEEPALIVE_S``), which also bounds connecting.

A renewal starts at the DAG's controller unless that is the broker just left, else at
another broker (of the service URL, or one the DAG names as a segment owner), which
redirects to the leader it knows. The failpoint ``NO_ASSIGNMENT_REFRESH`` turns all of
this off (a re-registration only after the connection dropped) so the fault harness can
show what it catches.

Used by stream consumers and checkpoint consumer groups (``consumer_type=CHECKPOINT``).

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

from anabranch import failpoints
from anabranch.client.backoff import Backoff
from anabranch.client.connection import (
    Address,
    ClientConnection,
    ConnectionPool,
    parse_service_url,
)
from anabranch.client.dag_session import DagSession
from anabranch.client.errors import OperationTimeout, ServiceNotReady, from_server_error
from anabranch.errors import AnabranchError, Closed
from anabranch.limits import (
    CLIENT_LOOKUP_REDIRECTS_MAX,
    CLIENT_RECONNECT_BACKOFF_MIN_S,
    SCALABLE_ASSIGNMENT_REFRESH_S,
    SCALABLE_REGISTRATION_KEEPALIVE_S,
)
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


def controller_moved(registered: Address | None, controller_url: str | None) -> bool:
    """Whether the DAG names another controller than the broker ``registered`` with.

    Example:
        >>> controller_moved(("b1", 6650), "pulsar://b2:6650")
        True
        >>> controller_moved(("b1", 6650), "pulsar://b1:6650"), controller_moved(None, "x")
        (False, False)
    """
    if registered is None or not controller_url:
        return False
    try:
        return parse_service_url(controller_url) != registered
    except AnabranchError:
        return False  # a URL we cannot use says nothing about where the leader is


class AssignmentFreshness:
    """Whether a registration's assignments keep up with the DAG (pure; times are given).

    A live controller pushes every new layout epoch to every registered consumer within
    milliseconds, so a DAG epoch above the last assignment's for longer than ``bound_s``
    means the controller stopped serving this registration. Any assignment restarts the
    clock (a leader working through several epochs is alive).

    Example:
        >>> f = AssignmentFreshness(5.0)
        >>> f.assigned(3, now=0.0); f.observed(4, now=10.0)
        >>> f.deadline(), f.overdue(14.0), f.overdue(15.0)
        (15.0, False, True)
        >>> f.assigned(4, now=12.0); f.deadline() is None
        True
    """

    def __init__(self, bound_s: float) -> None:
        self.bound_s = bound_s
        self.assignment_epoch = -1
        self.dag_epoch = -1
        self._behind_since: float | None = None

    def assigned(self, epoch: int, now: float) -> None:
        """An assignment (answer or update) of layout epoch ``epoch`` arrived."""
        self.assignment_epoch = epoch
        self._behind_since = now if self.dag_epoch > epoch else None

    def observed(self, dag_epoch: int, now: float) -> None:
        """The DAG watch holds layout epoch ``dag_epoch``."""
        self.dag_epoch = max(self.dag_epoch, dag_epoch)
        if self.dag_epoch <= self.assignment_epoch:
            self._behind_since = None
        elif self._behind_since is None:
            self._behind_since = now

    def deadline(self) -> float | None:
        """When the registration is due for renewal, if the assignment is behind."""
        return None if self._behind_since is None else self._behind_since + self.bound_s

    def overdue(self, now: float) -> bool:
        """Whether the assignment has been behind the DAG for ``bound_s`` or longer."""
        deadline = self.deadline()
        return deadline is not None and now >= deadline

    def restart(self, now: float) -> None:
        """A renewal is under way: give its answer ``bound_s`` before judging again."""
        if self._behind_since is not None:
            self._behind_since = now


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
        *,
        key_shared: bool = False,
    ) -> None:
        self._pool = pool
        self.key_shared = key_shared
        self._session = session
        self.topic = str(session.topic)
        self.subscription = subscription
        self.consumer_name = consumer_name
        self.consumer_type = consumer_type
        self._on_assignment = on_assignment
        self._conn: ClientConnection | None = None
        self._registering: ClientConnection | None = None
        """The connection of a SUBSCRIBE in flight (a CLOSE_CONSUMER may beat its answer)."""
        self._registering_closed = False
        self._address: Address | None = None
        """The broker of the last registration (while renewing: the one to avoid)."""
        self._consumer_id = 0
        self._again: asyncio.Task[None] | None = None
        self._watchdog: asyncio.Task[None] | None = None
        self._closers: set[asyncio.Task[None]] = set()
        # Capped at the refresh bound: a consumer without a controller tries that often.
        self._backoff = Backoff(
            CLIENT_RECONNECT_BACKOFF_MIN_S, SCALABLE_ASSIGNMENT_REFRESH_S, pool.random
        )
        self._follow = not failpoints.enabled(failpoints.NO_ASSIGNMENT_REFRESH)
        self._freshness = AssignmentFreshness(SCALABLE_ASSIGNMENT_REFRESH_S)
        self._attempts = 0
        self.renewals = 0
        """Registrations renewed while the connection was open (the controller moved)."""
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
        self._deliver(assignment)
        if self._follow and self._watchdog is None and not self._closing:
            self._watchdog = loop.create_task(self._watch())

    def _deliver(self, assignment: pb.ScalableConsumerAssignment) -> None:
        self._freshness.assigned(int(assignment.layout_epoch), asyncio.get_running_loop().time())
        self._on_assignment(assignment)

    def _first_address(self, avoid: Address | None) -> Address:
        """The DAG's controller, unless that is the broker just left; else another broker
        of the service URL or of the DAG's segment owners (another one each attempt), which
        redirects to the leader it knows."""
        controller = self._session.controller_url
        if controller:
            with contextlib.suppress(AnabranchError):
                address = parse_service_url(controller)
                if address != avoid:
                    return address
        others = [a for a in self._pool.service_addresses if a != avoid]
        for url in sorted(set(self._session.segment_brokers.values())):
            with contextlib.suppress(AnabranchError):
                address = parse_service_url(url)
                if address != avoid and address not in others:
                    others.append(address)
        if not others:
            return self._pool.service_address
        address = others[self._attempts % len(others)]
        self._attempts += 1
        return address

    async def _register(self, avoid: Address | None = None) -> pb.ScalableConsumerAssignment:
        address = self._first_address(avoid)
        keepalive = self._pool.keepalive_interval_s
        if self._follow:
            keepalive = min(keepalive, SCALABLE_REGISTRATION_KEEPALIVE_S)
        for _ in range(CLIENT_LOOKUP_REDIRECTS_MAX + 1):
            conn = ClientConnection(
                address,
                keepalive_interval_s=keepalive,
                operation_timeout_s=self._pool.operation_timeout_s,
                # The registration's own connection presents the client's credentials too.
                auth=self._pool.auth,
                ssl_context=self._pool.ssl_context,
            )
            try:
                # A paused broker accepts TCP connections but never answers CONNECT.
                await asyncio.wait_for(conn.open(), 2 * keepalive)
            except TimeoutError as timeout:
                raise OperationTimeout(f"{self}: no CONNECTED from {address}") from timeout
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
            if self.key_shared:
                body.key_shared_dispatch = True
            conn.register_consumer(consumer_id, self)
            self._registering, self._registering_closed = conn, False
            try:
                frame = await conn.request(
                    pb.BaseCommand(type=T.SCALABLE_TOPIC_SUBSCRIBE, scalableTopicSubscribe=body),
                    request_id,
                )
            except BaseException:
                await conn.close()
                raise
            finally:
                self._registering = None
            resp = frame.command.scalableTopicSubscribeResponse
            if not resp.HasField("error"):
                if self._closing:
                    await conn.close()
                    raise Closed(f"{self} was closed while registering")
                if self._registering_closed:
                    # The controller was deposed right after answering (its CLOSE_CONSUMER
                    # came in the same read as the answer): this registration is void.
                    await conn.close()
                    raise ServiceNotReady(f"{self}: the controller closed the registration")
                self._conn, self._consumer_id, self._address = conn, consumer_id, address
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
        """The controller connection dropped, or the controller closed the registration
        (CLOSE_CONSUMER: it was deposed): register again (same name) in the background."""
        if conn is self._registering:
            self._registering_closed = True
        if conn is not self._conn:
            return
        if conn.is_open and not self._follow:
            # Failpoint NO_ASSIGNMENT_REFRESH: only a dropped connection counts.
            conn.register_consumer(self._consumer_id, self)
            return
        reason = "the controller closed the registration" if conn.is_open else "connection lost"
        self._renew(reason)

    def _renew(self, reason: str) -> None:
        """Leave the current controller connection and register again in the background
        (the share waits at the leader for the grace period)."""
        if self._closing or self._pool.closed:
            return
        if self._again is not None and not self._again.done():
            return  # already registering again
        conn, self._conn = self._conn, None
        if conn is not None and conn.is_open:
            self.renewals += 1
            # Unregistered first: an update still arriving there must not be applied.
            conn.unregister_consumer(self._consumer_id)
            closer = asyncio.get_running_loop().create_task(conn.close())
            self._closers.add(closer)
            closer.add_done_callback(self._closers.discard)
        log.info("%s: registering again: %s", self, reason)
        loop = asyncio.get_running_loop()
        self._freshness.restart(loop.time())
        avoid = self._address if self._follow else None
        self._again = loop.create_task(self._register_again(avoid))

    async def _register_again(self, avoid: Address | None) -> None:
        while not self._closing and not self._pool.closed:
            await asyncio.sleep(self._backoff.next())
            if self._closing:
                return
            try:
                assignment = await self._register(avoid)
            except (AnabranchError, OSError) as err:
                log.info("%s: re-registering failed: %s", self, err)
                continue
            self._backoff.reset()
            self._deliver(assignment)
            return

    async def _watch(self) -> None:
        """Follow the DAG watch: renew the registration when the DAG names another
        controller, or shows an epoch the assignments do not catch up with in time."""
        loop = asyncio.get_running_loop()
        session = self._session
        seen = session.updates
        while not self._closing and not self._pool.closed:
            deadline = self._freshness.deadline()
            timeout = None if deadline is None else max(0.0, deadline - loop.time())
            try:
                await asyncio.wait_for(session.wait_for_update(seen), timeout)
            except TimeoutError:
                pass
            except AnabranchError:
                return  # the DAG session ended: its consumer is closing
            news, seen = session.updates != seen, session.updates
            self._check(news, loop.time())

    def _check(self, news: bool, now: float) -> None:
        try:
            epoch = self._session.layout.epoch
        except Closed:
            return
        self._freshness.observed(epoch, now)
        if self._conn is None:
            return  # registering again already
        controller = self._session.controller_url
        if news and controller_moved(self._address, controller):
            self._renew(f"the DAG names {controller} as the controller")
        elif self._freshness.overdue(now):
            self._renew(
                f"the DAG is at layout epoch {epoch} but the last assignment at "
                f"{self._freshness.assignment_epoch} for {self._freshness.bound_s}s"
            )

    def on_frame(self, frame: Frame) -> None:
        """SCALABLE_TOPIC_ASSIGNMENT_UPDATE from the controller."""
        if frame.type == T.SCALABLE_TOPIC_ASSIGNMENT_UPDATE and not self._closing:
            self._deliver(frame.command.scalableTopicAssignmentUpdate.assignment)

    @property
    def connection(self) -> ClientConnection | None:
        """The connection the registration lives on (None while re-registering)."""
        return self._conn

    async def _stop_tasks(self) -> None:
        tasks = [t for t in (self._again, self._watchdog) if t is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._closers:
            await asyncio.gather(*self._closers, return_exceptions=True)

    async def disconnect(self) -> None:
        """Drop the connection without leaving: the controller keeps this consumer's share
        for its grace period (a restart under the same ``consumer_name`` gets it back)."""
        if self._closing:
            return
        self._closing = True
        await self._stop_tasks()
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.unregister_consumer(self._consumer_id)
            await conn.close()

    async def close(self) -> None:
        """Leave the subscription (UNSUBSCRIBE: the others rebalance now) and disconnect."""
        if self._closing:
            return
        self._closing = True
        await self._stop_tasks()
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
