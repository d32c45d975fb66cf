"""Permission routes: grant, revoke and list namespace and topic permissions (Pulsar's).

* ``GET /admin/v2/namespaces/{t}/{ns}/permissions`` — ``{role: [actions]}`` granted on
  the namespace;
* ``POST .../permissions/{role}`` with a JSON list of actions (``["produce", "consume"]``;
  Pulsar's other action names are accepted and stored) sets the role's actions, replacing
  what it had; ``DELETE .../permissions/{role}`` revokes them (204 even if none);
* the same under ``/admin/v2/persistent/{t}/{ns}/{topic}`` for one topic (a partitioned
  topic's grant covers its partitions) and ``/admin/v2/scalable/{t}/{ns}/{topic}`` for a
  scalable topic (its segments included). A topic's ``GET`` answers its namespace's
  grants merged with its own, as Pulsar does.

Grants live in the namespace's policies (``auth_policies``); only the tenant's admins and
superusers may change or read them (``access.py``).

Example:
    >>> sorted({r.tag for r in ROUTES})
    ['namespaces', 'persistent', 'scalable']
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from aiohttp import web

from anabranch.admin.routes import Route, json_body, namespace_param, param, topic_param
from anabranch.core.authz import parse_actions
from anabranch.errors import InvalidArgument

if TYPE_CHECKING:
    from anabranch.admin.service import AdminService

V2 = "/admin/v2"
NS = f"{V2}/namespaces/{{tenant}}/{{namespace}}"
PERSISTENT = f"{V2}/persistent/{{tenant}}/{{namespace}}/{{topic}}"
SCALABLE = f"{V2}/scalable/{{tenant}}/{{namespace}}/{{topic}}"

ACTIONS = {"type": "array", "items": {"type": "string", "enum": ["produce", "consume"]}}
PERMISSIONS = {"type": "object", "additionalProperties": {"type": "array"}}


async def _actions(request: web.Request) -> list[str]:
    names: Any = await json_body(request, list[str], "actions", None)
    if not names:
        raise InvalidArgument('the body must be a JSON list of actions, e.g. ["produce"]')
    return parse_actions(names)


async def namespace_permissions(admin: AdminService, request: web.Request) -> object:
    return await admin.policies.namespace_permissions(namespace_param(request))


async def grant_namespace(admin: AdminService, request: web.Request) -> object:
    actions = await _actions(request)
    await admin.policies.grant_namespace_permission(
        namespace_param(request), param(request, "role"), actions
    )
    return None


async def revoke_namespace(admin: AdminService, request: web.Request) -> object:
    await admin.policies.revoke_namespace_permission(
        namespace_param(request), param(request, "role")
    )
    return None


def _topic(request: web.Request) -> str:
    domain = "topic" if request.path.startswith(f"{V2}/scalable/") else "persistent"
    return topic_param(request, domain)


async def topic_permissions(admin: AdminService, request: web.Request) -> object:
    return await admin.policies.topic_permissions(_topic(request))


async def grant_topic(admin: AdminService, request: web.Request) -> object:
    actions = await _actions(request)
    await admin.policies.grant_topic_permission(_topic(request), param(request, "role"), actions)
    return None


async def revoke_topic(admin: AdminService, request: web.Request) -> object:
    await admin.policies.revoke_topic_permission(_topic(request), param(request, "role"))
    return None


def _topic_routes(base: str, tag: str) -> list[Route]:
    return [
        Route("GET", f"{base}/permissions", topic_permissions,
              "Roles and their actions on the topic (namespace grants included).", tag,
              response_schema=PERMISSIONS),
        Route("POST", f"{base}/permissions/{{role}}", grant_topic,
              "Grant a role actions on the topic (replacing its topic grant).", tag,
              request_schema=ACTIONS),
        Route("DELETE", f"{base}/permissions/{{role}}", revoke_topic,
              "Revoke a role's grant on the topic.", tag),
    ]  # fmt: skip


ROUTES: list[Route] = [
    Route("GET", f"{NS}/permissions", namespace_permissions,
          "Roles and their actions on the namespace.", "namespaces",
          response_schema=PERMISSIONS),
    Route("POST", f"{NS}/permissions/{{role}}", grant_namespace,
          "Grant a role actions on the namespace (replacing its grant).", "namespaces",
          request_schema=ACTIONS),
    Route("DELETE", f"{NS}/permissions/{{role}}", revoke_namespace,
          "Revoke a role's grant on the namespace.", "namespaces"),
    *_topic_routes(PERSISTENT, "persistent"),
    *_topic_routes(SCALABLE, "scalable"),
]  # fmt: skip
