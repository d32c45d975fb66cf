"""etcd over TLS: the broker's metadata connection checks etcd's certificate against a CA
bundle and, when etcd asks for one, presents a client certificate (certificates made by
the test)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from anabranch.errors import MetadataUnavailable
from anabranch.metadata.etcd import EtcdMetadataStore
from anabranch.metadata.etcd_channel import EtcdOptions
from anabranch.testing.certificates import TestPki
from anabranch.testing.etcd import EtcdServer, EtcdTls


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> TestPki:
    return TestPki.create(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def etcd_tls(pki: TestPki, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdServer]:
    client_cert, client_key = pki.client("anabranch-broker")
    tls = EtcdTls(
        ca_file=pki.ca_cert,
        cert_file=pki.server_cert,
        key_file=pki.server_key,
        client_cert=client_cert,
        client_key=client_key,
    )
    server = EtcdServer.start(tmp_path_factory.mktemp("etcd-tls"), tls=tls)
    try:
        yield server
    finally:
        server.stop()


async def test_tls_with_a_client_certificate_reads_and_writes(
    etcd_tls: EtcdServer, pki: TestPki
) -> None:
    cert, key = pki.client("anabranch-broker")
    options = EtcdOptions(tls_trust_certs_file=pki.ca_cert, tls_cert_file=cert, tls_key_file=key)
    store = await EtcdMetadataStore.open(etcd_tls.endpoint, options=options)
    try:
        await store.put("/tls/a", b"1")
        record = await store.get("/tls/a")
        assert record is not None and record.value == b"1"
    finally:
        await store.close()


async def test_plaintext_to_a_tls_etcd_is_refused(etcd_tls: EtcdServer) -> None:
    with pytest.raises(MetadataUnavailable):
        store = await EtcdMetadataStore.open(etcd_tls.endpoint)
        await store.close()


async def test_without_the_client_certificate_etcd_refuses(
    etcd_tls: EtcdServer, pki: TestPki
) -> None:
    options = EtcdOptions(tls_trust_certs_file=pki.ca_cert)
    with pytest.raises(MetadataUnavailable):
        store = await EtcdMetadataStore.open(etcd_tls.endpoint, options=options)
        await store.close()


async def test_an_untrusted_server_certificate_is_refused(
    etcd_tls: EtcdServer, tmp_path: Path
) -> None:
    other = TestPki.create(tmp_path / "other", ca_name="someone-else")
    cert, key = other.client("anabranch-broker")
    options = EtcdOptions(tls_trust_certs_file=other.ca_cert, tls_cert_file=cert, tls_key_file=key)
    with pytest.raises(MetadataUnavailable):
        store = await EtcdMetadataStore.open(etcd_tls.endpoint, options=options)
        await store.close()
