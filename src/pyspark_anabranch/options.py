"""Parsing the connector's options (Spark hands them over as a case-insensitive dict of
strings) into small frozen, picklable dataclasses.

Example:
    >>> o = SourceOptions.parse({"serviceUrl": "pulsar://h:6650", "topic": "orders"})
    >>> (o.topics, o.admin_url, o.starting_offsets)
    (('public/default/orders',), 'http://h:8080', 'latest')
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from anabranch.client.connection import parse_service_urls
from anabranch.core.names import TopicDomain, TopicName
from anabranch.errors import InvalidArgument, NotAllowed
from anabranch.limits import CLIENT_OPERATION_TIMEOUT_S
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
    if not admin_url:
        host = brokers[0][0]
        admin_url = f"http://[{host}]:8080" if ":" in host else f"http://{host}:8080"
    client: dict[str, float] = {}
    for key, value in options.items():
        if key.lower().startswith("client."):
            name = key[len("client.") :]
            if name not in _CLIENT_OPTIONS:
                raise InvalidArgument(f"unknown client option {key!r} ({sorted(_CLIENT_OPTIONS)})")
            client[name] = float(value)
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
            poll_timeout_s=poll / 1000,
            client=client,
        )


@dataclass(frozen=True)
class SinkOptions:
    """The sink's options: ``serviceUrl``, ``adminUrl``, ``topic`` (else a ``topic`` column),
    ``deliveryGuarantee`` (``at_least_once``; ``exactly_once`` needs transactions)."""

    service_url: str
    admin_url: str
    topic: str | None
    client: Mapping[str, float] = field(default_factory=dict)

    @staticmethod
    def parse(options: Mapping[str, str]) -> SinkOptions:
        service_url, admin_url, client = _service(options)
        guarantee = (_get(options, "deliveryGuarantee") or "at_least_once").strip().lower()
        if guarantee == "exactly_once":
            raise NotAllowed(
                "deliveryGuarantee=exactly_once is not yet supported (it needs transactions); "
                "use deliveryGuarantee=at_least_once"
            )
        if guarantee != "at_least_once":
            raise InvalidArgument(f"deliveryGuarantee {guarantee!r}: use at_least_once")
        topic = _get(options, "topic")
        return SinkOptions(
            service_url,
            admin_url,
            topic_key(topic) if topic else None,
            client,
        )


__all__ = ["CLIENT_OPERATION_TIMEOUT_S", "SinkOptions", "SourceOptions", "topic_key"]
