"""Scalable-topic admin routes (PIP-468, DESIGN.md §3.3).

* ``/admin/v2/scalable/{tenant}/{namespace}`` GET list;
  ``/{topic}`` PUT ``?numInitialSegments=N`` (default 1), GET metadata (the layout JSON of
  DESIGN.md §3.4), DELETE; ``/{topic}/stats``; ``/{topic}/subscriptions`` GET;
  ``/{topic}/subscriptions/{subscription}`` PUT/DELETE; ``POST /{topic}/split/{segmentId}``;
  ``POST /{topic}/merge/{id1}/{id2}`` (both answer the new layout).
* ``/admin/v2/segments/{tenant}/{namespace}/{topic}/{descriptor}`` PUT (JSON list of
  subscriptions), ``POST .../terminate`` (answers the dedup snapshot), DELETE.
* A non-leader answers a mutation with 307 to the controller leader: the service raises
  :class:`~anabranch.errors.NotLeader` and ``http.py``'s error middleware sets
  ``Location`` to the same path on the leader.
* ``/admin/v2/namespaces/{tenant}/{namespace}/scalableTopicEnabled`` GET (the effective
  switch), POST ``true``/``false``, DELETE (back to the broker's ``scalable_topic_enabled``).

Example:
    >>> sorted({r.tag for r in ROUTES})
    ['namespaces', 'scalable', 'segments']
"""

from __future__ import annotations

from typing import Any

import msgspec
from aiohttp import web

from anabranch import limits
from anabranch.admin.routes import Route, int_param, json_body, namespace_param, param
from anabranch.admin.service import AdminService, _check_subscription_name
from anabranch.core.names import SegmentName, TopicName
from anabranch.errors import InvalidArgument, NotLeader

V2 = "/admin/v2"
NS = f"{V2}/scalable/{{tenant}}/{{namespace}}"
NS_POLICY = f"{V2}/namespaces/{{tenant}}/{{namespace}}/scalableTopicEnabled"
TOPIC = f"{NS}/{{topic}}"
SEGMENT = f"{V2}/segments/{{tenant}}/{{namespace}}/{{topic}}/{{descriptor}}"

STRINGS = {"type": "array", "items": {"type": "string"}}
OBJECT = {"type": "object"}
INTEGER = {"type": "integer"}
SEGMENT_INFO = {
    "type": "object",
    "properties": {
        "segmentId": INTEGER,
        "hashRange": {"type": "object", "properties": {"start": INTEGER, "end": INTEGER}},
        "state": {"type": "string", "enum": ["ACTIVE", "SEALED"]},
        "parentIds": {"type": "array", "items": INTEGER},
        "childIds": {"type": "array", "items": INTEGER},
        "createdAtEpoch": INTEGER,
        "sealedAtEpoch": INTEGER,
        "createdAtMs": INTEGER,
        "sealedAtMs": INTEGER,
    },
}
LAYOUT = {
    "type": "object",
    "properties": {
        "epoch": INTEGER,
        "nextSegmentId": INTEGER,
        "segments": {"type": "object", "additionalProperties": SEGMENT_INFO},
        "properties": {"type": "object", "additionalProperties": {"type": "string"}},
    },
}
SNAPSHOT = {"type": "object", "additionalProperties": INTEGER}
MUTATION_ERRORS = (307, 400, 404, 409)


def scalable_topic(request: web.Request) -> str:
    """``topic://tenant/namespace/topic`` from the path."""
    return f"topic://{namespace_param(request)}/{param(request, 'topic')}"


def segment_param(request: web.Request) -> SegmentName:
    """The ``segment://`` name from the segments path (InvalidArgument when malformed)."""
    topic = TopicName.parse(scalable_topic(request))
    hash_range, segment_id = SegmentName.parse_descriptor(param(request, "descriptor"))
    return SegmentName(topic, hash_range, segment_id)


def num_initial_segments(request: web.Request) -> int:
    """``?numInitialSegments=N`` (default 1), within [1, SCALABLE_INITIAL_SEGMENTS_MAX]."""
    text = request.query.get("numInitialSegments", "1")
    try:
        count = int(text)
    except ValueError:
        raise InvalidArgument(f"numInitialSegments {text!r} is not an integer") from None
    if not 1 <= count <= limits.SCALABLE_INITIAL_SEGMENTS_MAX:
        raise InvalidArgument(
            f"numInitialSegments must be 1 to {limits.SCALABLE_INITIAL_SEGMENTS_MAX}, not {count}"
        )
    return count


# --- scalable topics --------------------------------------------------------------------------


async def list_scalable_topics(admin: AdminService, request: web.Request) -> object:
    ns = namespace_param(request)
    await admin.policies.namespace_policies(ns)  # a namespace that does not exist: 404
    return await (await admin.scalable()).list_topics(ns)


async def create_scalable_topic(admin: AdminService, request: web.Request) -> object:
    count = num_initial_segments(request)
    name = scalable_topic(request)
    topic = TopicName.parse(name)
    await admin.broker.check_scalable_enabled(topic)
    guard = await admin.policies.namespace_guard(topic.namespace_name)
    await (await admin.scalable()).create(name, count, guard=[guard])
    return None


async def get_scalable_topic(admin: AdminService, request: web.Request) -> object:
    name = scalable_topic(request)
    await admin.broker.check_scalable_enabled(TopicName.parse(name))
    return (await admin.scalable_layout(name)).to_dict()


async def get_scalable_enabled(admin: AdminService, request: web.Request) -> object:
    """The namespace's effective switch (its policy, else the broker's setting)."""
    ns = await admin.policies.namespace_policies(namespace_param(request))
    if ns.scalable_topic_enabled is not None:
        return ns.scalable_topic_enabled
    return admin.broker.config.scalable_topic_enabled


async def set_scalable_enabled(admin: AdminService, request: web.Request) -> object:
    enabled = await json_body(request, bool, "scalableTopicEnabled", None)
    if enabled is None:
        raise InvalidArgument("the body must be true or false")
    await admin.policies.update_namespace_policies(
        namespace_param(request),
        lambda p: msgspec.structs.replace(p, scalable_topic_enabled=enabled),
    )
    return None


async def remove_scalable_enabled(admin: AdminService, request: web.Request) -> object:
    await admin.policies.update_namespace_policies(
        namespace_param(request),
        lambda p: msgspec.structs.replace(p, scalable_topic_enabled=None),
    )
    return None


async def delete_scalable_topic(admin: AdminService, request: web.Request) -> object:
    name = scalable_topic(request)
    await (await admin.scalable()).delete(name)
    await admin.broker.schemas.delete(name, force=True)
    await admin.policies.forget_topic_permissions(name)
    return None


async def scalable_topic_stats(admin: AdminService, request: web.Request) -> object:
    """At a non-leader, 307 to the controller leader (its assignment and autoscaler state
    live there); ``?redirects=`` counts the hops, and the last one answers here."""
    try:
        hops = int(request.query.get("redirects", "0"))
    except ValueError:
        raise InvalidArgument("redirects must be an integer") from None
    to_leader = hops < limits.ADMIN_STATS_REDIRECTS_MAX
    try:
        return await admin.scalable_stats(scalable_topic(request), to_leader=to_leader)
    except NotLeader as err:
        if not err.leader_url:
            raise
        target = request.rel_url.update_query(redirects=hops + 1)
        response = web.Response(status=307)
        response.headers["Location"] = err.leader_url.rstrip("/") + str(target)
        return response


async def list_scalable_subscriptions(admin: AdminService, request: web.Request) -> object:
    return await (await admin.scalable()).list_subscriptions(scalable_topic(request))


async def create_scalable_subscription(admin: AdminService, request: web.Request) -> object:
    sub = param(request, "subscription")
    _check_subscription_name(sub)
    await (await admin.scalable()).create_subscription(scalable_topic(request), sub)
    return None


async def delete_scalable_subscription(admin: AdminService, request: web.Request) -> object:
    sub = param(request, "subscription")
    await (await admin.scalable()).delete_subscription(scalable_topic(request), sub)
    return None


async def split_segment(admin: AdminService, request: web.Request) -> object:
    segment_id = int_param(request, "segmentId")
    layout = await (await admin.scalable()).split(scalable_topic(request), segment_id)
    return layout.to_dict()


async def merge_segments(admin: AdminService, request: web.Request) -> object:
    first, second = int_param(request, "id1"), int_param(request, "id2")
    layout = await (await admin.scalable()).merge(scalable_topic(request), first, second)
    return layout.to_dict()


# --- segment topics ---------------------------------------------------------------------------


async def create_segment(admin: AdminService, request: web.Request) -> object:
    segment = segment_param(request)
    subscriptions: Any = await json_body(request, list[str], "subscriptions", [])
    await admin.create_segment(segment, list(subscriptions))
    return None


async def terminate_segment(admin: AdminService, request: web.Request) -> object:
    return await admin.terminate_segment(segment_param(request))


async def delete_segment(admin: AdminService, request: web.Request) -> object:
    await admin.delete_segment(segment_param(request))
    return None


ROUTES: list[Route] = [
    Route("GET", NS, list_scalable_topics, "List the scalable topics of a namespace.",
          "scalable", response_schema=STRINGS),
    Route("PUT", TOPIC, create_scalable_topic,
          "Create a scalable topic; query numInitialSegments=N (integer, default 1).",
          "scalable", errors=MUTATION_ERRORS),
    Route("GET", TOPIC, get_scalable_topic, "The topic's segment layout (DAG) metadata.",
          "scalable", response_schema=LAYOUT),
    Route("DELETE", TOPIC, delete_scalable_topic,
          "Delete a scalable topic, its segment topics and metadata.", "scalable",
          errors=MUTATION_ERRORS),
    Route("GET", f"{TOPIC}/stats", scalable_topic_stats,
          "Per-segment state, range, backlog and message counters; a non-leader answers 307 "
          "to the controller leader (query redirects=N counts the hops).", "scalable",
          response_schema=OBJECT, errors=(307, 400, 404)),
    Route("GET", f"{TOPIC}/subscriptions", list_scalable_subscriptions,
          "List the topic's subscriptions.", "scalable", response_schema=STRINGS),
    Route("PUT", f"{TOPIC}/subscriptions/{{subscription}}", create_scalable_subscription,
          "Create a subscription (a cursor at earliest on every active segment).", "scalable",
          errors=MUTATION_ERRORS),
    Route("DELETE", f"{TOPIC}/subscriptions/{{subscription}}", delete_scalable_subscription,
          "Delete a subscription and its cursors.", "scalable", errors=MUTATION_ERRORS),
    Route("POST", f"{TOPIC}/split/{{segmentId}}", split_segment,
          "Split an active segment at its midpoint; answers the new layout.", "scalable",
          response_schema=LAYOUT, errors=MUTATION_ERRORS),
    Route("POST", f"{TOPIC}/merge/{{id1}}/{{id2}}", merge_segments,
          "Merge two adjacent active segments; answers the new layout.", "scalable",
          response_schema=LAYOUT, errors=MUTATION_ERRORS),
    Route("PUT", SEGMENT, create_segment,
          "Create a segment topic with a cursor at earliest per listed subscription.",
          "segments", request_schema=STRINGS),
    Route("POST", f"{SEGMENT}/terminate", terminate_segment,
          "Seal a segment topic; answers its dedup snapshot {producer: lastSequenceId}.",
          "segments", response_schema=SNAPSHOT),
    Route("DELETE", SEGMENT, delete_segment, "Delete a segment topic and its data.",
          "segments"),
    Route("GET", NS_POLICY, get_scalable_enabled,
          "Are scalable topics enabled in the namespace (its policy, else the broker's)?",
          "namespaces", response_schema={"type": "boolean"}),
    Route("POST", NS_POLICY, set_scalable_enabled,
          "Enable or disable scalable (topic://) topics in the namespace.", "namespaces",
          request_schema={"type": "boolean"}),
    Route("DELETE", NS_POLICY, remove_scalable_enabled,
          "Remove the namespace's scalable-topic override (the broker's setting applies).",
          "namespaces"),
]  # fmt: skip
