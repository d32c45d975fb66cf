"""``anabranch produce`` / ``consume`` against a real in-process broker."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from typer.testing import CliRunner

from anabranch.cli.main import app
from anabranch.testing.broker import InProcessBroker

TOPIC = "persistent://public/default/cli-tryout"


async def test_produce_then_consume_round_trip(tmp_path: Path) -> None:
    runner = CliRunner()
    async with InProcessBroker(tmp_path) as broker:
        url = ["--service-url", broker.service_url]
        # The CLI blocks on its own client thread; run it off this loop so the broker serves.
        sent = await asyncio.to_thread(
            runner.invoke, app, ["produce", TOPIC, "-m", "one", "-m", "two", "--key", "k", *url]
        )
        assert sent.exit_code == 0, sent.output
        got = await asyncio.to_thread(
            runner.invoke,
            app,
            [
                "consume",
                TOPIC,
                "-s",
                "cli",
                "--count",
                "2",
                "--initial-position",
                "earliest",
                "--output",
                "json",
                "--timeout",
                "10",
                *url,
            ],
        )
    assert got.exit_code == 0, got.output
    records = [json.loads(line) for line in got.stdout.splitlines() if line.startswith("{")]
    assert [(r["key"], r["value"]) for r in records] == [("k", "one"), ("k", "two")]


async def test_consume_reports_timeout_with_exit_code(tmp_path: Path) -> None:
    runner = CliRunner()
    async with InProcessBroker(tmp_path) as broker:
        got = await asyncio.to_thread(
            runner.invoke,
            app,
            [
                "consume",
                TOPIC,
                "-s",
                "idle",
                "--count",
                "1",
                "--timeout",
                "0.5",
                "--service-url",
                broker.service_url,
            ],
        )
    assert got.exit_code == 3
    assert "timed out after 0 message(s)" in got.output


def test_produce_to_unreachable_broker_fails_cleanly() -> None:
    got = CliRunner().invoke(
        app, ["produce", TOPIC, "-m", "x", "--service-url", "pulsar://127.0.0.1:1"]
    )
    assert got.exit_code == 1
    assert "error: cannot connect" in got.output


async def test_scalable_topic_round_trip_across_a_split(tmp_path: Path) -> None:
    """produce auto-creates a topic:// name; consume reads it as a stream after a split."""
    runner = CliRunner()
    topic = "topic://public/default/cli-scalable"
    async with InProcessBroker(tmp_path) as broker:
        url = ["--service-url", broker.service_url]
        first = await asyncio.to_thread(
            runner.invoke, app, ["produce", topic, "-m", "a1", "-m", "a2", "--key", "a", *url]
        )
        assert first.exit_code == 0, first.output
        await broker.service.scalable.split(topic, 0)
        second = await asyncio.to_thread(
            runner.invoke, app, ["produce", topic, "-m", "a3", "--key", "a", *url]
        )
        assert second.exit_code == 0, second.output
        args = ["consume", topic, "-s", "cli", "--count", "3", "--output", "json"]
        got = await asyncio.to_thread(runner.invoke, app, [*args, "--timeout", "10", *url])
        assert got.exit_code == 0, got.output
        layout = await broker.service.scalable.get_metadata(topic)
    records = [json.loads(line) for line in got.stdout.splitlines() if line.startswith("{")]
    assert [(r["key"], r["value"]) for r in records] == [("a", "a1"), ("a", "a2"), ("a", "a3")]
    assert layout.epoch == 1
