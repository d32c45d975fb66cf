"""open_metadata_store: URL forms and their errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from anabranch.errors import InvalidArgument
from anabranch.metadata.factory import open_metadata_store
from anabranch.metadata.memory import MemoryMetadataStore
from anabranch.metadata.sqlite import SqliteMetadataStore
from anabranch.testing.clock import ManualClock


async def test_memory_url_gives_a_memory_store_with_the_clock() -> None:
    clock = ManualClock()
    store = await open_metadata_store("memory://", clock=clock)
    assert isinstance(store, MemoryMetadataStore)
    session = await store.open_session(1.0, auto_keepalive=False)
    clock.advance(1.0)
    assert session.expired
    await store.close()


async def test_sqlite_url_opens_a_durable_file(tmp_path: Path) -> None:
    url = f"sqlite://{tmp_path}/meta.db?synchronous=NORMAL"
    store = await open_metadata_store(url)
    assert isinstance(store, SqliteMetadataStore)
    await store.put("/kept", b"1")
    await store.close()
    again = await open_metadata_store(f"sqlite://{tmp_path}/meta.db")
    record = await again.get("/kept")
    await again.close()
    assert record is not None and record.value == b"1"


@pytest.mark.parametrize(
    "url",
    [
        "",
        "zookeeper://host:2181",
        "memory://somewhere",
        "sqlite://relative/meta.db",
        "sqlite:///",
        "sqlite:///tmp/meta.db?synchronous=FULL&x=1",
        "sqlite:///tmp/meta.db?synchronous=SOMETIMES",
        "etcd://",
        "etcd://host:notaport",
    ],
)
async def test_invalid_urls_raise_invalid_argument(url: str) -> None:
    with pytest.raises(InvalidArgument):
        await open_metadata_store(url)
