"""``anabranch admin scalable ...`` through typer's CliRunner against a broker in a thread."""

from __future__ import annotations

import asyncio
import json
import re
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from anabranch.cli.main import app
from anabranch.testing.broker import InProcessBroker

runner = CliRunner()
TOPIC = "topic://public/default/orders"


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
    result = runner.invoke(app, ["admin", "--admin-url", url, "scalable", *args])
    assert result.exit_code == code, (result.stdout, result.stderr)
    return result.stdout


def cli_json(url: str, *args: str) -> Any:
    return json.loads(cli(url, *args, "--output", "json"))


def build_dag(url: str) -> dict[str, Any]:
    """4 segments; split 1 (-> 4, 5); merge 5 and 2 (-> 6): a DAG with a two-parent node."""
    cli(url, "create", TOPIC, "--segments", "4")
    cli(url, "split", TOPIC, "1")
    layout: dict[str, Any] = cli_json(url, "merge", TOPIC, "5", "2")
    return layout


def test_create_get_list_split_merge_delete(admin_url: str) -> None:
    layout = build_dag(admin_url)
    assert layout["epoch"] == 2 and layout["nextSegmentId"] == 7
    assert cli_json(admin_url, "get", TOPIC) == layout
    assert cli_json(admin_url, "list", "public/default") == [TOPIC]
    table = cli(admin_url, "get", TOPIC)
    assert "6" in table and "6000-bfff" in table and "SEALED" in table
    err = runner.invoke(
        app, ["admin", "--admin-url", admin_url, "scalable", "merge", TOPIC, "0", "3"]
    )
    assert err.exit_code == 1 and "HTTP 4" in err.stderr
    assert cli_json(admin_url, "get", TOPIC) == layout  # unchanged
    assert cli_json(admin_url, "subscriptions", TOPIC, "--create", "billing") == ["billing"]
    stats = cli_json(admin_url, "stats", TOPIC)
    assert stats["segments"]["6"]["backlog"] == {"billing": 0}
    assert "6000-bfff" in cli(admin_url, "stats", TOPIC)
    assert cli_json(admin_url, "subscriptions", TOPIC, "--delete", "billing") == []
    cli(admin_url, "delete", TOPIC)
    assert cli_json(admin_url, "list", "public/default") == []
    cli(admin_url, "get", TOPIC, code=1)


def test_dag_tree_shows_every_segment(admin_url: str) -> None:
    layout = build_dag(admin_url)
    out = runner.invoke(
        app, ["admin", "--admin-url", admin_url, "scalable", "dag", TOPIC], terminal_width=200
    ).stdout
    assert TOPIC in out
    for segment in layout["segments"].values():
        start, end = segment["hashRange"]["start"], segment["hashRange"]["end"]
        assert re.search(rf"\b{segment['segmentId']} {start:04x}-{end:04x} {segment['state']}", out)
    assert "sealed@1" in out and "created@2" in out
    assert out.count("6 6000-bfff ACTIVE") == 2  # under both merge parents
    assert "see above" in out


def test_dag_dot_has_one_edge_per_link(admin_url: str) -> None:
    layout = build_dag(admin_url)
    out = cli(admin_url, "dag", TOPIC, "--format", "dot")
    assert out.startswith("digraph") and out.rstrip().endswith("}")
    edges = re.findall(r'"(\d+)" -> "(\d+)";', out)
    expected = sorted(
        (str(parent), str(s["segmentId"]))
        for s in layout["segments"].values()
        for parent in s["parentIds"]
    )
    assert sorted(edges) == expected
    assert len(edges) == 4  # 1->4, 1->5, 5->6, 2->6
    for segment in layout["segments"].values():
        assert f'"{segment["segmentId"]}" [label=' in out
