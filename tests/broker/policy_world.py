"""An in-process broker with our admin client and client: the world of the policy tests
(caps, rates), each of which adds its own helpers to :class:`PolicyWorld`."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from anabranch.admin.client import AdminClient
from anabranch.aio import Client
from anabranch.testing.broker import InProcessBroker

NS = "public/default"


@dataclass
class PolicyWorld:
    broker: InProcessBroker
    admin: AdminClient
    client: Client

    @staticmethod
    def topic(name: str) -> str:
        return f"persistent://{NS}/{name}"


W = TypeVar("W", bound=PolicyWorld)


async def worlds(kind: type[W], tmp_path: Path, **config: Any) -> AsyncIterator[W]:
    """One world of ``kind`` on a broker with ``config`` (an async generator, so that a
    fixture or a test can ``async for`` it)."""
    async with InProcessBroker(tmp_path / "data", **config) as broker:
        assert broker.http_url is not None
        async with AdminClient(broker.http_url) as admin, Client(broker.service_url) as client:
            yield kind(broker, admin, client)
