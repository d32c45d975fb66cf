"""``anabranch admin topics compact|compaction-status`` and the compaction-threshold
commands against a broker running in a thread."""

from __future__ import annotations

from tests.admin.test_cli import admin_url, cli, cli_json

__all__ = ["admin_url"]  # the fixture, imported for pytest

NS = "public/default"
TOPIC = "persistent://public/default/prices"


def test_threshold_commands(admin_url: str) -> None:
    assert cli_json(admin_url, "namespaces", "get-compaction-threshold", NS) is None
    cli(admin_url, "namespaces", "set-compaction-threshold", NS, "--threshold", "10M")
    assert cli_json(admin_url, "namespaces", "get-compaction-threshold", NS) == 10 * 1024**2
    cli(admin_url, "namespaces", "remove-compaction-threshold", NS)
    assert cli_json(admin_url, "namespaces", "get-compaction-threshold", NS) is None
    cli(admin_url, "namespaces", "set-compaction-threshold", NS, "--threshold", "-1", code=2)


def test_compact_and_status(admin_url: str) -> None:
    cli(admin_url, "topics", "create", TOPIC)
    assert cli_json(admin_url, "topics", "compaction-status", TOPIC)["status"] == "NOT_RUN"
    cli(admin_url, "topics", "set-compaction-threshold", TOPIC, "--threshold", "1k")
    assert cli_json(admin_url, "topics", "get-compaction-threshold", TOPIC) == 1024
    cli(admin_url, "topics", "compact", TOPIC)
    status = cli_json(admin_url, "topics", "compaction-status", TOPIC, "--wait")
    assert status == {"status": "SUCCESS", "lastError": ""}
    cli(admin_url, "topics", "compaction-status", "persistent://public/default/nope", code=1)
