"""The rules of a transaction's header, with no I/O: who may end it, who may join it.

Theory of operation
-------------------
A transaction's header (``transactions/records.py``) is created OPEN at version 1 and
written once more, by the single CAS (``expected_version=1``) that makes it final. The
header state moves only along this table; anything absent is refused:

    | from | to                   | by                                               |
    |------|----------------------|--------------------------------------------------|
    | OPEN | COMMITTED            | END_TXN(COMMIT) before the deadline               |
    | OPEN | ABORTED              | END_TXN(ABORT), the timeout sweep, or a COMMIT    |
    |      |                      | that arrives after the deadline                  |

A transaction *expires* when ``now_ms > deadline`` (``created_at + timeout_ms``): from
then on it can only abort. END_TXN is judged by :func:`judge_end`:

    | header                | wanted         | verdict         | the coordinator...          |
    |-----------------------|----------------|-----------------|-----------------------------|
    | absent                | any            | NOT_FOUND       | TransactionNotFound         |
    | OPEN                  | ABORTED        | APPLY           | CASes it ABORTED            |
    | OPEN, not expired     | COMMITTED      | APPLY           | CASes it COMMITTED          |
    | OPEN, expired         | COMMITTED      | EXPIRED         | CASes it ABORTED (as the    |
    |                       |                |                 | timeout would), then        |
    |                       |                |                 | InvalidTxnStatus            |
    | final == wanted       |                | ALREADY         | succeeds again (idempotent  |
    |                       |                |                 | retry), re-wakes participants|
    | final != wanted       |                | INVALID_STATUS  | InvalidTxnStatus            |

A participant about to write an op record (and ADD_PARTITION / ADD_SUBSCRIPTION) asks
:func:`judge_join`: OK only for an OPEN, unexpired header. The op-record write itself is
guarded by ``Check(header, expected_version=1)``, so a join judged OK that races the
final CAS still fails in the store rather than landing after the outcome.

TxnID least bits come from a per-partition counter reserved in blocks (:class:`IdBlock`),
so one CAS of the counter key serves ``limits.TXN_ID_BLOCK`` transactions.

Example:
    >>> from anabranch.transactions.records import U64_MAX, TxnHeader, TxnState
    >>> h = TxnHeader(state=TxnState.OPEN, created_at=1_000, timeout_ms=500)
    >>> judge_end(h, TxnState.COMMITTED, now_ms=1_200)
    <EndVerdict.APPLY: 'APPLY'>
    >>> judge_end(h, TxnState.COMMITTED, now_ms=1_501)
    <EndVerdict.EXPIRED: 'EXPIRED'>
    >>> judge_join(h, now_ms=1_500), judge_join(None, now_ms=0)
    (<JoinVerdict.OK: 'OK'>, <JoinVerdict.NOT_FOUND: 'NOT_FOUND'>)
    >>> block, counter = reserve_block(counter_next=0, size=2)
    >>> block.take(), block.take(), block.take(), counter
    (0, 1, None, 2)
"""

from __future__ import annotations

import dataclasses
from enum import Enum

from anabranch import limits
from anabranch.core.txn_header import U64_MAX, TxnHeader, TxnState
from anabranch.errors import InvalidArgument

TRANSITIONS: dict[TxnState, frozenset[TxnState]] = {
    TxnState.OPEN: frozenset({TxnState.COMMITTED, TxnState.ABORTED}),
    TxnState.COMMITTED: frozenset(),
    TxnState.ABORTED: frozenset(),
}
"""Allowed header state changes (upstream's ``TxnStatus.canTransitionTo`` for PIP-473)."""

OPEN_VERSION = 1
"""The header's store version while OPEN: created at 1, finalized by a CAS from 1."""

FINAL_VERSION = 2
"""The header's store version once final (the one write after its creation)."""


class EndVerdict(Enum):
    """What END_TXN does with a header (see the table in the module docstring)."""

    APPLY = "APPLY"
    ALREADY = "ALREADY"
    INVALID_STATUS = "INVALID_STATUS"
    NOT_FOUND = "NOT_FOUND"
    EXPIRED = "EXPIRED"
    """COMMIT of an OPEN transaction past its deadline: abort it (the timeout's outcome)
    and answer InvalidTxnStatus; it must never commit."""


class JoinVerdict(Enum):
    """Whether a participant may add an op record to a transaction now."""

    OK = "OK"
    NOT_FOUND = "NOT_FOUND"
    CONFLICT = "CONFLICT"
    """The transaction is already final (TransactionConflict)."""
    EXPIRED = "EXPIRED"
    """OPEN but past its deadline: the sweep is about to abort it."""


def can_transition(current: TxnState, target: TxnState) -> bool:
    """Whether the header may move from ``current`` to ``target``.

    >>> can_transition(TxnState.OPEN, TxnState.ABORTED)
    True
    >>> can_transition(TxnState.ABORTED, TxnState.OPEN)
    False
    """
    return target in TRANSITIONS[current]


def is_expired(header: TxnHeader, now_ms: int) -> bool:
    """Whether an OPEN header is past its deadline (final headers never expire).

    >>> is_expired(TxnHeader(TxnState.OPEN, created_at=0, timeout_ms=10), now_ms=10)
    False
    """
    return header.state is TxnState.OPEN and now_ms > header.deadline


def judge_end(current: TxnHeader | None, wanted: TxnState, now_ms: int) -> EndVerdict:
    """The verdict on END_TXN asking for ``wanted`` (COMMITTED or ABORTED).

    >>> done = TxnHeader(TxnState.ABORTED, created_at=0, timeout_ms=10, finalized_at=5)
    >>> judge_end(done, TxnState.ABORTED, 6), judge_end(done, TxnState.COMMITTED, 6)
    (<EndVerdict.ALREADY: 'ALREADY'>, <EndVerdict.INVALID_STATUS: 'INVALID_STATUS'>)
    """
    if not wanted.final:
        raise InvalidArgument(f"END_TXN must ask for a final state, not {wanted.value}")
    if current is None:
        return EndVerdict.NOT_FOUND
    if current.state is wanted:
        return EndVerdict.ALREADY
    if not can_transition(current.state, wanted):
        return EndVerdict.INVALID_STATUS
    if wanted is TxnState.COMMITTED and is_expired(current, now_ms):
        return EndVerdict.EXPIRED
    return EndVerdict.APPLY


def judge_join(current: TxnHeader | None, now_ms: int) -> JoinVerdict:
    """Whether a participant may write an op record for this transaction at ``now_ms``.

    >>> done = TxnHeader(TxnState.COMMITTED, created_at=0, timeout_ms=10, finalized_at=5)
    >>> judge_join(done, 6)
    <JoinVerdict.CONFLICT: 'CONFLICT'>
    """
    if current is None:
        return JoinVerdict.NOT_FOUND
    if current.state.final:
        return JoinVerdict.CONFLICT
    if is_expired(current, now_ms):
        return JoinVerdict.EXPIRED
    return JoinVerdict.OK


def target_state(verdict: EndVerdict, wanted: TxnState) -> TxnState:
    """The state the final CAS writes for an APPLY or EXPIRED verdict.

    >>> target_state(EndVerdict.EXPIRED, TxnState.COMMITTED)
    <TxnState.ABORTED: 'ABORTED'>
    """
    if verdict is EndVerdict.APPLY:
        return wanted
    if verdict is EndVerdict.EXPIRED:
        return TxnState.ABORTED
    raise InvalidArgument(f"verdict {verdict.value} writes nothing")


def finalized(header: TxnHeader, state: TxnState, now_ms: int) -> TxnHeader:
    """The header's final form: ``state`` and ``finalized_at``; refuses illegal moves.

    >>> h = TxnHeader(TxnState.OPEN, created_at=0, timeout_ms=10)
    >>> finalized(h, TxnState.COMMITTED, 7).finalized_at
    7
    """
    if not can_transition(header.state, state):
        raise InvalidArgument(f"a {header.state.value} transaction cannot become {state.value}")
    return dataclasses.replace(header, state=state, finalized_at=now_ms)


def clamp_timeout(ms: int | None) -> int:
    """The timeout a NEW_TXN gets: 0 or None means the default; capped at the maximum.

    >>> clamp_timeout(0), clamp_timeout(5), clamp_timeout(10**12) == limits.TXN_TIMEOUT_MAX_MS
    (60000, 5, True)
    """
    if ms is None or ms == 0:
        return limits.TXN_TIMEOUT_DEFAULT_MS
    if ms < 0:
        raise InvalidArgument(f"transaction timeout must not be negative: {ms}")
    return min(ms, limits.TXN_TIMEOUT_MAX_MS)


@dataclasses.dataclass(slots=True)
class IdBlock:
    """Least bits ``[next, end)`` reserved for one coordinator partition.

    The reservation is durable (the counter key already says ``end``), so ids handed out
    from a block are never handed out again, even if this process dies with the rest
    of the block unused: those ids are simply skipped.
    """

    next: int
    end: int

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        if not 0 <= self.next <= self.end:
            raise InvalidArgument(f"id block [{self.next}, {self.end}) is not a range")

    @property
    def remaining(self) -> int:
        return self.end - self.next

    def take(self) -> int | None:
        """The next id, or None once the block is used up."""
        if self.next >= self.end:
            return None
        taken = self.next
        self.next += 1
        return taken


def reserve_block(counter_next: int, size: int = limits.TXN_ID_BLOCK) -> tuple[IdBlock, int]:
    """The block reserved from a counter at ``counter_next``, and the counter's new value.

    >>> reserve_block(512, 256)
    (IdBlock(next=512, end=768), 768)
    """
    if not 0 <= counter_next <= U64_MAX or size <= 0:
        # Least bits are an unsigned 64-bit wire field; ids are never reused, so a
        # partition whose counter ran out cannot start more transactions.
        raise InvalidArgument(f"cannot reserve {size} ids from counter {counter_next}")
    end = min(counter_next + size, U64_MAX + 1)
    return IdBlock(counter_next, end), end
