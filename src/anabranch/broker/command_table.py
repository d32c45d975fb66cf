"""The broker's wire dispatch: one static table, command type → handler → required permission.

Every client command the broker serves has one :class:`Command` row in :data:`TABLE`::

    command                          run      need            resource
    CONNECT, PING, PONG,             inline   NONE            -
      AUTH_RESPONSE (credentials refreshed after an AUTH_CHALLENGE)
    SEND                             inline   OWNED           (a producer of this connection)
    CLOSE_PRODUCER                   spawned  OWNED           (waits for pending receipts)
    FLOW, ACK, REDELIVER_UNACK...,   inline   OWNED           (a consumer of this connection)
      SEEK, GET_LAST_MESSAGE_ID,
      UNSUBSCRIBE, CLOSE_CONSUMER
    PRODUCER                         spawned  PRODUCE         topic
    SUBSCRIBE                        spawned  CONSUME         topic
    LOOKUP, PARTITIONED_METADATA,    spawned  LOOKUP          topic (produce or consume)
      GET_SCHEMA, GET_OR_CREATE_SCHEMA
    GET_TOPICS_OF_NAMESPACE,         spawned  NAMESPACE       namespace
      WATCH_TOPIC_LIST
    WATCH_TOPIC_LIST_CLOSE           inline   OWNED           (a watcher of this connection)
    SCALABLE_TOPIC_LOOKUP            spawned  LOOKUP          topic
    SCALABLE_TOPIC_SUBSCRIBE         spawned  CONSUME         topic
    SCALABLE_TOPIC_UNSUBSCRIBE       spawned  OWNED           (a consumer of this connection)
    SCALABLE_TOPIC_CLOSE, WATCH_     inline   OWNED           (a watch of this connection)
      SCALABLE_TOPICS_CLOSE
    WATCH_SCALABLE_TOPICS            spawned  NAMESPACE       namespace
    TC_CLIENT_CONNECT_REQUEST,       spawned  AUTHENTICATED   - (the coordinator checks the
      NEW_TXN, ADD_*_TO_TXN, END_TXN                            transaction's owner)

(:data:`TABLE` itself is the authority; ``tests/broker/test_command_table.py`` checks it
against this list's rules.) The permission is checked once, when a producer, consumer or
watch is created or a request is looked up, as Pulsar does; the hot frames (SEND, ACK,
FLOW) act on objects whose creation was checked, so they pay no check (need OWNED;
every inline row is NONE or OWNED, and dispatch never looks at an inline row's need).
A check that fails answers the request in its own response shape (``reject``; the
generic ERROR when None) and runs nothing. A command
type absent from the table is answered with ERROR and the connection closes. When a
connection closes, every :data:`CLOSE_HOOKS` function runs.

Example:
    >>> TABLE[T.PRODUCER].need, TABLE[T.SEND].need, TABLE[T.SEND].spawned
    (<Need.PRODUCE: 'produce'>, <Need.OWNED: 'owned'>, False)
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from anabranch import limits
from anabranch.broker import (
    consumer_commands,
    lookup,
    scalable_commands,
    topic_list_watchers,
    txn_commands,
)
from anabranch.broker.authorization import Resource
from anabranch.broker.error_codes import client_message, server_error
from anabranch.broker.producer import handle_producer
from anabranch.core.authz import Need
from anabranch.errors import AuthenticationError, NotAllowed, NotOwner
from anabranch.protocol import commands
from anabranch.protocol._generated import pulsar_api_pb2 as pb
from anabranch.protocol.frames import Frame, encode_command
from anabranch.security.authentication import Credentials

if TYPE_CHECKING:
    from anabranch.broker.session import Session

log = logging.getLogger(__name__)
T = pb.BaseCommand

SERVER_VERSION = "anabranch-0.1"

FrameHandler = Callable[["Session", Frame], Awaitable[None] | None]
Reject = Callable[["Session", Any, BaseException], None]


@dataclass(frozen=True, slots=True)
class Command:
    """One row of :data:`TABLE`."""

    handler: FrameHandler
    need: Need
    spawned: bool
    """Run as a task (may wait on metadata/storage) rather than inline, in order."""
    resource: Callable[[Any], Resource] | None = None
    """The resource the command's body names (for a scoped need)."""
    reject: Reject | None = None
    """Answer a refused request in its own response shape; None: ERROR(request_id)."""
    missing_tenant: bool = False
    """A refusal on a resource whose tenant does not exist is TopicNotFound rather than
    AuthorizationError (upstream's PARTITIONED_METADATA; ``Authorizer.check``)."""

    @property
    def checked(self) -> bool:
        """Whether dispatch checks this row's permission (with authentication on).

        Example:
            >>> TABLE[T.SUBSCRIBE].checked, TABLE[T.ACK].checked
            (True, False)
        """
        return self.need not in (Need.NONE, Need.OWNED)


# --- the core's own handlers ---------------------------------------------------------------


async def _handle_connect(session: Session, frame: Frame) -> None:
    refusal = session.refusal
    if refusal is not None:  # over max_connections(_per_ip): ERROR TooManyRequests, close
        session.flush()
        error = commands.error(0, server_error(refusal), client_message(refusal))
        session.transport.write(encode_command(error))
        session.close()
        return
    auth = session.service.authentication
    if auth is not None:
        body = frame.command.connect
        try:
            result = await auth.authenticate(
                body.auth_method_name,
                Credentials(bytes(body.auth_data), session.peer_certificate),
            )
        except AuthenticationError as err:
            if not body.client_version.startswith(_REFUSING_CLIENTS):
                # Official clients (the C++ core) retry a refused CONNECT until their
                # operation timeout (apache/pulsar-client-cpp#227): accept the handshake and
                # refuse their first request instead, so the application sees
                # AuthenticationError at once. Nothing is served either way.
                session.auth_failure = err
                session.service.counters.authentication_failures += 1
                log.info("%s: %s", session.remote_address, err)
            else:
                session.refuse_authentication(err)
                return
        else:
            session.role = result.role
            session.auth_method = body.auth_method_name or (
                "tls" if session.peer_certificate else ""
            )
            session.auth_expires_at = result.expires_at
    flags = pb.FeatureFlags(supports_scalable_topics=True, supports_topic_watchers=True)
    version = session.protocol.negotiate_version()
    max_size = session.service.config.max_message_size
    session.write(commands.connected(SERVER_VERSION, version, max_size, flags))
    if session.auth_failure is not None:
        # Its first request is refused: it may not make us buffer a full-sized frame first.
        session.protocol.frame_size_limit = limits.HANDSHAKE_FRAME_SIZE_MAX_BYTES


_REFUSING_CLIENTS = "anabranch"
"""``client_version`` prefix of clients (ours, the probe) that report an ERROR answering
CONNECT as the authentication error it is; others get the refusal on their first request."""


AUTH_REFRESH = b"PulsarAuthRefresh"
"""The challenge data Pulsar brokers send to ask for fresh credentials."""


async def _handle_auth_response(session: Session, frame: Frame) -> None:
    auth = session.service.authentication
    if auth is None:
        return  # nothing was challenged
    body = frame.command.authResponse
    try:
        result = await auth.authenticate(
            body.response.auth_method_name,
            Credentials(bytes(body.response.auth_data), session.peer_certificate),
        )
        if result.role != session.role:
            raise AuthenticationError("refreshed credentials name another role")
    except AuthenticationError as err:
        session.refuse_authentication(err)
        return
    session.auth_expires_at = result.expires_at
    session.auth_challenged_at = None
    session.service.counters.authentication_refreshes += 1


def _handle_ping(session: Session, frame: Frame) -> None:
    session.write(commands.pong())


def _handle_pong(session: Session, frame: Frame) -> None:
    return None  # the protocol object clears the outstanding PING


def _handle_send(session: Session, frame: Frame) -> None:
    cmd = frame.command.send
    producer = session.producers.get(cmd.producer_id)
    if producer is None:
        err = NotAllowed(f"producer {cmd.producer_id} is not open on this connection")
        session.write(
            commands.send_error(
                cmd.producer_id, cmd.sequence_id, server_error(err), client_message(err)
            )
        )
        return
    ownership = session.service.ownership
    if ownership is not None and not ownership.serving(producer.topic.name):
        # Cluster mode: the topic moved (or our session ran out): the client reconnects.
        moved = NotOwner(producer.topic.name, None)
        session.write(
            commands.send_error(cmd.producer_id, cmd.sequence_id, server_error(moved), str(moved))
        )
        return
    producer.send(frame)


async def _handle_close_producer(session: Session, frame: Frame) -> None:
    cmd = frame.command.close_producer
    producer = session.producers.get(cmd.producer_id)
    if producer is not None:
        producer.close()
        # Receipts of sends still being written go out before the SUCCESS.
        pending = [f for _, _, f, _ in producer.pending if not f.done()]
        if pending:
            await asyncio.wait(pending)
    session.reply_success(cmd.request_id)


# --- resources and typed refusals ----------------------------------------------------------


def _topic(body: Any) -> Resource:
    return Resource.of_topic(body.topic)


def _namespace(body: Any) -> Resource:
    return Resource.of_namespace(body.namespace)


def _reject_lookup(session: Session, body: Any, err: BaseException) -> None:
    kind = pb.CommandLookupTopicResponse
    answer = kind(request_id=body.request_id, response=kind.Failed, message=client_message(err))
    answer.error = server_error(err)  # type: ignore[assignment]
    session.write(T(type=T.LOOKUP_RESPONSE, lookupTopicResponse=answer))


def _reject_partitioned_metadata(session: Session, body: Any, err: BaseException) -> None:
    kind = pb.CommandPartitionedTopicMetadataResponse
    answer = kind(request_id=body.request_id, response=kind.Failed, message=client_message(err))
    answer.error = server_error(err)  # type: ignore[assignment]
    session.write(T(type=T.PARTITIONED_METADATA_RESPONSE, partitionMetadataResponse=answer))


def _reject_get_schema(session: Session, body: Any, err: BaseException) -> None:
    answer = pb.CommandGetSchemaResponse(request_id=body.request_id)
    answer.error_code = server_error(err)  # type: ignore[assignment]
    answer.error_message = client_message(err)
    session.write(T(type=T.GET_SCHEMA_RESPONSE, getSchemaResponse=answer))


def _reject_get_or_create_schema(session: Session, body: Any, err: BaseException) -> None:
    answer = pb.CommandGetOrCreateSchemaResponse(request_id=body.request_id)
    answer.error_code = server_error(err)  # type: ignore[assignment]
    answer.error_message = client_message(err)
    session.write(T(type=T.GET_OR_CREATE_SCHEMA_RESPONSE, getOrCreateSchemaResponse=answer))


def _reject_scalable_lookup(session: Session, body: Any, err: BaseException) -> None:
    answer = pb.CommandScalableTopicUpdate(session_id=body.session_id, message=client_message(err))
    answer.error = server_error(err)  # type: ignore[assignment]
    session.write(T(type=T.SCALABLE_TOPIC_UPDATE, scalableTopicUpdate=answer))


def _reject_scalable_subscribe(session: Session, body: Any, err: BaseException) -> None:
    answer = pb.CommandScalableTopicSubscribeResponse(
        request_id=body.request_id, message=client_message(err)
    )
    answer.error = server_error(err)  # type: ignore[assignment]
    session.write(
        T(type=T.SCALABLE_TOPIC_SUBSCRIBE_RESPONSE, scalableTopicSubscribeResponse=answer)
    )


def _reject_watch_namespace(session: Session, body: Any, err: BaseException) -> None:
    answer = pb.CommandWatchScalableTopicsUpdate(
        watch_id=body.watch_id, message=client_message(err)
    )
    answer.error = server_error(err)  # type: ignore[assignment]
    session.write(T(type=T.WATCH_SCALABLE_TOPICS_UPDATE, watchScalableTopicsUpdate=answer))


def _reject_txn(response_type: Any, field: str, kind: Any) -> Reject:
    def reject(session: Session, body: Any, err: BaseException) -> None:
        answer = kind(request_id=body.request_id, message=client_message(err))
        answer.error = server_error(err)
        for bits in ("txnid_most_bits", "txnid_least_bits"):
            if hasattr(body, bits) and bits in kind.DESCRIPTOR.fields_by_name:
                setattr(answer, bits, getattr(body, bits))
        session.write(T(type=response_type, **{field: answer}))

    return reject


# --- the table -----------------------------------------------------------------------------


def _body(handler: Callable[[Session, Any], Awaitable[None] | None]) -> FrameHandler:
    """A handler of the command's body as a handler of the frame (built once, here)."""

    def run(session: Session, frame: Frame) -> Awaitable[None] | None:
        return handler(session, frame.body)

    run.__name__ = getattr(handler, "__name__", "handler")
    return run


def _row(
    handler: Callable[[Session, Any], Awaitable[None] | None],
    need: Need,
    resource: Callable[[Any], Resource] | None = None,
    reject: Reject | None = None,
    *,
    missing_tenant: bool = False,
) -> Command:
    """A spawned row whose handler takes the command's body."""
    return Command(
        _body(handler),
        need,
        spawned=True,
        resource=resource,
        reject=reject,
        missing_tenant=missing_tenant,
    )


def _inline(handler: Callable[[Session, Any], Awaitable[None] | None]) -> Command:
    """An inline OWNED row whose handler takes the command's body."""
    return Command(_body(handler), Need.OWNED, spawned=False)


cc, sc, tc = consumer_commands, scalable_commands, txn_commands
N = Need

TABLE: dict[int, Command] = {
    # handshake and keepalive
    T.CONNECT: Command(_handle_connect, N.NONE, spawned=False),
    T.PING: Command(_handle_ping, N.NONE, spawned=False),
    T.PONG: Command(_handle_pong, N.NONE, spawned=False),
    T.AUTH_RESPONSE: Command(_handle_auth_response, N.NONE, spawned=False),
    # producers
    T.PRODUCER: _row(handle_producer, N.PRODUCE, _topic),
    T.SEND: Command(_handle_send, N.OWNED, spawned=False),
    T.CLOSE_PRODUCER: Command(_handle_close_producer, N.OWNED, spawned=True),
    # consumers
    T.SUBSCRIBE: _row(cc.handle_subscribe, N.CONSUME, _topic),
    T.FLOW: _inline(cc.handle_flow),
    T.ACK: _inline(cc.handle_ack),
    T.REDELIVER_UNACKNOWLEDGED_MESSAGES: _inline(cc.handle_redeliver_unacknowledged_messages),
    T.SEEK: _inline(cc.handle_seek),
    T.GET_LAST_MESSAGE_ID: _inline(cc.handle_get_last_message_id),
    T.UNSUBSCRIBE: _inline(cc.handle_unsubscribe),
    T.CLOSE_CONSUMER: _inline(cc.handle_close_consumer),
    # lookups and schemas
    T.LOOKUP: _row(lookup.handle_lookup, N.LOOKUP, _topic, _reject_lookup),
    T.PARTITIONED_METADATA: _row(
        lookup.handle_partitioned_metadata,
        N.LOOKUP,
        _topic,
        _reject_partitioned_metadata,
        missing_tenant=True,
    ),
    T.GET_TOPICS_OF_NAMESPACE: _row(lookup.handle_get_topics_of_namespace, N.NAMESPACE, _namespace),
    T.WATCH_TOPIC_LIST: _row(topic_list_watchers.handle_watch_topic_list, N.NAMESPACE, _namespace),
    T.WATCH_TOPIC_LIST_CLOSE: _inline(topic_list_watchers.handle_watch_topic_list_close),
    T.GET_SCHEMA: _row(lookup.handle_get_schema, N.LOOKUP, _topic, _reject_get_schema),
    T.GET_OR_CREATE_SCHEMA: _row(
        lookup.handle_get_or_create_schema, N.LOOKUP, _topic, _reject_get_or_create_schema
    ),
    # scalable topics (PIP-468)
    T.SCALABLE_TOPIC_LOOKUP: _row(
        sc.handle_scalable_topic_lookup, N.LOOKUP, _topic, _reject_scalable_lookup
    ),
    T.SCALABLE_TOPIC_CLOSE: _inline(sc.handle_scalable_topic_close),
    T.SCALABLE_TOPIC_SUBSCRIBE: _row(
        sc.handle_scalable_topic_subscribe, N.CONSUME, _topic, _reject_scalable_subscribe
    ),
    T.SCALABLE_TOPIC_UNSUBSCRIBE: _row(sc.handle_scalable_topic_unsubscribe, N.OWNED),
    T.WATCH_SCALABLE_TOPICS: _row(
        sc.handle_watch_scalable_topics, N.NAMESPACE, _namespace, _reject_watch_namespace
    ),
    T.WATCH_SCALABLE_TOPICS_CLOSE: _inline(sc.handle_watch_scalable_topics_close),
    # transactions (the coordinator checks that a transaction's owner ends it)
    T.TC_CLIENT_CONNECT_REQUEST: _row(
        tc.handle_tc_client_connect_request,
        N.AUTHENTICATED,
        reject=_reject_txn(
            T.TC_CLIENT_CONNECT_RESPONSE,
            "tcClientConnectResponse",
            pb.CommandTcClientConnectResponse,
        ),
    ),
    T.NEW_TXN: _row(
        tc.handle_new_txn,
        N.AUTHENTICATED,
        reject=_reject_txn(T.NEW_TXN_RESPONSE, "newTxnResponse", pb.CommandNewTxnResponse),
    ),
    T.ADD_PARTITION_TO_TXN: _row(
        tc.handle_add_partition_to_txn,
        N.AUTHENTICATED,
        reject=_reject_txn(
            T.ADD_PARTITION_TO_TXN_RESPONSE,
            "addPartitionToTxnResponse",
            pb.CommandAddPartitionToTxnResponse,
        ),
    ),
    T.ADD_SUBSCRIPTION_TO_TXN: _row(
        tc.handle_add_subscription_to_txn,
        N.AUTHENTICATED,
        reject=_reject_txn(
            T.ADD_SUBSCRIPTION_TO_TXN_RESPONSE,
            "addSubscriptionToTxnResponse",
            pb.CommandAddSubscriptionToTxnResponse,
        ),
    ),
    T.END_TXN: _row(
        tc.handle_end_txn,
        N.AUTHENTICATED,
        reject=_reject_txn(T.END_TXN_RESPONSE, "endTxnResponse", pb.CommandEndTxnResponse),
    ),
}
"""Every client command the broker serves (see the module docstring)."""

CLOSE_HOOKS: tuple[Callable[[Session], Awaitable[None] | None], ...] = (
    cc.on_session_closed,
    tc.on_session_closed,
    sc.on_session_closed,
    topic_list_watchers.on_session_closed,
)
"""Run once per connection when it closes (consumers detach, keys and watches end)."""
