"""Who sent this HTTP request: the admin app's authentication middleware.

With authentication on, every request is authenticated before its handler runs, from the
first of:

* ``Authorization: Bearer <jwt>`` -> the ``token`` provider;
* ``Authorization: Basic base64(user:password)`` -> the ``basic`` provider;
* the verified client certificate of an HTTPS connection -> the ``tls`` provider;
* nothing -> the anonymous role when configured.

Failure raises :class:`~anabranch.errors.AuthenticationError`, which the error middleware
answers 401 ``{"reason": ...}``. The role is stored as ``request["anabranch.role"]``
(:data:`ROLE`; None when authentication is disabled) for authorization and handlers.

Paths in :data:`OPEN_PATHS` (the health check a load balancer polls) are served without
credentials (role None unless some were sent and are valid); ``GET /metrics`` needs them
unless ``authenticate_metrics_endpoint`` is off (Pulsar's default is on).

Example:
    >>> basic_credentials("Basic " + base64.b64encode(b"ann:pw").decode())
    b'ann:pw'
"""

from __future__ import annotations

import base64
import binascii
import warnings
from collections.abc import Awaitable, Callable
from typing import Final

from aiohttp import web
from aiohttp.typedefs import Middleware
from aiohttp.web_exceptions import NotAppKeyWarning

from anabranch.errors import AuthenticationError
from anabranch.security.authentication import (
    AuthenticationService,
    Credentials,
    PeerCertificate,
)

ROLE: Final = "anabranch.role"
"""``request[ROLE]``: the authenticated role, or None (auth off, or an open path)."""

OPEN_PATHS: Final = frozenset({"/admin/v2/brokers/health"})
"""Served without credentials."""

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def request_role(request: web.Request) -> str | None:
    """The role the middleware stored (None when disabled or anonymous)."""
    role = request.get(ROLE)
    return role if isinstance(role, str) else None


def _set_role(request: web.Request, role: str | None) -> None:
    # The key is a plain string by contract (other modules read request["anabranch.role"]);
    # aiohttp recommends RequestKey objects and warns once per string key.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NotAppKeyWarning)
        request[ROLE] = role


def basic_credentials(header: str) -> bytes:
    """``user:password`` from an ``Authorization: Basic`` header value."""
    encoded = header[len("Basic ") :].strip()
    try:
        return base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError):
        raise AuthenticationError("malformed Basic credentials") from None


def peer_certificate(request: web.Request) -> PeerCertificate | None:
    """The verified client certificate of an HTTPS request, if any."""
    transport = request.transport
    if transport is None:
        return None
    cert = transport.get_extra_info("peercert")
    return cert if isinstance(cert, dict) and cert else None


def authentication_middleware(
    service: AuthenticationService | None, *, authenticate_metrics: bool = True
) -> Middleware:
    """The middleware for ``service`` (None: authentication disabled)."""

    @web.middleware
    async def authenticate(request: web.Request, handler: Handler) -> web.StreamResponse:
        if service is None:
            _set_role(request, None)
            return await handler(request)
        open_path = request.path in OPEN_PATHS or (
            request.path == "/metrics" and not authenticate_metrics
        )
        try:
            role = await _authenticate(service, request)
        except AuthenticationError:
            if not open_path:
                raise
            role = None
        _set_role(request, role)
        return await handler(request)

    return authenticate


async def _authenticate(service: AuthenticationService, request: web.Request) -> str:
    header = request.headers.get("Authorization", "")
    cert = peer_certificate(request)
    if header.startswith("Bearer "):
        method, data = "token", header[len("Bearer ") :].strip().encode("utf-8")
    elif header.startswith("Basic "):
        method, data = "basic", basic_credentials(header)
    elif header:
        raise AuthenticationError("unsupported Authorization scheme")
    else:
        method, data = "", b""
    result = await service.authenticate(method, Credentials(data, cert))
    return result.role
