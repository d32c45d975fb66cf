"""The admin HTTP server: ``aiohttp.web`` on the broker's own event loop.

One route table (``routes_v2`` + ``routes_scalable`` + ``routes_cluster`` +
``routes_transactions`` + ``routes_permissions`` + ``routes_schemas`` + the routes below)
feeds both the app and ``GET /openapi.json``. Every handler runs under the
authentication middleware (:mod:`anabranch.admin.authentication`: sets
``request["anabranch.role"]``, 401 without valid credentials when auth is on), then the
authorization middleware (``access.ROUTE_ACCESS`` says what each route needs; 403
AuthorizationError), inside one error middleware:

* :class:`~anabranch.errors.NotLeader` (a scalable-topic mutation on a non-leader)
  answers 307 with ``Location`` = the same path and query on the leader's HTTP address
  (503 while no leader is elected);
* an :class:`~anabranch.errors.AnabranchError` answers ``errors.HTTP_STATUS[type]`` with
  ``{"reason": str(err)}`` (Pulsar's error body);
* aiohttp's own HTTP errors (unknown path 404, wrong method 405, body too large 413) pass
  through with the same JSON body;
* anything else is logged with its traceback and answered 500 ``internal error``; the
  server never dies. Bodies say what ``error_codes.client_message`` says, never a file
  path or a traceback.

Example (a second admin listener for a running broker's service):
    >>> import asyncio, tempfile
    >>> from pathlib import Path
    >>> import aiohttp
    >>> from anabranch.testing.broker import InProcessBroker
    >>> async def run(service: BrokerService) -> None:
    ...     runner = await start_http(service, "127.0.0.1", 0)   # 0: any free port
    ...     port = runner.addresses[0][1]
    ...     async with aiohttp.ClientSession() as http:
    ...         async with http.get(f"http://127.0.0.1:{port}/admin/v2/tenants") as answer:
    ...             print(answer.status, await answer.json())
    ...     await runner.cleanup()
    >>> async def main() -> None:
    ...     with tempfile.TemporaryDirectory() as tmp:
    ...         async with InProcessBroker(Path(tmp)) as broker:
    ...             await run(broker.service)
    >>> asyncio.run(main())
    200 ['public']
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import msgspec
from aiohttp import web
from prometheus_client import CollectorRegistry

from anabranch.admin import (
    routes_autoscale,
    routes_cluster,
    routes_compaction,
    routes_inactive_topics,
    routes_messages,
    routes_nonpersistent,
    routes_offload,
    routes_permissions,
    routes_rates,
    routes_retention,
    routes_scalable,
    routes_schemas,
    routes_topic_limits,
    routes_transactions,
    routes_v2,
)
from anabranch.admin.access import authorization_middleware
from anabranch.admin.authentication import authentication_middleware
from anabranch.admin.http_guard import guarded_runner
from anabranch.admin.models import ErrorBody
from anabranch.admin.openapi import openapi_document
from anabranch.admin.routes import BODY_LIMIT, Route
from anabranch.admin.service import AdminService
from anabranch.broker.error_codes import client_message
from anabranch.broker.metrics import CONTENT_TYPE, broker_registry, render_off_loop
from anabranch.errors import HTTP_STATUS, AnabranchError, NotLeader

if TYPE_CHECKING:
    from anabranch.broker.service import BrokerService

log = logging.getLogger(__name__)

ADMIN_KEY = web.AppKey("admin", AdminService)
REGISTRY_KEY = web.AppKey("metrics_registry", CollectorRegistry)
SCRAPE_LOCK_KEY = web.AppKey("metrics_scrape_lock", asyncio.Lock)
"""One /metrics scrape formats at a time: a client looping on it queues behind itself."""


async def metrics(admin: AdminService, request: web.Request) -> object:
    body = await render_off_loop(request.app[REGISTRY_KEY], request.app[SCRAPE_LOCK_KEY])
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})


async def openapi(admin: AdminService, request: web.Request) -> object:
    return openapi_document(all_routes(), admin.http_url)


OWN_ROUTES: list[Route] = [
    Route("GET", "/metrics", metrics, "Prometheus metrics (text format).", "metrics",
          response_schema={"type": "string"}, errors=(), content_type=CONTENT_TYPE),
    Route("GET", "/openapi.json", openapi, "This OpenAPI document.", "meta",
          response_schema={"type": "object"}, errors=()),
]  # fmt: skip


def all_routes() -> list[Route]:
    """Every route the app serves, in registration order."""
    return [
        *routes_v2.ROUTES,
        *routes_retention.ROUTES,
        *routes_offload.ROUTES,
        *routes_scalable.ROUTES,
        *routes_cluster.ROUTES,
        *routes_transactions.ROUTES,
        *routes_permissions.ROUTES,
        *routes_autoscale.ROUTES,
        *routes_schemas.ROUTES,
        *routes_messages.ROUTES,
        *routes_nonpersistent.ROUTES,
        *routes_compaction.ROUTES,
        *routes_topic_limits.ROUTES,
        *routes_inactive_topics.ROUTES,
        *routes_rates.ROUTES,
        *OWN_ROUTES,
    ]


def error_response(status: int, reason: str) -> web.Response:
    """``{"reason": ...}`` with ``status``."""
    return web.Response(
        status=status, body=msgspec.json.encode(ErrorBody(reason)), content_type="application/json"
    )


@web.middleware
async def error_middleware(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """Map every failure to a JSON error answer (see the module docstring)."""
    try:
        return await handler(request)
    except NotLeader as err:
        if not err.leader_url:
            return error_response(503, str(err))  # no leader elected yet: retry later
        response = error_response(307, str(err))
        response.headers["Location"] = err.leader_url.rstrip("/") + request.path_qs
        return response
    except AnabranchError as err:
        status = HTTP_STATUS.get(type(err), err.http_status)
        if status >= 500:
            log.warning("%s %s: %s", request.method, request.path, err)
        return error_response(status, client_message(err))
    except web.HTTPException as err:
        if err.status < 400:
            raise
        return error_response(err.status, err.reason)
    except Exception as err:
        log.exception("%s %s failed", request.method, request.path)
        return error_response(500, client_message(err))


def _bind(route: Route) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    async def handle(request: web.Request) -> web.StreamResponse:
        result = await route.handler(request.app[ADMIN_KEY], request)
        if isinstance(result, web.StreamResponse):
            return result
        if result is None and route.response_schema is None:
            return web.Response(status=204)
        return web.Response(body=msgspec.json.encode(result), content_type="application/json")

    handle.__name__ = route.handler.__name__
    return handle


def build_app(admin: AdminService, registry: CollectorRegistry | None = None) -> web.Application:
    """The aiohttp application for ``admin`` (tests may serve it themselves)."""
    broker = admin.broker
    auth = authentication_middleware(
        getattr(broker, "authentication", None),
        authenticate_metrics=broker.config.authenticate_metrics_endpoint,
    )
    authorize = authorization_middleware(lambda request: request.app[ADMIN_KEY].broker.authorizer)
    app = web.Application(
        middlewares=[error_middleware, auth, authorize], client_max_size=BODY_LIMIT
    )
    app[ADMIN_KEY] = admin
    app[REGISTRY_KEY] = registry if registry is not None else broker_registry(admin.broker)
    app[SCRAPE_LOCK_KEY] = asyncio.Lock()
    for route in all_routes():
        app.router.add_route(route.method, route.path, _bind(route))

    async def close_admin(app: web.Application) -> None:
        await app[ADMIN_KEY].close()

    app.on_cleanup.append(close_admin)
    return app


async def start_http(
    service: BrokerService,
    host: str,
    port: int,
    *,
    ssl_context: ssl.SSLContext | None = None,
    tls_port: int | None = None,
    plaintext: bool = True,
) -> web.AppRunner:
    """Serve the admin API on ``host:port`` (0 picks a free port) on the running loop, and
    with ``ssl_context`` HTTPS on ``tls_port`` too (``plaintext`` False: HTTPS only).

    The bound URL is ``admin.http_url`` (also what lookups answer); stop with
    ``await runner.cleanup()``.
    """
    admin = AdminService(service)
    app = build_app(admin)
    runner = guarded_runner(app, access_log=None)
    await runner.setup()
    if plaintext:
        await web.TCPSite(runner, host, port, reuse_address=True).start()
    if ssl_context is not None and tls_port is not None:
        site = web.TCPSite(runner, host, tls_port, ssl_context=ssl_context, reuse_address=True)
        await site.start()
    ports = [int(a[1]) for a in runner.addresses if isinstance(a, tuple)]
    bound = ports[0] if ports else port
    advertised = getattr(service.config, "advertised_address", host) or host
    scheme = "http" if plaintext else "https"
    advertised_port = (
        getattr(service.config, "advertised_http_port", None) if plaintext else None
    ) or bound
    admin.http_url = f"{scheme}://{advertised}:{advertised_port}"
    log.info("admin HTTP on %s", admin.http_url)
    return runner
