"""Every admin HTTP route and every wire command, for every kind of role, token auth and
authorization on: each request is allowed or refused as the tables say.

Routes come from the running app's router and commands from the protobuf enum (minus the
broker→client types), so a route or command added without a table row fails here. The
expectation per role is :data:`authz_world.ALLOWED`, written out by hand.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

from anabranch.admin.access import ROUTE_ACCESS
from anabranch.broker.command_table import TABLE
from anabranch.core.authz import Need
from anabranch.protocol import commands
from anabranch.protocol._generated import pulsar_api_pb2 as pb
from tests.broker.test_command_table import NOT_SERVED, WIRE_COMMANDS
from tests.broker.test_core_protocol import RawClient
from tests.security.authz_world import (
    ALLOWED,
    ANONYMOUS,
    CONSUMER,
    PRODUCER,
    ROLES,
    SCALABLE,
    SUPERUSER,
    TOPIC,
    WRONG,
    World,
    world,
)

T = pb.BaseCommand

PARAMS = {
    "tenant": "acme", "namespace": "ns", "topic": "t", "cluster": "standalone",
    "subscription": "sub", "descriptor": "0000-ffff-0", "segment": "0000-ffff-0",
    "domain": "persistent", "role": "someone", "count": "1", "timestamp": "0",
    "segmentId": "0", "id1": "0", "id2": "1", "mostSigBits": "0", "leastSigBits": "0",
    "timeout": "1000", "subName": "sub", "transactionKey": "k", "sinkKey": "sink",
    "batchId": "1", "bundle": "0x00000000_0xffffffff", "version": "0", "messagePosition": "1",
    "ledgerId": "0", "entryId": "0", "expireTimeInSeconds": "1",
}  # fmt: skip
"""A value for every path parameter; a new parameter name fails the test (KeyError)."""

BODIES: dict[str, Any] = {"permissions": ["consume"]}
OPEN_WITHOUT_CREDENTIALS = {"/admin/v2/brokers/health"}
"""Served to anonymous requests too (the load balancer's health check)."""
LEAKS = re.compile(r"/admin/(tenants|namespaces|topics|clusters)/|other/ns|\.db|/tmp/")
"""What a refusal must never contain: metadata paths, other tenants' names, files."""


def concrete(template: str) -> str:
    return re.sub(r"\{(\w+)\}", lambda m: PARAMS[m.group(1)], template)


def app_routes(w: World) -> list[tuple[str, str]]:
    """``(method, path template)`` of every route the running app serves."""
    node = w.broker.node
    assert node is not None
    out = []
    for route in node.http_runner.app.router.routes():
        resource = route.resource
        assert resource is not None
        if route.method != "HEAD":
            out.append((route.method, resource.canonical))
    return out


async def test_every_http_route_for_every_role(tmp_path: Path) -> None:
    async with world(tmp_path) as w:
        routes = app_routes(w)
        assert len(routes) > 90
        unlisted = [r for r in routes if r not in ROUTE_ACCESS]
        assert not unlisted, f"routes without an access table row: {unlisted}"
        stale = [r for r in ROUTE_ACCESS if r not in routes]
        assert not stale, f"access rows of routes the app does not serve: {stale}"
        wrong: list[str] = []
        # Least privileged first: refused requests must leave the state for the next role.
        for role in ROLES:
            for method, template in routes:
                need = ROUTE_ACCESS[method, template]
                body = BODIES["permissions"] if "/permissions/" in template else None
                status, reason = await w.http(role, method, concrete(template), body)
                if role is ANONYMOUS:
                    expected = 200 if template in OPEN_WITHOUT_CREDENTIALS else 401
                    if (status == 401) != (expected == 401):
                        wrong.append(f"anonymous {method} {template}: {status} {reason}")
                    continue
                allowed = role in ALLOWED[need]
                if allowed and status in (401, 403):
                    wrong.append(f"{role} {method} {template} ({need}): refused: {reason}")
                elif not allowed and status != 403:
                    wrong.append(f"{role} {method} {template} ({need}): got {status}")
                elif not allowed and LEAKS.search(reason):
                    wrong.append(f"{role} {method} {template}: refusal leaks: {reason}")
        assert not wrong, "\n".join(wrong)


async def test_refused_requests_change_nothing(tmp_path: Path) -> None:
    async with world(tmp_path) as w:
        store = w.broker.service.store

        async def snapshot() -> dict[str, bytes]:
            out = {}
            for prefix in ("/admin/", "/topics/"):
                page = await store.list_prefix(prefix)
                out.update({r.path: r.value for r in page.records})
            return out

        before = await snapshot()
        for method, template in app_routes(w):
            if WRONG not in ALLOWED[ROUTE_ACCESS[method, template]]:
                body = BODIES["permissions"] if "/permissions/" in template else None
                status, _ = await w.http(WRONG, method, concrete(template), body)
                assert status == 403, (method, template, status)
        assert await snapshot() == before


# --- the wire ------------------------------------------------------------------------------

Builder = Callable[[int, bytes], pb.BaseCommand]
"""A request from its request id and the role's credentials."""


def _cmd(kind: Any, field: str, body: Any) -> pb.BaseCommand:
    command = T(type=kind)
    getattr(command, field).CopyFrom(body)
    return command


def _schema() -> pb.Schema:
    return pb.Schema(name="s", schema_data=b"", type=pb.Schema.String)


TXN: dict[str, Any] = {"txnid_most_bits": 0, "txnid_least_bits": 1}
WIRE: dict[int, tuple[Builder, set[int]]] = {
    T.PRODUCER: (lambda r, c: commands.producer(TOPIC, r, r), {T.PRODUCER_SUCCESS, T.ERROR}),
    T.SEND: (lambda r, c: commands.send(9999, r), {T.SEND_ERROR}),
    T.CLOSE_PRODUCER: (
        lambda r, c: _cmd(T.CLOSE_PRODUCER, "close_producer",
                       pb.CommandCloseProducer(producer_id=9999, request_id=r)),
        {T.SUCCESS, T.ERROR},
    ),
    T.SUBSCRIBE: (
        lambda r, c: commands.subscribe(TOPIC, f"s{r}", pb.CommandSubscribe.Shared, r, r),
        {T.SUCCESS, T.ERROR},
    ),
    T.FLOW: (lambda r, c: _cmd(T.FLOW, "flow", pb.CommandFlow(consumer_id=9999,
                                                         messagePermits=1)), set()),
    T.ACK: (
        lambda r, c: _cmd(T.ACK, "ack", pb.CommandAck(consumer_id=9999,
                                                   ack_type=pb.CommandAck.Individual)),
        set(),
    ),
    T.REDELIVER_UNACKNOWLEDGED_MESSAGES: (
        lambda r, c: _cmd(T.REDELIVER_UNACKNOWLEDGED_MESSAGES, "redeliverUnacknowledgedMessages",
                       pb.CommandRedeliverUnacknowledgedMessages(consumer_id=9999)),
        set(),
    ),
    T.SEEK: (
        lambda r, c: _cmd(T.SEEK, "seek", pb.CommandSeek(consumer_id=9999, request_id=r,
                                                      message_publish_time=0)),
        {T.SUCCESS, T.ERROR},
    ),
    T.GET_LAST_MESSAGE_ID: (
        lambda r, c: _cmd(T.GET_LAST_MESSAGE_ID, "getLastMessageId",
                       pb.CommandGetLastMessageId(consumer_id=9999, request_id=r)),
        {T.GET_LAST_MESSAGE_ID_RESPONSE, T.ERROR},
    ),
    T.UNSUBSCRIBE: (
        lambda r, c: _cmd(T.UNSUBSCRIBE, "unsubscribe",
                       pb.CommandUnsubscribe(consumer_id=9999, request_id=r)),
        {T.SUCCESS, T.ERROR},
    ),
    T.CLOSE_CONSUMER: (
        lambda r, c: _cmd(T.CLOSE_CONSUMER, "close_consumer",
                       pb.CommandCloseConsumer(consumer_id=9999, request_id=r)),
        {T.SUCCESS, T.ERROR},
    ),
    T.LOOKUP: (
        lambda r, c: _cmd(T.LOOKUP, "lookupTopic",
                          pb.CommandLookupTopic(topic=TOPIC, request_id=r)),
        {T.LOOKUP_RESPONSE},
    ),
    T.PARTITIONED_METADATA: (
        lambda r, c: _cmd(T.PARTITIONED_METADATA, "partitionMetadata",
                       pb.CommandPartitionedTopicMetadata(topic=TOPIC, request_id=r)),
        {T.PARTITIONED_METADATA_RESPONSE},
    ),
    T.GET_TOPICS_OF_NAMESPACE: (
        lambda r, c: _cmd(T.GET_TOPICS_OF_NAMESPACE, "getTopicsOfNamespace",
                       pb.CommandGetTopicsOfNamespace(namespace="acme/ns", request_id=r)),
        {T.GET_TOPICS_OF_NAMESPACE_RESPONSE, T.ERROR},
    ),
    T.WATCH_TOPIC_LIST: (
        lambda r, c: _cmd(T.WATCH_TOPIC_LIST, "watchTopicList",
                       pb.CommandWatchTopicList(request_id=r, watcher_id=r, namespace="acme/ns",
                                                topics_pattern="acme/ns/.*")),
        {T.WATCH_TOPIC_LIST_SUCCESS, T.ERROR},
    ),
    T.WATCH_TOPIC_LIST_CLOSE: (
        lambda r, c: _cmd(T.WATCH_TOPIC_LIST_CLOSE, "watchTopicListClose",
                       pb.CommandWatchTopicListClose(request_id=r, watcher_id=9999)),
        {T.SUCCESS},
    ),
    T.GET_SCHEMA: (
        lambda r, c: _cmd(T.GET_SCHEMA, "getSchema",
                          pb.CommandGetSchema(topic=TOPIC, request_id=r)),
        {T.GET_SCHEMA_RESPONSE},
    ),
    T.GET_OR_CREATE_SCHEMA: (
        lambda r, c: _cmd(T.GET_OR_CREATE_SCHEMA, "getOrCreateSchema",
                       pb.CommandGetOrCreateSchema(topic=TOPIC, request_id=r, schema=_schema())),
        {T.GET_OR_CREATE_SCHEMA_RESPONSE},
    ),
    T.SCALABLE_TOPIC_LOOKUP: (
        lambda r, c: _cmd(T.SCALABLE_TOPIC_LOOKUP, "scalableTopicLookup",
                       pb.CommandScalableTopicLookup(session_id=r, topic=SCALABLE)),
        {T.SCALABLE_TOPIC_UPDATE},
    ),
    T.SCALABLE_TOPIC_CLOSE: (
        lambda r, c: _cmd(T.SCALABLE_TOPIC_CLOSE, "scalableTopicClose",
                       pb.CommandScalableTopicClose(session_id=9999)),
        set(),
    ),
    T.SCALABLE_TOPIC_SUBSCRIBE: (
        lambda r, c: _cmd(T.SCALABLE_TOPIC_SUBSCRIBE, "scalableTopicSubscribe",
                       pb.CommandScalableTopicSubscribe(
                           request_id=r, topic=SCALABLE, subscription="sub",
                           consumer_name=f"c{r}", consumer_id=r, consumer_type=pb.STREAM)),
        {T.SCALABLE_TOPIC_SUBSCRIBE_RESPONSE},
    ),
    T.SCALABLE_TOPIC_UNSUBSCRIBE: (
        lambda r, c: _cmd(T.SCALABLE_TOPIC_UNSUBSCRIBE, "scalableTopicUnsubscribe",
                       pb.CommandScalableTopicUnsubscribe(request_id=r, consumer_id=9999)),
        {T.SUCCESS, T.ERROR},
    ),
    T.WATCH_SCALABLE_TOPICS: (
        lambda r, c: _cmd(T.WATCH_SCALABLE_TOPICS, "watchScalableTopics",
                       pb.CommandWatchScalableTopics(watch_id=r, namespace="acme/ns")),
        {T.WATCH_SCALABLE_TOPICS_UPDATE},
    ),
    T.WATCH_SCALABLE_TOPICS_CLOSE: (
        lambda r, c: _cmd(T.WATCH_SCALABLE_TOPICS_CLOSE, "watchScalableTopicsClose",
                       pb.CommandWatchScalableTopicsClose(watch_id=9999)),
        set(),
    ),
    T.TC_CLIENT_CONNECT_REQUEST: (
        lambda r, c: _cmd(T.TC_CLIENT_CONNECT_REQUEST, "tcClientConnectRequest",
                       pb.CommandTcClientConnectRequest(request_id=r, tc_id=0)),
        {T.TC_CLIENT_CONNECT_RESPONSE},
    ),
    T.NEW_TXN: (
        lambda r, c: _cmd(T.NEW_TXN, "newTxn", pb.CommandNewTxn(request_id=r, tc_id=0)),
        {T.NEW_TXN_RESPONSE},
    ),
    T.ADD_PARTITION_TO_TXN: (
        lambda r, c: _cmd(T.ADD_PARTITION_TO_TXN, "addPartitionToTxn",
                       pb.CommandAddPartitionToTxn(request_id=r, partitions=[TOPIC], **TXN)),
        {T.ADD_PARTITION_TO_TXN_RESPONSE},
    ),
    T.ADD_SUBSCRIPTION_TO_TXN: (
        lambda r, c: _cmd(T.ADD_SUBSCRIPTION_TO_TXN, "addSubscriptionToTxn",
                       pb.CommandAddSubscriptionToTxn(request_id=r, **TXN)),
        {T.ADD_SUBSCRIPTION_TO_TXN_RESPONSE},
    ),
    T.END_TXN: (
        lambda r, c: _cmd(T.END_TXN, "endTxn",
                       pb.CommandEndTxn(request_id=r, txn_action=pb.ABORT, **TXN)),
        {T.END_TXN_RESPONSE},
    ),
    T.PING: (lambda r, c: commands.ping(), {T.PONG}),
    T.AUTH_RESPONSE: (  # the role's own (still valid) credentials again: nothing answers
        lambda r, c: _cmd(T.AUTH_RESPONSE, "authResponse", pb.CommandAuthResponse(
            response=pb.AuthData(auth_method_name="token", auth_data=c))),
        set(),
    ),
    T.PONG: (lambda r, c: commands.pong(), set()),
}  # fmt: skip
"""A request naming ``acme/ns`` for every served command, and what answers it (an empty
set: nothing answers; a PING that follows must get its PONG)."""


def refusal_code(frame: Any) -> int | None:
    """The ServerError a response carries, if any (each response type names it its way)."""
    body = frame.body
    for name in ("error", "error_code"):
        if name in body.DESCRIPTOR.fields_by_name and body.HasField(name):
            return int(getattr(body, name))
    return None


async def connect(w: World, role: str | None) -> RawClient:
    client = await RawClient.open(w.broker.port)
    data = None if role is None else w.auth.token(role).encode()
    method = None if role is None else "token"
    await client.send(commands.connect("anabranch-matrix", pb.v21, None, method, data))
    return client


async def answer(client: RawClient, kinds: set[int]) -> Any:
    """The first frame of one of ``kinds`` (PING first when nothing else answers)."""
    if not kinds:
        await client.send(commands.ping())
        kinds = {T.PONG}
    while True:
        frame = await client.recv()
        assert frame is not None, "the broker closed the connection"
        if frame.type in kinds:
            return frame


async def test_every_wire_command_for_every_role(tmp_path: Path) -> None:
    served = WIRE_COMMANDS - NOT_SERVED - {T.CONNECT}
    assert served == TABLE.keys() - {T.CONNECT}
    missing = served - WIRE.keys()
    assert not missing, f"no matrix request for {[T.Type.Name(k) for k in missing]}"
    async with world(tmp_path) as w:
        wrong: list[str] = []
        for role in ROLES:
            client = await connect(w, role)
            try:
                first = await client.recv()
                assert first is not None
                if role is ANONYMOUS:  # refused at CONNECT: no command is ever served
                    assert first.type == T.ERROR
                    assert first.command.error.error == pb.AuthenticationError
                    assert await client.closed_by_broker() == []
                    continue
                assert first.type == T.CONNECTED, first.command
                for request_id, kind in enumerate(sorted(served), start=1):
                    build, kinds = WIRE[kind]
                    metadata = None
                    if kind == T.SEND:
                        metadata = pb.MessageMetadata(
                            producer_name="p", sequence_id=request_id, publish_time=1
                        )
                    credentials = w.auth.token(role).encode()
                    await client.send(build(request_id, credentials), metadata, b"x")
                    frame = await answer(client, kinds)
                    refused = refusal_code(frame) == pb.AuthorizationError
                    need = TABLE[kind].need
                    if refused == (role in ALLOWED[need]):
                        name = T.Type.Name(kind)
                        wrong.append(f"{role} {name} ({need}): refused={refused} {frame.body}")
                    if refused:
                        message = getattr(frame.body, "message", "") or getattr(
                            frame.body, "error_message", ""
                        )
                        assert not LEAKS.search(message), message
            finally:
                await client.close()
        assert not wrong, "\n".join(wrong)


async def test_authorization_off_checks_only_cluster_calls(tmp_path: Path) -> None:
    async with world(tmp_path, authorization_enabled=False) as w:
        cluster = "/admin/v2/cluster/segments/acme/ns/s/0000-ffff-0/subscriptions"
        assert (await w.http(WRONG, "GET", cluster))[0] == 403
        assert (await w.http(SUPERUSER, "GET", cluster))[0] == 200
        assert (await w.http(WRONG, "GET", "/admin/v2/namespaces/acme/ns/permissions"))[0] == 200
        client = await connect(w, WRONG)
        try:
            assert (await client.recv()) is not None
            await client.send(commands.producer(TOPIC, 1, 1))
            assert (await answer(client, {T.PRODUCER_SUCCESS, T.ERROR})).type == (
                T.PRODUCER_SUCCESS
            )
        finally:
            await client.close()
        assert Need.CLUSTER in ALLOWED


async def test_a_sink_batch_is_its_owners(tmp_path: Path) -> None:
    """The batch routes need only authentication; the batch itself answers 404 to any
    role but the one that began it and superusers."""
    batch = "/admin/v2/transactions/batches/etl-sink/7"
    async with world(tmp_path) as w:
        status, text = await w.http(PRODUCER, "PUT", f"{batch}?queryId=q")
        assert status == 200, text
        begun = msgspec.json.decode(text)
        commit = {"queryId": "q", "epoch": begun["epoch"], "winners": ["0-x"]}
        for role in (WRONG, CONSUMER):
            assert (await w.http(role, "GET", batch))[0] == 404
            assert (await w.http(role, "PUT", f"{batch}?queryId=other"))[0] == 404
            assert (await w.http(role, "POST", f"{batch}/commit", commit))[0] == 404
            assert (await w.http(role, "POST", f"{batch}/abort", {"epoch": 0}))[0] == 404
        status, text = await w.http(SUPERUSER, "GET", batch)
        assert status == 200 and msgspec.json.decode(text)["state"] == "OPEN"
        status, text = await w.http(PRODUCER, "POST", f"{batch}/commit", commit)
        assert status == 200 and msgspec.json.decode(text)["winners"] == ["0-x"]


def test_the_route_table_pins_what_matters() -> None:
    for (method, path), need in ROUTE_ACCESS.items():
        if path.startswith("/admin/v2/cluster/"):
            assert need is Need.CLUSTER, (method, path)  # controller-to-broker calls
        if "/permissions" in path:
            assert need is Need.TENANT_ADMIN, (method, path)
        if path.startswith("/lookup/"):
            assert need is Need.LOOKUP, (method, path)
        if "/subscription/" in path and method != "GET":
            assert need is Need.CONSUME, (method, path)
    for method in ("PUT", "POST", "DELETE"):
        assert ROUTE_ACCESS[method, "/admin/v2/tenants/{tenant}"] is Need.SUPERUSER
        assert ROUTE_ACCESS[method, "/admin/v2/clusters/{cluster}"] is Need.SUPERUSER
    assert ROUTE_ACCESS["PUT", "/admin/v2/namespaces/{tenant}/{namespace}"] is Need.TENANT_ADMIN
