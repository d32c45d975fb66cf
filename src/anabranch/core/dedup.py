"""Producer deduplication state of one topic or segment, by (producer name, sequence id).

Theory of operation
-------------------
A producer numbers its messages with increasing sequence ids (gaps allowed). The broker
remembers, per producer name, two high-water marks, as Pulsar's ``MessageDeduplication``:

- *pushed*: the highest id accepted for writing (it may still be in flight);
- *persisted*: the highest id whose write completed.

A send is judged on its first sequence id (a batch also names its last one):

    | sequence id                     | verdict    | the broker...                                |
    |---------------------------------|------------|----------------------------------------------|
    | > pushed                        | NEW        | writes it; ``admit`` moves pushed to the last |
    | <= persisted                    | DUPLICATE  | acknowledges without writing                 |
    | persisted < id <= pushed        | IN_FLIGHT  | answers once the earlier write ends, or asks |
    |                                 |            | the client to retry; never writes it twice   |

There is no "out of order" verdict: ids only grow, so a lower id than one already seen is a
retry of something sent before, i.e. a duplicate, whether or not it was seen itself.

``on_persisted`` moves both marks (also used while replaying a ledger tail after a
restart); ``on_failed`` drops the pushed mark back to persisted, since a failed write
fails every write queued behind it. Only *persisted* marks are durable:
:meth:`DedupState.snapshot` returns them, :meth:`DedupState.restore` rebuilds a state.

Bounds: at most ``limits.DEDUP_PRODUCERS_MAX`` producers are remembered and a snapshot is at
most ``limits.DEDUP_SNAPSHOT_BYTES_MAX`` bytes of JSON; past either, the least recently
persisted producers go first (a retry of theirs after that counts as new, as upstream after
it purges an inactive producer).

Across a split or merge, a child segment is seeded with the sealed parents' snapshots
(:meth:`DedupState.seeded_from`, the maximum per producer): a producer that re-routes a
retry to the child after the parent was sealed gets DUPLICATE for an id the parent
persisted, not a second copy (PIP-460: "deduplication state must be carried over").

Example:
    >>> d = DedupState()
    >>> d.admit("p1", 0), d.admit("p1", 0)
    (<DedupVerdict.NEW: 'NEW'>, <DedupVerdict.IN_FLIGHT: 'IN_FLIGHT'>)
    >>> d.on_persisted("p1", 0); d.check("p1", 0)
    <DedupVerdict.DUPLICATE: 'DUPLICATE'>
    >>> child = DedupState.seeded_from([d.snapshot(), {"p1": 5, "p2": 1}])
    >>> child.snapshot(), child.check("p1", 5), child.check("p1", 6)
    ({'p1': 5, 'p2': 1}, <DedupVerdict.DUPLICATE: 'DUPLICATE'>, <DedupVerdict.NEW: 'NEW'>)
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from enum import StrEnum

import msgspec

from anabranch import limits
from anabranch.errors import InvalidArgument

SEQUENCE_ID_MAX = 2**63 - 1
"""Largest sequence id: Pulsar's sequence id is a Java long; larger ids are InvalidArgument."""

_NONE = -1
"""Mark of a producer with nothing seen (Pulsar's -1)."""


class DedupVerdict(StrEnum):
    """What to do with a send; see the module's table."""

    NEW = "NEW"
    DUPLICATE = "DUPLICATE"
    IN_FLIGHT = "IN_FLIGHT"


class DedupState:
    """Per-producer pushed/persisted marks of one topic or segment (no I/O, no clock).

    Example:
        >>> d = DedupState()
        >>> d.admit("p", 10, last_sequence_id=14)  # a batch 10..14
        <DedupVerdict.NEW: 'NEW'>
        >>> d.check("p", 12), d.check("p", 15)
        (<DedupVerdict.IN_FLIGHT: 'IN_FLIGHT'>, <DedupVerdict.NEW: 'NEW'>)
    """

    __slots__ = ("_persisted", "_pushed", "producers_max")

    def __init__(self, producers_max: int = limits.DEDUP_PRODUCERS_MAX) -> None:
        self._pushed: dict[str, int] = {}
        self._persisted: dict[str, int] = {}
        self.producers_max = producers_max
        """Producers remembered; past it the least recently persisted is forgotten."""

    # --- construction -----------------------------------------------------------------

    @classmethod
    def restore(cls, snapshot: Mapping[str, int]) -> DedupState:
        """A state whose persisted (and pushed) marks are ``snapshot``."""
        state = cls()
        for producer, sequence_id in snapshot.items():
            _check_producer(producer)
            if sequence_id != _NONE:
                _check_sequence_id(sequence_id)
            state._persisted[producer] = sequence_id
            state._pushed[producer] = sequence_id
        return state

    @classmethod
    def seeded_from(cls, parent_snapshots: Iterable[Mapping[str, int]]) -> DedupState:
        """A child segment's state: the highest persisted id of each producer in any parent."""
        merged: dict[str, int] = {}
        for snapshot in parent_snapshots:
            for producer, sequence_id in snapshot.items():
                merged[producer] = max(merged.get(producer, _NONE), sequence_id)
        return cls.restore(merged)

    # --- decisions ------------------------------------------------------------------------

    def check(
        self, producer: str, sequence_id: int, last_sequence_id: int | None = None
    ) -> DedupVerdict:
        """Judge a send without changing anything."""
        _check_producer(producer)
        last = _check_range(sequence_id, last_sequence_id)
        del last  # validated only: the verdict follows the first id, as upstream
        if sequence_id > self._pushed.get(producer, _NONE):
            return DedupVerdict.NEW
        if sequence_id <= self._persisted.get(producer, _NONE):
            return DedupVerdict.DUPLICATE
        return DedupVerdict.IN_FLIGHT

    def admit(
        self, producer: str, sequence_id: int, last_sequence_id: int | None = None
    ) -> DedupVerdict:
        """Judge a send and, when NEW, record it as pushed (call after the send is valid:
        checksum and size checks come first, so a rejected send never advances the state)."""
        verdict = self.check(producer, sequence_id, last_sequence_id)
        if verdict is DedupVerdict.NEW:
            self._pushed[producer] = _check_range(sequence_id, last_sequence_id)
            if producer not in self._persisted:
                self._persisted[producer] = _NONE
                if len(self._persisted) > self.producers_max:
                    self._evict_oldest()
        return verdict

    def on_persisted(self, producer: str, sequence_id: int) -> None:
        """The write ending at ``sequence_id`` is durable (or was replayed from the ledger).

        The producer becomes the most recently persisted (``_persisted`` is kept in that
        order: eviction and bounded snapshots drop the oldest first)."""
        _check_producer(producer)
        _check_sequence_id(sequence_id)
        persisted = max(self._persisted.pop(producer, _NONE), sequence_id)
        self._persisted[producer] = persisted
        self._pushed[producer] = max(self._pushed.get(producer, _NONE), persisted)
        if len(self._persisted) > self.producers_max:
            self._evict_oldest()

    def _evict_oldest(self) -> None:
        while len(self._persisted) > self.producers_max:
            oldest = next(iter(self._persisted))
            self.forget(oldest)

    def on_failed(self, producer: str | None = None) -> None:
        """A write failed: forget what was pushed but not persisted (one producer or all)."""
        names = list(self._pushed) if producer is None else [producer]
        for name in names:
            if name in self._pushed:
                self._pushed[name] = self._persisted.get(name, _NONE)

    def forget(self, producer: str) -> None:
        """Drop a producer's marks (an idle producer purged by the shell)."""
        self._pushed.pop(producer, None)
        self._persisted.pop(producer, None)

    # --- queries and snapshots ------------------------------------------------------------

    def last_persisted(self, producer: str) -> int:
        """The producer's highest persisted id, -1 if none (the value Pulsar returns to a
        producer on connect so it resumes numbering after it)."""
        return self._persisted.get(producer, _NONE)

    def last_pushed(self, producer: str) -> int:
        """The producer's highest accepted id, -1 if none."""
        return self._pushed.get(producer, _NONE)

    def snapshot(self, max_bytes: int | None = limits.DEDUP_SNAPSHOT_BYTES_MAX) -> dict[str, int]:
        """The durable part: persisted marks by producer, sorted by name.

        Bounded in bytes: ``json.dumps`` of the result (ASCII-escaped, default separators,
        the largest of the encodings used) is at most ``max_bytes``; the most recently
        persisted producers that fit are kept, the oldest left out (None: every one).

        Example:
            >>> d = DedupState()
            >>> for i in range(5):
            ...     d.on_persisted(f"p{i}", 7)
            >>> kept = d.snapshot(max_bytes=30)
            >>> kept, len(json.dumps(kept))
            ({'p2': 7, 'p3': 7, 'p4': 7}, 27)
        """
        marks = [(p, s) for p, s in self._persisted.items() if s != _NONE]
        if max_bytes is not None:
            used = 2  # {}
            kept: list[tuple[str, int]] = []
            for producer, sequence_id in reversed(marks):
                size = len(json.dumps(producer)) + len(str(sequence_id)) + 2 + (2 if kept else 0)
                if used + size > max_bytes:
                    break
                used += size
                kept.append((producer, sequence_id))
            marks = kept
        return dict(sorted(marks))

    def to_json(self) -> bytes:
        """:meth:`snapshot` as JSON bytes (for a cursor property or a metadata value)."""
        return msgspec.json.encode(self.snapshot())

    @classmethod
    def from_json(cls, data: bytes | str) -> DedupState:
        """Inverse of :meth:`to_json`; bad input raises InvalidArgument."""
        try:
            snapshot = msgspec.json.decode(data, type=dict[str, int])
        except msgspec.DecodeError as err:
            raise InvalidArgument(f"dedup snapshot is not valid: {err}") from None
        return cls.restore(snapshot)

    def __len__(self) -> int:
        return len(self._pushed)

    def validate(self) -> None:
        """Both maps name the same producers and ``-1 <= persisted <= pushed`` for each."""
        if set(self._pushed) != set(self._persisted):
            raise InvalidArgument("dedup state: pushed and persisted name different producers")
        for producer, pushed in self._pushed.items():
            persisted = self._persisted[producer]
            if not _NONE <= persisted <= pushed <= SEQUENCE_ID_MAX:
                raise InvalidArgument(
                    f"dedup state: {producer!r} persisted {persisted} > pushed {pushed}"
                )


def _check_producer(producer: str) -> None:
    if not isinstance(producer, str) or not producer:
        raise InvalidArgument(f"producer name {producer!r} is not a non-empty string")


def _check_sequence_id(sequence_id: int) -> None:
    if (
        not isinstance(sequence_id, int)
        or isinstance(sequence_id, bool)
        or not 0 <= sequence_id <= SEQUENCE_ID_MAX
    ):
        raise InvalidArgument(f"sequence id {sequence_id!r} is outside [0, 2^63-1]")


def _check_range(sequence_id: int, last_sequence_id: int | None) -> int:
    """Validate a send's ids; return the last id of the send."""
    _check_sequence_id(sequence_id)
    if last_sequence_id is None:
        return sequence_id
    _check_sequence_id(last_sequence_id)
    if last_sequence_id < sequence_id:
        raise InvalidArgument(f"last sequence id {last_sequence_id} is before first {sequence_id}")
    return last_sequence_id
