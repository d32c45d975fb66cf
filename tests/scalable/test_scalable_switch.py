"""The ``scalable_topic_enabled`` switch (PIP-460 "Configuration": ``scalableTopicEnabled``)
of the broker and of a namespace, through the wire, REST and the CLI, and what a legacy
(v4) client — the official ``pulsar-client`` — sees for a ``topic://`` name."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pulsar
import pytest
from typer.testing import CliRunner

from anabranch.admin.client import AdminClient, AdminHttpError
from anabranch.aio import Client
from anabranch.cli.main import app
from anabranch.errors import NotAllowed
from anabranch.testing.broker import InProcessBroker

TOPIC = "topic://public/default/switched"
HANG_GUARD_S = 30.0


async def test_a_broker_with_scalable_topics_off_refuses_topic_names(tmp_path: Path) -> None:
    async with (
        InProcessBroker(tmp_path, ledgers="memory", scalable_topic_enabled=False) as broker,
        Client(broker.service_url) as client,
    ):
        assert broker.http_url is not None
        async with AdminClient(broker.http_url) as admin:
            with pytest.raises(AdminHttpError) as refused:
                await admin.create_scalable_topic(TOPIC, 1)
            assert refused.value.status == 405
            assert "scalable topics are disabled for this broker" in refused.value.reason
            with pytest.raises(NotAllowed, match="scalable topics are disabled"):
                await asyncio.wait_for(client.create_producer(TOPIC), HANG_GUARD_S)
            with pytest.raises(NotAllowed, match="scalable topics are disabled"):
                await asyncio.wait_for(client.subscribe_stream(TOPIC, "s"), HANG_GUARD_S)
            assert await admin.get_scalable_topic_enabled("public/default") is False
            # A namespace can switch them on where the broker has them off.
            await admin.set_scalable_topic_enabled("public/default", True)
            await admin.create_scalable_topic(TOPIC, 1)
            producer = await client.create_producer(TOPIC)
            assert (await producer.send(b"x", key="k")).segment_id == 0
            await producer.close()


async def test_a_namespace_policy_switches_scalable_topics_off(tmp_path: Path) -> None:
    async with (
        InProcessBroker(tmp_path, ledgers="memory") as broker,
        Client(broker.service_url) as client,
    ):
        assert broker.http_url is not None
        async with AdminClient(broker.http_url) as admin:
            await admin.create_scalable_topic(TOPIC, 1)
            assert await admin.get_scalable_topic_enabled("public/default") is True
            await admin.set_scalable_topic_enabled("public/default", False)
            policies = await admin.request("GET", "/admin/v2/namespaces/public/default")
            assert policies["scalableTopicEnabled"] is False
            with pytest.raises(AdminHttpError, match="namespace public/default"):
                await admin.get_scalable_topic(TOPIC)  # an existing one: looked up, refused
            with pytest.raises(NotAllowed, match="disabled for namespace public/default"):
                await asyncio.wait_for(client.create_producer(TOPIC), HANG_GUARD_S)
            await admin.set_scalable_topic_enabled("public/default", None)
            assert await admin.get_scalable_topic_enabled("public/default") is True
            assert (await admin.get_scalable_topic(TOPIC))["epoch"] == 0


def official_client_errors(url: str) -> list[tuple[str, float]]:
    """What the official client raises for a producer, a consumer and a reader of a
    ``topic://`` name, and how long each took."""
    client = pulsar.Client(url, operation_timeout_seconds=20)
    out = []
    try:
        attempts: tuple[Callable[[], object], ...] = (
            lambda: client.create_producer(TOPIC),
            lambda: client.subscribe(TOPIC, "s"),
            lambda: client.create_reader(TOPIC, pulsar.MessageId.earliest),
        )
        for attempt in attempts:
            started = time.monotonic()
            try:
                attempt()
                out.append(("no error", time.monotonic() - started))
            except Exception as err:
                out.append((type(err).__name__, time.monotonic() - started))
    finally:
        client.close()
    return out


async def test_the_official_client_fails_fast_on_a_topic_name(tmp_path: Path) -> None:
    """The v4 client's own name parser knows only persistent:// and non-persistent://: it
    raises InvalidTopicName before sending anything, far from its operation timeout."""
    async with InProcessBroker(tmp_path, ledgers="memory") as broker:
        await broker.service.scalable.create(TOPIC, 1)
        errors = await asyncio.to_thread(official_client_errors, broker.service_url)
    assert [name for name, _ in errors] == ["InvalidTopicName"] * 3
    assert all(took < 5.0 for _, took in errors), errors  # a refusal, not the 20 s timeout


# --- CLI -------------------------------------------------------------------------------------


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


def test_the_cli_switches_a_namespace(admin_url: str) -> None:
    runner = CliRunner()

    def cli(*args: str, code: int = 0) -> str:
        result = runner.invoke(app, ["admin", "--admin-url", admin_url, *args])
        assert result.exit_code == code, (result.stdout, result.stderr)
        return result.stdout

    ns = "public/default"
    cli("namespaces", "set-scalable-topics", ns, "--disable")
    assert cli("namespaces", "get-scalable-topics", ns, "--output", "json").strip() == "false"
    cli("scalable", "create", TOPIC, code=1)
    cli("namespaces", "set-scalable-topics", ns, "--remove")
    assert cli("namespaces", "get-scalable-topics", ns, "--output", "json").strip() == "true"
    cli("scalable", "create", TOPIC)


def test_the_cli_shows_assignments(tmp_path: Path) -> None:
    """``scalable stats``: the consumers of a Key_Shared stream subscription sharing
    segment 0, in JSON and in the table."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    broker = InProcessBroker(tmp_path, ledgers="memory")

    def run(coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, loop).result(HANG_GUARD_S)

    run(broker.__aenter__())
    client = Client(broker.service_url)
    try:
        assert broker.http_url is not None
        run(client.__aenter__())
        run(broker.service.scalable.create(TOPIC, 1))
        for name in ("w1", "w2"):
            run(
                client.subscribe_stream(
                    TOPIC, "fan", consumer_name=name, dispatch_mode="key_shared"
                )
            )
        args = ["admin", "--admin-url", broker.http_url, "scalable", "stats", TOPIC]
        result = CliRunner().invoke(app, [*args, "--output", "json"])
        assert result.exit_code == 0, result.stderr
        state = json.loads(result.stdout)["subscriptionStates"]["fan"]
        assert state["sharedSegments"] == {"0": ["w1", "w2"]}
        table = CliRunner().invoke(app, args)
        assert table.exit_code == 0, table.stderr
        # The table may be narrower than its cells (rich fixes the width when the CLI's
        # console is built): match the row's start, which truncation keeps.
        rows = [line for line in table.stdout.splitlines() if "STREAM_KEY" in line]
        assert len(rows) == 2 and all("connected" in r and "yes" in r for r in rows), table.stdout
        assert {"w1", "w2"} <= set(table.stdout.split()), table.stdout
    finally:
        # Closed even when an assertion failed: a leaked socket fails a later test.
        run(client.__aexit__(None, None, None))
        run(broker.__aexit__(None, None, None))
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        loop.close()


def test_the_blocking_client_sends_delayed_and_acks_one_by_one(tmp_path: Path) -> None:
    """The sync facade passes ``deliver_after`` through and has ``acknowledge`` for the
    Key_Shared dispatch mode."""
    import anabranch

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    broker = InProcessBroker(tmp_path, ledgers="memory")
    try:
        asyncio.run_coroutine_threadsafe(broker.__aenter__(), loop).result(HANG_GUARD_S)
        with anabranch.Client(broker.service_url) as client:
            stream = client.subscribe_stream(TOPIC, "fan", dispatch_mode="key_shared")
            producer = client.create_producer(TOPIC)
            due = time.time() + 0.3
            producer.send(b"later", key="k", deliver_after=0.3)
            msg = stream.receive(timeout=HANG_GUARD_S)
            assert msg is not None and msg.value == b"later"
            assert time.time() >= due - 0.1  # held until due (a little clock slack)
            stream.acknowledge(msg)
            producer.close()
            stream.close()
        asyncio.run_coroutine_threadsafe(broker.__aexit__(None, None, None), loop).result()
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        loop.close()


async def test_a_permissive_v4_client_is_refused_at_once_by_the_broker(tmp_path: Path) -> None:
    """A v4 client whose name parser lets ``topic://`` through (not the official one)
    gets PRODUCER and SUBSCRIBE refused with NotAllowedError naming the reason."""
    from anabranch.client.connection import ClientConnection
    from anabranch.protocol._generated import pulsar_api_pb2 as pb

    t = pb.BaseCommand
    async with InProcessBroker(tmp_path, ledgers="memory") as broker:
        await broker.service.scalable.create(TOPIC, 1)
        host, port = broker.service_url.removeprefix("pulsar://").split(":")
        conn = ClientConnection((host, int(port)))
        await conn.open()
        try:
            producer = pb.CommandProducer(topic=TOPIC, producer_id=1)
            subscribe = pb.CommandSubscribe(
                topic=TOPIC, subscription="s", subType=pb.CommandSubscribe.Shared, consumer_id=1
            )
            for command in (
                t(type=t.PRODUCER, producer=producer),
                t(type=t.SUBSCRIBE, subscribe=subscribe),
            ):
                request_id = conn.new_request_id()
                body = command.producer if command.type == t.PRODUCER else command.subscribe
                body.request_id = request_id
                with pytest.raises(NotAllowed, match=r"scalable topic .* a v4 client cannot"):
                    await asyncio.wait_for(conn.request(command, request_id), HANG_GUARD_S)
        finally:
            await conn.close()
