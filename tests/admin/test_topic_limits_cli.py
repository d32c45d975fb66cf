"""``anabranch admin namespaces|topics`` per-topic cap commands (pulsar-admin's names)
against a broker running in a thread."""

from __future__ import annotations

from tests.admin.test_cli import admin_url, cli, cli_json

__all__ = ["admin_url"]  # the fixture, imported for pytest

NS = "public/default"
TOPIC = "persistent://public/default/cap-cli"


def test_namespace_cap_commands(admin_url: str) -> None:
    cli(admin_url, "namespaces", "set-max-producers-per-topic", NS, "-p", "3")
    cli(admin_url, "namespaces", "set-max-subscriptions-per-topic", NS,
        "--max-subscriptions-per-topic", "7")  # fmt: skip
    assert cli_json(admin_url, "namespaces", "get-max-producers-per-topic", NS) == 3
    assert cli_json(admin_url, "namespaces", "get-max-subscriptions-per-topic", NS) == 7
    assert cli_json(admin_url, "namespaces", "get-max-consumers-per-topic", NS) is None
    cli(admin_url, "namespaces", "remove-max-producers-per-topic", NS)
    assert cli_json(admin_url, "namespaces", "get-max-producers-per-topic", NS) is None
    cli(admin_url, "namespaces", "set-max-consumers-per-topic", NS, "-c", "-1", code=2)
    cli(admin_url, "namespaces", "set-max-unacked-messages-per-consumer", NS, "-c", "9")
    assert cli_json(admin_url, "namespaces", "get-max-unacked-messages-per-consumer", NS) == 9
    cli(admin_url, "namespaces", "remove-max-unacked-messages-per-consumer", NS)
    assert cli_json(admin_url, "namespaces", "get-max-unacked-messages-per-consumer", NS) is None


def test_topic_cap_commands_and_the_applied_value(admin_url: str) -> None:
    cli(admin_url, "topics", "create", TOPIC)
    cli(admin_url, "namespaces", "set-max-consumers-per-subscription", NS, "-c", "4")
    assert cli_json(admin_url, "topics", "get-max-consumers-per-subscription", TOPIC) is None
    applied = ("topics", "get-max-consumers-per-subscription", TOPIC, "--applied")
    assert cli_json(admin_url, *applied) == 4
    cli(admin_url, "topics", "set-max-consumers-per-subscription", TOPIC, "-c", "2")
    assert cli_json(admin_url, *applied) == 2
    cli(admin_url, "topics", "set-max-producers", TOPIC, "--max-producers", "1")
    assert cli_json(admin_url, "topics", "get-max-producers", TOPIC) == 1
    cli(admin_url, "topics", "remove-max-consumers-per-subscription", TOPIC)
    assert cli_json(admin_url, *applied) == 4
    on_sub = ("topics", "get-max-unacked-messages-on-subscription", TOPIC, "--applied")
    assert cli_json(admin_url, *on_sub) == 200_000  # the broker's default
    cli(admin_url, "topics", "set-max-unacked-messages-on-subscription", TOPIC, "-m", "7")
    assert cli_json(admin_url, *on_sub) == 7
