"""Broker settings that choose the ledger backend (``storage``, ``jetstream_*``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from anabranch.broker.config import BrokerConfig
from anabranch.broker.standalone import _ledger_factory
from anabranch.metadata.memory import MemoryMetadataStore
from anabranch.storage.jetstream_ledger import JetStreamManagedLedgerFactory
from anabranch.storage.ledger import FileManagedLedgerFactory
from anabranch.testing.clock import ManualClock


def test_file_storage_is_the_default(tmp_path: Path) -> None:
    cfg = BrokerConfig.load(data_dir=tmp_path)
    assert cfg.storage == "file"
    factory = _ledger_factory("file", cfg, MemoryMetadataStore(), ManualClock())
    assert isinstance(factory, FileManagedLedgerFactory)


def test_jetstream_needs_urls(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="needs jetstream_urls"):
        BrokerConfig.load(data_dir=tmp_path, storage="jetstream")


def test_jetstream_from_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ANABRANCH_STORAGE", "jetstream")
    monkeypatch.setenv("ANABRANCH_JETSTREAM_URLS", "nats://a:4222, nats://b:4222")
    monkeypatch.setenv("ANABRANCH_JETSTREAM_REPLICAS", "1")
    monkeypatch.setenv("ANABRANCH_JETSTREAM_PASSWORD", "s3cret")
    cfg = BrokerConfig.load(data_dir=tmp_path)
    assert cfg.jetstream_urls == ["nats://a:4222", "nats://b:4222"]
    assert "s3cret" not in repr(cfg)
    factory = _ledger_factory("file", cfg, MemoryMetadataStore(), ManualClock())
    assert isinstance(factory, JetStreamManagedLedgerFactory)
    assert (factory.urls, factory.replicas) == (cfg.jetstream_urls, 1)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("jetstream_replicas", 0),
        ("jetstream_stream_prefix", "a.b"),
        ("jetstream_stream_prefix", "a-b"),
    ],
)
def test_bad_jetstream_settings(tmp_path: Path, field: str, value: object) -> None:
    values: dict[str, Any] = {field: value}
    with pytest.raises(ValidationError):
        BrokerConfig.load(None, data_dir=tmp_path, jetstream_urls=["nats://a:4222"], **values)
