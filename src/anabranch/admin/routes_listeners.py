"""HTTP lookups naming an advertised listener (``?listenerName=`` or the
``X-Pulsar-ListenerName`` header, as upstream's ``/lookup/v2/topic``): the answer carries
that listener's URLs of the topic's broker; an unknown name is a 404
(:class:`~anabranch.errors.ListenerNotFound`), never the default URLs.

Example:
    >>> # GET /lookup/v2/topic/persistent/public/default/t?listenerName=external
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

from anabranch.admin.models import LookupData
from anabranch.broker.advertised_listeners import from_record, listener_urls, parse_listeners

if TYPE_CHECKING:
    from anabranch.admin.service import AdminService


async def listener_lookup(admin: AdminService, data: LookupData, name: str) -> LookupData:
    """``data`` (where the topic is served) with the URLs of listener ``name`` of the
    broker it names."""
    broker = admin.broker
    ownership = getattr(broker, "ownership", None)
    published = getattr(ownership, "published_listeners", None)
    if published is not None and data.broker_url != broker.advertised_url:
        listeners = from_record(await published(data.broker_url))
    else:
        listeners = parse_listeners(broker.config.advertised_listeners)
    chosen = listener_urls(listeners, name)
    return msgspec.structs.replace(
        data,
        broker_url=chosen.pulsar_url,
        native_url=chosen.pulsar_url,
        broker_url_tls=chosen.pulsar_url_tls,
    )
