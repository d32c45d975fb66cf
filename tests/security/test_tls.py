"""TLS listeners (``pulsar+ssl://``, HTTPS) and TLS client-certificate authentication,
with the official client and ours. Certificates are made by the test
(:mod:`anabranch.testing.certificates`)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pulsar
import pytest

from anabranch import AuthenticationTLS
from anabranch.admin.client import AdminClient, AdminHttpError
from anabranch.aio import Client
from anabranch.client.connection import ConnectionPool
from anabranch.client.errors import AuthenticationFailed
from anabranch.client.tls import TlsOptions
from anabranch.protocol._generated import pulsar_api_pb2 as pb
from anabranch.testing.broker import InProcessBroker
from anabranch.testing.certificates import TestPki, TlsSetup
from anabranch.testing.security import TokenAuth
from tests.security.official import refusal, round_trip

TOPIC = "persistent://public/default/tls"
MESSAGES = [f"m-{i}".encode() for i in range(5)]


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> TestPki:
    return TestPki.create(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def other_pki(tmp_path_factory: pytest.TempPathFactory) -> TestPki:
    return TestPki.create(tmp_path_factory.mktemp("other-pki"), ca_name="untrusted-ca")


def tls_url(broker: InProcessBroker) -> str:
    assert broker.node is not None and broker.node.service_url_tls is not None
    return broker.node.service_url_tls


def https_url(broker: InProcessBroker) -> str:
    assert broker.node is not None and broker.node.https_url is not None
    return broker.node.https_url


@pytest.fixture
async def tls_broker(tmp_path: Path, pki: TestPki) -> AsyncIterator[InProcessBroker]:
    async with InProcessBroker(tmp_path, security=TlsSetup(pki, authenticate=True)) as broker:
        yield broker


def roles(broker: InProcessBroker) -> list[str | None]:
    assert broker.node is not None
    return [s.role for s in broker.node.server.sessions]


async def test_lookup_answers_carry_the_tls_url(tls_broker: InProcessBroker, pki: TestPki) -> None:
    cert, key = pki.client("alice")
    pool = ConnectionPool(
        tls_url(tls_broker),
        auth=AuthenticationTLS(cert, key),
        tls=TlsOptions(trust_certs_file_path=str(pki.ca_cert)),
    )
    try:
        conn = await pool.get()
        request_id = conn.new_request_id()
        body = pb.CommandLookupTopic(topic=TOPIC, request_id=request_id)
        frame = await conn.request(
            pb.BaseCommand(type=pb.BaseCommand.LOOKUP, lookupTopic=body), request_id
        )
    finally:
        await pool.close()
    answer = frame.command.lookupTopicResponse
    assert answer.brokerServiceUrlTls == tls_url(tls_broker)
    assert answer.brokerServiceUrl == tls_broker.service_url
    assert tls_url(tls_broker).startswith("pulsar+ssl://127.0.0.1:")


async def test_official_client_over_tls_with_a_client_certificate(
    tls_broker: InProcessBroker, pki: TestPki
) -> None:
    cert, key = pki.client("alice")
    got = await asyncio.to_thread(
        round_trip,
        tls_url(tls_broker),
        TOPIC,
        tls_trust_certs_file_path=str(pki.ca_cert),
        authentication=pulsar.AuthenticationTLS(str(cert), str(key)),
    )
    assert got == MESSAGES


async def test_official_client_tls_role_is_the_cn(
    tls_broker: InProcessBroker, pki: TestPki
) -> None:
    cert, key = pki.client("svc-orders")
    client = await asyncio.to_thread(
        pulsar.Client,
        tls_url(tls_broker),
        tls_trust_certs_file_path=str(pki.ca_cert),
        authentication=pulsar.AuthenticationTLS(str(cert), str(key)),
    )
    try:
        await asyncio.to_thread(client.create_producer, TOPIC)
        assert "svc-orders" in roles(tls_broker)
    finally:
        await asyncio.to_thread(client.close)


async def test_official_client_without_a_certificate_is_refused(
    tls_broker: InProcessBroker, pki: TestPki
) -> None:
    name = await asyncio.to_thread(
        refusal, tls_url(tls_broker), TOPIC, tls_trust_certs_file_path=str(pki.ca_cert)
    )
    assert name == "AuthenticationError"
    assert tls_broker.service.loaded_topic(TOPIC) is None


async def test_our_client_over_tls_with_a_client_certificate(
    tls_broker: InProcessBroker, pki: TestPki
) -> None:
    cert, key = pki.client("bob")
    async with Client(
        tls_url(tls_broker),
        auth=AuthenticationTLS(cert, key),
        tls_trust_certs_file_path=str(pki.ca_cert),
        tls_validate_hostname=True,  # the broker's certificate names 127.0.0.1
    ) as client:
        producer = await client.create_producer(TOPIC)
        consumer = await client.subscribe(TOPIC, "s", initial_position="earliest")
        await producer.send(b"over-tls")
        msg = await consumer.receive(timeout=30)
        assert msg is not None and msg.value == b"over-tls"
        assert "bob" in roles(tls_broker)


async def test_our_client_with_an_untrusted_certificate_fails(
    tls_broker: InProcessBroker, pki: TestPki, other_pki: TestPki
) -> None:
    cert, key = other_pki.client("mallory")
    async with Client(
        tls_url(tls_broker),
        auth=AuthenticationTLS(cert, key),
        tls_trust_certs_file_path=str(pki.ca_cert),
    ) as client:
        with pytest.raises(AuthenticationFailed):
            await client.create_producer(TOPIC)
    assert "mallory" not in roles(tls_broker)
    assert tls_broker.service.loaded_topic(TOPIC) is None


async def test_our_client_refuses_an_untrusted_broker(
    tls_broker: InProcessBroker, other_pki: TestPki
) -> None:
    async with Client(
        tls_url(tls_broker), tls_trust_certs_file_path=str(other_pki.ca_cert)
    ) as client:
        with pytest.raises(AuthenticationFailed, match="TLS"):
            await client.create_producer(TOPIC)


async def test_tls_only_broker_with_token_auth(tmp_path: Path, pki: TestPki) -> None:
    auth = TokenAuth()
    setup = TlsSetup(pki, plaintext=False, also=auth)
    async with InProcessBroker(tmp_path, security=setup) as broker:
        assert broker.node is not None and broker.node.http_port is None
        assert broker.service.advertised_url == tls_url(broker)
        got = await asyncio.to_thread(
            round_trip,
            tls_url(broker),
            TOPIC,
            tls_trust_certs_file_path=str(pki.ca_cert),
            authentication=pulsar.AuthenticationToken(auth.token("alice")),
        )
        assert got == MESSAGES
        async with Client(
            tls_url(broker),
            auth_token=auth.token("bob"),
            tls_trust_certs_file_path=str(pki.ca_cert),
        ) as client:
            producer = await client.create_producer(TOPIC)
            await producer.send(b"x")


async def test_https_admin_with_our_admin_client(tmp_path: Path, pki: TestPki) -> None:
    auth = TokenAuth()
    async with InProcessBroker(tmp_path, security=TlsSetup(pki, also=auth)) as broker:
        url = https_url(broker)
        async with AdminClient(
            url, auth_token=auth.token("admin"), tls_trust_certs_file_path=str(pki.ca_cert)
        ) as admin:
            assert "public" in await admin.list_tenants()
        async with AdminClient(url, tls_trust_certs_file_path=str(pki.ca_cert)) as anonymous:
            with pytest.raises(AdminHttpError) as caught:
                await anonymous.list_tenants()
            assert caught.value.status == 401
        cert, key = pki.client("ops")
        async with AdminClient(
            url, auth=AuthenticationTLS(cert, key), tls_trust_certs_file_path=str(pki.ca_cert)
        ) as by_cert:
            # The token provider is the only one enabled here: a certificate is not enough.
            with pytest.raises(AdminHttpError):
                await by_cert.list_tenants()


async def test_https_admin_tls_authentication(tls_broker: InProcessBroker, pki: TestPki) -> None:
    cert, key = pki.client("ops")
    async with AdminClient(
        https_url(tls_broker),
        auth=AuthenticationTLS(cert, key),
        tls_trust_certs_file_path=str(pki.ca_cert),
    ) as admin:
        assert "public" in await admin.list_tenants()


async def test_required_client_certificate(tmp_path: Path, pki: TestPki) -> None:
    setup = TlsSetup(pki, authenticate=True, require_client_cert=True)
    async with InProcessBroker(tmp_path, security=setup) as broker:
        async with Client(tls_url(broker), tls_trust_certs_file_path=str(pki.ca_cert)) as client:
            with pytest.raises(AuthenticationFailed):
                await client.create_producer(TOPIC)
        cert, key = pki.client("frank")
        async with Client(
            tls_url(broker),
            auth=AuthenticationTLS(cert, key),
            tls_trust_certs_file_path=str(pki.ca_cert),
        ) as client:
            producer = await client.create_producer(TOPIC)
            await producer.send(b"x")
            assert "frank" in roles(broker)


async def test_http_lookup_names_the_tls_urls(tls_broker: InProcessBroker, pki: TestPki) -> None:
    cert, key = pki.client("ops")
    async with AdminClient(
        https_url(tls_broker),
        auth=AuthenticationTLS(cert, key),
        tls_trust_certs_file_path=str(pki.ca_cert),
    ) as admin:
        answer = await admin.request("GET", "/lookup/v2/topic/persistent/public/default/t")
        cluster = await admin.get_cluster("standalone")
    assert answer["brokerUrlTls"] == tls_url(tls_broker)
    assert answer["httpUrlTls"] == https_url(tls_broker)
    assert answer["brokerUrl"] == tls_broker.service_url
    assert cluster["brokerServiceUrlTls"].startswith("pulsar+ssl://")
