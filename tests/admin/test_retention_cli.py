"""``anabranch admin namespaces`` retention, message TTL, backlog-quota, inactive-topic,
subscription-expiration and publish-rate commands (pulsar-admin's names and units) against
a broker running in a thread."""

from __future__ import annotations

from anabranch.cli.admin import parse_size, parse_time_s
from tests.admin.test_cli import admin_url, cli, cli_json

__all__ = ["admin_url"]  # the fixture, imported for pytest

NS = "public/default"


def test_size_and_time_units() -> None:
    assert parse_size("2G") == 2 * 1024**3
    assert parse_size("100") == 100
    assert parse_time_s("2d") == 2 * 86400
    assert parse_time_s("45m") == 2700


def test_retention_commands(admin_url: str) -> None:
    cli(admin_url, "namespaces", "set-retention", NS, "--size", "10G", "--time", "3h")
    assert cli_json(admin_url, "namespaces", "get-retention", NS) == {
        "retentionTimeInMinutes": 180,
        "retentionSizeInMB": 10 * 1024,
    }
    cli(admin_url, "namespaces", "set-retention", NS, "--size", "-1", "--time", "-1")
    assert cli_json(admin_url, "namespaces", "get-retention", NS) == {
        "retentionTimeInMinutes": -1,
        "retentionSizeInMB": -1,
    }
    cli(admin_url, "namespaces", "remove-retention", NS)
    assert cli_json(admin_url, "namespaces", "get-retention", NS)["retentionSizeInMB"] == 0
    cli(admin_url, "namespaces", "set-retention", NS, "--size", "lots", "--time", "1h", code=2)


def test_message_ttl_commands(admin_url: str) -> None:
    cli(admin_url, "namespaces", "set-message-ttl", NS, "--messageTTL", "1h")
    assert cli_json(admin_url, "namespaces", "get-message-ttl", NS) == 3600
    cli(admin_url, "namespaces", "remove-message-ttl", NS)
    assert cli_json(admin_url, "namespaces", "get-message-ttl", NS) is None


def test_backlog_quota_commands(admin_url: str) -> None:
    cli(admin_url, "namespaces", "set-backlog-quota", NS, "--limit", "2G",
        "--policy", "producer_exception")  # fmt: skip
    cli(admin_url, "namespaces", "set-backlog-quota", NS, "--limitTime", "1h",
        "--policy", "consumer_backlog_eviction", "--type", "message_age")  # fmt: skip
    assert cli_json(admin_url, "namespaces", "get-backlog-quotas", NS) == {
        "destination_storage": {
            "limitSize": 2 * 1024**3,
            "limitTime": -1,
            "policy": "producer_exception",
        },
        "message_age": {"limitSize": -1, "limitTime": 3600, "policy": "consumer_backlog_eviction"},
    }
    cli(admin_url, "namespaces", "set-backlog-quota", NS, "--policy", "drop_everything", code=1)
    cli(admin_url, "namespaces", "remove-backlog-quota", NS, "--type", "message_age")
    assert list(cli_json(admin_url, "namespaces", "get-backlog-quotas", NS)) == [
        "destination_storage"
    ]


def test_topic_level_commands(admin_url: str) -> None:
    topic = "persistent://public/default/overridden"
    cli(admin_url, "topics", "create", topic)
    assert cli_json(admin_url, "topics", "get-retention", topic) is None
    cli(admin_url, "topics", "set-retention", topic, "-s", "1G", "-t", "1d")
    assert cli_json(admin_url, "topics", "get-retention", topic) == {
        "retentionTimeInMinutes": 1440,
        "retentionSizeInMB": 1024,
    }
    cli(admin_url, "topics", "set-message-ttl", topic, "-ttl", "90")
    assert cli_json(admin_url, "topics", "get-message-ttl", topic) == 90
    assert cli_json(admin_url, "namespaces", "get-message-ttl", NS) is None
    cli(admin_url, "topics", "set-backlog-quota", topic, "-l", "10M", "-p", "producer_exception")
    assert (
        cli_json(admin_url, "topics", "get-backlog-quotas", topic)["destination_storage"][
            "limitSize"
        ]
        == 10 * 1024**2
    )
    cli(admin_url, "topics", "remove-backlog-quota", topic)
    cli(admin_url, "topics", "remove-message-ttl", topic)
    cli(admin_url, "topics", "remove-retention", topic)
    assert cli_json(admin_url, "topics", "get-backlog-quotas", topic) == {}
    cli(admin_url, "topics", "get-retention", "persistent://public/default/absent", code=1)


def test_inactive_topic_policy_commands(admin_url: str) -> None:
    cli(admin_url, "namespaces", "set-inactive-topic-policies", NS, "-e", "-t", "1h",
        "-m", "delete_when_subscriptions_caught_up")  # fmt: skip
    assert cli_json(admin_url, "namespaces", "get-inactive-topic-policies", NS) == {
        "inactiveTopicDeleteMode": "delete_when_subscriptions_caught_up",
        "maxInactiveDurationSeconds": 3600,
        "deleteWhileInactive": True,
    }
    cli(admin_url, "namespaces", "set-inactive-topic-policies", NS, "-d", "-m", "sometimes",
        code=1)  # fmt: skip
    cli(admin_url, "namespaces", "remove-inactive-topic-policies", NS)
    assert cli_json(admin_url, "namespaces", "get-inactive-topic-policies", NS) is None


def test_subscription_expiration_commands(admin_url: str) -> None:
    cli(admin_url, "namespaces", "set-subscription-expiration-time", NS, "-t", "90")
    assert cli_json(admin_url, "namespaces", "get-subscription-expiration-time", NS) == 90
    cli(admin_url, "namespaces", "set-subscription-expiration-time", NS, "-t", "-5", code=2)
    cli(admin_url, "namespaces", "remove-subscription-expiration-time", NS)
    assert cli_json(admin_url, "namespaces", "get-subscription-expiration-time", NS) is None


def test_publish_rate_commands(admin_url: str) -> None:
    cli(admin_url, "namespaces", "set-publish-rate", NS, "-m", "500", "-b", "1048576")
    assert cli_json(admin_url, "namespaces", "get-publish-rate", NS) == {
        "publishThrottlingRateInMsg": 500,
        "publishThrottlingRateInByte": 1048576,
    }
    cli(admin_url, "namespaces", "set-publish-rate", NS, "-m", "-7", code=1)
    cli(admin_url, "namespaces", "remove-publish-rate", NS)
    assert cli_json(admin_url, "namespaces", "get-publish-rate", NS) is None


def test_dispatch_rate_commands(admin_url: str) -> None:
    topic = "persistent://public/default/dispatch-cli"
    cli(admin_url, "topics", "create", topic)
    cli(admin_url, "namespaces", "set-dispatch-rate", NS, "-md", "100", "-dt", "2")
    assert cli_json(admin_url, "namespaces", "get-dispatch-rate", NS) == {
        "dispatchThrottlingRateInMsg": 100,
        "dispatchThrottlingRateInByte": -1,
        "relativeToPublishRate": False,
        "ratePeriodInSecond": 2,
    }
    cli(admin_url, "topics", "set-subscription-dispatch-rate", topic, "-bd", "4096")
    applied = cli_json(admin_url, "topics", "get-subscription-dispatch-rate", topic, "--applied")
    assert applied["dispatchThrottlingRateInByte"] == 4096
    applied = cli_json(admin_url, "topics", "get-dispatch-rate", topic, "--applied")
    assert applied["dispatchThrottlingRateInMsg"] == 100  # the namespace's
    cli(admin_url, "namespaces", "set-dispatch-rate", NS, "-dt", "0", code=1)
    cli(admin_url, "namespaces", "remove-dispatch-rate", NS)
    assert cli_json(admin_url, "namespaces", "get-dispatch-rate", NS) is None
    cli(admin_url, "topics", "remove-subscription-dispatch-rate", topic)
    assert cli_json(admin_url, "topics", "get-subscription-dispatch-rate", topic) is None


def test_subscribe_rate_commands(admin_url: str) -> None:
    cli(admin_url, "namespaces", "set-subscribe-rate", NS, "-sr", "5", "-st", "10")
    assert cli_json(admin_url, "namespaces", "get-subscribe-rate", NS) == {
        "subscribeThrottlingRatePerConsumer": 5,
        "ratePeriodInSecond": 10,
    }
    cli(admin_url, "namespaces", "set-subscribe-rate", NS, "-sr", "5", "-st", "0", code=1)
    cli(admin_url, "namespaces", "remove-subscribe-rate", NS)
    assert cli_json(admin_url, "namespaces", "get-subscribe-rate", NS) is None
