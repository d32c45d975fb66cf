"""An S3 outage during offloads logs one line per attempt, not a traceback: the
offloader retries with backoff (0.5 s doubling), so a fault driver that killed SeaweedFS
mid-offload found a 12-line traceback in the broker log per retry. Other failures keep
their traceback."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

from anabranch.admin.client import AdminClient
from anabranch.aio import Client
from anabranch.testing.seaweedfs import SeaweedS3
from tests.tiered.test_offload_broker import NS, broker_for, eventually, produce


async def test_an_s3_outage_logs_each_failed_offload_in_one_line(
    tmp_path: Path, seaweed: SeaweedS3, caplog: pytest.LogCaptureFixture
) -> None:
    topic = f"persistent://{NS}/outage-logs"
    async with broker_for(tmp_path / "data", seaweed, offload_deletion_lag_ms=-1) as broker:
        assert broker.http_url is not None
        async with AdminClient(broker.http_url) as admin, Client(broker.service_url) as client:
            ids = await produce(client, topic, 25)
            await asyncio.to_thread(seaweed.stop)
            try:
                with caplog.at_level(logging.WARNING, logger="anabranch.broker.offload"):
                    await admin.offload(topic, (ids[-1].ledger_id, 0))

                    async def failed() -> bool:
                        return str((await admin.offload_status(topic))["status"]) == "ERROR"

                    await eventually(failed, "offload fails while S3 is down")
            finally:
                await asyncio.to_thread(seaweed.start_again)
    lines = [r for r in caplog.records if "offload failed" in r.getMessage()]
    assert lines
    assert all("ObjectStoreUnavailable" in r.getMessage() for r in lines)
    assert [r for r in lines if r.exc_info] == []
