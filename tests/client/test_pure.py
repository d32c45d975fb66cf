"""Pure client pieces: message ids, routing, backoff, error mapping, options."""

from __future__ import annotations

import pulsar
import pytest

from anabranch.client.backoff import Backoff
from anabranch.client.connection import parse_service_url, parse_service_urls
from anabranch.client.consumer import ConsumerOptions, SubscriptionType
from anabranch.client.errors import SERVER_ERRORS, MessageTooBig, from_server_error
from anabranch.client.message_id import MessageId
from anabranch.client.producer import ProducerOptions
from anabranch.client.routing import Router, java_string_hash, murmur3_32_hash
from anabranch.errors import InvalidArgument, NotFound, ValueTooLarge
from anabranch.protocol._generated import pulsar_api_pb2 as pb
from anabranch.protocol.compression import CompressionType


@pytest.mark.parametrize(
    "mid",
    [
        MessageId(0, 0),
        MessageId(5, 7, 3, 2),
        MessageId(2**63 - 1, 2**62, 0, 0),
        MessageId.earliest(),
        MessageId.latest(),
        MessageId(1, 2, 3, -1, segment_id=9),
    ],
)
def test_message_id_round_trips(mid: MessageId) -> None:
    assert MessageId.from_bytes(mid.to_bytes()) == mid


def test_message_id_order_and_hash() -> None:
    ids = [
        MessageId(2, 0),
        MessageId(1, 5, 1),
        MessageId(1, 5),
        MessageId(1, 5, 0),
        MessageId.earliest(),
        MessageId(0, 9, segment_id=1),
    ]
    assert sorted(ids) == [
        MessageId.earliest(),
        MessageId(1, 5),
        MessageId(1, 5, 0),
        MessageId(1, 5, 1),
        MessageId(2, 0),
        MessageId(0, 9, segment_id=1),
    ]
    assert len({MessageId(1, 2), MessageId(1, 2, batch_size=4), MessageId(1, 3)}) == 2
    assert MessageId(1, 2, 3).entry == MessageId(1, 2)


def test_message_id_bytes_interoperate_with_official_client() -> None:
    ours = MessageId(11, 22, 3, 4)
    theirs = pulsar.MessageId.deserialize(ours.to_bytes())
    assert (theirs.ledger_id(), theirs.entry_id(), theirs.batch_index(), theirs.partition()) == (
        11, 22, 3, 4,
    )  # fmt: skip
    official = pulsar.MessageId(1, 100, 200, 5).serialize()
    assert MessageId.from_bytes(official) == MessageId(100, 200, 5, 1)


def test_message_id_rejects_garbage() -> None:
    with pytest.raises(InvalidArgument):
        MessageId.from_bytes(b"\x08")
    with pytest.raises(InvalidArgument):
        MessageId.from_bytes(b"\x00\x01")


def test_java_string_hash_matches_java() -> None:
    # Values of String.hashCode() & Integer.MAX_VALUE computed by the JVM.
    assert java_string_hash("") == 0
    assert java_string_hash("a") == 97
    assert java_string_hash("hello") == 99162322
    assert java_string_hash("key-0") == 101943362  # ((((107*31+101)*31+121)*31+45)*31+48)
    assert java_string_hash("\u00e9") == 233
    # A surrogate pair counts as two UTF-16 units: 0xD83D*31 + 0xDE00.
    assert java_string_hash("\U0001f600") == 0xD83D * 31 + 0xDE00
    # Overflowing hashes wrap to 32 bits and lose the sign bit.
    assert java_string_hash("polygenelubricants") == (-(2**31)) & 0x7FFFFFFF


def test_murmur3_hash_is_masked_unsigned_murmur() -> None:
    assert murmur3_32_hash("hello") == 0x248BFA47 & 0x7FFFFFFF


def test_router_keys_stable_and_round_robin() -> None:
    router = Router(3)
    assert [router.partition(None) for _ in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    assert router.partition("hello") == 99162322 % 3
    assert Router(3, "murmur3").partition("hello") == (0x248BFA47 & 0x7FFFFFFF) % 3
    with pytest.raises(ValueError):
        Router(0)


def test_backoff_doubles_to_the_bound_with_jitter() -> None:
    b = Backoff(0.1, 30.0, random=lambda: 0.0)
    delays = [b.next() for _ in range(12)]
    assert delays[:4] == pytest.approx([0.1, 0.2, 0.4, 0.8])
    assert max(delays) == 30.0 and delays[-1] == 30.0
    jittered = Backoff(0.1, 30.0, random=lambda: 0.999)
    d = [jittered.next() for _ in range(12)]
    assert d[0] == 0.1  # never below the minimum
    assert d[1] == pytest.approx(0.2 * (1 - 0.0999))
    assert d[-1] == pytest.approx(30.0 * (1 - 0.0999))
    b.reset()
    assert b.next() == 0.1
    with pytest.raises(ValueError):
        Backoff(0, 1)


def test_every_server_error_code_is_mapped() -> None:
    for code in pb.ServerError.values():
        assert code in SERVER_ERRORS
        err = from_server_error(code, "m")
        assert err.retriable is SERVER_ERRORS[code][1]
    assert isinstance(from_server_error(pb.TopicNotFound, "t"), NotFound)
    assert from_server_error(pb.ServiceNotReady, "").retriable
    assert not from_server_error(pb.ProducerBusy, "").retriable
    assert issubclass(MessageTooBig, ValueTooLarge)


def test_options_parse_names_and_reject_unknown() -> None:
    assert ProducerOptions.from_kwargs({"compression": "lz4"}).compression is CompressionType.LZ4
    assert (
        ConsumerOptions.from_kwargs({"subscription_type": "Failover"}).subscription_type
        is SubscriptionType.FAILOVER
    )
    with pytest.raises(InvalidArgument):
        ProducerOptions.from_kwargs({"no_such_option": 1})
    with pytest.raises(InvalidArgument):
        ProducerOptions.from_kwargs({"compression": "brotli"})
    with pytest.raises(InvalidArgument):
        ConsumerOptions(receiver_queue_size=0)


def test_service_url_lists_several_brokers() -> None:
    assert parse_service_urls("pulsar://a:6651, b ,[::1]:7000/") == (
        ("a", 6651),
        ("b", 6650),
        ("::1", 7000),
    )
    assert parse_service_url("pulsar://only:1") == ("only", 1)
    with pytest.raises(InvalidArgument, match="names 2 brokers"):
        parse_service_url("pulsar://a,b")
    for bad in ("http://a", "pulsar://", "pulsar://a,,b", "pulsar://a:port", "a:6650"):
        with pytest.raises(InvalidArgument):
            parse_service_urls(bad)


def test_batch_messages_are_values_like_hand_made_ones() -> None:
    import pickle

    from anabranch.client.message import EntryInfo, Message, batch_message
    from anabranch.client.message_id import MessageId
    from anabranch.errors import InvalidMessage
    from anabranch.protocol.batch import single_metadata

    entry = MessageId(3, 4, -1, 2)
    info = EntryInfo("persistent://public/default/t", 10, "p", 1, 99, entry, 2)
    lazy = batch_message(b"v", info, 1, single_metadata(1, 8, "k", 12, [("a", "b")]))
    eager = Message(
        b"v", "k", {"a": "b"}, MessageId(3, 4, 1, 2, None, 2), info.topic, 10, 12, 1, "p", 8
    )
    assert lazy == eager and lazy.message_id == eager.message_id
    assert lazy._consumer_id == 99 and eager._consumer_id == 0
    assert pickle.loads(pickle.dumps(lazy)) == eager
    assert lazy.relocated(MessageId(1, 1), "topic://public/default/t").topic.startswith("topic")
    with pytest.raises(AttributeError):
        lazy.value = b"x"  # type: ignore[misc]
    with pytest.raises(TypeError):
        hash(lazy)
    broken = batch_message(b"w", info, 0, b"\x12\x05ab")  # a key longer than its bytes
    assert broken.value == b"w" and "unparsable" in repr(broken)
    with pytest.raises(InvalidMessage):
        _ = broken.key
    assert broken != eager
