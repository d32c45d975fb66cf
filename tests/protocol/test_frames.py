"""Frame codec: every frame kind whole, byte by byte and with trailing bytes; bad input."""

from __future__ import annotations

import logging
import struct

import pytest

from anabranch.errors import BadFrameLength, FrameTooLarge, MalformedFrame, ProtocolError
from anabranch.limits import FRAME_SIZE_MAX_BYTES
from anabranch.protocol import commands
from anabranch.protocol._generated import pulsar_api_pb2 as pb
from anabranch.protocol.frames import (
    Frame,
    FrameDecoder,
    decode_frame,
    encode_command,
    encode_entry,
    encode_entry_frame,
    encode_payload_frame,
)

T = pb.BaseCommand


def _metadata(sequence_id: int = 0) -> pb.MessageMetadata:
    return pb.MessageMetadata(producer_name="p", sequence_id=sequence_id, publish_time=0)


def _frame_kinds() -> dict[str, bytes]:
    md = _metadata(5)
    bem = pb.BrokerEntryMetadata(broker_timestamp=7, index=9)
    return {
        "simple": encode_command(commands.connect("c", 21)),
        "empty-body": encode_command(commands.ping()),
        "payload": encode_payload_frame(commands.send(1, 5), md, b"payload"),
        "payload-no-checksum": encode_entry_frame(
            commands.send(1, 5), encode_entry(md, b"payload", checksum=False)
        ),
        "broker-entry-metadata": encode_payload_frame(
            commands.message(3, 1, 2), md, b"payload", broker_entry_metadata=bem
        ),
        "empty-payload": encode_payload_frame(commands.message(3, 1, 2), md, b""),
    }


FRAMES = _frame_kinds()


def _check(kind: str, frame: Frame) -> None:
    assert frame.frame_size == len(FRAMES[kind])
    if kind in ("simple", "empty-body"):
        assert frame.metadata is None and frame.payload == b""
        return
    assert frame.metadata is not None and frame.metadata.sequence_id == 5
    assert frame.payload == (b"" if kind == "empty-payload" else b"payload")
    assert frame.checksum_ok is (None if kind == "payload-no-checksum" else True)
    if kind == "broker-entry-metadata":
        assert frame.broker_entry_metadata is not None
        assert frame.broker_entry_metadata.index == 9


@pytest.mark.parametrize("kind", sorted(FRAMES))
def test_whole(kind: str) -> None:
    frames = FrameDecoder().feed(FRAMES[kind])
    assert len(frames) == 1
    _check(kind, frames[0])


@pytest.mark.parametrize("kind", sorted(FRAMES))
def test_byte_by_byte_yields_nothing_until_the_last_byte(kind: str) -> None:
    data = FRAMES[kind]
    decoder = FrameDecoder()
    for i in range(len(data) - 1):
        assert decoder.feed(data[i : i + 1]) == []
    frames = decoder.feed(data[-1:])
    assert len(frames) == 1
    _check(kind, frames[0])
    assert decoder.buffered_bytes == 0


@pytest.mark.parametrize("kind", sorted(FRAMES))
def test_trailing_bytes_stay_buffered(kind: str) -> None:
    data = FRAMES[kind]
    ping = encode_command(commands.ping())
    decoder = FrameDecoder()
    frames = decoder.feed(data + ping[:6])
    assert len(frames) == 1
    _check(kind, frames[0])
    assert decoder.buffered_bytes == 6
    assert [f.type_name for f in decoder.feed(ping[6:])] == ["PING"]


def test_many_frames_in_one_chunk_keep_order() -> None:
    data = b"".join(FRAMES[k] for k in sorted(FRAMES))
    types = [f.type_name for f in FrameDecoder().feed(data)]
    assert len(types) == len(FRAMES)


# --- round trips of proto2 required zeros and defaults ---------------------------------------


def test_required_fields_at_zero_round_trip() -> None:
    cmd = commands.send_receipt(producer_id=0, sequence_id=0, ledger_id=0, entry_id=0)
    (frame,) = FrameDecoder().feed(encode_command(cmd))
    receipt = frame.command.send_receipt
    assert receipt.HasField("producer_id") and receipt.producer_id == 0
    assert receipt.message_id.HasField("ledgerId") and receipt.message_id.ledgerId == 0
    assert receipt.message_id.partition == -1
    assert not receipt.message_id.HasField("partition")
    assert receipt.message_id.batch_index == -1


def test_defaults_preserved() -> None:
    sub = commands.subscribe("t", "s", pb.CommandSubscribe.Shared, 0, 0)
    (frame,) = FrameDecoder().feed(encode_command(sub))
    body = frame.command.subscribe
    assert body.durable is True and body.force_topic_creation is True
    assert body.initialPosition == pb.CommandSubscribe.Latest
    ps = commands.producer_success(1, "p")
    assert decode_frame(encode_command(ps)[4:]).command.producer_success.last_sequence_id == -1
    md = pb.MessageMetadata(producer_name="", sequence_id=0, publish_time=0)
    (mf,) = FrameDecoder().feed(encode_payload_frame(commands.send(0, 0), md, b""))
    assert mf.metadata is not None
    assert mf.metadata.num_messages_in_batch == 1
    assert mf.metadata.compression == pb.NONE


def test_extreme_ids_round_trip() -> None:
    big = 2**64 - 1
    cmd = commands.send_receipt(big, 2**63 - 1, big, big)
    (frame,) = FrameDecoder().feed(encode_command(cmd))
    assert frame.command.send_receipt.producer_id == big
    assert frame.command.send_receipt.sequence_id == 2**63 - 1


def test_encoding_incomplete_command_is_refused() -> None:
    with pytest.raises(MalformedFrame):
        encode_command(pb.BaseCommand(type=T.SEND, send=pb.CommandSend(producer_id=1)))


# --- bad input (DESIGN.md section 3.2), each raises before allocating ------------------------


@pytest.mark.parametrize(
    ("prefix", "error"),
    [
        (FRAME_SIZE_MAX_BYTES, FrameTooLarge),  # + 4 for the prefix itself is over
        (2**31 - 1, FrameTooLarge),
        (-1, BadFrameLength),
        (-(2**31), BadFrameLength),
        (0, BadFrameLength),
        (3, BadFrameLength),
    ],
)
def test_bad_length_prefix_raises_before_buffering(prefix: int, error: type[Exception]) -> None:
    decoder = FrameDecoder()
    with pytest.raises(error):
        decoder.feed(struct.pack(">i", prefix) + b"\x00" * 100)
    assert decoder.buffered_bytes == 0


def test_bad_prefix_split_over_chunks_raises_before_buffering() -> None:
    decoder = FrameDecoder()
    assert decoder.feed(b"\x7f\xff") == []
    with pytest.raises(FrameTooLarge) as info:
        decoder.feed(b"\xff\xff" + b"\x00" * 1000)
    assert info.value.size == 2**31 - 1 + 4
    assert info.value.max_size == FRAME_SIZE_MAX_BYTES
    assert decoder.buffered_bytes == 0


def test_largest_legal_frame_is_accepted_smaller_limit() -> None:
    decoder = FrameDecoder(max_frame_size=64)
    ping = encode_command(commands.ping())
    assert len(decoder.feed(ping)) == 1
    with pytest.raises(FrameTooLarge):
        decoder.feed(struct.pack(">I", 61))


def test_decoder_stays_failed() -> None:
    decoder = FrameDecoder()
    with pytest.raises(BadFrameLength):
        decoder.feed(struct.pack(">i", -5))
    with pytest.raises(BadFrameLength):
        decoder.feed(encode_command(commands.ping()))


def _raw(cmd_bytes: bytes, total_extra: int = 0, cmd_size: int | None = None) -> bytes:
    size = len(cmd_bytes) if cmd_size is None else cmd_size
    body = struct.pack(">i", size) + cmd_bytes
    return struct.pack(">I", len(body) + total_extra) + body


def test_cmd_size_larger_than_frame() -> None:
    cmd = commands.ping().SerializeToString()
    with pytest.raises(MalformedFrame, match="command size"):
        FrameDecoder().feed(_raw(cmd, cmd_size=len(cmd) + 1))


def test_negative_cmd_size() -> None:
    with pytest.raises(MalformedFrame):
        FrameDecoder().feed(_raw(b"\x08\x12", cmd_size=-1))


def test_truncated_protobuf() -> None:
    cmd = commands.connect("client", 21).SerializeToString()
    with pytest.raises(MalformedFrame):
        FrameDecoder().feed(_raw(cmd[:-3]))


@pytest.mark.parametrize(
    ("what", "frame"),
    [
        ("BaseCommand", _raw(b"\xff" * 8)),
        (
            "MessageMetadata",
            encode_entry_frame(commands.send(1, 1), struct.pack(">i", 8) + b"\xff" * 8 + b"x"),
        ),
    ],
)
def test_unparsable_protobuf_is_a_fixed_reason(
    what: str, frame: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    # The reason reaches the peer in an ERROR command: the protobuf runtime's own text
    # (internal package name, parser state) must not; the broker's debug log keeps it.
    caplog.set_level(logging.DEBUG, logger="anabranch.protocol.frames")
    with pytest.raises(MalformedFrame) as raised:
        FrameDecoder().feed(frame)
    assert str(raised.value) == f"malformed frame: unparsable {what}"
    assert f"unparsable {what}: " in caplog.text


def test_missing_required_fields() -> None:
    partial = pb.BaseCommand(type=T.FLOW)
    partial.flow.consumer_id = 1  # messagePermits (required) missing
    with pytest.raises(MalformedFrame, match="messagePermits"):
        FrameDecoder().feed(_raw(partial.SerializePartialToString()))


def test_unknown_command_type() -> None:
    with pytest.raises(MalformedFrame, match="type"):
        FrameDecoder().feed(_raw(b"\x08\x63"))  # type = 99


def test_body_not_matching_type() -> None:
    wrong = pb.BaseCommand(type=T.SEND, flow=pb.CommandFlow(consumer_id=1, messagePermits=1))
    with pytest.raises(MalformedFrame, match="without its send body"):
        FrameDecoder().feed(_raw(wrong.SerializeToString()))


def test_extra_body_is_rejected() -> None:
    both = commands.flow(1, 1)
    both.send.CopyFrom(pb.CommandSend(producer_id=1, sequence_id=1))
    with pytest.raises(MalformedFrame, match="unrelated"):
        FrameDecoder().feed(_raw(both.SerializeToString()))


def test_payload_on_simple_command_is_rejected() -> None:
    data = encode_command(commands.ping())
    bad = struct.pack(">I", len(data) - 4 + 3) + data[4:] + b"abc"
    with pytest.raises(MalformedFrame, match="followed by"):
        FrameDecoder().feed(bad)


def test_send_without_metadata_is_rejected() -> None:
    with pytest.raises(MalformedFrame, match="metadata"):
        FrameDecoder().feed(encode_entry_frame(commands.send(1, 1), b""))


def test_metadata_size_over_frame_is_rejected() -> None:
    entry = struct.pack(">i", 1000) + b"x"
    with pytest.raises(MalformedFrame, match="metadata size"):
        FrameDecoder().feed(encode_entry_frame(commands.send(1, 1), entry))


# --- checksums -------------------------------------------------------------------------------


def test_checksum_mismatch_is_flagged_not_fatal() -> None:
    good = encode_payload_frame(commands.send(1, 9), _metadata(9), b"payload")
    bad = good[:-1] + bytes([good[-1] ^ 0xFF])
    decoder = FrameDecoder()
    (frame,) = decoder.feed(bad + encode_command(commands.ping()))[:1]
    assert frame.type == T.SEND and frame.checksum_ok is False
    assert frame.command.send.sequence_id == 9  # enough to answer SEND_ERROR(ChecksumError)
    assert [f.type_name for f in decoder.feed(encode_command(commands.ping()))] == ["PING"]


def test_checksum_mismatch_with_garbled_metadata_is_still_just_flagged() -> None:
    good = encode_payload_frame(commands.send(1, 9), _metadata(9), b"")
    cmd_size = struct.unpack_from(">I", good, 4)[0]
    meta_start = 4 + 4 + cmd_size + 6 + 4
    garbled = good[:meta_start] + b"\xff" * (len(good) - meta_start)
    (frame,) = FrameDecoder().feed(garbled)
    assert frame.checksum_ok is False and frame.metadata is None


def test_entry_is_what_was_received() -> None:
    entry = encode_entry(_metadata(1), b"stored")
    (frame,) = FrameDecoder().feed(encode_entry_frame(commands.send(1, 1), entry))
    assert frame.entry == entry
    resent = encode_entry_frame(commands.message(4, 1, 1), frame.entry)
    (again,) = FrameDecoder().feed(resent)
    assert again.payload == b"stored" and again.checksum_ok is True


def test_all_errors_are_protocol_errors() -> None:
    for cls in (BadFrameLength, FrameTooLarge, MalformedFrame):
        assert issubclass(cls, ProtocolError)
