"""Inclusive hash ranges over the 16-bit keyspace, and the key → hash rule.

A scalable topic's keyspace is ``[0x0000, 0xFFFF]``. Every segment owns one inclusive
:class:`HashRange`; a key is routed to the active segment whose range contains
:func:`segment_hash` of the key. The hash rule is upstream Pulsar's current one
(``ScalableTopicHashing``): the *high* 16 bits of the raw, unsigned MurmurHash3 x86_32
(seed 0) of the UTF-8 key bytes. It is fixed by DESIGN.md §3.1 so that upstream v5
clients and ours route the same key to the same segment.

Example:
    >>> r = HashRange(0x0000, 0xFFFF)
    >>> r.split()
    (HashRange(start=0, end=32767), HashRange(start=32768, end=65535))
    >>> hex(segment_hash("hello"))
    '0x248b'
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import mmh3

from anabranch.errors import InvalidArgument, NotAllowed

HASH_MIN = 0x0000
"""Smallest hash value of the keyspace."""

HASH_MAX = 0xFFFF
"""Largest hash value of the keyspace (inclusive)."""

KEYSPACE_SIZE = HASH_MAX - HASH_MIN + 1
"""Number of distinct hash values: 65536."""

_HEX_RE = re.compile(r"([0-9a-f]{4})-([0-9a-f]{4})")


def segment_hash(key: str | bytes) -> int:
    """Hash a message key into the keyspace ``[0, 0xFFFF]`` (upstream's current rule).

    ``str`` keys are encoded as UTF-8 first, so ``"a"`` and ``b"a"`` hash alike.

    Example:
        >>> [hex(segment_hash(k)) for k in ("a", "key-0", b"order-42")]
        ['0x3c25', '0xe337', '0x4b11']
    """
    data = key.encode("utf-8") if isinstance(key, str) else key
    return (mmh3.hash(data, seed=0, signed=False) >> 16) & 0xFFFF


@dataclass(frozen=True, order=True, slots=True)
class HashRange:
    """An inclusive ``[start, end]`` inside ``[0x0000, 0xFFFF]``; ordered by start, then end.

    Construction validates: out-of-keyspace bounds or ``end < start`` raise
    :class:`~anabranch.errors.InvalidArgument`.

    Example:
        >>> a, b = HashRange(0, 0x7FFF), HashRange(0x8000, 0xFFFF)
        >>> (a.is_adjacent_to(b), a.merge(b) == HashRange.full(), str(a), a.to_hex())
        (True, True, '[0000, 7fff]', '0000-7fff')
    """

    start: int
    end: int

    def __post_init__(self) -> None:
        # bool is an int subclass; True/False as a bound is always a caller bug.
        for bound in (self.start, self.end):
            if not isinstance(bound, int) or isinstance(bound, bool):
                raise InvalidArgument(f"hash range bound {bound!r} is not an int")
        if not HASH_MIN <= self.start <= HASH_MAX or not HASH_MIN <= self.end <= HASH_MAX:
            raise InvalidArgument(
                f"hash range [{self.start}, {self.end}] is outside [{HASH_MIN}, {HASH_MAX}]"
            )
        if self.end < self.start:
            raise InvalidArgument(f"hash range end {self.end} is before start {self.start}")

    @classmethod
    def full(cls) -> HashRange:
        """The whole keyspace ``[0x0000, 0xFFFF]``.

        Example:
            >>> HashRange.full().size
            65536
        """
        return cls(HASH_MIN, HASH_MAX)

    @classmethod
    def from_hex(cls, text: str) -> HashRange:
        """Parse the ``"%04x-%04x"`` form (lower-case, exactly four digits each).

        Example:
            >>> HashRange.from_hex("0a0b-f0f0")
            HashRange(start=2571, end=61680)
        """
        match = _HEX_RE.fullmatch(text)
        if match is None:
            raise InvalidArgument(f"hash range {text!r} is not of the form 'hhhh-hhhh'")
        return cls(int(match.group(1), 16), int(match.group(2), 16))

    @property
    def size(self) -> int:
        """Number of hash values in the range (``end - start + 1``)."""
        return self.end - self.start + 1

    def to_hex(self) -> str:
        """The ``"%04x-%04x"`` form used in segment descriptors."""
        return f"{self.start:04x}-{self.end:04x}"

    def __str__(self) -> str:
        return f"[{self.start:04x}, {self.end:04x}]"

    def contains(self, hash_value: int) -> bool:
        """Whether ``hash_value`` lies inside the range (bounds included)."""
        return self.start <= hash_value <= self.end

    def covers(self, other: HashRange) -> bool:
        """Whether ``other`` lies entirely inside this range."""
        return self.start <= other.start and other.end <= self.end

    def overlaps(self, other: HashRange) -> bool:
        """Whether the two ranges share at least one hash value."""
        return self.start <= other.end and other.start <= self.end

    def is_adjacent_to(self, other: HashRange) -> bool:
        """Whether the ranges touch without overlapping (either order)."""
        return self.end + 1 == other.start or other.end + 1 == self.start

    def split(self) -> tuple[HashRange, HashRange]:
        """Split at ``mid = start + (end-start)//2`` into ``[start, mid]`` and ``[mid+1, end]``.

        A range one value wide cannot split: :class:`~anabranch.errors.NotAllowed`.

        Example:
            >>> HashRange(100, 101).split()
            (HashRange(start=100, end=100), HashRange(start=101, end=101))
        """
        if self.size < 2:
            raise NotAllowed(f"hash range {self} is one value wide and cannot split")
        mid = self.start + (self.end - self.start) // 2
        return HashRange(self.start, mid), HashRange(mid + 1, self.end)

    def merge(self, other: HashRange) -> HashRange:
        """The union of two adjacent ranges; non-adjacent ranges raise InvalidArgument.

        Example:
            >>> HashRange(0x4000, 0x7FFF).merge(HashRange(0, 0x3FFF))
            HashRange(start=0, end=32767)
        """
        if not self.is_adjacent_to(other):
            raise InvalidArgument(f"hash ranges {self} and {other} are not adjacent")
        return HashRange(min(self.start, other.start), max(self.end, other.end))
