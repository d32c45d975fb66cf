"""Regex subscriptions on the wire: GET_TOPICS_OF_NAMESPACE with a pattern and a hash, and
topic-list watchers (PIP-145), over raw frames; the pattern rules as properties."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from anabranch import limits
from anabranch.broker.scalable_commands import topics_hash
from anabranch.core import topic_patterns
from anabranch.protocol import commands
from anabranch.protocol._generated import pulsar_api_pb2 as pb
from anabranch.testing.broker import InProcessBroker
from tests.broker.test_core_protocol import RawClient

T = pb.BaseCommand
NS = "public/default"
P = "persistent://public/default"
REDOS = "public/default/(a+)+$"
BOUNDED_REDOS = ".{0,300}" * 6 + "b"  # 49 characters: ~len(name) ** 6 on a failing match


# --- the pure rules ----------------------------------------------------------------------------


def test_upstream_hash_of_known_lists() -> None:
    # Guava's crc32c HashCode.toString(): the CRC's bytes, low byte first.
    assert topics_hash([]) == "00000000"
    assert topics_hash(["b", "a"]) == topics_hash(["a", "b"])
    from anabranch.protocol.checksum import crc32c

    assert topics_hash(["ab"]) == crc32c(b"ab").to_bytes(4, "little").hex()


def test_matching_ignores_the_domain_and_the_partition_suffix() -> None:
    pattern = topic_patterns.compile_safely("persistent://public/default/orders-.*")
    assert pattern is not None
    assert topic_patterns.matches(f"{P}/orders-1-partition-2", pattern)
    assert not topic_patterns.matches(f"{P}/audit", pattern)
    # A full match, as Java's Matcher.matches(): a prefix is not enough.
    exact = topic_patterns.compile_safely("public/default/orders")
    assert exact is not None and not topic_patterns.matches(f"{P}/orders-2", exact)


@pytest.mark.parametrize(
    "hostile",
    [
        REDOS,
        "public/default/(a|aa)*b",
        "public/default/((ab)*)+c",
        "public/default/.*.*.*x",
        "public/default/" + "x" * limits.TOPICS_PATTERN_LENGTH_MAX,
        "public/default/(",
    ],
)
def test_hostile_patterns_are_not_evaluated(hostile: str) -> None:
    assert topic_patterns.compile_safely(hostile) is None


@pytest.mark.parametrize(
    "hostile",
    [
        BOUNDED_REDOS,  # the probe: bounded repeats, so no unbounded quantifier to count
        f"persistent://{BOUNDED_REDOS[:40]}b",
        "(.{0,300}){6}",
        ".{0,100}.{0,100}.{0,100}b",
        "[a-z]{0,255}[a-z]{0,255}[a-z]{0,255}x",
        "(?i)[a-z]{0,255}[A-Z]{0,255}[a-z]{0,255}",  # case-folded classes overlap
        "\\w{0,200}[0-9]{0,200}\\d{0,200}-",
        ".*.{0,300}.{0,300}b",
        "(a|aa){0,50}b",
        "(?:){100000000}",  # a zero-width repeat: its count is the cost
        "(?:(?=a)){1000000}b",
        "(a)\\1",  # backreferences are not bounded
    ],
)
def test_patterns_costly_to_match_are_not_evaluated(hostile: str) -> None:
    assert topic_patterns.match_cost(topic_patterns._strip_domain(hostile)) > (
        limits.TOPICS_PATTERN_MATCH_STEPS_MAX
    )
    assert topic_patterns.compile_safely(hostile) is None


@pytest.mark.parametrize(
    ("pattern", "matching", "other"),
    [
        ("public/default/.*", "public/default/anything", "public/other/x"),
        ("persistent://public/default/orders-.*", "public/default/orders-1", "public/x/orders-1"),
        (".*foo.*", "public/default/a-foo-b", "public/default/fo"),
        (".*-(eu|us)-.*", "public/default/orders-eu-1", "public/default/orders-ap-1"),
        ("persistent://public/default/t[0-9]+", "public/default/t42", "public/default/t4x"),
        ("public/default/topic-\\d{1,3}", "public/default/topic-123", "public/default/topic-1234"),
        ("topic-\\d{1,3}", "topic-7", "public/default/topic-7"),
        ("public/default/[a-z]+-[0-9]+", "public/default/orders-12", "public/default/orders-"),
        (".*-(eu|us)-.*-[ab]", "public/default/x-eu-y-a", "public/default/x-eu-y-c"),
        ("(?i)public/default/ORDERS-.*", "public/default/orders-1", "public/default/order"),
        (".{0,50}.{0,50}.{0,50}b", "public/default/b", "public/default/a"),
    ],
)
def test_ordinary_patterns_are_evaluated_as_before(pattern: str, matching: str, other: str) -> None:
    compiled = topic_patterns.compile_safely(pattern)
    assert compiled is not None
    assert topic_patterns.match_cost(compiled.pattern) <= limits.TOPICS_PATTERN_MATCH_STEPS_MAX
    expected = re.compile(topic_patterns._strip_domain(pattern))
    for name in (matching, other, matching + "-partition-3"):
        assert topic_patterns.matches(f"persistent://{name}", compiled) == (
            expected.fullmatch(name.removesuffix("-partition-3")) is not None
        )
    assert topic_patterns.matches(f"persistent://{matching}", compiled)
    assert not topic_patterns.matches(f"persistent://{other}", compiled)


def test_match_anything_is_evaluated() -> None:
    anything = topic_patterns.compile_safely(".*")
    assert anything is not None and topic_patterns.matches(f"{P}/x-partition-1", anything)


LINEAR = 8 * (topic_patterns.NAME_CHARS_MAX + 1)
QUADRATIC = topic_patterns.NAME_CHARS_MAX**2


@pytest.mark.parametrize(
    ("pattern", "bound"),
    [
        # Only the run's end can go on when what follows cannot be one of its characters.
        ("[0-9]+-.*", LINEAR),
        ("[0-9]{0,300}-[0-9]{0,300}-[0-9]{0,300}", LINEAR),
        (".*$", LINEAR),
        ("x.*+.*+", LINEAR),  # possessive: never backtracked into
        ("(eu|us)-.*", LINEAR),  # branches start with different characters
        ("\\N{KELVIN SIGN}+k", LINEAR),  # case-sensitive: not a 'k'
    ],
)
def test_a_repeat_only_its_end_can_leave_is_linear(pattern: str, bound: int) -> None:
    assert topic_patterns.match_cost(pattern) <= bound


@pytest.mark.parametrize(
    "pattern",
    [
        "[0-9]+[0-9-].*",
        "\\d+\\w.*",
        "[^-]+[a-z].*",
        "(?i:[a-z])+K.*",
        "(?i)\\N{KELVIN SIGN}+k.*",  # case-folded: the Kelvin sign matches 'k'
        "(a|ab)+.*",
        ".*(a|ab).*",
        "(?:ab){0,400}.*",
    ],
)
def test_overlapping_neighbours_multiply(pattern: str) -> None:
    # What backtracking can split two ways is counted both ways (the rule is sound).
    assert topic_patterns.match_cost(pattern) >= QUADRATIC // 4


@given(st.text(alphabet="ab()|*+?{},[]\\.x^$:", max_size=30))
def test_safe_patterns_fail_fast_on_long_names(pattern: str) -> None:
    compiled = topic_patterns.compile_safely(pattern)
    if compiled is None:
        return
    assert not topic_patterns.has_nested_quantifier(topic_patterns._strip_domain(pattern))
    # What the broker evaluates stays cheap on a long non-matching name (hang guard only:
    # the property is that it returns at all, with the right answer).
    name = "a" * 200 + "!"
    assert topic_patterns.matches(f"{P}/{name}", compiled) == (
        compiled.fullmatch(f"public/default/{name}") is not None
    )


@given(st.lists(st.sampled_from(["a", "b", "(", ")", "+", "*", "|"]), max_size=12))
def test_a_quantified_group_holding_a_quantifier_is_nested(parts: list[str]) -> None:
    body = "".join(parts)
    try:
        re.compile(body)
    except re.error:
        return
    nested = topic_patterns.has_nested_quantifier(f"({body}+)+")
    assert nested


# --- the wire ----------------------------------------------------------------------------------


@pytest.fixture
async def broker(tmp_path: Path) -> AsyncIterator[InProcessBroker]:
    async with InProcessBroker(tmp_path, ledgers="memory") as b:
        for name in ("orders-1", "orders-2", "audit"):
            await b.service.policies.register_topic(f"{P}/{name}")
        yield b


@pytest.fixture
async def client(broker: InProcessBroker) -> AsyncIterator[RawClient]:
    c = await RawClient.open(broker.port)
    try:
        connected = (await c.handshake()).command.connected
        assert connected.feature_flags.supports_topic_watchers
        yield c
    finally:
        await c.close()


async def get_topics(
    client: RawClient, request_id: int, **fields: object
) -> pb.CommandGetTopicsOfNamespaceResponse:
    body = pb.CommandGetTopicsOfNamespace(request_id=request_id, namespace=NS, **fields)  # type: ignore[arg-type]
    await client.send(T(type=T.GET_TOPICS_OF_NAMESPACE, getTopicsOfNamespace=body))
    answer = (await client.expect(T.GET_TOPICS_OF_NAMESPACE_RESPONSE)).command
    result: pb.CommandGetTopicsOfNamespaceResponse = answer.getTopicsOfNamespaceResponse
    return result


async def test_get_topics_filters_and_hashes_as_upstream(client: RawClient) -> None:
    everything = await get_topics(client, 1)
    assert {f"{P}/orders-1", f"{P}/orders-2", f"{P}/audit"} <= set(everything.topics)
    assert not everything.filtered and everything.changed
    assert everything.topics_hash == topics_hash(list(everything.topics))

    orders = await get_topics(client, 2, topics_pattern=f"{P}/orders-.*")
    assert sorted(orders.topics) == [f"{P}/orders-1", f"{P}/orders-2"]
    assert orders.filtered and orders.changed
    assert orders.topics_hash == topics_hash([f"{P}/orders-1", f"{P}/orders-2"])

    same = await get_topics(
        client, 3, topics_pattern="public/default/orders-.*", topics_hash=orders.topics_hash
    )
    assert not same.changed and list(same.topics) == [] and same.filtered
    assert same.topics_hash == orders.topics_hash

    none = await get_topics(client, 4, mode=pb.CommandGetTopicsOfNamespace.NON_PERSISTENT)
    assert list(none.topics) == [] and none.topics_hash == "00000000"
    both = await get_topics(client, 5, mode=pb.CommandGetTopicsOfNamespace.ALL)
    assert set(both.topics) == set(everything.topics)


async def answered_unfiltered_at_once(
    broker: InProcessBroker, client: RawClient, evil_name: str, pattern: str
) -> None:
    """A topic whose name makes ``pattern`` backtrack: GET_TOPICS answers it unfiltered
    (the client filters), and the connection (and the broker) still answer at once."""
    await broker.service.policies.register_topic(evil_name)
    try:
        answer = await get_topics(client, 1, topics_pattern=pattern)
        assert not answer.filtered and evil_name in answer.topics
        await client.send(commands.ping())
        await client.expect(T.PONG)
    finally:
        await broker.service.policies.unregister_topic(evil_name)


async def test_a_redos_pattern_is_answered_unfiltered_at_once(
    broker: InProcessBroker, client: RawClient
) -> None:
    # 2**40 backtracking steps for REDOS
    await answered_unfiltered_at_once(broker, client, f"{P}/" + "a" * 40 + "-b", REDOS)
    long_one = await get_topics(client, 2, topics_pattern="public/default/" + "o" * 60)
    assert not long_one.filtered


async def test_a_bounded_repeats_redos_is_answered_unfiltered_at_once(
    broker: InProcessBroker, client: RawClient
) -> None:
    # The probe's topic was 110 characters long; 40 keep this test quick without the fix
    # (C(46, 6) splits), where the pattern was evaluated (filtered=true).
    await answered_unfiltered_at_once(broker, client, f"{P}/" + "a" * 40, BOUNDED_REDOS)


async def watch(
    client: RawClient, watcher_id: int, pattern: str
) -> pb.CommandWatchTopicListSuccess:
    body = pb.CommandWatchTopicList(
        request_id=watcher_id, watcher_id=watcher_id, namespace=NS, topics_pattern=pattern
    )
    await client.send(T(type=T.WATCH_TOPIC_LIST, watchTopicList=body))
    frame = await client.expect(T.WATCH_TOPIC_LIST_SUCCESS)
    success: pb.CommandWatchTopicListSuccess = frame.command.watchTopicListSuccess
    return success


async def test_a_watcher_gets_created_and_deleted_matching_topics(
    broker: InProcessBroker, client: RawClient
) -> None:
    success = await watch(client, 7, f"{P}/orders-.*")
    assert sorted(success.topic) == [f"{P}/orders-1", f"{P}/orders-2"]
    assert success.topics_hash == topics_hash(list(success.topic))
    policies = broker.service.policies
    await policies.register_topic(f"{P}/audit-2")  # not matching: no update
    await policies.register_topic(f"{P}/orders-3")
    update = (await client.expect(T.WATCH_TOPIC_UPDATE)).command.watchTopicUpdate
    assert update.watcher_id == 7 and list(update.new_topics) == [f"{P}/orders-3"]
    expected = [f"{P}/orders-1", f"{P}/orders-2", f"{P}/orders-3"]
    assert update.topics_hash == topics_hash(expected)
    await policies.unregister_topic(f"{P}/orders-3")
    update = (await client.expect(T.WATCH_TOPIC_UPDATE)).command.watchTopicUpdate
    assert list(update.deleted_topics) == [f"{P}/orders-3"] and not update.new_topics
    assert update.topics_hash == success.topics_hash

    close = pb.CommandWatchTopicListClose(request_id=99, watcher_id=7)
    await client.send(T(type=T.WATCH_TOPIC_LIST_CLOSE, watchTopicListClose=close))
    assert (await client.expect(T.SUCCESS)).command.success.request_id == 99
    await policies.register_topic(f"{P}/orders-4")  # closed: nothing more is pushed
    await client.send(commands.ping())
    await client.expect(T.PONG)
    await policies.unregister_topic(f"{P}/orders-4")
    await policies.unregister_topic(f"{P}/audit-2")


async def test_watcher_refusals(broker: InProcessBroker, client: RawClient) -> None:
    async def refused(watcher_id: int, pattern: str, ns: str = NS) -> pb.CommandError:
        body = pb.CommandWatchTopicList(
            request_id=watcher_id, watcher_id=watcher_id, namespace=ns, topics_pattern=pattern
        )
        await client.send(T(type=T.WATCH_TOPIC_LIST, watchTopicList=body))
        error: pb.CommandError = (await client.expect(T.ERROR)).command.error
        assert error.request_id == watcher_id
        return error

    assert (await refused(1, REDOS)).error == pb.NotAllowedError
    assert (await refused(5, BOUNDED_REDOS)).error == pb.NotAllowedError
    assert (await refused(2, "public/default/" + "x" * 60)).error == pb.NotAllowedError
    assert (await refused(3, "nope/ns/.*", "nope/ns")).error == pb.TopicNotFound
    await watch(client, 4, "public/default/x.*")
    assert (await refused(4, "public/default/y.*")).error == pb.NotAllowedError
    sessions = [s for s in broker._node().server.sessions if s.topic_list_watchers]
    assert len(sessions) == 1 and list(sessions[0].topic_list_watchers) == [4]
    await client.close()
    for _ in range(100):  # hang guard: the close hook ends the watcher
        if not sessions[0].topic_list_watchers:
            break
        await asyncio.sleep(0.01)
    assert not sessions[0].topic_list_watchers


async def test_watchers_per_connection_are_bounded(
    broker: InProcessBroker, client: RawClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(limits, "TOPIC_LIST_WATCHERS_PER_CONNECTION_MAX", 3)
    for watcher_id in (1, 2, 3):
        await watch(client, watcher_id, "public/default/x.*")
    body = pb.CommandWatchTopicList(
        request_id=4, watcher_id=4, namespace=NS, topics_pattern="public/default/x.*"
    )
    await client.send(T(type=T.WATCH_TOPIC_LIST, watchTopicList=body))
    error = (await client.expect(T.ERROR)).command.error
    assert error.request_id == 4 and error.error == pb.NotAllowedError
    close = pb.CommandWatchTopicListClose(request_id=5, watcher_id=1)
    await client.send(T(type=T.WATCH_TOPIC_LIST_CLOSE, watchTopicListClose=close))
    await client.expect(T.SUCCESS)
    await watch(client, 4, "public/default/x.*")  # room again
