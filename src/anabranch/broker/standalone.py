"""Standalone mode: one process, SQLite metadata, local-disk ledgers under ``data_dir``.

Example:
    >>> async def run(cfg: BrokerConfig) -> None:
    ...     node = await Standalone.start(cfg)
    ...     await node.stop()
"""

from __future__ import annotations

from dataclasses import dataclass

from anabranch.broker.config import BrokerConfig
from anabranch.metadata.api import MetadataStore


@dataclass
class Standalone:
    """What ``anabranch standalone`` runs: for now the metadata store only."""

    config: BrokerConfig
    store: MetadataStore

    @classmethod
    async def start(cls, config: BrokerConfig) -> Standalone:
        from anabranch.metadata.factory import open_metadata_store

        config.data_dir.mkdir(parents=True, exist_ok=True)
        store = await open_metadata_store(config.metadata_url)
        return cls(config, store)

    def describe(self) -> str:
        return (
            f"metadata {self.config.metadata_url} (the broker on :{self.config.port} "
            "is not built yet: only the metadata store runs)"
        )

    async def stop(self) -> None:
        await self.store.close()
