"""Records cluster brokers keep in the shared metadata store, and their paths.

* ``/brokers/<broker id>`` (ephemeral, the broker's session) → :class:`BrokerRecord`: the
  broker's ``pulsar://`` and ``http://`` addresses and its load, rewritten periodically.
  The broker id is its advertised ``host:port``.
* ``/ownership/<domain>/<tenant>/<namespace>/<local name>`` (ephemeral, the owner's
  session) → :class:`OwnerRecord`. ``state`` is ``owned`` while the broker serves the
  topic; an unload moves it to ``releasing`` (the owner is closing the topic: nobody may
  take it) and then ``released`` (anyone may take it by CAS on the record's version, the
  named ``target`` first). A segment's record is under ``/ownership/segment/...``.

Example:
    >>> ownership_path("persistent://public/default/orders")
    '/ownership/persistent/public/default/orders'
    >>> ownership_path("segment://public/default/orders/0000-7fff-1")
    '/ownership/segment/public/default/orders/0000-7fff-1'
    >>> rec = OwnerRecord("b1:6650", "pulsar://b1:6650", "http://b1:8080", session=7)
    >>> decode_owner(encode(rec)) == rec
    True
"""

from __future__ import annotations

import enum

import msgspec

from anabranch.errors import InvalidArgument

BROKERS_PREFIX = "/brokers/"
OWNERSHIP_PREFIX = "/ownership/"


class OwnerState(enum.StrEnum):
    OWNED = "owned"
    RELEASING = "releasing"
    RELEASED = "released"


class BrokerRecord(msgspec.Struct, rename="camel", kw_only=True):
    """One live broker of the cluster, with the load it last reported."""

    broker_id: str
    pulsar_url: str
    http_url: str
    cluster: str
    pulsar_url_tls: str = ""
    """The broker's ``pulsar+ssl://`` URL ("" without a TLS listener)."""
    advertised_listeners: dict[str, list[str]] = msgspec.field(default_factory=dict)
    """Its named listeners' URLs (``advertised_listeners``), for lookups naming one."""
    owned_topics: int = 0
    loaded_topics: int = 0
    connections: int = 0
    msg_rate_in: float = 0.0
    msg_rate_out: float = 0.0
    msg_rate_long_term: float = 0.0
    """In + out msgs/s smoothed over ``CLUSTER_LOAD_RATE_HORIZON_S`` (what placement weighs:
    a burst of a few seconds barely moves it, a sustained rate does)."""
    reported_ms: int = 0


class OwnerRecord(msgspec.Struct, rename="camel"):
    """Who owns a topic; ``session`` is the owner's metadata session id (so a broker can
    tell its own record from one left by its previous, lost session)."""

    broker_id: str
    pulsar_url: str
    http_url: str
    state: OwnerState = OwnerState.OWNED
    target: str | None = None
    """The broker meant to take the topic over after an unload (None: any)."""
    session: int = 0
    pulsar_url_tls: str = ""
    """The owner's ``pulsar+ssl://`` URL ("" without a TLS listener)."""


def broker_path(broker_id: str) -> str:
    """``/brokers/<host:port>``."""
    return BROKERS_PREFIX + broker_id


def ownership_path(topic: str) -> str:
    """The ownership key of a canonical topic or segment name."""
    domain, sep, rest = topic.partition("://")
    if not sep or not domain or not rest:
        raise InvalidArgument(f"not a canonical topic name: {topic!r}")
    return f"{OWNERSHIP_PREFIX}{domain}/{rest}"


def topic_of_ownership_path(path: str) -> str:
    """Inverse of :func:`ownership_path`.

    >>> topic_of_ownership_path("/ownership/persistent/t/ns/x")
    'persistent://t/ns/x'
    """
    domain, _, rest = path[len(OWNERSHIP_PREFIX) :].partition("/")
    return f"{domain}://{rest}"


def encode(record: BrokerRecord | OwnerRecord) -> bytes:
    return msgspec.json.encode(record)


def decode_owner(data: bytes) -> OwnerRecord:
    try:
        return msgspec.json.decode(data, type=OwnerRecord)
    except msgspec.DecodeError as err:
        raise InvalidArgument(f"bad ownership record: {err}") from err


def decode_broker(data: bytes) -> BrokerRecord:
    try:
        return msgspec.json.decode(data, type=BrokerRecord)
    except msgspec.DecodeError as err:
        raise InvalidArgument(f"bad broker record: {err}") from err
