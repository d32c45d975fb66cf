"""``anabranch admin schemas ...`` and the schema compatibility strategy commands.

As pulsar-admin: ``schemas upload|compatibility`` read a JSON file
``{"type": "AVRO", "schema": "<definition>", "properties": {}}``; a ``topic://`` name
addresses a scalable topic's history, anything else a persistent one.

Example:
    $ anabranch admin schemas get persistent://public/default/users --version 0
    $ anabranch admin schemas upload public/default/users --filename user-v2.json
    $ anabranch admin namespaces set-schema-compatibility-strategy public/default -c BACKWARD
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Annotated, Any

import typer

from anabranch.admin.client import AdminClient
from anabranch.cli.admin import OutputOpt, Target, _run, admin_app, namespaces_app, topics_app
from anabranch.errors import InvalidArgument

schemas_app = typer.Typer(no_args_is_help=True, help="Topic schemas and their versions.")
admin_app.add_typer(schemas_app, name="schemas")

FileOpt = Annotated[
    Path, typer.Option("--filename", "-f", help='JSON: {"type", "schema", "properties"}')
]
StrategyOpt = Annotated[
    str,
    typer.Option(
        "--compatibility", "-c",
        help="ALWAYS_INCOMPATIBLE, ALWAYS_COMPATIBLE, BACKWARD, FORWARD, FULL, *_TRANSITIVE",
    ),
]  # fmt: skip


def read_payload(path: Path) -> dict[str, Any]:
    """The schema payload file as a dict; InvalidArgument when it is not one.

    Called inside the admin call (see :func:`_payload_call`), so that InvalidArgument
    takes the commands' error path: ``error: <reason>``, exit 1.

    Example:
        >>> import tempfile
        >>> f = Path(tempfile.mkdtemp()) / "s.json"
        >>> _ = f.write_text('{"type": "STRING", "properties": {"owner": "billing"}}')
        >>> read_payload(f)
        {'type': 'STRING', 'schema': '', 'properties': {'owner': 'billing'}}
        >>> _ = f.write_text('{"type": "STRING", "properties": [1, 2]}')
        >>> read_payload(f)
        Traceback (most recent call last):
        anabranch.errors.InvalidArgument: s.json: 'properties' must map names to strings
    """
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except OSError as err:  # missing, a directory, unreadable: the reason, not the errno dump
        raise InvalidArgument(f"cannot read schema file {path}: {err.strerror}") from None
    except ValueError as err:  # not UTF-8, not JSON
        raise InvalidArgument(f"cannot read schema file {path}: {err}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("type"), str):
        raise InvalidArgument(f"{path.name}: expected an object with a string 'type'")
    schema = doc.get("schema", "")
    if not isinstance(schema, str):  # pulsar-admin files may hold the definition as JSON
        schema = json.dumps(schema)
    properties = doc.get("properties") or {}  # null: none, as pulsar-admin writes it
    if not isinstance(properties, dict) or not all(
        isinstance(value, str) for value in properties.values()
    ):  # the broker keeps Map<String, String>, as Pulsar does
        raise InvalidArgument(f"{path.name}: 'properties' must map names to strings")
    return {"type": doc["type"], "schema": schema, "properties": properties}


def _payload_call(
    path: Path, send: Callable[[AdminClient, dict[str, Any]], Awaitable[Any]]
) -> Callable[[AdminClient], Awaitable[Any]]:
    """An admin call that reads the payload file first: a bad file fails on the same error
    path as a refused call (read before the call, it ended in a traceback)."""

    async def call(client: AdminClient) -> Any:
        return await send(client, read_payload(path))

    return call


@schemas_app.command("get")
def get_schema(
    topic: str,
    version: Annotated[int | None, typer.Option("--version", help="default: the latest")] = None,
    all_versions: Annotated[bool, typer.Option("--all-version", help="every version")] = False,
    output: OutputOpt = None,
) -> None:
    """A topic's schema."""
    if all_versions:
        _run(lambda c: c.get_all_schemas(topic), output, f"schemas of {topic}")
    else:
        _run(lambda c: c.get_schema(topic, version), output, f"schema of {topic}")


@schemas_app.command("upload")
def upload_schema(topic: str, filename: FileOpt, output: OutputOpt = None) -> None:
    """Register a schema (checked against the topic's compatibility strategy)."""
    send = _payload_call(
        filename, lambda c, p: c.upload_schema(topic, p["type"], p["schema"], p["properties"])
    )
    _run(send, output, f"schema version of {topic}")


@schemas_app.command("delete")
def delete_schema(
    topic: str,
    force: Annotated[bool, typer.Option("--force", "-f", help="remove the history")] = False,
    output: OutputOpt = None,
) -> None:
    """Delete a topic's schema."""
    _run(lambda c: c.delete_schema(topic, force=force), output, f"schema of {topic} deleted")


@schemas_app.command("compatibility")
def test_compatibility(topic: str, filename: FileOpt, output: OutputOpt = None) -> None:
    """Whether a schema could be registered on a topic."""
    send = _payload_call(
        filename,
        lambda c, p: c.test_schema_compatibility(topic, p["type"], p["schema"], p["properties"]),
    )
    _run(send, output, f"compatibility with {topic}")


def _strategy_commands(app: typer.Typer, what: str) -> None:
    """Register the set/get/remove strategy commands on ``namespaces`` or ``topics``."""

    @app.command("set-schema-compatibility-strategy", help=f"Set {what} strategy.")
    def set_strategy(target: Target, compatibility: StrategyOpt, output: OutputOpt = None) -> None:
        _run(lambda c: c.set_schema_compatibility_strategy(target, compatibility.upper()),
             output, f"schema compatibility strategy of {target} set")  # fmt: skip

    @app.command("get-schema-compatibility-strategy", help=f"Get {what} strategy.")
    def get_strategy(target: Target, output: OutputOpt = None) -> None:
        _run(lambda c: c.get_schema_compatibility_strategy(target), output,
             f"schema compatibility strategy of {target}")  # fmt: skip

    @app.command("remove-schema-compatibility-strategy", help=f"Remove {what} strategy.")
    def remove_strategy(target: Target, output: OutputOpt = None) -> None:
        _run(lambda c: c.remove_schema_compatibility_strategy(target), output,
             f"schema compatibility strategy of {target} removed")  # fmt: skip


_strategy_commands(namespaces_app, "a namespace's schema compatibility")
_strategy_commands(topics_app, "a topic's schema compatibility")
