"""Advertised listeners: the config's rules (upstream's MultipleListenerValidator), LOOKUP
and the HTTP lookup naming a listener, and the official client's ``listener_name`` against
a standalone advertising its port under two names (``127.0.0.1`` and ``localhost``)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pulsar
import pytest
from pydantic import ValidationError

from anabranch.broker.advertised_listeners import Listener, parse_listeners
from anabranch.broker.config import BrokerConfig
from anabranch.errors import InvalidArgument
from anabranch.protocol._generated import pulsar_api_pb2 as pb
from anabranch.testing.broker import InProcessBroker
from anabranch.testing.ports import free_port
from tests.broker.test_core_protocol import RawClient

T = pb.BaseCommand
TOPIC = "persistent://public/default/listeners"


# --- configuration -----------------------------------------------------------------------------


def test_listener_specs_as_upstream_validates_them(tmp_path: Path) -> None:
    spec = "internal:pulsar://10.0.0.1:6650,internal:pulsar+ssl://10.0.0.1:6651,external:pulsar://host:16650"
    assert parse_listeners(spec) == {
        "internal": Listener("pulsar://10.0.0.1:6650", "pulsar+ssl://10.0.0.1:6651"),
        "external": Listener("pulsar://host:16650", ""),
    }
    for bad in (
        "internal:pulsar://a:1,internal:pulsar://b:2",  # two pulsar:// URLs
        "a:pulsar://h:1,b:pulsar+ssl://h:1",  # one host:port, two listeners
        "a:http://h:1",
        "a:pulsar://h",  # no port
        ":pulsar://h:1",
        "justaname",
    ):
        with pytest.raises(InvalidArgument):
            parse_listeners(bad)
    config = BrokerConfig.model_validate({"data_dir": tmp_path, "advertised_listeners": spec})
    assert config.internal_listener_name == "internal"  # the first, by default
    table = {"a": ["pulsar://h:1", "pulsar+ssl://h:2"], "b": "pulsar://g:1"}
    config = BrokerConfig.model_validate(  # a TOML table
        {"data_dir": tmp_path, "advertised_listeners": table, "internal_listener_name": "b"}
    )
    assert parse_listeners(config.advertised_listeners)["a"].pulsar_url_tls == "pulsar+ssl://h:2"
    with pytest.raises(ValidationError, match="not an advertised listener"):
        BrokerConfig.model_validate(
            {"data_dir": tmp_path, "advertised_listeners": spec, "internal_listener_name": "x"}
        )


# --- the wire and HTTP -------------------------------------------------------------------------


@pytest.fixture
async def broker(tmp_path: Path) -> AsyncIterator[InProcessBroker]:
    port = free_port()
    listeners = f"internal:pulsar://127.0.0.1:{port},external:pulsar://localhost:{port}"
    async with InProcessBroker(
        tmp_path, ledgers="memory", port=port, advertised_listeners=listeners
    ) as b:
        yield b


async def lookup(client: RawClient, request_id: int, listener: str | None) -> Any:
    body = pb.CommandLookupTopic(topic=TOPIC, request_id=request_id)
    if listener is not None:
        body.advertised_listener_name = listener
    await client.send(T(type=T.LOOKUP, lookupTopic=body))
    return (await client.expect(T.LOOKUP_RESPONSE)).command.lookupTopicResponse


async def test_lookups_answer_the_named_listener(broker: InProcessBroker) -> None:
    client = await RawClient.open(broker.port)
    try:
        await client.handshake()
        plain = await lookup(client, 1, None)
        assert plain.brokerServiceUrl == broker.service_url
        external = await lookup(client, 2, "external")
        assert external.response == pb.CommandLookupTopicResponse.Connect
        assert external.brokerServiceUrl == f"pulsar://localhost:{broker.port}"
        internal = await lookup(client, 3, "internal")
        assert internal.brokerServiceUrl == f"pulsar://127.0.0.1:{broker.port}"
        unknown = await lookup(client, 4, "nope")
        assert unknown.response == pb.CommandLookupTopicResponse.Failed
        assert unknown.error == pb.ServiceNotReady
        assert unknown.message == "the broker do not have nope listener"
    finally:
        await client.close()

    assert broker.http_url is not None
    path = f"{broker.http_url}/lookup/v2/topic/persistent/public/default/listeners"
    async with aiohttp.ClientSession() as http:
        async with http.get(path, params={"listenerName": "external"}) as resp:
            assert resp.status == 200
            assert (await resp.json())["brokerUrl"] == f"pulsar://localhost:{broker.port}"
        async with http.get(path, headers={"X-Pulsar-ListenerName": "internal"}) as resp:
            assert (await resp.json())["brokerUrl"] == f"pulsar://127.0.0.1:{broker.port}"
        async with http.get(path, params={"listenerName": "nope"}) as resp:
            assert resp.status == 404
            assert "the broker do not have nope listener" in await resp.text()


def official_round_trip(url: str, listener: str) -> bytes:
    client = pulsar.Client(url, listener_name=listener, operation_timeout_seconds=30)
    try:
        consumer = client.subscribe(TOPIC, "s", initial_position=pulsar.InitialPosition.Earliest)
        client.create_producer(TOPIC).send(b"via " + listener.encode())
        msg = consumer.receive(timeout_millis=10_000)
        consumer.acknowledge(msg)
        return bytes(msg.data())
    finally:
        client.close()


def official_unknown_listener(url: str) -> tuple[str, float]:
    client = pulsar.Client(url, listener_name="nope", operation_timeout_seconds=2)
    started = time.monotonic()
    try:
        client.create_producer(TOPIC)
    except Exception as err:  # the official client's own exception types
        return f"{type(err).__name__}: {err}", time.monotonic() - started
    finally:
        client.close()
    return "", time.monotonic() - started


async def test_official_client_listener_name(broker: InProcessBroker) -> None:
    got = await asyncio.to_thread(official_round_trip, broker.service_url, "external")
    assert got == b"via external"
    # Upstream answers an unknown listener with ServiceNotReady, which the official (C++)
    # client retries until its operation timeout (logging "the broker do not have nope
    # listener"), then raises Timeout: what matters is that it never connects elsewhere.
    error, _elapsed = await asyncio.to_thread(official_unknown_listener, broker.service_url)
    assert error.startswith("Timeout"), error


async def test_our_client_names_a_listener_and_fails_fast_on_an_unknown_one(
    broker: InProcessBroker,
) -> None:
    from anabranch.aio import Client
    from anabranch.errors import ListenerNotFound

    async with Client(broker.service_url, listener_name="external") as client:
        assert await client._pool.lookup(TOPIC) == ("localhost", broker.port)
        producer = await client.create_producer(TOPIC)
        await producer.send(b"ours")
    async with Client(broker.service_url, listener_name="nope") as client:
        with pytest.raises(ListenerNotFound, match="the broker do not have nope listener"):
            await client.create_producer(TOPIC)


async def test_the_internal_listener_is_the_brokers_own_address(tmp_path: Path) -> None:
    port = free_port()
    listeners = f"internal:pulsar://127.0.0.1:{port},external:pulsar://localhost:{port}"
    async with InProcessBroker(
        tmp_path,
        ledgers="memory",
        port=port,
        advertised_listeners=listeners,
        internal_listener_name="external",
    ) as broker:
        # Upstream's brokerServiceUrl: lookups naming no listener answer the internal one.
        assert broker.service_url == f"pulsar://localhost:{port}"
        client = await RawClient.open(port)
        try:
            await client.handshake()
            assert (await lookup(client, 1, None)).brokerServiceUrl == f"pulsar://localhost:{port}"
            internal = await lookup(client, 2, "internal")
            assert internal.brokerServiceUrl == f"pulsar://127.0.0.1:{port}"
        finally:
            await client.close()
