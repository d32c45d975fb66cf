"""Decoding stored entries into columns: the vectorized batch walk and the protobuf path give,
for any entries, window and chunking, exactly the rows a simple model built on
``decode_batch`` gives (hypothesis); and the vectorized walk really is taken for the layouts
producers write, including values that look like message headers."""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from anabranch.errors import InvalidMessage
from anabranch.protocol._generated import pulsar_api_pb2 as pb
from anabranch.protocol.batch import decode_batch, encode_batch, join_batch, single_metadata
from anabranch.protocol.compression import CompressionType, compress
from pyspark_anabranch.bulk_decode import decode_run
from pyspark_anabranch.columns import (
    BULK_MIN_MESSAGES,
    EVENT_MS_MAX,
    Chunk,
    ChunkBuilder,
    EntryDecoder,
)
from pyspark_anabranch.planning import encode_position

LEDGER = 3
Row = tuple[Any, ...]


@dataclass
class Msg:
    key: str | None = None
    value: bytes = b""
    event_time: int | None = None
    sequence_id: int | None = None
    properties: tuple[tuple[str, str], ...] = ()
    compacted_out: bool = False
    null_value: bool = False
    null_key: bool = False
    b64_key: bytes | None = None

    def single(self) -> pb.SingleMessageMetadata:
        md = pb.SingleMessageMetadata(payload_size=len(self.value))
        self._fill(md)
        if self.compacted_out:
            md.compacted_out = True
        if self.sequence_id is not None:
            md.sequence_id = self.sequence_id
        return md

    def _fill(self, md: Any) -> None:
        if self.b64_key is not None:
            md.partition_key = base64.b64encode(self.b64_key).decode()
            md.partition_key_b64_encoded = True
        elif self.key is not None:
            md.partition_key = self.key
        if self.null_key:
            md.null_partition_key = True
        if self.event_time is not None:
            md.event_time = self.event_time
        for k, v in self.properties:
            md.properties.add(key=k, value=v)
        if self.null_value:
            md.null_value = True

    def row(self, position: int, publish: int, properties: bool) -> Row:
        if self.b64_key is not None:
            key = None if self.null_key else self.b64_key
        elif self.key is None or self.null_key:
            key = None
        else:
            key = self.key.encode()
        value = None if self.null_value else self.value
        props = [list(self.properties)] if properties else []
        event = self.event_time if self.event_time and self.event_time <= EVENT_MS_MAX else None
        return (key, value, position, publish, event, *props)


@dataclass
class Entry:
    messages: list[Msg]
    batched: bool
    codec: int
    publish: int

    def encode(self, entry_id: int) -> tuple[int, int, pb.MessageMetadata, bytes]:
        md = pb.MessageMetadata(producer_name="p", sequence_id=entry_id, publish_time=self.publish)
        if self.batched:
            payload = encode_batch((m.single(), m.value) for m in self.messages)
            md.num_messages_in_batch = len(self.messages)
        else:
            (only,) = self.messages
            only._fill(md)
            payload = only.value
        if self.codec != CompressionType.NONE:
            md.compression = self.codec  # type: ignore[assignment]
            md.uncompressed_size = len(payload)
            payload = compress(self.codec, payload)
        return LEDGER, entry_id, md, payload

    def rows(self, entry_id: int, properties: bool) -> list[tuple[int, Row | None]]:
        """(position, row or None if compacted out) of each message."""
        base = encode_position(LEDGER, entry_id, -1)
        if not self.batched:
            return [(base, self.messages[0].row(base, self.publish, properties))]
        return [
            (
                base + 1 + i,
                None if m.compacted_out else m.row(base + 1 + i, self.publish, properties),
            )
            for i, m in enumerate(self.messages)
        ]


def fake_header_value() -> bytes:
    """A value that holds a complete, well-formed batch message (a decoy for the walk)."""
    return join_batch([(single_metadata(5, 7, "k"), b"abcde")]) + b"\x00\x00\x00"


text = st.text(max_size=4) | st.integers(60, 70).map(lambda n: "é" * n)  # up to 140 bytes
values = (
    st.binary(max_size=24)
    | st.integers(0, 40).map(bytes)  # zero bytes
    | st.just(fake_header_value())
    | st.sampled_from([127, 128, 16_383, 16_384]).map(lambda n: b"L" * n)
)
short_keys = st.none() | st.text(max_size=4)


@st.composite
def messages(draw: st.DrawFn, plain: bool = False) -> Msg:
    m = Msg(
        key=draw(short_keys if plain else st.none() | text),
        value=draw(values if plain else values | st.just(b"L" * 2**21)),
        event_time=draw(st.none() | st.just(0) | st.integers(1, 2**64 - 1)),
        sequence_id=draw(st.none() | st.integers(0, 2**64 - 1)),
    )
    if plain:
        return m
    m.properties = tuple(draw(st.lists(st.tuples(text, text), max_size=2)))
    rare = draw(st.sampled_from(["", "", "", "", "", "", "compacted", "null", "nullkey", "b64"]))
    if rare == "compacted":
        m.compacted_out = True
    elif rare == "null":
        m.null_value, m.value = True, b""
    elif rare == "nullkey":
        m.null_key = True
    elif rare == "b64":
        m.b64_key = draw(st.binary(max_size=8))
    return m


@st.composite
def entries(draw: st.DrawFn) -> list[Entry]:
    out = []
    for _ in range(draw(st.integers(1, 4))):
        batched = draw(st.booleans() | st.just(True))
        plain = draw(st.sampled_from([False, True, True]))
        if batched:
            count = draw(st.sampled_from([1, 2] + [BULK_MIN_MESSAGES, BULK_MIN_MESSAGES + 3] * 2))
            msgs = draw(st.lists(messages(plain), min_size=count, max_size=count))
        else:
            msgs = [draw(messages(plain).filter(lambda m: not m.compacted_out))]
        codec = draw(st.sampled_from([CompressionType.NONE] * 3 + [CompressionType.LZ4]))
        out.append(Entry(msgs, batched, codec, draw(st.integers(1, 2**41))))
    return out


def model(es: list[Entry], start: int, end: int, properties: bool) -> list[Row]:
    return [
        row
        for entry_id, e in enumerate(es)
        for pos, row in e.rows(entry_id, properties)
        if start <= pos < end and row is not None
    ]


def rows_of(chunks: list[Chunk], properties: bool) -> list[Row]:
    out: list[Row] = []
    for c in chunks:
        cols = [
            c.keys.to_pylist(),
            c.values.to_pylist(),
            c.positions.tolist(),
            c.publish_ms.tolist(),
            c.event_ms.to_pylist(),
        ]
        if properties:
            assert c.properties is not None
            cols.append(c.properties.to_pylist())
        out.extend(zip(*cols, strict=True))
    return out


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_chunks_match_the_model(data: st.DataObject) -> None:
    es = data.draw(entries())
    positions = sorted(p for i, e in enumerate(es) for p, _ in e.rows(i, False))
    bounds = st.sampled_from([0, positions[-1] + 1, 1 << 62]) | st.sampled_from(positions)
    start, end = sorted((data.draw(bounds), data.draw(bounds)))
    properties = data.draw(st.sampled_from([False, False, True]))
    decoder = EntryDecoder("segment://t/ns/x/0000-ffff-0", start, end)
    builder = ChunkBuilder(decoder, properties)
    chunks: list[Chunk] = []
    # Feed entries the way a range reader does (until the range is done), with a reconnect's
    # redelivery of earlier entries and chunk cuts anywhere.
    order = list(range(len(es)))
    replay_at = data.draw(st.integers(0, len(es)))
    replay_from = data.draw(st.integers(0, replay_at))
    order[replay_at:replay_at] = list(range(replay_from, replay_at))
    for entry_id in order:
        if decoder.done:
            break
        builder.add(*es[entry_id].encode(entry_id))
        if data.draw(st.booleans()):
            chunk = builder.finish()
            if chunk is not None:
                chunks.append(chunk)
    last = builder.finish()
    chunks += [last] if last is not None else []
    assert rows_of(chunks, properties) == model(es, start, end, properties)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.lists(messages(plain=True), min_size=16, max_size=24), min_size=1, max_size=3))
def test_the_vectorized_walk_decodes_every_producer_layout(batches: list[list[Msg]]) -> None:
    payloads = [encode_batch((m.single(), m.value) for m in ms) for ms in batches]
    counts = [len(ms) for ms in batches]
    run = decode_run(payloads, counts)
    assert run is not None
    expected = [m.row(0, 0, False) for ms in batches for m in ms]
    assert run.keys.to_pylist() == [key for key, *_ in expected]
    assert run.values.to_pylist() == [value for _, value, *_ in expected]
    assert run.event_ms.to_pylist() == [row[4] for row in expected]
    assert run.index.tolist() == [i for ms in batches for i in range(len(ms))]


def producer_batch(count: int, key_of: Any, value_of: Any) -> bytes:
    return join_batch(
        (single_metadata(len(value_of(i)), 1000 + i, key_of(i)), value_of(i)) for i in range(count)
    )


@pytest.mark.parametrize(
    ("key_of", "value_of"),
    [
        (lambda i: f"k{i % 1000}", lambda i: b"x" * 100),
        (lambda i: None, lambda i: bytes(i % 7)),  # values of zero bytes, no keys
        (lambda i: "é" * (i % 60), lambda i: fake_header_value() * (i % 3)),
        (str, lambda i: b"v" * (i * 97 % 20_000)),
    ],
)
def test_producer_layouts_take_the_vectorized_walk(key_of: Any, value_of: Any) -> None:
    payloads = [producer_batch(n, key_of, value_of) for n in (50, 1, 300)]
    counts = [50, 1, 300]
    run = decode_run(payloads, counts)
    assert run is not None
    expected = [x for p, n in zip(payloads, counts, strict=True) for x in decode_batch(p, n)]
    assert run.values.to_pylist() == [v for _, v in expected]
    assert run.keys.to_pylist() == [
        m.partition_key.encode() if m.HasField("partition_key") else None for m, _ in expected
    ]
    assert run.entry.tolist() == [0] * 50 + [1] + [2] * 300
    assert run.index.tolist() == [*range(50), 0, *range(300)]


def test_event_times_and_unknown_layouts() -> None:
    with_events = join_batch(
        (single_metadata(1, i, "k", event_time=(1 << 40) + i), b"v") for i in range(20)
    )
    run = decode_run([with_events], [20])
    assert run is not None
    assert run.event_ms.to_pylist() == [(1 << 40) + i for i in range(20)]
    # properties are not in the walk's layout: the caller decodes with protobuf
    with_props = join_batch(
        (single_metadata(1, i, "k", properties=[("a", "b")]), b"v") for i in range(20)
    )
    assert decode_run([with_props], [20]) is None
    assert decode_run([with_events], [21]) is None  # the entry's count disagrees


@pytest.mark.parametrize(
    "payload",
    [
        b"\x00\x00\x00",  # truncated size
        b"\x00\x00\x00\x09\x18\x05",  # metadata longer than the payload
        b"\x00\x00\x00\x02\x18\x09abc",  # value longer than the payload
        b"\x00\x00\x00\x02\x12\x01",  # unparsable metadata
        b"\x00\x00\x00\x02\x18\x01ab",  # bytes after the last message
        producer_batch(20, str, lambda i: b"v")[:-1],  # 20 declared, the last one cut short
        producer_batch(20, str, lambda i: b"v") + b"\x00",
    ],
)
def test_corrupt_batches_are_invalid_messages(payload: bytes) -> None:
    count = 1 if len(payload) < 20 else 20
    md = pb.MessageMetadata(
        producer_name="p", sequence_id=0, publish_time=1, num_messages_in_batch=count
    )
    builder = ChunkBuilder(EntryDecoder("segment://t/ns/x/0000-ffff-0", 0, 1 << 62))
    with pytest.raises(InvalidMessage):
        builder.add(LEDGER, 0, md, payload)
        builder.finish()
