from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from tests.client.fake_broker import FakeBroker


@pytest.fixture
async def fake() -> AsyncIterator[FakeBroker]:
    broker = await FakeBroker().start()
    yield broker
    await broker.stop()
