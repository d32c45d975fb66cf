"""Parsing the connector's options (Spark hands them over as a case-insensitive dict of
strings) into small frozen, picklable dataclasses.

Example:
    >>> o = SourceOptions.parse({"serviceUrl": "pulsar://h:6650", "topic": "orders"})
    >>> (o.topics, o.admin_url, o.starting_offsets)
    (('public/default/orders',), 'http://h:8080', 'latest')
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from anabranch.client.connection import parse_service_urls
from anabranch.core.names import TopicDomain, TopicName
from anabranch.errors import InvalidArgument
from anabranch.limits import (
    CLIENT_OPERATION_TIMEOUT_S,
    TXN_SINK_KEY_BYTES_MAX,
    TXN_TIMEOUT_MAX_MS,
)
from pyspark_anabranch.planning import parse_duration_ms

DEFAULT_POLL_TIMEOUT_MS = 120_000
DEFAULT_MAX_TRIGGER_DELAY = "15m"
_CLIENT_OPTIONS = {"operation_timeout_s", "keepalive_interval_s"}


def _get(options: Mapping[str, str], name: str) -> str | None:
    # Spark's dict is case-insensitive; a plain dict in tests may not be.
    if name in options:
        return options[name]
    lowered = {k.lower(): v for k, v in options.items()}
    return lowered.get(name.lower())


def _bool(options: Mapping[str, str], name: str, default: bool) -> bool:
    raw = _get(options, name)
    if raw is None:
        return default
    if raw.strip().lower() in ("true", "1", "yes"):
        return True
    if raw.strip().lower() in ("false", "0", "no"):
        return False
    raise InvalidArgument(f"option {name}={raw!r} is not true/false")


def _int(options: Mapping[str, str], name: str) -> int | None:
    raw = _get(options, name)
    if raw is None:
        return None
    try:
        value = int(raw)
    except ValueError as err:
        raise InvalidArgument(f"option {name}={raw!r} is not an integer") from err
    if value <= 0:
        raise InvalidArgument(f"option {name} must be > 0")
    return value


def _timestamp(options: Mapping[str, str]) -> int | None:
    """``startingTimestamp``: milliseconds since the epoch, >= 0."""
    raw = _get(options, "startingTimestamp")
    if raw is None:
        return None
    try:
        value = int(raw.strip())
    except ValueError as err:
        raise InvalidArgument(
            f"option startingTimestamp={raw!r} is not milliseconds since the epoch"
        ) from err
    if value < 0:
        raise InvalidArgument("option startingTimestamp must be >= 0")
    return value


def topic_key(topic: str) -> str:
    """``t/ns/x`` of ``topic://t/ns/x``, ``t/ns/x`` or ``x`` (public/default).

    Example:
        >>> topic_key("topic://a/b/c"), topic_key("orders")
        ('a/b/c', 'public/default/orders')
    """
    name = TopicName.parse(topic.strip(), TopicDomain.TOPIC)
    if name.domain is not TopicDomain.TOPIC:
        raise InvalidArgument(f"{topic!r} is not a scalable topic:// name")
    return f"{name.tenant}/{name.namespace}/{name.local_name}"


def _service(options: Mapping[str, str]) -> tuple[str, str, dict[str, float]]:
    service_url = _get(options, "serviceUrl")
    if not service_url:
        raise InvalidArgument("option serviceUrl is required (e.g. pulsar://localhost:6650)")
    brokers = parse_service_urls(service_url)  # a bad URL fails here, on the driver
    admin_url = _get(options, "adminUrl")
    if admin_url and not admin_url.startswith(("http://", "https://")):
        raise InvalidArgument(f"option adminUrl {admin_url!r} is not an http:// or https:// URL")
    if not admin_url:
        host = brokers[0][0]
        admin_url = f"http://[{host}]:8080" if ":" in host else f"http://{host}:8080"
    client: dict[str, float] = {}
    for key, value in options.items():
        if key.lower().startswith("client."):
            name = key[len("client.") :]
            if name not in _CLIENT_OPTIONS:
                raise InvalidArgument(f"unknown client option {key!r} ({sorted(_CLIENT_OPTIONS)})")
            try:
                number = float(value)
            except ValueError:
                raise InvalidArgument(f"option {key}={value!r} is not a number") from None
            # NaN or infinity would reach the client's timers, where no wait ever ends.
            if not math.isfinite(number) or number <= 0:
                raise InvalidArgument(f"option {key} must be a finite number > 0")
            client[name] = number
    return service_url, admin_url, client


@dataclass(frozen=True)
class SourceOptions:
    """The source's options (see DESIGN.md §3.7 and the package docstring)."""

    service_url: str
    admin_url: str
    topics: tuple[str, ...]
    starting_offsets: str = "latest"
    ending_offsets: str = "latest"
    starting_timestamp: int | None = None
    max_records: int | None = None
    max_bytes: int | None = None
    min_records: int | None = None
    max_trigger_delay_ms: int = 15 * 60_000
    fail_on_data_loss: bool = True
    include_properties: bool = False
    ack_subscription: str | None = None
    read_compacted: bool = False
    """``readCompacted``: read each segment's compacted view (the latest message per key)
    up to its compaction horizon, then its tail (table-like reads)."""
    poll_timeout_s: float = DEFAULT_POLL_TIMEOUT_MS / 1000
    client: Mapping[str, float] = field(default_factory=dict)

    @staticmethod
    def parse(options: Mapping[str, str], *, batch: bool = False) -> SourceOptions:
        service_url, admin_url, client = _service(options)
        raw_topics = _get(options, "topic") or _get(options, "topics")
        if not raw_topics:
            raise InvalidArgument("option topic (or topics, comma-separated) is required")
        topics = tuple(sorted({topic_key(t) for t in raw_topics.split(",") if t.strip()}))
        explicit_start = _get(options, "startingOffsets")
        starting = explicit_start or ("earliest" if batch else "latest")
        ending = _get(options, "endingOffsets") or "latest"
        if batch and starting.strip() == "latest":
            raise InvalidArgument("startingOffsets=latest makes no sense for a batch read")
        timestamp = _timestamp(options)
        if timestamp is not None and explicit_start is not None:
            raise InvalidArgument(
                "startingTimestamp and startingOffsets are mutually exclusive: give one"
            )
        isolation = (_get(options, "isolationLevel") or "read_committed").strip()
        if isolation != "read_committed":
            raise InvalidArgument(f"isolationLevel {isolation!r}: only read_committed exists")
        max_records = _int(options, "maxRecordsPerTrigger") or _int(options, "maxOffsetsPerTrigger")
        delay = _get(options, "maxTriggerDelay") or DEFAULT_MAX_TRIGGER_DELAY
        poll = _int(options, "pollTimeoutMs") or DEFAULT_POLL_TIMEOUT_MS
        return SourceOptions(
            service_url=service_url,
            admin_url=admin_url,
            topics=topics,
            starting_offsets=starting.strip(),
            ending_offsets=ending.strip(),
            starting_timestamp=timestamp,
            max_records=max_records,
            max_bytes=_int(options, "maxBytesPerTrigger"),
            min_records=_int(options, "minRecordsPerTrigger"),
            max_trigger_delay_ms=parse_duration_ms(delay),
            fail_on_data_loss=_bool(options, "failOnDataLoss", True),
            include_properties=_bool(options, "includeProperties", False),
            ack_subscription=_get(options, "ackSubscription") or None,
            read_compacted=_bool(options, "readCompacted", False),
            poll_timeout_s=poll / 1000,
            client=client,
        )


DELIVERY_GUARANTEES = ("exactly_once", "at_least_once")
DEFAULT_DELIVERY_GUARANTEE = "exactly_once"
DEFAULT_TXN_TIMEOUT_MS = 120_000
"""An open batch transaction older than this is aborted by the broker (and redone by Spark's
replay); while it is open, read-committed readers of the output stop before its first entry."""

BATCH_JOB_KEY_SUFFIX_CHARS = 33
"""What a batch ``df.write`` appends to its sink key: ``.`` and a uuid's 32 hex digits."""


def check_sink_key(key: str, what: str = "sinkId") -> str:
    """``key`` if it can name batch transactions: 1 to TXN_SINK_KEY_BYTES_MAX UTF-8 bytes, no
    ``&`` (the transaction-key separator), no ``/`` (it goes in a URL path segment), no control
    characters or spaces.

    Example:
        >>> check_sink_key("orders-upper")
        'orders-upper'
        >>> check_sink_key("a&b")
        Traceback (most recent call last):
        ...
        anabranch.errors.InvalidArgument: sinkId 'a&b': '&' cannot go in a sink key
    """
    if not key:
        raise InvalidArgument(f"{what} is empty")
    size = len(key.encode())
    if size > TXN_SINK_KEY_BYTES_MAX:
        raise InvalidArgument(
            f"{what} is {size} bytes long; a sink key is at most {TXN_SINK_KEY_BYTES_MAX}"
        )
    for ch in key:
        if ch in "&/":
            raise InvalidArgument(f"{what} {key!r}: {ch!r} cannot go in a sink key")
        if not ch.isprintable() or ch.isspace():
            raise InvalidArgument(
                f"{what} {key!r}: control characters and spaces cannot go in a sink key"
            )
    return key


@dataclass(frozen=True)
class SinkOptions:
    """The sink's options: ``serviceUrl``, ``adminUrl``, ``topic`` (else a ``topic`` column),
    ``deliveryGuarantee`` (``exactly_once``, the default: one batch transaction per
    micro-batch; or ``at_least_once``: plain produce), ``sinkId`` (the batch transactions' key;
    default: the streaming query id), ``txnTimeoutMs`` (default 120000)."""

    service_url: str
    admin_url: str
    topic: str | None
    client: Mapping[str, float] = field(default_factory=dict)
    delivery_guarantee: str = DEFAULT_DELIVERY_GUARANTEE
    sink_id: str | None = None
    txn_timeout_ms: int = DEFAULT_TXN_TIMEOUT_MS

    @property
    def exactly_once(self) -> bool:
        return self.delivery_guarantee == "exactly_once"

    @staticmethod
    def parse(options: Mapping[str, str]) -> SinkOptions:
        service_url, admin_url, client = _service(options)
        raw = _get(options, "deliveryGuarantee") or DEFAULT_DELIVERY_GUARANTEE
        guarantee = raw.strip().lower()
        if guarantee not in DELIVERY_GUARANTEES:
            raise InvalidArgument(
                f"deliveryGuarantee {raw!r}: use one of {', '.join(DELIVERY_GUARANTEES)}"
            )
        sink_id = _get(options, "sinkId")
        if sink_id is not None:
            sink_id = sink_id.strip()
            check_sink_key(sink_id)
            # a batch df.write appends ".<job uuid>": the whole key must fit too
            check_sink_key(sink_id + "." + "0" * (BATCH_JOB_KEY_SUFFIX_CHARS - 1))
        timeout = _int(options, "txnTimeoutMs") or DEFAULT_TXN_TIMEOUT_MS
        if timeout > TXN_TIMEOUT_MAX_MS:
            raise InvalidArgument(f"txnTimeoutMs {timeout} is over the limit {TXN_TIMEOUT_MAX_MS}")
        topic = _get(options, "topic")
        return SinkOptions(
            service_url,
            admin_url,
            topic_key(topic) if topic else None,
            client,
            delivery_guarantee=guarantee,
            sink_id=sink_id,
            txn_timeout_ms=timeout,
        )


__all__ = [
    "CLIENT_OPERATION_TIMEOUT_S",
    "SinkOptions",
    "SourceOptions",
    "check_sink_key",
    "topic_key",
]
