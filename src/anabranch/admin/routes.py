"""The admin route table's building blocks, shared by the HTTP app and the OpenAPI document.

A :class:`Route` is one method + path + handler + the facts OpenAPI needs. Handlers take
the :class:`~anabranch.admin.service.AdminService` and the request and return a value:
``None`` answers 204, a ``web.StreamResponse`` is sent as is, anything else is JSON 200.

Example:
    >>> async def ping(admin: AdminService, request: web.Request) -> object:
    ...     return "pong"
    >>> Route("GET", "/ping", ping, "Answer pong.", tag="misc").path_params
    []
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec
from aiohttp import web

from anabranch import limits
from anabranch.admin.models import decode_json
from anabranch.broker.policies import NamespacePolicies
from anabranch.core.names import TopicName
from anabranch.errors import InvalidArgument, NotFound

if TYPE_CHECKING:
    from anabranch.admin.service import AdminService

Handler = Callable[["AdminService", web.Request], Awaitable[object]]

_PARAM_RE = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")


@dataclass(frozen=True)
class Route:
    """One admin endpoint."""

    method: str
    path: str
    handler: Handler
    summary: str
    tag: str
    request_schema: dict[str, Any] | None = None
    """JSON schema of the body, if the route takes one."""
    response_schema: dict[str, Any] | None = None
    """JSON schema of a 200 answer; None means the route answers 204 No Content."""
    query: tuple[str, ...] = ()
    """Optional boolean query flags (``force``, ``perPartition``)."""
    errors: tuple[int, ...] = field(default=(400, 404))
    content_type: str = "application/json"

    @property
    def path_params(self) -> list[str]:
        """Names of the ``{param}`` parts of the path, in order."""
        return _PARAM_RE.findall(self.path)


def param(request: web.Request, name: str) -> str:
    """A path parameter (aiohttp has already percent-decoded it)."""
    return request.match_info[name]


def topic_param(request: web.Request, domain: str = "persistent") -> str:
    """``domain://tenant/namespace/topic`` from the path."""
    return f"{domain}://{namespace_param(request)}/{param(request, 'topic')}"


def namespace_param(request: web.Request) -> str:
    """``tenant/namespace`` from the path."""
    return f"{param(request, 'tenant')}/{param(request, 'namespace')}"


def flag(request: web.Request, name: str) -> bool:
    """A boolean query flag: ``?force`` / ``?force=true`` are true."""
    value = request.query.get(name)
    return value is not None and value.lower() in ("", "true", "1", "yes")


def int_param(request: web.Request, name: str) -> int:
    """An integer path parameter (InvalidArgument when it is not one)."""
    text = param(request, name)
    try:
        return int(text)
    except ValueError:
        raise InvalidArgument(f"{name} {text!r} is not an integer") from None


async def body_bytes(request: web.Request) -> bytes:
    """The raw body, bounded by ``limits.ADMIN_REQUEST_BODY_BYTES_MAX`` (aiohttp's
    ``client_max_size`` enforces the bound before the body is buffered) and in time by
    ``limits.ADMIN_REQUEST_BODY_TIMEOUT_S`` (InvalidArgument: a client trickling a body
    would hold its connection and the handler forever)."""
    try:
        async with asyncio.timeout(limits.ADMIN_REQUEST_BODY_TIMEOUT_S):
            return await request.read()
    except TimeoutError:
        raise InvalidArgument(
            f"the request body did not arrive within {limits.ADMIN_REQUEST_BODY_TIMEOUT_S:g} s"
        ) from None


async def json_body(request: web.Request, kind: type[Any], what: str, default: Any) -> Any:
    """Decode the body into ``kind``; ``default`` when the body is empty."""
    data = await body_bytes(request)
    if not data.strip():
        return default
    return decode_json(data, kind, what)


BODY_LIMIT = limits.ADMIN_REQUEST_BODY_BYTES_MAX
INT32_MAX = 2**31 - 1
"""The largest value of a policy field that is a Java ``int`` upstream."""


async def policy_topic(admin: AdminService, request: web.Request) -> TopicName:
    """The persistent topic of a topic-policy route's path; NotFound unless it (or its
    partitioned topic) exists."""
    name = TopicName.parse(topic_param(request))
    if await admin.policies.get_partitions(name) == 0 and not await admin.topic_exists(name):
        raise NotFound(f"topic {name}")
    return name


async def set_namespace_fields(admin: AdminService, request: web.Request, **fields: Any) -> None:
    """Set fields of the path's namespace policies (None: unset), by compare-and-set."""
    await admin.policies.update_namespace_policies(
        namespace_param(request), lambda p: msgspec.structs.replace(p, **fields)
    )


async def set_topic_fields(admin: AdminService, request: web.Request, **fields: Any) -> None:
    """Set fields of the path's topic policies (None: unset), by compare-and-set."""
    topic = await policy_topic(admin, request)
    await admin.broker.topic_policies.update(topic, lambda p: msgspec.structs.replace(p, **fields))


async def partition_count(request: web.Request) -> int:
    """The body of a create/update partitioned topic request: the number of partitions."""
    count = await json_body(request, int, "partition count", None)
    if count is None:
        raise InvalidArgument("the body must be the number of partitions")
    return int(count)


async def applied_policies(admin: AdminService, topic: TopicName) -> NamespacePolicies:
    """The policies in force for ``topic``: its overrides over its namespace's."""
    namespace, own = await admin.broker.policy_levels(topic)
    return own.over(namespace)
