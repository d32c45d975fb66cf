"""Topic, segment and namespace names (upstream SegmentTopicNameTest, TopicName rules)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from anabranch.core.hash_range import HashRange
from anabranch.core.names import (
    NAME_COMPONENT_CHARS_MAX,
    NamespaceName,
    SegmentName,
    TopicDomain,
    TopicName,
    parse_name,
)
from anabranch.errors import InvalidArgument

components = st.text(alphabet="abcXYZ019_.=:-", min_size=1, max_size=20).filter(
    lambda s: s not in (".", "..") and "-partition-" not in s
)


def test_persistent_full_name() -> None:
    t = TopicName.parse("persistent://public/default/orders")
    assert (t.domain, t.tenant, t.namespace, t.local_name, t.partition) == (
        TopicDomain.PERSISTENT,
        "public",
        "default",
        "orders",
        None,
    )
    assert t.namespace_name == NamespaceName("public", "default")
    assert str(t) == "persistent://public/default/orders"


def test_partition_suffix() -> None:
    t = TopicName.parse("persistent://t/ns/x-partition-12")
    assert (t.local_name, t.partition, t.full_local_name) == ("x", 12, "x-partition-12")
    assert t.base == TopicName.parse("persistent://t/ns/x")
    assert t.base.with_partition(12) == t
    # Leading zeros are not the canonical form, so they are just part of the local name.
    odd = TopicName.parse("persistent://t/ns/x-partition-012")
    assert (odd.local_name, odd.partition) == ("x-partition-012", None)


def test_local_name_that_looks_partitioned_needs_the_field() -> None:
    with pytest.raises(InvalidArgument, match="partition"):
        TopicName(TopicDomain.PERSISTENT, "t", "ns", "x-partition-1")


def test_scalable_topic_cannot_be_partitioned() -> None:
    with pytest.raises(InvalidArgument, match="partition"):
        TopicName.parse("topic://t/ns/x-partition-1")
    with pytest.raises(InvalidArgument, match="partition"):
        TopicName(TopicDomain.TOPIC, "t", "ns", "x", 1)


def test_short_forms_take_default_domain() -> None:
    assert str(TopicName.parse("public/default/x")) == "persistent://public/default/x"
    assert str(TopicName.parse("x")) == "persistent://public/default/x"
    scalable = TopicName.parse("t/ns/x", default_domain=TopicDomain.TOPIC)
    assert str(scalable) == "topic://t/ns/x"
    assert scalable.short_name == "t/ns/x"


def test_segment_from_parent_and_descriptor() -> None:
    parent = TopicName.parse("topic://tenant/ns/my-topic")
    s = SegmentName(parent, HashRange(0, 0x7FFF), 1)
    assert str(s) == "segment://tenant/ns/my-topic/0000-7fff-1"
    assert s.descriptor == "0000-7fff-1"
    assert SegmentName.parse(str(s)) == s
    assert SegmentName.parse("segment://public/default/test/0000-ffff-0").topic == TopicName(
        TopicDomain.TOPIC, "public", "default", "test"
    )


def test_format_descriptor() -> None:
    assert SegmentName.parse_descriptor("0000-7fff-3") == (HashRange(0, 0x7FFF), 3)


def test_segment_parent_must_be_topic_domain() -> None:
    # upstream testFromParentRejectsPersistentDomain
    with pytest.raises(InvalidArgument, match="topic://"):
        SegmentName(TopicName.parse("persistent://t/ns/x"), HashRange.full(), 0)


def test_parse_name_dispatches_on_domain() -> None:
    assert isinstance(parse_name("segment://t/ns/x/0000-ffff-0"), SegmentName)
    assert isinstance(parse_name("topic://t/ns/x"), TopicName)
    with pytest.raises(InvalidArgument, match="segment name"):
        TopicName.parse("segment://t/ns/x/0000-ffff-0")
    with pytest.raises(InvalidArgument, match="not a segment"):
        SegmentName.parse("topic://t/ns/x")


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("", "empty"),
        ("http://t/ns/x", "unknown domain"),
        ("persistent://t/ns", "path components"),
        ("persistent://t/ns/x/y", "path components"),
        ("persistent://t//x", "empty"),
        ("persistent://t/ns/", "empty"),
        ("persistent://t/ns/a b", "characters"),
        ("persistent://t/ns/a%2F", "characters"),
        ("persistent://t/ns/a&b", "characters"),
        ("persistent://t/../x", "reserved"),
        ("persistent://t/ns/" + "x" * (NAME_COMPONENT_CHARS_MAX + 1), "over"),
        ("segment://t/ns/x", "path components"),
        ("segment://t/ns/x/0000-ffff", "descriptor"),
        ("segment://t/ns/x/0000-FFFF-1", "descriptor"),
        ("segment://t/ns/x/ffff-0000-1", "before start"),
        ("segment://t/ns/x/0000-ffff-01", "descriptor"),
        ("segment://t/ns/x/0000-ffff--1", "descriptor"),
        ("segment://t/ns/x/0000-ffff-9223372036854775808", r"2\^63"),
        ("segment://t/ns/x-partition-1/0000-ffff-1", "partition"),
        ("topic://t/ns/x/0000-ffff-1", "path components"),
        ("topic://t/ns/x-partition-0", "partition"),
        ("persistent://t/ns/x-partition-2147483648", "partition"),
    ],
)
def test_rejects_with_reason(text: str, reason: str) -> None:
    with pytest.raises(InvalidArgument, match=reason):
        parse_name(text)


def test_segment_short_form_rejected() -> None:
    with pytest.raises(InvalidArgument, match="full segment"):
        parse_name("t/ns/x/0000-ffff-0", TopicDomain.SEGMENT)


def test_namespace_names() -> None:
    assert str(NamespaceName.parse("public/default")) == "public/default"
    for bad in ("public", "public/default/x", "/default", "pub lic/default"):
        with pytest.raises(InvalidArgument):
            NamespaceName.parse(bad)


@given(components, components, components, st.none() | st.integers(0, 2**31 - 1))
def test_persistent_round_trip(t: str, ns: str, x: str, partition: int | None) -> None:
    name = TopicName(TopicDomain.PERSISTENT, t, ns, x, partition)
    assert TopicName.parse(str(name)) == name
    assert TopicName.parse(name.short_name) == name


@given(components, components, components, st.none() | st.integers(0, 2**31 - 1))
def test_non_persistent_round_trip(t: str, ns: str, x: str, partition: int | None) -> None:
    name = TopicName(TopicDomain.NON_PERSISTENT, t, ns, x, partition)
    assert str(name).startswith("non-persistent://")
    assert TopicName.parse(str(name)) == name and not name.is_persistent
    assert TopicName.parse(name.short_name).is_persistent  # short forms stay persistent
    assert parse_name(str(name)) == name


def test_non_persistent_names() -> None:
    name = TopicName.parse("non-persistent://t/ns/x-partition-2")
    assert (name.domain, name.local_name, name.partition) == (
        TopicDomain.NON_PERSISTENT, "x", 2)  # fmt: skip
    assert str(name.base) == "non-persistent://t/ns/x"
    assert TopicName.parse("persistent://t/ns/x").is_persistent
    assert TopicName.parse("topic://t/ns/x").is_persistent
    with pytest.raises(InvalidArgument, match="non-persistent"):
        parse_name("nonpersistent://t/ns/x")  # the error lists the domains


@given(
    components,
    components,
    components,
    st.tuples(st.integers(0, 0xFFFF), st.integers(0, 0xFFFF)),
    st.integers(0, 2**63 - 1),
)
def test_segment_round_trip(t: str, ns: str, x: str, bounds: tuple[int, int], sid: int) -> None:
    name = SegmentName(TopicName(TopicDomain.TOPIC, t, ns, x), HashRange(*sorted(bounds)), sid)
    assert SegmentName.parse(str(name)) == name
    assert parse_name(str(name)) == name


@given(st.text(max_size=40))
def test_fuzz_parse_is_valid_or_invalid_argument(text: str) -> None:
    """Any string parses to a name that formats back to a parseable canonical form, or
    raises InvalidArgument; never another exception."""
    try:
        name = parse_name(text)
    except InvalidArgument as err:
        assert str(err)
        return
    assert parse_name(str(name)) == name


@given(st.text(alphabet="abcdef0123456789-/:sgmentopicrsa", max_size=48))
def test_fuzz_near_miss_names(text: str) -> None:
    try:
        name = parse_name("segment://" + text)
    except InvalidArgument:
        return
    assert isinstance(name, SegmentName)
    assert str(name) == "segment://" + text
