"""``anabranch admin topics peek-messages|examine-message|get-message-by-id|expire-messages``.

As pulsar-admin. Payloads print as text when they are UTF-8, else as ``payloadBase64``.

Example:
    $ anabranch admin topics peek-messages public/default/orders -s billing -n 3
    $ anabranch admin topics examine-message public/default/orders -i earliest -m 1
    $ anabranch admin topics get-message-by-id public/default/orders -l 0 -e 12
    $ anabranch admin topics expire-messages public/default/orders -s billing -t 1h
"""

from __future__ import annotations

import base64
from typing import Annotated, Any

import typer

from anabranch.cli.admin import OutputOpt, _run, parse_time_s, topics_app

SubOpt = Annotated[str, typer.Option("--subscription", "-s", help="Subscription name.")]


def printable(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages with their payload as text (UTF-8) or base64, for printing.

    Example:
        >>> printable([{"messageId": "0:1", "payload": b"hi"}, {"payload": b"\\xff"}])
        [{'messageId': '0:1', 'payload': 'hi'}, {'payloadBase64': '/w=='}]
    """
    out = []
    for message in messages:
        shown = {k: v for k, v in message.items() if k != "payload"}
        payload: bytes = message["payload"]
        try:
            shown["payload"] = payload.decode("utf-8")
        except UnicodeDecodeError:
            shown["payloadBase64"] = base64.b64encode(payload).decode()
        out.append(shown)
    return out


@topics_app.command("peek-messages")
def peek_messages(
    topic: str,
    subscription: SubOpt,
    count: Annotated[int, typer.Option("--count", "-n", min=1, max=1000)] = 1,
    output: OutputOpt = None,
) -> None:
    """The first messages of a subscription's backlog (they stay unacknowledged)."""

    async def call(c: Any) -> Any:
        return printable(await c.peek_messages(topic, subscription, count))

    _run(call, output, f"backlog of {topic}/{subscription}")


@topics_app.command("examine-message")
def examine_message(
    topic: str,
    initial_position: Annotated[
        str, typer.Option("--initialPosition", "-i", help="earliest or latest")
    ] = "latest",
    message_position: Annotated[int, typer.Option("--messagePosition", "-m", min=1)] = 1,
    output: OutputOpt = None,
) -> None:
    """The N-th message from the earliest or the latest one."""

    async def call(c: Any) -> Any:
        return printable(await c.examine_message(topic, initial_position, message_position))

    _run(call, output, f"message of {topic}")


@topics_app.command("get-message-by-id")
def get_message_by_id(
    topic: str,
    ledger_id: Annotated[int, typer.Option("--ledgerId", "-l")],
    entry_id: Annotated[int, typer.Option("--entryId", "-e")],
    output: OutputOpt = None,
) -> None:
    """The message at ledgerId:entryId."""

    async def call(c: Any) -> Any:
        return printable(await c.get_message_by_id(topic, ledger_id, entry_id))

    _run(call, output, f"message {ledger_id}:{entry_id} of {topic}")


ExpireOpt = Annotated[str, typer.Option("--expireTime", "-t", help="e.g. 3600, 1h, 2d")]


@topics_app.command("expire-messages")
def expire_messages(
    topic: str, subscription: SubOpt, expire_time: ExpireOpt, output: OutputOpt = None
) -> None:
    """Acknowledge a subscription's messages older than the given time."""
    seconds = parse_time_s(expire_time)
    _run(lambda c: c.expire_messages(topic, subscription, seconds), output,
         f"messages of {topic}/{subscription} older than {expire_time} expired")  # fmt: skip


@topics_app.command("expire-messages-all-subscriptions")
def expire_messages_all(topic: str, expire_time: ExpireOpt, output: OutputOpt = None) -> None:
    """Expire messages older than the given time on every subscription."""
    seconds = parse_time_s(expire_time)
    _run(lambda c: c.expire_messages_all_subscriptions(topic, seconds), output,
         f"messages of {topic} older than {expire_time} expired")  # fmt: skip
