"""HashRange and segment_hash (upstream HashRangeTest, SegmentRouterTest hashing)."""

from __future__ import annotations

import mmh3
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from anabranch.core.hash_range import HASH_MAX, HashRange, segment_hash
from anabranch.errors import InvalidArgument, NotAllowed

ranges = st.tuples(st.integers(0, HASH_MAX), st.integers(0, HASH_MAX)).map(
    lambda t: HashRange(min(t), max(t))
)


@pytest.mark.parametrize(
    ("key", "expected"),
    [("a", 0x3C25), ("hello", 0x248B), ("key-0", 0xE337), ("order-42", 0x4B11), ("", 0)],
)
def test_segment_hash_reference_values(key: str, expected: int) -> None:
    assert segment_hash(key) == expected
    assert segment_hash(key.encode()) == expected


def test_segment_hash_uses_high_half_of_unsigned_raw_hash() -> None:
    # DESIGN.md §7: mmh3.hash(b"hello", signed=False) == 0x248bfa47.
    assert mmh3.hash(b"hello", seed=0, signed=False) == 0x248BFA47
    assert segment_hash("hello") == 0x248BFA47 >> 16


def test_segment_hash_encodes_str_as_utf8() -> None:
    assert segment_hash("ключ") == segment_hash("ключ".encode())


@given(st.binary(max_size=64))
def test_segment_hash_in_keyspace(key: bytes) -> None:
    assert 0 <= segment_hash(key) <= HASH_MAX


def test_split_full_range() -> None:
    assert HashRange.full().split() == (HashRange(0, 0x7FFF), HashRange(0x8000, 0xFFFF))


def test_split_small_range() -> None:
    assert HashRange(100, 101).split() == (HashRange(100, 100), HashRange(101, 101))


def test_cannot_split_single_value() -> None:
    with pytest.raises(NotAllowed):
        HashRange(7, 7).split()


@pytest.mark.parametrize(("start", "end"), [(-1, 5), (0, 0x10000), (10, 9), (0x10000, 0x10000)])
def test_invalid_range(start: int, end: int) -> None:
    with pytest.raises(InvalidArgument):
        HashRange(start, end)


def test_bool_bounds_rejected() -> None:
    with pytest.raises(InvalidArgument):
        HashRange(False, True)


def test_adjacency_either_order() -> None:
    a, b, c = HashRange(0, 9), HashRange(10, 20), HashRange(22, 30)
    assert a.is_adjacent_to(b) and b.is_adjacent_to(a)
    assert not b.is_adjacent_to(c)
    assert not a.is_adjacent_to(a)


def test_merge_non_adjacent_rejected() -> None:
    with pytest.raises(InvalidArgument):
        HashRange(0, 9).merge(HashRange(11, 20))
    with pytest.raises(InvalidArgument):
        HashRange(0, 9).merge(HashRange(5, 20))  # overlapping is not adjacent


def test_hex_round_trip() -> None:
    assert HashRange.from_hex("0a0b-f0f0") == HashRange(0x0A0B, 0xF0F0)
    assert HashRange(0x0A0B, 0xF0F0).to_hex() == "0a0b-f0f0"
    assert str(HashRange.full()) == "[0000, ffff]"


@pytest.mark.parametrize("text", ["0A0B-F0F0", "a0b-f0f0", "0a0b_f0f0", "0a0b-f0f0 ", "f0f0-0a0b"])
def test_from_hex_rejects(text: str) -> None:
    with pytest.raises(InvalidArgument):
        HashRange.from_hex(text)


def test_ordering_by_start_then_end() -> None:
    assert sorted([HashRange(5, 9), HashRange(0, 9), HashRange(0, 3)]) == [
        HashRange(0, 3),
        HashRange(0, 9),
        HashRange(5, 9),
    ]


@given(ranges, st.integers(0, HASH_MAX))
def test_contains_matches_bounds(r: HashRange, h: int) -> None:
    assert r.contains(h) == (r.start <= h <= r.end)


@given(ranges)
def test_split_then_merge_is_identity(r: HashRange) -> None:
    assume(r.size >= 2)
    low, high = r.split()
    assert low.is_adjacent_to(high) and not low.overlaps(high)
    assert low.size + high.size == r.size
    assert 0 <= low.size - high.size <= 1  # midpoint: the low half gets the odd value
    assert low.merge(high) == r == high.merge(low)
    assert r.covers(low) and r.covers(high)


@given(ranges, ranges)
def test_overlaps_is_symmetric_and_exact(a: HashRange, b: HashRange) -> None:
    shared = max(a.start, b.start) <= min(a.end, b.end)
    assert a.overlaps(b) == b.overlaps(a) == shared
