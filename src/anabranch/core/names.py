"""Tenant, namespace, topic and segment names: parse, format, validate.

Four topic domains (DESIGN.md §3.1):

    persistent://tenant/ns/name[-partition-N]    a classic Pulsar topic (or one partition)
    non-persistent://tenant/ns/name[-partition-N]
                                                 an in-memory Pulsar topic: messages go to
                                                 the consumers connected now, never to disk
    topic://tenant/ns/name                       a scalable topic (never partitioned)
    segment://tenant/ns/name/<start>-<end>-<id>  one segment of a scalable topic:
                                                 start/end as %04x, id in decimal

Short forms ``tenant/ns/name`` and ``name`` (tenant ``public``, namespace ``default``) take
the caller's default domain, ``persistent`` unless told otherwise, as Pulsar does.

A name component (tenant, namespace, topic local name) is 1..255 ASCII characters from
``[A-Za-z0-9_.=:-]`` and is not ``.`` or ``..``: the components become metadata-store path
segments and segment topic names, so ``/``, ``%``, ``&``, spaces and control characters are
rejected rather than escaped. Every rejection is :class:`~anabranch.errors.InvalidArgument`
with the reason in its message. Formatting a parsed name gives back the canonical text,
so ``str(parse(x)) == x`` for every canonical ``x``.

Example:
    >>> t = TopicName.parse("public/default/orders", default_domain=TopicDomain.TOPIC)
    >>> str(t)
    'topic://public/default/orders'
    >>> s = SegmentName.parse("segment://public/default/orders/0000-7fff-1")
    >>> (str(s.topic), s.hash_range.to_hex(), s.segment_id)
    ('topic://public/default/orders', '0000-7fff', 1)
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum

from anabranch.core.hash_range import HashRange
from anabranch.errors import InvalidArgument

DEFAULT_TENANT = "public"
DEFAULT_NAMESPACE = "default"

NAME_COMPONENT_CHARS_MAX = 255
"""Longest tenant, namespace or local name; longer names raise InvalidArgument. Matches the
common file-name limit, and keeps full metadata paths well under METADATA_PATH_BYTES_MAX."""

PARTITION_INDEX_MAX = 2**31 - 1
"""Largest partition index: Pulsar's partition number is a Java int."""

SEGMENT_ID_MAX = 2**63 - 1
"""Largest segment id: upstream's segment id is a Java long."""

_COMPONENT_RE = re.compile(r"[A-Za-z0-9_.=:\-]+")
_PARTITION_RE = re.compile(r"(.+)-partition-(0|[1-9][0-9]*)")
_DESCRIPTOR_RE = re.compile(r"([0-9a-f]{4})-([0-9a-f]{4})-(0|[1-9][0-9]*)")


class TopicDomain(StrEnum):
    """The scheme of a topic name."""

    PERSISTENT = "persistent"
    NON_PERSISTENT = "non-persistent"
    TOPIC = "topic"
    SEGMENT = "segment"


def validate_component(kind: str, value: str) -> str:
    """Return ``value`` if it is a valid name component, else raise InvalidArgument.

    ``kind`` ("tenant", "namespace", "topic") only names the component in the message.

    Example:
        >>> validate_component("tenant", "public")
        'public'
    """
    if not isinstance(value, str):
        raise InvalidArgument(f"{kind} name {value!r} is not a string")
    if not value:
        raise InvalidArgument(f"{kind} name is empty")
    if len(value) > NAME_COMPONENT_CHARS_MAX:
        raise InvalidArgument(
            f"{kind} name is {len(value)} characters, over {NAME_COMPONENT_CHARS_MAX}"
        )
    if _COMPONENT_RE.fullmatch(value) is None:
        raise InvalidArgument(f"{kind} name {value!r} has characters outside [A-Za-z0-9_.=:-]")
    if value in (".", ".."):
        raise InvalidArgument(f"{kind} name {value!r} is reserved")
    return value


@dataclass(frozen=True, slots=True)
class NamespaceName:
    """``tenant/namespace``.

    Example:
        >>> n = NamespaceName.parse("public/default")
        >>> (n.tenant, n.namespace, str(n))
        ('public', 'default', 'public/default')
    """

    tenant: str
    namespace: str

    def __post_init__(self) -> None:
        validate_component("tenant", self.tenant)
        validate_component("namespace", self.namespace)

    @classmethod
    def parse(cls, text: str) -> NamespaceName:
        """Parse ``tenant/namespace``; anything else raises InvalidArgument."""
        parts = _split_path("namespace", text, 2)
        return cls(parts[0], parts[1])

    def __str__(self) -> str:
        return f"{self.tenant}/{self.namespace}"


@dataclass(frozen=True, slots=True)
class TopicName:
    """A ``persistent://``, ``non-persistent://`` or ``topic://`` name; ``local_name``
    excludes any partition suffix.

    Example:
        >>> p = TopicName.parse("persistent://t/ns/x-partition-3")
        >>> (p.local_name, p.partition, str(p.base), str(p))
        ('x', 3, 'persistent://t/ns/x', 'persistent://t/ns/x-partition-3')
        >>> n = TopicName.parse("non-persistent://t/ns/live")
        >>> (n.domain, n.is_persistent, str(n))
        (<TopicDomain.NON_PERSISTENT: 'non-persistent'>, False, 'non-persistent://t/ns/live')
    """

    domain: TopicDomain
    tenant: str
    namespace: str
    local_name: str
    partition: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.domain, TopicDomain) or self.domain is TopicDomain.SEGMENT:
            raise InvalidArgument(
                f"topic domain {self.domain!r} is not 'persistent', 'non-persistent' or 'topic'"
                " (segments are SegmentName)"
            )
        validate_component("tenant", self.tenant)
        validate_component("namespace", self.namespace)
        validate_component("topic", self.local_name)
        if _PARTITION_RE.fullmatch(self.local_name) is not None:
            # Otherwise "x-partition-1" with no partition would format as partition 1 of x.
            raise InvalidArgument(
                f"topic local name {self.local_name!r} ends in a -partition-N suffix"
            )
        if self.partition is not None:
            if self.domain is TopicDomain.TOPIC:
                raise InvalidArgument("a scalable topic:// name cannot have a partition")
            if (
                not isinstance(self.partition, int)
                or isinstance(self.partition, bool)
                or not 0 <= self.partition <= PARTITION_INDEX_MAX
            ):
                raise InvalidArgument(
                    f"partition {self.partition!r} is outside [0, {PARTITION_INDEX_MAX}]"
                )
        # The full local name is a component too: the suffix must not push it over the limit.
        validate_component("topic", self.full_local_name)

    @classmethod
    def parse(cls, text: str, default_domain: TopicDomain = TopicDomain.PERSISTENT) -> TopicName:
        """Parse a full or short topic name; ``segment://`` names raise (use SegmentName).

        Example:
            >>> str(TopicName.parse("orders"))
            'persistent://public/default/orders'
        """
        name = parse_name(text, default_domain)
        if isinstance(name, SegmentName):
            raise InvalidArgument(f"{text!r} is a segment name, not a topic name")
        return name

    @property
    def namespace_name(self) -> NamespaceName:
        """The topic's ``tenant/namespace``."""
        return NamespaceName(self.tenant, self.namespace)

    @property
    def is_persistent(self) -> bool:
        """False for a ``non-persistent://`` topic (nothing of it is ever stored)."""
        return self.domain is not TopicDomain.NON_PERSISTENT

    @property
    def full_local_name(self) -> str:
        """The local name with its ``-partition-N`` suffix, if any."""
        if self.partition is None:
            return self.local_name
        return f"{self.local_name}-partition-{self.partition}"

    @property
    def base(self) -> TopicName:
        """The partitioned topic this partition belongs to (itself if not a partition)."""
        return TopicName(self.domain, self.tenant, self.namespace, self.local_name)

    def with_partition(self, index: int) -> TopicName:
        """Partition ``index`` of this (persistent) topic."""
        return TopicName(self.domain, self.tenant, self.namespace, self.local_name, index)

    @property
    def short_name(self) -> str:
        """``tenant/ns/local`` without the domain."""
        return f"{self.tenant}/{self.namespace}/{self.full_local_name}"

    def __str__(self) -> str:
        return f"{self.domain.value}://{self.short_name}"


@dataclass(frozen=True, slots=True)
class SegmentName:
    """``segment://t/ns/x/<start>-<end>-<id>``: one segment of the scalable topic ``topic``.

    Example:
        >>> parent = TopicName.parse("topic://tenant/ns/my-topic")
        >>> str(SegmentName(parent, HashRange(0, 0x7FFF), 1))
        'segment://tenant/ns/my-topic/0000-7fff-1'
    """

    topic: TopicName
    hash_range: HashRange
    segment_id: int

    def __post_init__(self) -> None:
        if not isinstance(self.topic, TopicName) or self.topic.domain is not TopicDomain.TOPIC:
            raise InvalidArgument(f"segment parent {self.topic} is not a topic:// name")
        if not isinstance(self.hash_range, HashRange):
            raise InvalidArgument(f"segment hash range {self.hash_range!r} is not a HashRange")
        if (
            not isinstance(self.segment_id, int)
            or isinstance(self.segment_id, bool)
            or not 0 <= self.segment_id <= SEGMENT_ID_MAX
        ):
            raise InvalidArgument(f"segment id {self.segment_id!r} is outside [0, 2^63-1]")

    @classmethod
    def parse(cls, text: str) -> SegmentName:
        """Parse a full ``segment://`` name (there is no short form for segments)."""
        name = parse_name(text, TopicDomain.SEGMENT)
        if not isinstance(name, SegmentName):
            raise InvalidArgument(f"{text!r} is not a segment:// name")
        return name

    @property
    def descriptor(self) -> str:
        """``"%04x-%04x-%d"`` of the range and id, the last path component."""
        return f"{self.hash_range.to_hex()}-{self.segment_id}"

    @staticmethod
    def parse_descriptor(text: str) -> tuple[HashRange, int]:
        """Parse ``<start>-<end>-<id>`` into a range and an id.

        Example:
            >>> SegmentName.parse_descriptor("0000-7fff-3")
            (HashRange(start=0, end=32767), 3)
        """
        match = _DESCRIPTOR_RE.fullmatch(text) if isinstance(text, str) else None
        if match is None:
            raise InvalidArgument(
                f"segment descriptor {text!r} is not '<hhhh>-<hhhh>-<decimal id>'"
            )
        segment_id = int(match.group(3))
        if segment_id > SEGMENT_ID_MAX:
            raise InvalidArgument(f"segment id {segment_id} is over 2^63-1")
        return HashRange(int(match.group(1), 16), int(match.group(2), 16)), segment_id

    def __str__(self) -> str:
        return f"segment://{self.topic.short_name}/{self.descriptor}"


def parse_name(
    text: str, default_domain: TopicDomain = TopicDomain.PERSISTENT
) -> TopicName | SegmentName:
    """Parse any topic or segment name; short forms take ``default_domain``.

    Example:
        >>> parse_name("segment://t/ns/x/0000-ffff-0").segment_id
        0
        >>> str(parse_name("t/ns/x", TopicDomain.TOPIC))
        'topic://t/ns/x'
    """
    if not isinstance(text, str):
        raise InvalidArgument(f"topic name {text!r} is not a string")
    scheme, sep, rest = text.partition("://")
    if sep:
        try:
            domain = TopicDomain(scheme)
        except ValueError:
            raise InvalidArgument(
                f"topic name {text!r} has unknown domain {scheme!r}"
                " (expected persistent, non-persistent, topic or segment)"
            ) from None
        parts = _split_path("topic", rest, 4 if domain is TopicDomain.SEGMENT else 3)
    else:
        domain = default_domain
        if domain is TopicDomain.SEGMENT:
            raise InvalidArgument(f"segment name {text!r} must be a full segment:// name")
        if "/" not in text:
            # Pulsar's single-word short form lives in public/default.
            parts = [DEFAULT_TENANT, DEFAULT_NAMESPACE, validate_component("topic", text)]
        else:
            parts = _split_path("topic", text, 3)
    tenant, namespace, local = parts[0], parts[1], parts[2]
    if domain is TopicDomain.SEGMENT:
        hash_range, segment_id = SegmentName.parse_descriptor(parts[3])
        return SegmentName(
            TopicName(TopicDomain.TOPIC, tenant, namespace, local), hash_range, segment_id
        )
    partition: int | None = None
    match = _PARTITION_RE.fullmatch(local)
    if match is not None:
        if domain is TopicDomain.TOPIC:
            raise InvalidArgument(f"scalable topic name {text!r} cannot have a partition suffix")
        local, partition = match.group(1), int(match.group(2))
    return TopicName(domain, tenant, namespace, local, partition)


def _split_path(kind: str, text: str, count: int) -> list[str]:
    """Split ``a/b/...`` into exactly ``count`` validated components."""
    parts = text.split("/")
    if len(parts) != count:
        raise InvalidArgument(
            f"{kind} name {text!r} has {len(parts)} path components, expected {count}"
        )
    names = ("tenant", "namespace", "topic", "segment descriptor")
    for name, part in zip(names[: min(count, 3)], parts, strict=False):
        validate_component(name, part)
    return parts
