"""``anabranch admin topics offload|offload-status`` and the namespaces' offload settings.

As pulsar-admin: ``topics offload`` takes a size threshold (``-s 10M``: keep that much in
the hot tier, offload the sealed ledgers before it) or a message id (``-m ledger:entry``:
offload the sealed ledgers before it); ``offload-status`` prints the last offload's
status. ``namespaces set-offload-threshold``, ``set-offload-threshold-seconds`` and
``set-offload-deletion-lag`` set the namespace policies the broker's offloader applies.

Example:
    $ anabranch admin topics offload persistent://acme/orders/in -m 12:0
    $ anabranch admin topics offload-status acme/orders/in --output json
    $ anabranch admin namespaces set-offload-threshold acme/orders --size 1G
    $ anabranch admin namespaces set-offload-deletion-lag acme/orders --lag 10m
"""

from __future__ import annotations

from typing import Annotated

import typer

from anabranch.admin.client import AdminClient
from anabranch.cli.admin import (
    OutputOpt,
    _message_id,
    _run,
    namespaces_app,
    parse_size,
    parse_time_s,
    topics_app,
)

MessageOpt = Annotated[
    str | None,
    typer.Option("--message-id", "-m", help="<ledger>:<entry>: offload the ledgers before it"),
]
SizeOpt = Annotated[
    str | None,
    typer.Option("--size-threshold", "-s", help="keep this much hot (e.g. 10M), offload older"),
]


async def _before_threshold(client: AdminClient, topic: str, threshold: int) -> tuple[int, int]:
    """The first message of the newest ledgers that together hold ``threshold`` bytes
    (pulsar-admin computes it from internal stats the same way)."""
    stats = await client.internal_stats(topic)
    ledgers = list(stats.get("ledgers") or [])
    kept = 0
    for info in reversed(ledgers):
        kept += int(info.get("size", 0))
        if kept > threshold:
            return (int(info["ledgerId"]) + 1, 0)
    return (int(ledgers[0]["ledgerId"]) if ledgers else 0, 0)


@topics_app.command("offload")
def topics_offload(
    topic: str, message_id: MessageOpt = None, size: SizeOpt = None, output: OutputOpt = None
) -> None:
    """Offload a topic's sealed ledgers to the object store (tiered storage)."""
    if (message_id is None) == (size is None):
        raise typer.BadParameter("give exactly one of --message-id and --size-threshold")

    async def call(client: AdminClient) -> None:
        if message_id is not None:
            before = _message_id(message_id)
        else:
            assert size is not None
            before = await _before_threshold(client, topic, parse_size(size))
        await client.offload(topic, before)

    _run(call, output, f"offload of {topic} started")


@topics_app.command("offload-status")
def topics_offload_status(topic: str, output: OutputOpt = None) -> None:
    """The status of a topic's last offload (NOT_RUN, RUNNING, SUCCESS, ERROR)."""
    _run(lambda c: c.offload_status(topic), output, f"offload status of {topic}")


@namespaces_app.command("set-offload-threshold")
def namespaces_set_offload_threshold(
    namespace: str,
    size: Annotated[str, typer.Option("--size", "-s", help="e.g. 10M, 1G; 0 at once; -1 off")],
    output: OutputOpt = None,
) -> None:
    """Offload sealed ledgers once the hot tier holds more than this."""
    value = parse_size(size)
    _run(lambda c: c.set_offload_value(namespace, "offloadThreshold", value), output,
         f"offload threshold of {namespace} set")  # fmt: skip


@namespaces_app.command("get-offload-threshold")
def namespaces_get_offload_threshold(namespace: str, output: OutputOpt = None) -> None:
    """The offload threshold in bytes (-1: disabled)."""
    _run(lambda c: c.get_offload_value(namespace, "offloadThreshold"), output,
         f"offload threshold of {namespace}")  # fmt: skip


@namespaces_app.command("set-offload-threshold-seconds")
def namespaces_set_offload_threshold_s(
    namespace: str,
    time: Annotated[str, typer.Option("--time", "-t", help="e.g. 30m, 2h; -1 off")],
    output: OutputOpt = None,
) -> None:
    """Offload sealed ledgers closed longer ago than this."""
    value = parse_time_s(time)
    _run(lambda c: c.set_offload_value(namespace, "offloadThresholdInSeconds", value), output,
         f"offload time threshold of {namespace} set")  # fmt: skip


@namespaces_app.command("get-offload-threshold-seconds")
def namespaces_get_offload_threshold_s(namespace: str, output: OutputOpt = None) -> None:
    """The offload time threshold in seconds (-1: disabled)."""
    _run(lambda c: c.get_offload_value(namespace, "offloadThresholdInSeconds"), output,
         f"offload time threshold of {namespace}")  # fmt: skip


@namespaces_app.command("set-offload-deletion-lag")
def namespaces_set_offload_deletion_lag(
    namespace: str,
    lag: Annotated[str, typer.Option("--lag", "-l", help="e.g. 10m, 4h; -1 keeps hot copies")],
    output: OutputOpt = None,
) -> None:
    """How long an offloaded ledger's hot copy stays."""
    seconds = parse_time_s(lag)
    value = -1 if seconds == -1 else seconds * 1000
    _run(lambda c: c.set_offload_value(namespace, "offloadDeletionLagMs", value), output,
         f"offload deletion lag of {namespace} set")  # fmt: skip


@namespaces_app.command("get-offload-deletion-lag")
def namespaces_get_offload_deletion_lag(namespace: str, output: OutputOpt = None) -> None:
    """The offload deletion lag in ms (None: the broker's default)."""
    _run(lambda c: c.get_offload_value(namespace, "offloadDeletionLagMs"), output,
         f"offload deletion lag of {namespace}")  # fmt: skip


@namespaces_app.command("clear-offload-deletion-lag")
def namespaces_clear_offload_deletion_lag(namespace: str, output: OutputOpt = None) -> None:
    """Back to the broker's default deletion lag."""
    _run(lambda c: c.remove_offload_value(namespace, "offloadDeletionLagMs"), output,
         f"offload deletion lag of {namespace} cleared")  # fmt: skip
