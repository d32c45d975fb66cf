"""Segment operations sent to another broker: an owner that stops answering."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any, cast

import pytest

from anabranch.broker.cluster import segments
from anabranch.broker.cluster.segments import ClusterSegmentOps
from anabranch.core.names import SegmentName
from anabranch.errors import MetadataUnavailable
from anabranch.security.broker_client import BrokerClientCredentials

SEGMENT = SegmentName.parse("segment://public/default/orders/0000-7fff-1")


async def test_an_owner_that_never_answers_is_a_retriable_metadata_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A SIGSTOPped owner: the kernel still accepts the connection, nothing ever answers.
    # The split's controller must see MetadataUnavailable (503, retried in the background),
    # not a bare TimeoutError (500 and a logged traceback).
    held: list[asyncio.StreamWriter] = []

    async def never_answer(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)

    server = await asyncio.start_server(never_answer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    monkeypatch.setattr(segments, "REMOTE_SEGMENT_OP_TIMEOUT_S", 0.2)

    async def lookup(_name: str) -> SimpleNamespace:
        return SimpleNamespace(pulsar_url="pulsar://elsewhere", http_url=f"http://127.0.0.1:{port}")

    ownership = SimpleNamespace(
        lookup=lookup,
        me=SimpleNamespace(pulsar_url="pulsar://me"),
        credentials=BrokerClientCredentials(),
    )
    ops = ClusterSegmentOps(cast(Any, None), cast(Any, ownership))
    try:
        with pytest.raises(MetadataUnavailable, match="no answer"):
            await ops.create_segment(SEGMENT, ["s"])
    finally:
        await ops.close()
        for writer in held:
            writer.close()
        server.close()
        await server.wait_closed()
