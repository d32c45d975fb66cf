"""Fuzzing the decoder (only ProtocolError may escape) and the generated-code check."""

from __future__ import annotations

import struct
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from anabranch.errors import ProtocolError
from anabranch.protocol import commands, generate
from anabranch.protocol._generated import pulsar_api_pb2 as pb
from anabranch.protocol.connection import ProtocolConnection, Role
from anabranch.protocol.frames import FrameDecoder, encode_command, encode_payload_frame

_MD = pb.MessageMetadata(producer_name="p", sequence_id=1, publish_time=2)
VALID = [
    encode_command(commands.connect("c", 21)),
    encode_command(commands.ping()),
    encode_command(commands.subscribe("t", "s", 1, 1, 1)),
    encode_payload_frame(commands.send(1, 1), _MD, b"payload"),
    encode_payload_frame(
        commands.message(1, 2, 3), _MD, b"p", pb.BrokerEntryMetadata(broker_timestamp=1)
    ),
]


def _feed_all(chunks: list[bytes], max_frame_size: int = 1 << 16) -> int:
    decoder = FrameDecoder(max_frame_size=max_frame_size)
    count = 0
    try:
        for chunk in chunks:
            count += len(decoder.feed(chunk))
            assert decoder.buffered_bytes <= max_frame_size + len(chunk)
    except ProtocolError:
        pass
    return count


@settings(max_examples=400, deadline=None)
@given(st.lists(st.binary(max_size=200), max_size=8))
def test_random_bytes_raise_only_protocol_errors(chunks: list[bytes]) -> None:
    assert _feed_all(chunks) >= 0


@settings(max_examples=600, deadline=None)
@given(
    st.sampled_from(VALID),
    st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), min_size=1, max_size=6),
    st.integers(1, 64),
)
def test_mutated_frames_raise_only_protocol_errors(
    frame: bytes, edits: list[tuple[int, int]], chunk: int
) -> None:
    data = bytearray(frame)
    for pos, value in edits:
        data[pos % len(data)] = value
    chunks = [bytes(data[i : i + chunk]) for i in range(0, len(data), chunk)]
    assert _feed_all(chunks) in (0, 1)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(VALID), st.integers(0, 200), st.integers(-(2**31), 2**31 - 1))
def test_mutated_sizes_raise_only_protocol_errors(frame: bytes, where: int, value: int) -> None:
    data = bytearray(frame)
    pos = where % max(1, len(data) - 3)
    data[pos : pos + 4] = struct.pack(">i", value)
    assert _feed_all([bytes(data)]) in (0, 1)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(VALID), max_size=5), st.binary(max_size=50))
def test_connection_raises_only_protocol_errors(frames: list[bytes], tail: bytes) -> None:
    broker = ProtocolConnection(Role.BROKER, max_frame_size=1 << 16)
    try:
        decoded = broker.receive_data(b"".join(frames) + tail)
    except ProtocolError:
        assert broker.state.name == "CLOSED"
    else:
        assert len(decoded) <= len(frames)


def test_generated_code_is_up_to_date() -> None:
    assert generate.main(["--check"]) == 0


def test_stale_generated_code_is_detected(tmp_path: Path) -> None:
    fresh = tmp_path / "fresh"
    generate.generate(fresh)
    stale = tmp_path / "stale"
    stale.mkdir()
    for name in generate.OUTPUTS:
        (stale / name).write_bytes((fresh / name).read_bytes())
    assert generate.differing_files(stale, fresh) == []
    (stale / generate.OUTPUTS[0]).write_text("# edited\n")
    assert generate.differing_files(stale, fresh) == [generate.OUTPUTS[0]]
