"""Pulsar admin v2 schema routes: the registry of a topic, and compatibility strategies.

Paths and bodies are upstream's (``pulsar-admin schemas ...``)::

    GET    /admin/v2/schemas/{t}/{ns}/{topic}/schema            latest  GetSchemaResponse
    GET    /admin/v2/schemas/{t}/{ns}/{topic}/schema/{version}  one version
    GET    /admin/v2/schemas/{t}/{ns}/{topic}/schemas           {"getSchemaResponseList": [..]}
    POST   /admin/v2/schemas/{t}/{ns}/{topic}/schema            upload  {"type", "schema",
                                                                 "properties"} → {"version"}
    DELETE /admin/v2/schemas/{t}/{ns}/{topic}/schema?force      → {"version"}
    POST   /admin/v2/schemas/{t}/{ns}/{topic}/compatibility     → {"isCompatibility",
                                                                 "schemaCompatibilityStrategy"}
    POST   /admin/v2/schemas/{t}/{ns}/{topic}/version           → {"version"}
    GET/PUT/DELETE /admin/v2/namespaces/{t}/{ns}/schemaCompatibilityStrategy   "BACKWARD"
    GET/PUT/DELETE /admin/v2/persistent/{t}/{ns}/{topic}/schemaCompatibilityStrategy

The schema paths name ``persistent://`` topics, as upstream's; ``?domain=topic`` (scalable
topics) selects that domain's history, which is kept apart (see ``broker/schema.py``).

Example:
    >>> sorted({r.path.rsplit("/", 1)[1] for r in ROUTES})[:4]
    ['compatibility', 'schema', 'schemaCompatibilityStrategy', 'schemas']
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import msgspec
from aiohttp import web

from anabranch.admin.routes import Route, flag, json_body, namespace_param, param, policy_topic
from anabranch.broker.policies import NamespacePolicies
from anabranch.broker.schema import SchemaVersion, schema_type_name, schema_type_value
from anabranch.broker.topic_policies import TopicPolicies
from anabranch.core.names import TopicName
from anabranch.core.schema_compat import Strategy
from anabranch.errors import IncompatibleSchema, InvalidArgument, NotFound
from anabranch.protocol._generated import pulsar_api_pb2 as pb

if TYPE_CHECKING:
    from anabranch.admin.service import AdminService

SCHEMAS = "/admin/v2/schemas/{tenant}/{namespace}/{topic}"
NS = "/admin/v2/namespaces/{tenant}/{namespace}"
TOPIC = "/admin/v2/persistent/{tenant}/{namespace}/{topic}"
SCHEMA_DOMAINS = ("persistent", "topic")

STRING = {"type": "string"}
SCHEMA_RESPONSE = {
    "type": "object",
    "properties": {
        "version": {"type": "integer"},
        "type": STRING,
        "timestamp": {"type": "integer"},
        "data": STRING,
        "properties": {"type": "object", "additionalProperties": STRING},
    },
}
PAYLOAD = {
    "type": "object",
    "properties": {
        "type": STRING,
        "schema": STRING,
        "properties": {"type": "object", "additionalProperties": STRING},
    },
}
VERSION = {"type": "object", "properties": {"version": {"type": "integer"}}}
STRATEGY = {"type": "string", "enum": [s.value for s in Strategy]}


class SchemaPayload(msgspec.Struct, kw_only=True):
    """Upstream's ``PostSchemaPayload``."""

    type: str
    schema: str = ""
    properties: dict[str, str] = msgspec.field(default_factory=dict)

    def to_schema(self, name: str) -> pb.Schema:
        """The wire schema this payload describes (InvalidArgument on an unknown type)."""
        schema = pb.Schema(name=name, schema_data=self.schema.encode())
        schema.type = schema_type_value(self.type)  # type: ignore[assignment]
        for key, value in sorted(self.properties.items()):
            schema.properties.add(key=key, value=value)
        return schema


def schema_topic(request: web.Request) -> TopicName:
    """The topic a schema route names: ``persistent://`` unless ``?domain=topic``."""
    domain = request.query.get("domain", "persistent")
    if domain not in SCHEMA_DOMAINS:
        raise InvalidArgument(f"domain {domain!r}: one of {', '.join(SCHEMA_DOMAINS)}")
    return TopicName.parse(f"{domain}://{namespace_param(request)}/{param(request, 'topic')}")


def _response(found: SchemaVersion) -> dict[str, Any]:
    return {
        "version": found.number,
        "type": schema_type_name(found.schema.type),
        "timestamp": found.timestamp_ms,
        # Definitions are text (Avro/JSON/protobuf descriptors as upstream sends them).
        "data": found.schema.schema_data.decode("utf-8", errors="replace"),
        "properties": {p.key: p.value for p in found.schema.properties},
    }


async def _payload(request: web.Request) -> SchemaPayload:
    payload: SchemaPayload | None = await json_body(request, SchemaPayload, "schema", None)
    if payload is None:
        raise InvalidArgument("a schema payload {type, schema, properties} is required")
    return payload


async def get_schema(admin: AdminService, request: web.Request) -> object:
    return _response(await admin.broker.schemas.get_version(str(schema_topic(request))))


async def get_schema_version(admin: AdminService, request: web.Request) -> object:
    text = param(request, "version")
    if not text.isdigit():
        raise InvalidArgument(f"schema version {text!r} is not a non-negative integer")
    found = await admin.broker.schemas.get_version(str(schema_topic(request)), int(text))
    return _response(found)


async def get_all_schemas(admin: AdminService, request: web.Request) -> object:
    live = await admin.broker.schemas.live(str(schema_topic(request)))
    if not live:
        raise NotFound(f"schema of {schema_topic(request)}")
    return {"getSchemaResponseList": [_response(v) for v in live]}


async def post_schema(admin: AdminService, request: web.Request) -> object:
    topic = schema_topic(request)
    await admin.policies.namespace_policies(f"{topic.tenant}/{topic.namespace}")
    schema = (await _payload(request)).to_schema(topic.local_name)
    version = await admin.broker.schemas.get_or_create(str(topic), schema)
    return {"version": int.from_bytes(version, "big", signed=True)}


async def delete_schema(admin: AdminService, request: web.Request) -> object:
    topic = schema_topic(request)
    number = await admin.broker.schemas.delete(topic, force=flag(request, "force"))
    if number is None:
        raise NotFound(f"schema of {topic}")
    return {"version": number}


async def test_compatibility(admin: AdminService, request: web.Request) -> object:
    topic = schema_topic(request)
    schema = (await _payload(request)).to_schema(topic.local_name)
    strategy = await admin.broker.schemas.strategy(topic)
    try:
        await admin.broker.schemas.check(str(topic), schema)
    except IncompatibleSchema:
        compatible = False
    else:
        compatible = True
    return {"isCompatibility": compatible, "schemaCompatibilityStrategy": strategy.value}


async def get_version_of(admin: AdminService, request: web.Request) -> object:
    topic = schema_topic(request)
    schema = (await _payload(request)).to_schema(topic.local_name)
    version = await admin.broker.schemas.version_of(str(topic), schema)
    return {"version": int.from_bytes(version, "big", signed=True)}


async def _strategy_body(request: web.Request) -> Strategy:
    value = await json_body(request, str, "schema compatibility strategy", None)
    if value is None:
        raise InvalidArgument('a strategy name is required, e.g. "BACKWARD"')
    try:
        return Strategy.parse(value)
    except ValueError as err:
        raise InvalidArgument(str(err)) from None


async def get_ns_strategy(admin: AdminService, request: web.Request) -> object:
    return (
        await admin.policies.namespace_policies(namespace_param(request))
    ).schema_compatibility_strategy


async def set_ns_strategy(admin: AdminService, request: web.Request) -> object:
    strategy = await _strategy_body(request)

    def change(p: NamespacePolicies) -> NamespacePolicies:
        return msgspec.structs.replace(p, schema_compatibility_strategy=strategy.value)

    await admin.policies.update_namespace_policies(namespace_param(request), change)
    return None


async def remove_ns_strategy(admin: AdminService, request: web.Request) -> object:
    def change(p: NamespacePolicies) -> NamespacePolicies:
        return msgspec.structs.replace(p, schema_compatibility_strategy="UNDEFINED")

    await admin.policies.update_namespace_policies(namespace_param(request), change)
    return None


async def get_topic_strategy(admin: AdminService, request: web.Request) -> object:
    topic = await policy_topic(admin, request)
    if flag(request, "applied"):
        return (await admin.broker.schemas.strategy(topic)).value
    return (await admin.broker.topic_policies.get(topic)).schema_compatibility_strategy


async def set_topic_strategy(admin: AdminService, request: web.Request) -> object:
    topic = await policy_topic(admin, request)
    strategy = await _strategy_body(request)

    def change(p: TopicPolicies) -> TopicPolicies:
        return msgspec.structs.replace(p, schema_compatibility_strategy=strategy.value)

    await admin.broker.topic_policies.update(topic, change)
    return None


async def remove_topic_strategy(admin: AdminService, request: web.Request) -> object:
    topic = await policy_topic(admin, request)

    def change(p: TopicPolicies) -> TopicPolicies:
        return msgspec.structs.replace(p, schema_compatibility_strategy=None)

    await admin.broker.topic_policies.update(topic, change)
    return None


ROUTES: list[Route] = [
    Route("GET", f"{SCHEMAS}/schema", get_schema,
          "A topic's latest schema (?domain=topic for a scalable topic).", "schemas",
          response_schema=SCHEMA_RESPONSE, query=("domain",)),
    Route("GET", f"{SCHEMAS}/schema/{{version}}", get_schema_version,
          "One version of a topic's schema.", "schemas", response_schema=SCHEMA_RESPONSE,
          query=("domain",)),
    Route("GET", f"{SCHEMAS}/schemas", get_all_schemas,
          "Every live version of a topic's schema.", "schemas",
          response_schema={"type": "object"}, query=("domain",)),
    Route("POST", f"{SCHEMAS}/schema", post_schema,
          "Register a schema (checked against the topic's compatibility strategy).",
          "schemas", request_schema=PAYLOAD, response_schema=VERSION, query=("domain",),
          errors=(400, 404, 409)),
    Route("DELETE", f"{SCHEMAS}/schema", delete_schema,
          "Delete a topic's schema (a delete marker; ?force removes the history).",
          "schemas", response_schema=VERSION, query=("domain", "force")),
    Route("POST", f"{SCHEMAS}/compatibility", test_compatibility,
          "Whether a schema could be registered.", "schemas", request_schema=PAYLOAD,
          response_schema={"type": "object"}, query=("domain",)),
    Route("POST", f"{SCHEMAS}/version", get_version_of,
          "The version equal to a schema.", "schemas", request_schema=PAYLOAD,
          response_schema=VERSION, query=("domain",)),
    Route("GET", f"{NS}/schemaCompatibilityStrategy", get_ns_strategy,
          "A namespace's schema compatibility strategy (UNDEFINED: the broker's).",
          "namespaces", response_schema=STRATEGY),
    Route("PUT", f"{NS}/schemaCompatibilityStrategy", set_ns_strategy,
          "Set a namespace's schema compatibility strategy.", "namespaces",
          request_schema=STRATEGY),
    Route("DELETE", f"{NS}/schemaCompatibilityStrategy", remove_ns_strategy,
          "Remove a namespace's schema compatibility strategy.", "namespaces"),
    Route("GET", f"{TOPIC}/schemaCompatibilityStrategy", get_topic_strategy,
          "A topic's strategy override (null when unset; ?applied=true: in force).",
          "persistent", response_schema=STRATEGY, query=("applied",)),
    Route("PUT", f"{TOPIC}/schemaCompatibilityStrategy", set_topic_strategy,
          "Override the schema compatibility strategy of a topic.", "persistent",
          request_schema=STRATEGY),
    Route("DELETE", f"{TOPIC}/schemaCompatibilityStrategy", remove_topic_strategy,
          "Remove a topic's strategy override.", "persistent"),
]  # fmt: skip
