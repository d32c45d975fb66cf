"""The hand-encoded hot frames are byte-identical to the protobuf runtime's encoding."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from anabranch.broker.consumer import message_id_data
from anabranch.broker.hot_frames import encode_message_head, encode_send_receipt
from anabranch.protocol import commands
from anabranch.protocol._generated import pulsar_api_pb2 as pb
from anabranch.protocol.frames import decode_frame, encode_command, encode_entry, encode_entry_frame
from anabranch.storage.api import Position

U64 = st.integers(min_value=0, max_value=2**64 - 1)
SIGNED = st.integers(min_value=-1, max_value=2**63 - 1)


@given(U64, U64, U64, U64, st.none() | U64)
def test_send_receipt_matches_protobuf(
    producer_id: int, sequence_id: int, ledger_id: int, entry_id: int, highest: int | None
) -> None:
    expected = encode_command(
        commands.send_receipt(producer_id, sequence_id, ledger_id, entry_id, highest)
    )
    assert encode_send_receipt(producer_id, sequence_id, ledger_id, entry_id, highest) == expected


@given(
    U64,
    SIGNED,
    SIGNED,
    st.integers(min_value=-1, max_value=2**31 - 1),
    st.integers(min_value=0, max_value=2**32 - 1),
    U64,
    st.binary(max_size=64),
)
def test_message_frame_matches_protobuf(  # noqa: PLR0917
    consumer_id: int,
    ledger_id: int,
    entry_id: int,
    partition: int,
    redelivery_count: int,
    epoch: int,
    payload: bytes,
) -> None:
    md = pb.MessageMetadata(producer_name="p", sequence_id=1, publish_time=2)
    entry = encode_entry(md, payload)
    body = pb.CommandMessage(
        consumer_id=consumer_id,
        message_id=message_id_data(Position(ledger_id, entry_id), partition),
    )
    if redelivery_count:
        body.redelivery_count = redelivery_count
    if epoch:
        body.consumer_epoch = epoch
    expected = encode_entry_frame(pb.BaseCommand(type=pb.BaseCommand.MESSAGE, message=body), entry)
    got = encode_message_head(
        consumer_id, ledger_id, entry_id, partition, redelivery_count, epoch, len(entry)
    )
    got += entry  # what a session writes as two parts
    assert got == expected
    assert decode_frame(got[4:]).payload == payload
