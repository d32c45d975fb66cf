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

from anabranch.cli.admin import Output, _print
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


def _fails_cleanly(result: Any, code: int, *expected: str) -> None:
    """An ``error: ...`` line and the exit status, not a traceback."""
    assert isinstance(result.exception, SystemExit), result.exception
    assert result.exit_code == code, (result.stdout, result.stderr)
    assert result.stderr.startswith("error: "), result.stderr
    said = " ".join(result.stderr.split())  # rich wraps long lines at the terminal width
    for text in expected:
        assert text in said, result.stderr


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        (None, "cannot read schema file"),  # no such file
        ("", "cannot read schema file"),  # a directory
        ("{not json", "cannot read schema file"),
        ("[1]", "expected an object with a string 'type'"),
        ('{"type": "STRING", "properties": [1, 2]}', "'properties' must map names to strings"),
        ('{"type": "STRING", "properties": {"n": 1}}', "'properties' must map names to strings"),
    ],
)
def test_a_bad_schema_file_is_an_error_line(
    admin_url: str, tmp_path: Path, content: str | None, reason: str
) -> None:
    payload = tmp_path / "schema.json"
    if content == "":
        payload.mkdir()
    elif content is not None:
        payload.write_text(content)
    topic = "persistent://public/default/typed"
    for command in ("upload", "compatibility"):
        args = ["admin", "--admin-url", admin_url, "schemas", command, topic, "-f", str(payload)]
        _fails_cleanly(runner.invoke(app, args), 1, reason)


def test_a_schema_file_with_null_properties_is_uploaded(admin_url: str, tmp_path: Path) -> None:
    payload = tmp_path / "schema.json"
    payload.write_text('{"type": "STRING", "schema": "", "properties": null}')
    topic = "persistent://public/default/typed"
    assert cli_json(admin_url, "schemas", "upload", topic, "-f", str(payload)) == 0


def test_an_unusable_token_is_an_error_line(tmp_path: Path) -> None:
    # Refused before any request: no broker needed, and none is reported unreachable.
    dead = f"http://127.0.0.1:{free_port()}"
    crlf = tmp_path / "crlf.jwt"
    crlf.write_text("abc\r\ndef\n")
    cases = [
        (["--auth-token", "a\nb"], "--auth-token contains a control character"),
        (["--auth-token-file", str(crlf)], f"token file {crlf} contains a control character"),
        (["--auth-token-file", str(tmp_path / "none.jwt")], "cannot read token file"),
        (["--auth-token-file", str(tmp_path)], "cannot read token file"),
    ]
    for options, reason in cases:
        result = runner.invoke(app, ["admin", "--admin-url", dead, *options, "tenants", "list"])
        _fails_cleanly(result, 1, reason)
    empty = tmp_path / "empty.jwt"
    empty.write_text("\n")
    result = runner.invoke(app, ["admin", "--admin-url", dead, "--auth-token-file", str(empty),
                                 "tenants", "list"])  # fmt: skip
    _fails_cleanly(result, 1, "is empty")


def test_a_scalable_name_on_a_topics_command_points_to_scalable(admin_url: str) -> None:
    args = ["admin", "--admin-url", admin_url, "topics", "stats", "topic://public/default/s"]
    _fails_cleanly(runner.invoke(app, args), 1, "HTTP 404", "anabranch admin scalable")
    # Any other 404 is reported as it was.
    result = runner.invoke(app, ["admin", "--admin-url", admin_url, "tenants", "get", "nobody"])
    _fails_cleanly(result, 1, "HTTP 404")
    assert "scalable" not in result.stderr


def test_text_that_looks_like_markup_is_printed_as_given(
    admin_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # rich reads "[/x]" as a closing tag: unescaped, it was a MarkupError traceback.
    result = runner.invoke(app, ["admin", "--admin-url", admin_url, "tenants", "get", "a[/x]"])
    _fails_cleanly(result, 1, "a[/x]")
    # Answers quote message payloads (peek-messages) and names: tables print them verbatim.
    _print([{"payload": "[/x] [bold]b[/bold]"}], Output.table, "backlog of [/t]")
    _print({"payload": "[/x]"}, Output.table, "message")
    _print(None, Output.table, "ok [/y]")
    printed = capsys.readouterr().out
    for text in ("[/x] [bold]b[/bold]", "backlog of [/t]", "ok [/y]"):
        assert text in printed, printed
