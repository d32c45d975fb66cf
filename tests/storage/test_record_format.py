"""One test per reader outcome of the record format (leveldb log_test style)."""

from __future__ import annotations

import struct

import pytest

from anabranch import limits
from anabranch.errors import CorruptRecord, ValueTooLarge
from anabranch.storage.record_format import HEADER_BYTES, decode_one, encode, scan

A, B, C = b"alpha", b"bravo-bravo", b""


def three() -> bytes:
    return encode(A) + encode(B) + encode(C)


def test_round_trip_whole() -> None:
    result = scan(three(), where="t")
    assert [p for _, p in result.records] == [A, B, C]
    assert result.torn is None
    assert result.valid_end == len(three())


def test_offsets_are_absolute() -> None:
    result = scan(three(), where="t", base_offset=100)
    assert [o for o, _ in result.records] == [100, 100 + 8 + len(A), 100 + 16 + len(A) + len(B)]


def test_byte_by_byte_prefixes_never_yield_partial_records() -> None:
    buf = three()
    boundaries = {0, 8 + len(A), 16 + len(A) + len(B), len(buf)}
    for cut in range(len(buf) + 1):
        result = scan(buf[:cut], where="t", recovery=True)
        assert result.valid_end <= cut
        assert (result.torn is None) == (cut in boundaries)
        for _, payload in result.records:
            assert payload in (A, B, C)


def test_truncated_tail_short_header() -> None:
    buf = encode(A) + encode(B)[:5]
    result = scan(buf, where="t", recovery=True)
    assert result.records == [(0, A)]
    assert result.torn == "short header"
    assert result.valid_end == 8 + len(A)
    with pytest.raises(CorruptRecord):
        scan(buf, where="t")  # strict mode: a torn record is corruption


def test_truncated_tail_short_payload() -> None:
    buf = encode(A) + encode(B)[:-1]
    result = scan(buf, where="t", recovery=True)
    assert [p for _, p in result.records] == [A]
    assert result.torn == "short payload"


def test_bad_length_is_corrupt_even_in_recovery() -> None:
    bad = struct.pack(">II", limits.STORAGE_RECORD_BYTES_MAX + 1, 0) + b"x" * 16
    with pytest.raises(CorruptRecord) as info:
        scan(encode(A) + bad, where="seg", recovery=True)
    assert info.value.offset == 8 + len(A)
    assert "bad length" in info.value.reason


def test_checksum_mismatch_in_the_middle_is_corrupt() -> None:
    buf = bytearray(three())
    buf[8 + len(A) + HEADER_BYTES + 2] ^= 0x01  # a bit flip inside B's payload
    with pytest.raises(CorruptRecord) as info:
        scan(bytes(buf), where="seg", recovery=True)
    assert info.value.offset == 8 + len(A)
    assert info.value.reason == "checksum mismatch"


def test_flipped_length_caught_by_checksum() -> None:
    buf = bytearray(encode(b"abcdef") + encode(B))
    buf[3] = 5  # length 6 -> 5: still inside the buffer
    with pytest.raises(CorruptRecord):
        scan(bytes(buf), where="seg", recovery=True)


def test_checksum_mismatch_on_final_record_is_torn() -> None:
    buf = bytearray(encode(A) + encode(B))
    buf[-1] ^= 0xFF
    result = scan(bytes(buf), where="seg", recovery=True)
    assert [p for _, p in result.records] == [A]
    assert result.torn == "checksum mismatch at tail"


def test_damaged_records_never_joined() -> None:
    # A torn fragment of B followed by a complete C: the reader must not resynchronise
    # onto C or read B's header with C's bytes as its payload.
    buf = encode(A) + encode(B)[:10] + encode(b"charlie")
    with pytest.raises(CorruptRecord):
        scan(buf, where="seg", recovery=True)
    zero_fill = encode(A) + bytes(32)  # a zeroed tail (extended but unwritten) is not data
    result = scan(zero_fill, where="seg", recovery=True)
    assert [p for _, p in result.records] == [A]
    assert result.torn == "zero-filled tail"
    assert result.valid_end == 8 + len(A)


def test_trailing_bytes_after_whole_record() -> None:
    with pytest.raises(CorruptRecord):
        decode_one(encode(A) + b"\x00", where="t", offset=0)
    assert decode_one(encode(A), where="t", offset=0) == A


def test_max_records_stops_early() -> None:
    result = scan(three() + b"garbage", where="t", max_records=2)
    assert [p for _, p in result.records] == [A, B]


def test_oversized_payload_refused_at_encode() -> None:
    with pytest.raises(ValueTooLarge):
        encode(bytes(limits.STORAGE_RECORD_BYTES_MAX + 1))
