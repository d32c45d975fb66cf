"""Pulsar admin v2 routes that look at or expire stored messages (``admin/messages.py``)::

    GET  /admin/v2/persistent/{t}/{ns}/{topic}/subscription/{sub}/position/{messagePosition}
    GET  /admin/v2/persistent/{t}/{ns}/{topic}/examinemessage
                                        ?initialPosition=earliest|latest&messagePosition=N
    GET  /admin/v2/persistent/{t}/{ns}/{topic}/ledger/{ledgerId}/entry/{entryId}
    POST /admin/v2/persistent/{t}/{ns}/{topic}/subscription/{sub}/expireMessages/{seconds}
    POST /admin/v2/persistent/{t}/{ns}/{topic}/all_subscription/expireMessages/{seconds}

The three reads answer ``application/octet-stream`` with ``X-Pulsar-*`` headers, as upstream.

Example:
    >>> [r.method for r in ROUTES]
    ['GET', 'GET', 'GET', 'POST', 'POST']
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from aiohttp import web

from anabranch.admin.messages import (
    entry_headers,
    expire,
    nth_from,
    nth_unacknowledged,
    read_at,
    split_entry,
)
from anabranch.admin.routes import Route, int_param, param, topic_param
from anabranch.errors import InvalidArgument, NotFound
from anabranch.storage.api import Entry, Position

if TYPE_CHECKING:
    from anabranch.admin.service import AdminService

TOPIC = "/admin/v2/persistent/{tenant}/{namespace}/{topic}"
SUB = f"{TOPIC}/subscription/{{subscription}}"
EXPIRE_SECONDS_MAX = 100 * 365 * 24 * 3600


def _raw(entry: Entry) -> web.Response:
    message = split_entry(entry)
    return web.Response(
        body=message.payload,
        headers=entry_headers(entry.position, message.metadata),
        content_type="application/octet-stream",
    )


def _query_int(request: web.Request, name: str, default: int) -> int:
    text = request.query.get(name)
    if text is None:
        return default
    try:
        return int(text)
    except ValueError:
        raise InvalidArgument(f"{name} {text!r} is not an integer") from None


async def peek(admin: AdminService, request: web.Request) -> object:
    topic = await admin.existing_topic(topic_param(request))
    n = int_param(request, "messagePosition")
    return _raw(await nth_unacknowledged(topic, param(request, "subscription"), n))


async def examine(admin: AdminService, request: web.Request) -> object:
    topic = await admin.existing_topic(topic_param(request))
    initial = request.query.get("initialPosition", "latest").lower()
    n = _query_int(request, "messagePosition", 1)
    return _raw(await nth_from(topic.ledger, initial, n))


async def get_by_id(admin: AdminService, request: web.Request) -> object:
    topic = await admin.existing_topic(topic_param(request))
    position = Position(int_param(request, "ledgerId"), int_param(request, "entryId"))
    return _raw(await read_at(topic.ledger, position))


def _cutoff_ms(request: web.Request) -> int:
    seconds = int_param(request, "expireTimeInSeconds")
    if seconds < 0 or seconds > EXPIRE_SECONDS_MAX:
        raise InvalidArgument(f"expireTimeInSeconds {seconds} is outside [0, 100 years]")
    return int(time.time() * 1000) - seconds * 1000


async def expire_messages(admin: AdminService, request: web.Request) -> object:
    topic = await admin.existing_topic(topic_param(request))
    await expire(topic, param(request, "subscription"), _cutoff_ms(request))
    return None


async def expire_all(admin: AdminService, request: web.Request) -> object:
    topic = await admin.existing_topic(topic_param(request))
    cutoff = _cutoff_ms(request)
    for name in list(topic.subscriptions):
        try:
            await expire(topic, name, cutoff)
        except NotFound:
            continue  # a non-durable subscription has no cursor to move
    return None


BYTES = {"type": "string", "format": "binary"}
ROUTES: list[Route] = [
    Route("GET", f"{SUB}/position/{{messagePosition}}", peek,
          "Peek the N-th message of a subscription's backlog (raw, X-Pulsar-* headers).",
          "persistent", response_schema=BYTES, content_type="application/octet-stream"),
    Route("GET", f"{TOPIC}/examinemessage", examine,
          "The N-th message from the earliest or latest (?initialPosition&messagePosition).",
          "persistent", response_schema=BYTES, content_type="application/octet-stream",
          query=("initialPosition", "messagePosition")),
    Route("GET", f"{TOPIC}/ledger/{{ledgerId}}/entry/{{entryId}}", get_by_id,
          "The message at a message id.", "persistent", response_schema=BYTES,
          content_type="application/octet-stream"),
    Route("POST", f"{SUB}/expireMessages/{{expireTimeInSeconds}}", expire_messages,
          "Acknowledge a subscription's messages older than N seconds.", "persistent"),
    Route("POST", f"{TOPIC}/all_subscription/expireMessages/{{expireTimeInSeconds}}",
          expire_all, "Expire messages older than N seconds on every subscription.",
          "persistent"),
]  # fmt: skip
