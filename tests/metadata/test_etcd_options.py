"""Reaching etcd: several endpoints, user/password authentication (and TLS, in
test_etcd_tls.py) against real etcd processes."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import pytest
from aetcd import rpc

from anabranch.broker.config import BrokerConfig
from anabranch.errors import InvalidArgument, MetadataUnavailable
from anabranch.metadata.etcd import EtcdMetadataStore
from anabranch.metadata.etcd_channel import EtcdOptions
from anabranch.testing.etcd import EtcdServer
from anabranch.testing.ports import free_port

ROOT_PASSWORD = "s3cret-root"


@pytest.fixture(scope="module")
def etcd_with_auth(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdServer]:
    server = EtcdServer.start(tmp_path_factory.mktemp("etcd-auth"))
    try:
        _enable_auth(server.endpoint)
        yield server
    finally:
        server.stop()


def _enable_auth(endpoint: str) -> None:
    """etcd's own recipe: a root user holding the root role, then auth on."""
    with grpc.insecure_channel(endpoint) as channel:
        auth = rpc.AuthStub(channel)
        auth.UserAdd(rpc.AuthUserAddRequest(name="root", password=ROOT_PASSWORD), timeout=10)
        auth.RoleAdd(rpc.AuthRoleAddRequest(name="root"), timeout=10)
        auth.UserGrantRole(rpc.AuthUserGrantRoleRequest(user="root", role="root"), timeout=10)
        auth.AuthEnable(rpc.AuthEnableRequest(), timeout=10)


@pytest.fixture
async def store(etcd_with_auth: EtcdServer) -> AsyncIterator[EtcdMetadataStore]:
    options = EtcdOptions(username="root", password=ROOT_PASSWORD)
    opened = await EtcdMetadataStore.open(etcd_with_auth.endpoint, options=options)
    try:
        yield opened
    finally:
        await opened.close()


async def test_the_right_password_reads_and_writes(store: EtcdMetadataStore) -> None:
    await store.put("/auth/a", b"1")
    record = await store.get("/auth/a")
    assert record is not None and record.value == b"1"


async def test_no_credentials_are_refused_with_a_typed_error(etcd_with_auth: EtcdServer) -> None:
    with pytest.raises(MetadataUnavailable):
        store = await EtcdMetadataStore.open(etcd_with_auth.endpoint)
        await store.close()


async def test_a_wrong_password_is_refused(etcd_with_auth: EtcdServer) -> None:
    options = EtcdOptions(username="root", password="wrong")
    with pytest.raises(MetadataUnavailable):
        store = await EtcdMetadataStore.open(etcd_with_auth.endpoint, options=options)
        await store.close()


async def test_an_expired_token_is_renewed(store: EtcdMetadataStore) -> None:
    # What etcd answers when a simple token expired: a token it no longer knows.
    store._client.metadata = (("token", "expired.1"),)
    await store.put("/auth/b", b"2")
    record = await store.get("/auth/b")
    assert record is not None and record.value == b"2"
    assert store._client.metadata != (("token", "expired.1"),)


async def test_a_dead_first_endpoint_fails_over_to_the_next(etcd_with_auth: EtcdServer) -> None:
    dead = f"127.0.0.1:{free_port()}"
    options = EtcdOptions(username="root", password=ROOT_PASSWORD)
    store = await EtcdMetadataStore.open(f"{dead},{etcd_with_auth.endpoint}", options=options)
    try:
        await store.put("/auth/c", b"3")
        record = await store.get("/auth/c")
        assert record is not None and record.value == b"3"
    finally:
        await store.close()


def test_broker_settings_make_the_options(tmp_path: Path) -> None:
    config = BrokerConfig.model_validate(
        {"data_dir": tmp_path, "etcd_username": "broker", "etcd_password": "pw"}
    )
    assert config.etcd_options() == EtcdOptions(username="broker", password="pw")
    assert "pw" not in repr(config)
    half = BrokerConfig.model_validate({"data_dir": tmp_path, "etcd_username": "broker"})
    with pytest.raises(InvalidArgument, match="go together"):
        half.etcd_options()


@pytest.mark.parametrize("bad", ["", "host", "host:", ":2379", "h:99999", "a:1,b"])
def test_malformed_endpoints_are_refused(bad: str) -> None:
    with pytest.raises(InvalidArgument):
        EtcdOptions.parse_endpoints(bad)
