"""The official ``pulsar-client`` against schema compatibility: a namespace strategy decides
which evolutions producers and consumers may bring (IncompatibleSchema otherwise, as
against Pulsar); the schema admin endpoints and CLI see the same registry; deleting a
topic deletes its schemas; ``persistent://`` and ``topic://`` keep separate histories."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pulsar
import pytest
from pulsar.schema import Integer, JsonSchema, Record, String
from typer.testing import CliRunner

from anabranch.admin.client import AdminClient, AdminHttpError
from anabranch.cli.main import app
from anabranch.testing.broker import InProcessBroker

TOPIC = "persistent://public/default/official-users"


def user_v1() -> type[Record]:
    class User(Record):  # type: ignore[misc]
        name = String()

    return User


def user_v2() -> type[Record]:  # a field with a default: BACKWARD compatible
    class User(Record):  # type: ignore[misc]
        name = String()
        age = Integer(required_default=True)

    return User


def user_v3() -> type[Record]:  # a required field without a default: not BACKWARD
    class User(Record):  # type: ignore[misc]
        name = String()
        zip = String(required=True)

    return User


def create(url: str, record: type[Record], *, consumer: bool = False) -> str:
    """Create a producer (or subscribe) with ``record``'s JSON schema; the outcome."""
    client = pulsar.Client(url, operation_timeout_seconds=30)
    try:
        if consumer:
            client.subscribe(TOPIC, "readers", schema=JsonSchema(record)).close()
        else:
            producer = client.create_producer(TOPIC, schema=JsonSchema(record))
            producer.send(record(name="ada", **({"age": 36} if "age" in record._fields else {})))
            producer.close()
    except Exception as err:
        return type(err).__name__
    finally:
        client.close()
    return "ok"


def cli(url: str, *args: str) -> Any:
    result = CliRunner().invoke(app, ["admin", "--admin-url", url, *args, "--output", "json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.output) if result.output.strip() else None


async def test_official_clients_follow_the_namespace_strategy(tmp_path: Path) -> None:
    async with InProcessBroker(tmp_path) as broker:
        assert broker.http_url is not None
        url = broker.service_url
        async with AdminClient(broker.http_url) as admin:
            await admin.set_schema_compatibility_strategy("public/default", "BACKWARD")
            assert await admin.get_schema_compatibility_strategy("public/default") == "BACKWARD"
            assert await asyncio.to_thread(create, url, user_v1()) == "ok"
            assert await asyncio.to_thread(create, url, user_v2()) == "ok"
            assert await asyncio.to_thread(create, url, user_v3()) == "IncompatibleSchema"
            assert await asyncio.to_thread(create, url, user_v3(), consumer=True) == (
                "IncompatibleSchema"
            )
            assert await asyncio.to_thread(create, url, user_v1(), consumer=True) == "ok"
            versions = await admin.get_all_schemas(TOPIC)
            assert [(v["version"], v["type"]) for v in versions] == [(0, "JSON"), (1, "JSON")]
            assert "age" in versions[1]["data"]
            v3 = JsonSchema(user_v3()).schema_info().schema()
            answer = await admin.test_schema_compatibility(TOPIC, "JSON", v3)
            assert answer == {"isCompatibility": False, "schemaCompatibilityStrategy": "BACKWARD"}
            # A topic override wins over the namespace's strategy.
            await admin.set_schema_compatibility_strategy(TOPIC, "FORWARD")
            assert (await admin.test_schema_compatibility(TOPIC, "JSON", v3))["isCompatibility"]
            assert await asyncio.to_thread(create, url, user_v3()) == "ok"
            await admin.remove_schema_compatibility_strategy(TOPIC)
            await admin.delete_topic(TOPIC, force=True)
            with pytest.raises(AdminHttpError) as gone:
                await admin.get_schema(TOPIC)
            assert gone.value.status == 404


async def test_schema_admin_endpoints_and_cli(tmp_path: Path) -> None:
    async with InProcessBroker(tmp_path) as broker:
        assert broker.http_url is not None
        http = broker.http_url
        definition = json.dumps({"type": "record", "name": "U", "fields": []})
        payload = tmp_path / "u.json"
        payload.write_text(json.dumps({"type": "AVRO", "schema": definition}))
        assert (
            await asyncio.to_thread(cli, http, "schemas", "upload", TOPIC, "-f", str(payload)) == 0
        )
        scalable = "topic://public/default/official-users"
        got = await asyncio.to_thread(cli, http, "schemas", "get", TOPIC)
        assert (got["version"], got["type"], got["data"]) == (0, "AVRO", definition)
        async with AdminClient(http) as admin:
            with pytest.raises(AdminHttpError) as apart:  # topic:// has its own history
                await admin.get_schema(scalable)
            assert apart.value.status == 404
            assert await admin.upload_schema(scalable, "STRING") == 0
            with pytest.raises(AdminHttpError) as refused:
                await admin.upload_schema(TOPIC, "STRING")  # FULL: no type change
            assert refused.value.status == 409 and "AVRO" in refused.value.reason
            with pytest.raises(AdminHttpError) as bad:
                await admin.upload_schema(TOPIC, "NOPE")
            assert bad.value.status == 400 and "unknown schema type" in bad.value.reason
        assert await asyncio.to_thread(cli, http, "schemas", "delete", TOPIC) == 1
        ns_cli = ("namespaces", "set-schema-compatibility-strategy", "public/default")
        await asyncio.to_thread(cli, http, *ns_cli, "-c", "always_compatible")
        strategy = ("namespaces", "get-schema-compatibility-strategy", "public/default")
        assert await asyncio.to_thread(cli, http, *strategy) == "ALWAYS_COMPATIBLE"
