"""``anabranch produce`` and ``anabranch consume``: quick tries from a terminal.

Example:
    $ anabranch produce public/default/orders -m hello -m world --key order-42
    $ anabranch consume public/default/orders -s tryout --count 2 --initial-position earliest
"""

from __future__ import annotations

import json
import sys
from typing import Annotated

import typer
from rich.console import Console

from anabranch.client.message import Message
from anabranch.errors import AnabranchError

SERVICE_URL = "pulsar://127.0.0.1:6650"
console = Console(stderr=True)


def produce(
    topic: Annotated[str, typer.Argument(help="Topic, e.g. public/default/orders.")],
    message: Annotated[
        list[str] | None, typer.Option("--message", "-m", help="Message text (repeatable).")
    ] = None,
    key: Annotated[str | None, typer.Option(help="Message key.")] = None,
    repeat: Annotated[int, typer.Option(min=1, help="Send each message this many times.")] = 1,
    service_url: Annotated[str, typer.Option(help="Broker URL.")] = SERVICE_URL,
) -> None:
    """Send messages given with -m, or one per line of standard input."""
    from anabranch import Client

    bodies = message if message else [line.rstrip("\n") for line in sys.stdin]
    try:
        with Client(service_url) as client:
            producer = client.create_producer(topic)
            for _ in range(repeat):
                for body in bodies:
                    producer.send(body.encode("utf-8"), key=key)
            producer.flush()
    except AnabranchError as err:
        console.print(f"[red]error:[/] {err}")
        raise typer.Exit(1) from err
    console.print(f"sent {len(bodies) * repeat} message(s) to {topic}")


def consume(  # noqa: PLR0917 (typer passes options by keyword)
    topic: Annotated[str, typer.Argument(help="Topic, e.g. public/default/orders.")],
    subscription: Annotated[str, typer.Option("--subscription", "-s")] = "anabranch-cli",
    count: Annotated[int, typer.Option(help="Stop after this many messages (0: forever).")] = 1,
    subscription_type: Annotated[
        str, typer.Option("--type", help="exclusive|shared|failover|key_shared.")
    ] = "exclusive",
    initial_position: Annotated[str, typer.Option(help="earliest|latest.")] = "latest",
    timeout: Annotated[float, typer.Option(help="Give up after this many idle seconds.")] = 0,
    output: Annotated[str, typer.Option(help="text|json")] = "text",
    service_url: Annotated[str, typer.Option(help="Broker URL.")] = SERVICE_URL,
) -> None:
    """Receive and acknowledge messages, printing each one."""
    from anabranch import Client

    received = 0
    try:
        with Client(service_url) as client:
            consumer = client.subscribe(
                topic,
                subscription,
                subscription_type=subscription_type,
                initial_position=initial_position,
            )
            while count == 0 or received < count:
                msg = consumer.receive(timeout=timeout or None)
                if msg is None:
                    break
                _print(msg, output)
                consumer.acknowledge(msg)
                received += 1
    except AnabranchError as err:
        console.print(f"[red]error:[/] {err}")
        raise typer.Exit(1) from err
    if count and received < count:
        console.print(f"timed out after {received} message(s)")
        raise typer.Exit(3)


def _print(msg: Message, output: str) -> None:
    value = msg.value.decode("utf-8", errors="replace")
    if output == "json":
        record = {
            "key": msg.key,
            "value": value,
            "properties": msg.properties,
            "messageId": str(msg.message_id),
            "publishTime": msg.publish_time,
            "redeliveryCount": msg.redelivery_count,
        }
        typer.echo(json.dumps(record, sort_keys=True))
    else:
        typer.echo(f"{msg.message_id} key={msg.key!r} {value}")
