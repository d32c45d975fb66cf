"""Offload on the JetStream managed ledger (segments of scalable topics use it too): sealed
ledgers go to a real SeaweedFS, their messages leave the stream, reads come from S3."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import pytest

from anabranch.errors import NotFound
from anabranch.metadata.memory import MemoryMetadataStore
from anabranch.storage.api import EARLIEST, ManagedLedgerConfig
from anabranch.storage.jetstream_ledger import JetStreamManagedLedgerFactory
from anabranch.storage.object_store import S3ObjectStore
from anabranch.storage.tiered import TieredStorage
from anabranch.testing.nats import NatsCluster
from anabranch.testing.seaweedfs import SeaweedS3
from tests.tiered.conftest import settings_of


@pytest.fixture(scope="module")
def nats(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsCluster]:
    cluster = NatsCluster.start(tmp_path_factory.mktemp("nats"), nodes=1)
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
async def store() -> AsyncIterator[MemoryMetadataStore]:
    made = MemoryMetadataStore()
    yield made
    await made.close()


def factory_of(
    nats: NatsCluster, store: MemoryMetadataStore, seaweed: SeaweedS3
) -> JetStreamManagedLedgerFactory:
    factory = JetStreamManagedLedgerFactory(
        nats.urls, store, replicas=1, prefix="off", tail_cache_bytes=0, api_timeout_s=5.0
    )
    factory.tiered = TieredStorage(S3ObjectStore(settings_of(seaweed)))
    return factory


async def test_jetstream_ledger_offload_purges_stream_and_reads_from_s3(
    nats: NatsCluster, store: MemoryMetadataStore, seaweed: SeaweedS3
) -> None:
    factory = factory_of(nats, store, seaweed)
    config = ManagedLedgerConfig(ledger_entries_max=10)
    ml = await factory.open("t/ns/persistent/js-off", config)
    expected = [b"j%03d" % i for i in range(25)]
    for data in expected:
        await ml.append(data)
    sealed = [i for i in ml.ledgers if i.closed_ms is not None]
    assert len(sealed) == 2
    for info in sealed:
        assert await ml.offload_ledger(info.ledger_id, deletion_lag_ms=0)
        assert await ml.delete_offloaded_hot(info.ledger_id)
    stream = await ml._client.stream_info(ml.stream)
    assert stream["state"]["messages"] < 25  # the cold ledgers' messages left the stream
    assert [e.data for e in await ml.read(EARLIEST, 100)] == expected
    await ml.close()
    await factory.close()

    again = factory_of(nats, store, seaweed)
    reopened = await again.open("t/ns/persistent/js-off", config)
    assert [e.data for e in await reopened.read(EARLIEST, 100)] == expected
    assert [i.hot for i in reopened.ledgers][:2] == [False, False]
    keys = [i.offload.key for i in reopened.ledgers if i.offload is not None]
    s3 = S3ObjectStore(settings_of(seaweed))
    assert len(keys) == 2 and all([await s3.size(key) > 0 for key in keys])
    await reopened.delete()  # deleting the topic deletes its offloaded objects too
    for key in keys:
        with pytest.raises(NotFound):
            await s3.size(key)
    await again.close()
