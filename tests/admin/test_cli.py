"""``anabranch admin`` through typer's CliRunner against a broker running in a thread.

The CLI runs its own ``asyncio.run`` per command, so the broker lives on a separate
event loop in a background thread.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from anabranch.cli.main import app
from anabranch.testing.broker import InProcessBroker
from anabranch.testing.ports import free_port

runner = CliRunner()


@pytest.fixture
def admin_url(tmp_path: Path) -> Iterator[str]:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    broker = InProcessBroker(tmp_path, ledgers="memory")
    try:
        asyncio.run_coroutine_threadsafe(broker.__aenter__(), loop).result()
        assert broker.http_url is not None
        yield broker.http_url
        asyncio.run_coroutine_threadsafe(broker.__aexit__(None, None, None), loop).result()
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        loop.close()


def cli(url: str, *args: str, code: int = 0) -> str:
    result = runner.invoke(app, ["admin", "--admin-url", url, *args])
    assert result.exit_code == code, (result.stdout, result.stderr)
    return result.stdout


def cli_json(url: str, *args: str) -> Any:
    return json.loads(cli(url, *args, "--output", "json"))


def test_clusters_and_tenants(admin_url: str) -> None:
    assert cli_json(admin_url, "clusters", "list") == ["standalone"]
    assert "standalone" in cli(admin_url, "clusters", "list")  # the rich table
    cli(admin_url, "tenants", "create", "acme", "--allowed-clusters", "standalone")
    assert cli_json(admin_url, "tenants", "list") == ["acme", "public"]
    assert cli_json(admin_url, "tenants", "get", "acme")["allowedClusters"] == ["standalone"]
    cli(admin_url, "tenants", "create", "acme", code=1)
    cli(admin_url, "tenants", "delete", "acme")
    assert cli_json(admin_url, "tenants", "list") == ["public"]


def test_namespaces(admin_url: str) -> None:
    cli(admin_url, "namespaces", "create", "public/billing")
    assert cli_json(admin_url, "namespaces", "list", "public") == [
        "public/billing",
        "public/default",
    ]
    cli(admin_url, "namespaces", "set-deduplication", "public/billing", "--enable")
    assert cli_json(admin_url, "namespaces", "get-deduplication", "public/billing") is True
    assert cli_json(admin_url, "namespaces", "get", "public/billing")["deduplicationEnabled"]
    cli(admin_url, "namespaces", "delete", "public/billing")
    cli(admin_url, "namespaces", "get", "public/billing", code=1)


def test_topics_partitions_subscriptions_terminate(admin_url: str) -> None:
    topic = "persistent://public/default/orders"
    cli(admin_url, "topics", "create", topic, "--partitions", "2")
    assert cli_json(admin_url, "topics", "partitions", topic) == {"partitions": 2}
    cli(admin_url, "topics", "update-partitions", topic, "3")
    assert cli_json(admin_url, "topics", "list-partitioned", "public/default") == [topic]
    assert len(cli_json(admin_url, "topics", "list", "public/default")) == 3
    stats = cli_json(admin_url, "topics", "stats", topic)
    assert stats["metadata"] == {"partitions": 3}
    cli(admin_url, "topics", "delete", topic)
    assert cli_json(admin_url, "topics", "list", "public/default") == []

    plain = "persistent://public/default/plain"
    cli(admin_url, "topics", "create", plain)
    cli(admin_url, "topics", "create-subscription", plain, "s1", "--position", "earliest")
    assert cli_json(admin_url, "topics", "subscriptions", plain) == ["s1"]
    cli(admin_url, "topics", "skip", plain, "s1")
    cli(admin_url, "topics", "skip", plain, "s1", "--count", "2")
    cli(admin_url, "topics", "reset-cursor", plain, "s1", "--time", "0")
    cli(admin_url, "topics", "reset-cursor", plain, "s1", code=2)  # neither option
    internal = cli_json(admin_url, "topics", "internal-stats", plain)
    assert set(internal["cursors"]) == {"s1"}
    assert cli_json(admin_url, "topics", "stats", plain)["msgInCounter"] == 0
    last = cli_json(admin_url, "topics", "terminate", plain)
    assert last["partitionIndex"] == -1
    assert cli_json(admin_url, "topics", "lookup", plain)["httpUrl"] == admin_url
    cli(admin_url, "topics", "delete-subscription", plain, "s1")
    assert cli_json(admin_url, "topics", "subscriptions", plain) == []
    cli(admin_url, "topics", "delete", plain)
    cli(admin_url, "topics", "stats", plain, code=1)


def test_errors_name_the_reason_and_unreachable_is_exit_2(admin_url: str) -> None:
    result = runner.invoke(app, ["admin", "--admin-url", admin_url, "tenants", "get", "nobody"])
    assert result.exit_code == 1
    assert "404" in result.stderr
    dead = f"http://127.0.0.1:{free_port()}"
    result = runner.invoke(app, ["admin", "--admin-url", dead, "tenants", "list"])
    assert result.exit_code == 2
    assert "cannot reach" in result.stderr
