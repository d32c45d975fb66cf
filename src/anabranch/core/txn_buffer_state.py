"""What a topic's readers may see of its transactional entries (PIP-473 participant side).

Theory of operation
-------------------
A topic's dispatchers never read past ``max_read_position(lac)``, so an entry of an OPEN
transaction, and every entry after it (read-committed: a later non-transactional entry
waits too), stays unread until the transaction ends. The state knows four things:

- **open** transactions with the positions of their entries (kept sorted);
- **in-flight** transactional appends, each pinning the LAC it saw when it started (the
  entry lands after it, at a position nobody knows yet);
- transactions **recovered** OPEN after a restart whose positions are not known yet,
  pinned at the op record's ``first_after`` (every entry of theirs lies after it);
- **aborted** positions, which the dispatcher skips (and acknowledges).

``max_read_position(lac)`` is the smallest of: ``lac``, the position just before the first
entry of each open transaction (``(l, e)`` → ``(l, e-1)``; positions order as tuples, so
``(l, -1)`` is before ``(l, 0)``), each in-flight pin and each recovered pin. It never
moves back: a new pin is the current LAC, which is not below it, and a new transaction's
first entry lands after such a pin.

Outcomes:

    | event          | open txn                   | its in-flight appends land...        |
    |----------------|----------------------------|--------------------------------------|
    | committed      | forgotten (entries readable)| readable                            |
    | aborted        | positions → aborted set    | in the aborted set                   |
    | committed with | entries of a winner branch | winners readable, the rest in the    |
    | winners        | readable, the rest aborted | aborted set                          |
    | (unknown txn)  | nothing changes            |                                      |

**Branches** (batch transactions of an exactly-once sink): an append may name a branch
(a Spark task attempt); a commit naming ``winners`` commits only the entries of those
branches, and every other entry of the transaction (a losing branch, or no branch) is
aborted, exactly as if its transaction had aborted.

Transactions are any hashable pair of ints (the shell uses ``TxnId``), positions are
``(ledger_id, entry_id)`` tuples (the shell uses ``Position``); no I/O, no clock.

Example:
    >>> s = TxnBufferState()
    >>> token = s.begin_append((0, 1), lac=(5, 2))    # txn 0_1 appends; LAC is 5:2
    >>> s.max_read_position((5, 3))                   # a plain entry landed at 5:3
    (5, 2)
    >>> s.end_append(token, (5, 4))                   # the txn's entry lands at 5:4
    >>> s.max_read_position((5, 6))
    (5, 3)
    >>> s.apply_outcome((0, 1), committed=False)
    True
    >>> s.max_read_position((5, 6)), s.is_aborted((5, 4)), s.is_aborted((5, 3))
    ((5, 6), True, False)

    Two branches of one transaction, one winner:

    >>> s.open_txn((0, 2))
    >>> for pos, branch in (((6, 0), "0-a"), ((6, 1), "0-b")):
    ...     s.end_append(s.begin_append((0, 2), (5, 6), branch), pos)
    >>> s.apply_outcome((0, 2), committed=True, winners=frozenset({"0-b"}))
    True
    >>> s.max_read_position((6, 1)), s.is_aborted((6, 0)), s.is_aborted((6, 1))
    ((6, 1), True, False)
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterable
from dataclasses import dataclass

from anabranch.errors import InvalidArgument

Pos = tuple[int, int]
Txn = tuple[int, int]


def before(position: Pos) -> Pos:
    """The position just before ``position`` in its ledger.

    >>> before((3, 0))
    (3, -1)
    """
    return (position[0], position[1] - 1)


def _wins(committed: bool, winners: frozenset[str] | None, branch: str | None) -> bool:
    """Whether an entry of ``branch`` is committed by this outcome."""
    if not committed:
        return False
    return winners is None or (branch is not None and branch in winners)


@dataclass(slots=True)
class _Append:
    """One in-flight transactional append."""

    txn: Txn
    pin: Pos
    branch: str | None = None
    aborted: bool | None = None
    """Set when the outcome arrived while the append was in flight (True = aborted)."""


class TxnBufferState:
    """Open transactions, pins and aborted positions of one topic (see the module doc)."""

    __slots__ = (
        "_aborted",
        "_aborted_by_txn",
        "_appends",
        "_branches",
        "_open",
        "_recovered",
        "_tokens",
    )

    def __init__(self) -> None:
        self._open: dict[Txn, list[Pos]] = {}
        self._appends: dict[int, _Append] = {}
        self._recovered: dict[Txn, Pos] = {}
        self._aborted: dict[Pos, Txn] = {}
        self._aborted_by_txn: dict[Txn, list[Pos]] = {}
        # Branch of each branched position of an open transaction (absent = no branch).
        self._branches: dict[Txn, dict[Pos, str]] = {}
        self._tokens = itertools.count()

    # --- events ---------------------------------------------------------------------------

    def open_txn(self, txn: Txn) -> None:
        """Know ``txn`` as OPEN on this topic (idempotent)."""
        self._open.setdefault(txn, [])

    def begin_append(self, txn: Txn, lac: Pos, branch: str | None = None) -> int:
        """A transactional append (of ``branch``, if any) starts while the ledger's last
        confirmed entry is ``lac``; returns the token to end it with. ``txn`` becomes OPEN
        here if it was not."""
        self.open_txn(txn)
        token = next(self._tokens)
        self._appends[token] = _Append(txn, (lac[0], lac[1]), branch)
        return token

    def end_append(self, token: int, position: Pos) -> None:
        """The append of ``token`` landed at ``position``; the outcome, if one arrived
        meanwhile, applies to it too."""
        append = self._appends.pop(token)
        if append.aborted is None:
            bisect.insort(self._open[append.txn], position)
            if append.branch is not None:
                self._branches.setdefault(append.txn, {})[position] = append.branch
        elif append.aborted:
            self._add_aborted(append.txn, [position])

    def fail_append(self, token: int) -> None:
        """The append of ``token`` failed: nothing was written, the pin goes."""
        del self._appends[token]

    def recover_unfinished(self, txn: Txn, first_after: Pos) -> None:
        """After a restart: ``txn`` is OPEN and its entries lie after ``first_after``."""
        self.open_txn(txn)
        current = self._recovered.get(txn)
        self._recovered[txn] = first_after if current is None else min(current, first_after)

    def found(self, txn: Txn, position: Pos, branch: str | None = None) -> None:
        """A recovery scan found an entry of the OPEN ``txn`` (of ``branch``) at
        ``position``."""
        positions = self._open[txn]
        index = bisect.bisect_left(positions, position)
        if index == len(positions) or positions[index] != position:
            positions.insert(index, position)
        if branch is not None:
            self._branches.setdefault(txn, {})[position] = branch

    def end_scan(self, txn: Txn) -> None:
        """A recovery scan has found every entry of ``txn``: its pin goes."""
        self._recovered.pop(txn, None)

    def apply_outcome(
        self, txn: Txn, *, committed: bool, winners: frozenset[str] | None = None
    ) -> bool:
        """``txn`` ended; True if this changed anything (an idempotent repeat does not).

        A commit with ``winners`` commits only the entries of those branches; the others
        (other branches, and entries with no branch) go to the aborted set."""
        changed = False
        for append in self._appends.values():
            if append.txn == txn and append.aborted is None:
                append.aborted = not _wins(committed, winners, append.branch)
                changed = True
        positions = self._open.pop(txn, None)
        branches = self._branches.pop(txn, {})
        self._recovered.pop(txn, None)
        if positions is not None:
            changed = True
            if not committed:
                self._add_aborted(txn, positions)
            elif winners is not None:
                losers = [p for p in positions if not _wins(True, winners, branches.get(p))]
                self._add_aborted(txn, losers)
        return changed

    def load_aborted(self, txn: Txn, positions: Iterable[Pos]) -> None:
        """Positions of an aborted ``txn`` (from its durable record, or a recovery scan)."""
        self._open.pop(txn, None)
        self._branches.pop(txn, None)
        self._recovered.pop(txn, None)
        self._add_aborted(txn, positions)

    def prune_aborted(self, first_valid: Pos) -> list[Txn]:
        """Forget aborted transactions whose every entry lies before ``first_valid``
        (trimmed from the ledger); returns them, so their records can be deleted."""
        gone = [t for t, ps in self._aborted_by_txn.items() if not ps or ps[-1] < first_valid]
        for txn in gone:
            for position in self._aborted_by_txn.pop(txn):
                self._aborted.pop(position, None)
        return gone

    def _add_aborted(self, txn: Txn, positions: Iterable[Pos]) -> None:
        positions = list(positions)
        if not positions:
            # Nothing to skip: a commit whose winners wrote everything, or a transaction
            # with no entry here, must not count (or be kept) as an aborted one.
            return
        known = self._aborted_by_txn.setdefault(txn, [])
        for position in positions:
            if position not in self._aborted:
                self._aborted[position] = txn
                bisect.insort(known, position)

    # --- queries --------------------------------------------------------------------------

    def max_read_position(self, lac: Pos) -> Pos:
        """The last position a dispatcher may read when the ledger's LAC is ``lac``."""
        limit = lac
        for positions in self._open.values():
            if positions and before(positions[0]) < limit:
                limit = before(positions[0])
        for append in self._appends.values():
            limit = min(limit, append.pin)
        for pin in self._recovered.values():
            limit = min(limit, pin)
        return limit

    def is_aborted(self, position: Pos) -> bool:
        return position in self._aborted

    def is_ongoing(self, txn: Txn) -> bool:
        return txn in self._open

    def positions(self, txn: Txn) -> list[Pos]:
        """Known positions of the OPEN ``txn`` (sorted)."""
        return list(self._open.get(txn, ()))

    def aborted_positions(self, txn: Txn) -> list[Pos]:
        return list(self._aborted_by_txn.get(txn, ()))

    def in_flight(self, txn: Txn) -> int:
        """Appends of ``txn`` still in flight."""
        return sum(1 for a in self._appends.values() if a.txn == txn)

    @property
    def open_count(self) -> int:
        return len(self._open)

    @property
    def recovered_count(self) -> int:
        return len(self._recovered)

    @property
    def aborted_txn_count(self) -> int:
        return len(self._aborted_by_txn)

    @property
    def in_flight_count(self) -> int:
        return len(self._appends)

    def validate(self) -> None:
        """Check the invariants; InvalidArgument names the first one broken."""
        for txn, positions in self._open.items():
            if positions != sorted(set(positions)):
                raise InvalidArgument(f"positions of {txn} not sorted and unique")
            if txn in self._aborted_by_txn:
                raise InvalidArgument(f"{txn} is both open and aborted")
            for position in positions:
                if position in self._aborted:
                    raise InvalidArgument(f"{position} of open {txn} is aborted")
        for txn, branched in self._branches.items():
            if txn not in self._open or not set(branched) <= set(self._open[txn]):
                raise InvalidArgument(f"branched positions of {txn} are not open positions")
        for txn in self._recovered:
            if txn not in self._open:
                raise InvalidArgument(f"recovered {txn} is not open")
        for append in self._appends.values():
            if append.aborted is None and append.txn not in self._open:
                raise InvalidArgument(f"in-flight append of {append.txn} has no open txn")
        count = sum(len(ps) for ps in self._aborted_by_txn.values())
        if count != len(self._aborted):
            raise InvalidArgument("aborted positions and their transactions disagree")
