"""DESIGN.md §3.2 "after failed auth: reject and close; nothing created", on raw frames.

Our client (``client_version`` "anabranch...") gets ERROR(AuthenticationError) answering
CONNECT and the close. Other clients (the official C++ core retries a refused handshake
until its operation timeout) get CONNECTED, then their first request is refused with
AuthenticationError in the form they wait for, and the connection closes. Either way the
metadata store is untouched."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from anabranch.protocol import commands
from anabranch.protocol._generated import pulsar_api_pb2 as pb
from anabranch.testing.broker import InProcessBroker
from anabranch.testing.security import TokenAuth
from tests.broker.test_core_protocol import TOPIC, RawClient

T = pb.BaseCommand


@pytest.fixture
async def broker(tmp_path: Path) -> AsyncIterator[InProcessBroker]:
    async with InProcessBroker(tmp_path, metadata="memory", security=TokenAuth()) as b:
        yield b


async def connect(broker: InProcessBroker, version: str, token: bytes) -> RawClient:
    client = await RawClient.open(broker.port)
    await client.send(commands.connect(version, pb.v21, None, "token", token))
    return client


async def test_our_client_gets_error_and_close(broker: InProcessBroker) -> None:
    revision = await broker.service.store.current_revision()
    client = await connect(broker, "anabranch-python-0.1", b"bad")
    try:
        frames = await client.closed_by_broker()
    finally:
        await client.close()
    assert [f.type for f in frames] == [T.ERROR]
    assert frames[0].command.error.error == pb.AuthenticationError
    assert "authentication failed" in frames[0].command.error.message
    assert await broker.service.store.current_revision() == revision


@pytest.mark.parametrize(
    ("request_command", "response"),
    [
        (commands.producer(TOPIC, 1, 7), T.ERROR),
        (
            T(
                type=T.PARTITIONED_METADATA,
                partitionMetadata=pb.CommandPartitionedTopicMetadata(topic=TOPIC, request_id=7),
            ),
            T.PARTITIONED_METADATA_RESPONSE,
        ),
        (
            T(type=T.LOOKUP, lookupTopic=pb.CommandLookupTopic(topic=TOPIC, request_id=7)),
            T.LOOKUP_RESPONSE,
        ),
    ],
)
async def test_other_clients_get_the_error_on_their_first_request(
    broker: InProcessBroker, request_command: pb.BaseCommand, response: int
) -> None:
    revision = await broker.service.store.current_revision()
    client = await connect(broker, "Pulsar-CPP-v3.13", b"bad")
    try:
        await client.expect(T.CONNECTED)
        await client.send(request_command)
        frames = await client.closed_by_broker()
    finally:
        await client.close()
    assert [f.type for f in frames] == [response]
    body = frames[0].body
    assert body.request_id == 7
    assert body.error == pb.AuthenticationError
    assert await broker.service.store.current_revision() == revision
    assert broker.service.loaded_topics() == []
    assert broker.node is not None
    assert all(s.role is None for s in broker.node.server.sessions)
