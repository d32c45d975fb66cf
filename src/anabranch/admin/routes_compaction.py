"""Pulsar admin v2 topic-compaction routes (``broker/compaction.py`` does the work)::

    PUT  /admin/v2/persistent/{t}/{ns}/{topic}/compaction        start (409 if running;
                                                                 a partitioned topic: each
                                                                 partition)
    GET  /admin/v2/persistent/{t}/{ns}/{topic}/compaction        {"status", "lastError"}
    POST/GET/DELETE /admin/v2/namespaces/{t}/{ns}/compactionThreshold       bytes
    POST/GET/DELETE /admin/v2/persistent/{t}/{ns}/{topic}/compactionThreshold
    PUT/GET /admin/v2/segments/{t}/{ns}/{topic}/{descriptor}/compaction    one segment
    PUT  /admin/v2/scalable/{t}/{ns}/{topic}/compaction          every segment of the layout

``status`` is upstream's ``LongRunningProcessStatus``: NOT_RUN, RUNNING, SUCCESS or ERROR.
A threshold of 0 turns automatic compaction off; a GET of an unset one answers ``null``
(the topic's ``?applied=true``: the value in force, the broker's default included).

Example:
    >>> sorted({(r.method, r.path.rsplit("/", 1)[1]) for r in ROUTES})[:3]
    [('DELETE', 'compactionThreshold'), ('GET', 'compaction'), ('GET', 'compactionThreshold')]
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec
from aiohttp import web

from anabranch.admin.routes import (
    Route,
    applied_policies,
    flag,
    json_body,
    namespace_param,
    policy_topic,
    topic_param,
)
from anabranch.admin.routes_scalable import scalable_topic, segment_param
from anabranch.broker.compaction import TopicCompaction
from anabranch.broker.topic_policies import TopicPolicies
from anabranch.core.names import SegmentName, TopicName
from anabranch.errors import CompactionInProgress, InvalidArgument

if TYPE_CHECKING:
    from anabranch.admin.service import AdminService

NS = "/admin/v2/namespaces/{tenant}/{namespace}"
TOPIC = "/admin/v2/persistent/{tenant}/{namespace}/{topic}"
SEGMENT = "/admin/v2/segments/{tenant}/{namespace}/{topic}/{descriptor}"
SCALABLE = "/admin/v2/scalable/{tenant}/{namespace}/{topic}"
INTEGER = {"type": "integer"}
STATUS = {
    "type": "object",
    "properties": {
        "status": {"type": "string", "enum": ["NOT_RUN", "RUNNING", "SUCCESS", "ERROR"]},
        "lastError": {"type": "string"},
    },
}


def status_of(run: TopicCompaction) -> dict[str, str]:
    """Upstream's ``LongRunningProcessStatus`` JSON."""
    return {"status": run.status, "lastError": run.last_error}


async def _run_of(admin: AdminService, name: str) -> TopicCompaction:
    topic = await admin.broker.get_topic(name, create=False)
    run = admin.broker.compactions.of(topic)
    await run.view()  # a view written before a restart: its status is SUCCESS
    return run


async def trigger(admin: AdminService, request: web.Request) -> object:
    name = TopicName.parse(topic_param(request))
    partitions = await admin.policies.get_partitions(name)
    if partitions == 0:
        topic = await admin.existing_topic(str(name))
        await (await _run_of(admin, topic.name)).trigger()
        return None
    for i in range(partitions):
        run = await _run_of(admin, str(name.with_partition(i)))
        if not run.running:
            await run.trigger()
    return None


async def status(admin: AdminService, request: web.Request) -> object:
    topic = await admin.existing_topic(topic_param(request))
    return status_of(await _run_of(admin, topic.name))


async def trigger_segment(admin: AdminService, request: web.Request) -> object:
    await (await _run_of(admin, str(segment_param(request)))).trigger()
    return None


async def segment_status(admin: AdminService, request: web.Request) -> object:
    return status_of(await _run_of(admin, str(segment_param(request))))


async def trigger_scalable(admin: AdminService, request: web.Request) -> object:
    """Compact each segment of the layout (per-segment compaction: a key's messages stay
    in one segment until a split or merge, and readers go through segments in order)."""
    name = scalable_topic(request)
    layout = await admin.scalable_layout(name)
    topic = TopicName.parse(name)
    for segment in layout.segments.values():
        run = await _run_of(admin, str(SegmentName(topic, segment.hash_range, segment.segment_id)))
        try:
            await run.trigger()
        except CompactionInProgress:
            continue  # already being compacted: that is what was asked for
    return None


# --- thresholds -------------------------------------------------------------------------------


async def _threshold_body(request: web.Request) -> int:
    value = await json_body(request, int, "compactionThreshold", None)
    if value is None or value < 0:
        raise InvalidArgument("the body must be a compaction threshold in bytes, >= 0")
    return int(value)


async def get_threshold(admin: AdminService, request: web.Request) -> object:
    return (await admin.policies.namespace_policies(namespace_param(request))).compaction_threshold


async def set_threshold(admin: AdminService, request: web.Request) -> object:
    value = await _threshold_body(request)
    await admin.policies.update_namespace_policies(
        namespace_param(request), lambda p: msgspec.structs.replace(p, compaction_threshold=value)
    )
    return None


async def remove_threshold(admin: AdminService, request: web.Request) -> object:
    await admin.policies.update_namespace_policies(
        namespace_param(request), lambda p: msgspec.structs.replace(p, compaction_threshold=None)
    )
    return None


async def get_topic_threshold(admin: AdminService, request: web.Request) -> object:
    topic = await policy_topic(admin, request)
    if flag(request, "applied"):
        value = (await applied_policies(admin, topic)).compaction_threshold
        return (
            value if value is not None else admin.broker.config.compaction_threshold_default_bytes
        )
    return (await admin.broker.topic_policies.get(topic)).compaction_threshold


async def set_topic_threshold(admin: AdminService, request: web.Request) -> object:
    topic = await policy_topic(admin, request)
    value = await _threshold_body(request)

    def change(p: TopicPolicies) -> TopicPolicies:
        return msgspec.structs.replace(p, compaction_threshold=value)

    await admin.broker.topic_policies.update(topic, change)
    return None


async def remove_topic_threshold(admin: AdminService, request: web.Request) -> object:
    topic = await policy_topic(admin, request)

    def change(p: TopicPolicies) -> TopicPolicies:
        return msgspec.structs.replace(p, compaction_threshold=None)

    await admin.broker.topic_policies.update(topic, change)
    return None


ROUTES: list[Route] = [
    Route("PUT", f"{TOPIC}/compaction", trigger,
          "Start compacting a topic (each partition of a partitioned topic).", "persistent",
          errors=(404, 409)),
    Route("GET", f"{TOPIC}/compaction", status,
          "The status of a topic's last compaction.", "persistent", response_schema=STATUS,
          errors=(404,)),
    Route("PUT", f"{SEGMENT}/compaction", trigger_segment, "Start compacting a segment.",
          "segments", errors=(400, 404, 409)),
    Route("GET", f"{SEGMENT}/compaction", segment_status,
          "The status of a segment's last compaction.", "segments", response_schema=STATUS),
    Route("PUT", f"{SCALABLE}/compaction", trigger_scalable,
          "Start compacting every segment of a scalable topic.", "scalable"),
    Route("GET", f"{NS}/compactionThreshold", get_threshold,
          "A namespace's compaction threshold in bytes (null when unset).", "namespaces",
          response_schema=INTEGER),
    Route("POST", f"{NS}/compactionThreshold", set_threshold,
          "Set a namespace's compaction threshold in bytes (0: off).", "namespaces",
          request_schema=INTEGER, errors=(400, 404)),
    Route("DELETE", f"{NS}/compactionThreshold", remove_threshold,
          "Remove a namespace's compaction threshold.", "namespaces"),
    Route("GET", f"{TOPIC}/compactionThreshold", get_topic_threshold,
          "A topic's compaction threshold override (?applied=true: in force).", "persistent",
          response_schema=INTEGER, query=("applied",), errors=(404,)),
    Route("POST", f"{TOPIC}/compactionThreshold", set_topic_threshold,
          "Override the compaction threshold for a topic.", "persistent",
          request_schema=INTEGER, errors=(400, 404)),
    Route("DELETE", f"{TOPIC}/compactionThreshold", remove_topic_threshold,
          "Remove a topic's compaction threshold override.", "persistent", errors=(404,)),
]  # fmt: skip
