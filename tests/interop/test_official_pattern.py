"""The official ``pulsar-client`` subscribes to a regular expression: it gets the matching
topics that exist, not the others, and (after its fixed 60 s re-poll: the Python client
ignores ``pattern_auto_discovery_period``, apache/pulsar-client-python#171) a matching topic
created later. What it sends (GET_TOPICS_OF_NAMESPACE) and what our broker answers are
recorded at the command table and checked against upstream's rules.

This is the suite's one test that waits for the official client's 60 s discovery period."""

from __future__ import annotations

import asyncio
import re
import time
from pathlib import Path
from typing import Any

import pulsar
import pytest

from anabranch.broker import command_table
from anabranch.broker.command_table import TABLE, Command
from anabranch.broker.scalable_commands import topics_hash
from anabranch.protocol._generated import pulsar_api_pb2 as pb
from anabranch.protocol.frames import Frame
from anabranch.testing.broker import InProcessBroker

T = pb.BaseCommand
P = "persistent://public/default"
OFFICIAL_REPOLL_S = 60


def spy_get_topics(
    monkeypatch: pytest.MonkeyPatch,
) -> tuple[list[pb.CommandGetTopicsOfNamespace], list[pb.CommandGetTopicsOfNamespaceResponse]]:
    """Record the GET_TOPICS_OF_NAMESPACE requests and their answers (the real handler
    still answers)."""
    asked: list[pb.CommandGetTopicsOfNamespace] = []
    answered: list[pb.CommandGetTopicsOfNamespaceResponse] = []
    row = TABLE[T.GET_TOPICS_OF_NAMESPACE]

    async def recording(session: Any, frame: Frame) -> None:
        asked.append(frame.command.getTopicsOfNamespace)
        write = session.write

        def capture(command: pb.BaseCommand) -> None:
            if command.type == T.GET_TOPICS_OF_NAMESPACE_RESPONSE:
                answered.append(command.getTopicsOfNamespaceResponse)
            write(command)

        session.write = capture
        try:
            result = row.handler(session, frame)
            if result is not None:
                await result
        finally:
            del session.write

    spy = Command(recording, row.need, row.spawned, row.resource, row.reject)
    monkeypatch.setitem(command_table.TABLE, T.GET_TOPICS_OF_NAMESPACE, spy)
    return asked, answered


def regex_session(url: str) -> dict[str, Any]:
    client = pulsar.Client(url, operation_timeout_seconds=30)
    try:
        for name in ("orders-1", "orders-2", "audit"):
            client.create_producer(f"{P}/{name}").send(f"{name}:before".encode())
        consumer = client.subscribe(
            re.compile(f"{P}/orders-.*"),
            "regex",
            initial_position=pulsar.InitialPosition.Earliest,
            pattern_auto_discovery_period=1,
        )
        first: list[str] = []
        for _ in range(2):
            msg = consumer.receive(timeout_millis=15_000)
            consumer.acknowledge(msg)
            first.append(msg.data().decode())
        try:
            consumer.receive(timeout_millis=500)
            stray = True
        except pulsar.Timeout:
            stray = False
        # Created after the subscription: found at the client's next (60 s) poll.
        client.create_producer(f"{P}/orders-3").send(b"orders-3:later")
        started = time.monotonic()
        later = consumer.receive(timeout_millis=(OFFICIAL_REPOLL_S + 30) * 1000)
        consumer.acknowledge(later)
        waited = time.monotonic() - started
        consumer.close()
        return {"first": sorted(first), "stray": stray, "later": later.data(), "waited": waited}
    finally:
        client.close()


async def test_official_regex_subscription(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    asked, answered = spy_get_topics(monkeypatch)
    async with InProcessBroker(tmp_path, ledgers="memory") as broker:
        result = await asyncio.to_thread(regex_session, broker.service_url)
    assert result["first"] == ["orders-1:before", "orders-2:before"]
    assert not result["stray"]  # audit matched nothing
    assert result["later"] == b"orders-3:later"
    # What the official client sends and gets: persistent mode on public/default; the
    # answers carry upstream's hash of what they list, changed=true on a new list.
    assert len(asked) >= 2
    assert {(a.namespace, a.mode) for a in asked} == {
        ("public/default", pb.CommandGetTopicsOfNamespace.PERSISTENT)
    }
    for request, answer in zip(asked, answered, strict=True):
        assert answer.topics_hash == topics_hash(list(answer.topics)) or not answer.changed
        assert answer.filtered == request.HasField("topics_pattern")
        if not request.HasField("topics_hash"):
            assert answer.changed
    assert f"{P}/orders-3" not in answered[0].topics
    assert f"{P}/orders-3" in answered[-1].topics or not answered[-1].changed
