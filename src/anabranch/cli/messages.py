"""``anabranch produce`` and ``anabranch consume``: quick tries from a terminal.

Example:
    $ anabranch produce public/default/orders -m hello -m world --key order-42
    $ anabranch consume public/default/orders -s tryout --count 2 --initial-position earliest
    $ anabranch consume topic://public/default/orders -s billing --count 10
"""

from __future__ import annotations

import json
import os
import sys
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape

from anabranch.client.message import Message
from anabranch.client.sync import Client, Consumer, QueueConsumer, StreamConsumer
from anabranch.errors import AnabranchError, InvalidArgument

SERVICE_URL = "pulsar://127.0.0.1:6650"
console = Console(stderr=True)
"""Where the commands report; names and reasons go through ``escape`` (a ``[/x]`` in them
would be read as rich markup: a MarkupError traceback)."""


def produce(
    topic: Annotated[str, typer.Argument(help="Topic, e.g. public/default/orders.")],
    *,
    message: Annotated[
        list[str] | None, typer.Option("--message", "-m", help="Message text (repeatable).")
    ] = None,
    key: Annotated[str | None, typer.Option(help="Message key.")] = None,
    repeat: Annotated[int, typer.Option(min=1, help="Send each message this many times.")] = 1,
    service_url: Annotated[str, typer.Option(help="Broker URL.")] = SERVICE_URL,
    auth_token: Annotated[
        str | None, typer.Option(envvar="ANABRANCH_AUTH_TOKEN", help="JWT for token auth.")
    ] = None,
    tls_trust_certs: Annotated[
        str | None,
        typer.Option(envvar="ANABRANCH_TLS_TRUST_CERTS", help="CA bundle (pulsar+ssl://)."),
    ] = None,
) -> None:
    """Send messages given with -m, or one per line of standard input."""
    from anabranch import Client

    bodies = message if message else [line.rstrip("\n") for line in sys.stdin]
    try:
        with Client(
            service_url, auth_token=auth_token, tls_trust_certs_file_path=tls_trust_certs
        ) as client:
            producer = client.create_producer(topic)
            for _ in range(repeat):
                for body in bodies:
                    producer.send(body.encode("utf-8"), key=key)
            producer.flush()
    except AnabranchError as err:
        console.print(f"[red]error:[/] {escape(str(err))}")
        raise typer.Exit(1) from err
    console.print(f"sent {len(bodies) * repeat} message(s) to {escape(topic)}")


def consume(  # noqa: PLR0917 (typer passes options by keyword)
    topic: Annotated[str, typer.Argument(help="Topic, e.g. public/default/orders.")],
    subscription: Annotated[str, typer.Option("--subscription", "-s")] = "anabranch-cli",
    count: Annotated[int, typer.Option(help="Stop after this many messages (0: forever).")] = 1,
    subscription_type: Annotated[
        str,
        typer.Option(
            "--type",
            help="exclusive|shared|failover|key_shared; on topic:// names stream|queue"
            " (exclusive/failover read as stream, shared as queue).",
        ),
    ] = "exclusive",
    initial_position: Annotated[str, typer.Option(help="earliest|latest.")] = "latest",
    timeout: Annotated[float, typer.Option(help="Give up after this many idle seconds.")] = 0,
    output: Annotated[str, typer.Option(help="text|json")] = "text",
    service_url: Annotated[str, typer.Option(help="Broker URL.")] = SERVICE_URL,
    auth_token: Annotated[
        str | None, typer.Option(envvar="ANABRANCH_AUTH_TOKEN", help="JWT for token auth.")
    ] = None,
    tls_trust_certs: Annotated[
        str | None,
        typer.Option(envvar="ANABRANCH_TLS_TRUST_CERTS", help="CA bundle (pulsar+ssl://)."),
    ] = None,
) -> None:
    """Receive and acknowledge messages, printing each one."""
    received = 0
    try:
        with Client(
            service_url, auth_token=auth_token, tls_trust_certs_file_path=tls_trust_certs
        ) as client:
            consumer = _subscribe(client, topic, subscription, subscription_type, initial_position)
            while count == 0 or received < count:
                msg = consumer.receive(timeout=timeout or None)
                if msg is None:
                    break
                _print(msg, output)
                if isinstance(consumer, StreamConsumer):
                    consumer.acknowledge_cumulative(msg)
                else:
                    consumer.acknowledge(msg)
                received += 1
    except AnabranchError as err:
        console.print(f"[red]error:[/] {escape(str(err))}")
        raise typer.Exit(1) from err
    if count and received < count:
        console.print(f"timed out after {received} message(s)")
        raise typer.Exit(3)


def _subscribe(
    client: Client, topic: str, subscription: str, subscription_type: str, initial_position: str
) -> Consumer | StreamConsumer | QueueConsumer:
    """A consumer of ``topic``: scalable topics get a stream or queue consumer."""
    if not topic.startswith("topic://"):
        return client.subscribe(
            topic,
            subscription,
            subscription_type=subscription_type,
            initial_position=initial_position,
        )
    kind = subscription_type.lower()
    if kind in ("stream", "exclusive", "failover"):
        # A stream subscription starts at the earliest message of every segment.
        return client.subscribe_stream(topic, subscription, consumer_name=f"cli-{os.getpid()}")
    if kind in ("queue", "shared"):
        return client.subscribe_queue(topic, subscription, initial_position=initial_position)
    raise InvalidArgument(f"--type {subscription_type!r} does not apply to scalable topics")


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
