"""Which sealed ledgers to offload to the object store, and which hot copies to delete.

Theory of operation
-------------------
Pure decisions (no I/O, no clock: ``now_ms`` comes in), Pulsar's offload policies:

* ``offloadThreshold`` (bytes, namespace): counting the managed ledger's ledgers from the
  newest (the open one included) down, a sealed ledger is offloaded once the hot tier
  holds more than the threshold counting it and everything newer. ``0`` offloads every
  sealed ledger at once; ``-1`` (the default) disables size-driven offload.
* ``offloadThresholdInSeconds``: a sealed ledger closed at least that long ago is
  offloaded; ``-1`` disables it. Either threshold suffices.
* A manual trigger (``PUT .../offload`` with a message id) offloads every sealed ledger
  *before* that message's ledger.
* ``offloadDeletionLagMs``: the hot copy of an offloaded ledger is deleted once that
  long has passed since the offload completed (``-1`` keeps hot copies forever).

The open (last) ledger is never offloaded, nor is an empty one. Ledgers are planned oldest
first, so an interrupted run leaves a contiguous offloaded prefix in the common case.

Example:
    >>> p = OffloadPolicy(threshold_bytes=100, deletion_lag_ms=10)
    >>> ledgers = [OffloadCandidate(1, 80, closed_ms=0), OffloadCandidate(2, 80, closed_ms=5),
    ...            OffloadCandidate(3, 30, closed_ms=None)]
    >>> plan_offload(ledgers, p, now_ms=20)
    OffloadPlan(offload=(1, 2), delete_hot=())
    >>> ledgers[0] = OffloadCandidate(1, 80, closed_ms=0, offloaded_ms=5)
    >>> plan_offload(ledgers, p, now_ms=20).delete_hot
    (1,)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from anabranch.errors import InvalidArgument

DISABLED = -1
"""A threshold or deletion lag that never acts (Pulsar's -1)."""

DEFAULT_DELETION_LAG_MS = 4 * 3600 * 1000
"""Pulsar's ``managedLedgerOffloadDeletionLagMs`` default: 4 hours."""


@dataclass(frozen=True, slots=True)
class OffloadPolicy:
    """A namespace's (or the broker's default) offload settings; ``-1`` disables a bound."""

    threshold_bytes: int = DISABLED
    threshold_s: int = DISABLED
    deletion_lag_ms: int = DEFAULT_DELETION_LAG_MS

    def __post_init__(self) -> None:
        for name in ("threshold_bytes", "threshold_s", "deletion_lag_ms"):
            if getattr(self, name) < DISABLED:
                raise InvalidArgument(f"{name} must be -1 (disabled) or >= 0")

    @property
    def automatic(self) -> bool:
        """Whether any threshold can trigger an offload by itself."""
        return self.threshold_bytes != DISABLED or self.threshold_s != DISABLED


@dataclass(frozen=True, slots=True)
class OffloadCandidate:
    """One ledger as the planner sees it (oldest first in the list it gets)."""

    ledger_id: int
    size: int
    closed_ms: int | None
    """None while it is the open ledger."""
    offloaded_ms: int | None = None
    """When its offload completed; None when not offloaded."""
    hot: bool = True
    """Its entries are still in the hot tier."""
    entries: int = 1


@dataclass(frozen=True, slots=True)
class OffloadPlan:
    """Ledger ids to offload and ledger ids whose hot copy to delete, oldest first."""

    offload: tuple[int, ...]
    delete_hot: tuple[int, ...]


def plan_offload(
    ledgers: Sequence[OffloadCandidate],
    policy: OffloadPolicy,
    now_ms: int,
    before_ledger: int | None = None,
) -> OffloadPlan:
    """What to do now; ``before_ledger`` (a manual trigger) offloads every sealed ledger
    with a smaller id whatever the thresholds say."""
    newer_bytes = 0
    chosen: list[int] = []
    for info in reversed(ledgers):
        if info.hot:
            newer_bytes += info.size
        if info.closed_ms is None or info.offloaded_ms is not None or info.entries == 0:
            continue
        by_size = policy.threshold_bytes != DISABLED and newer_bytes > policy.threshold_bytes
        by_age = (
            policy.threshold_s != DISABLED and now_ms - info.closed_ms >= policy.threshold_s * 1000
        )
        by_hand = before_ledger is not None and info.ledger_id < before_ledger
        if by_size or by_age or by_hand:
            chosen.append(info.ledger_id)
    lag = policy.deletion_lag_ms
    doomed = tuple(
        info.ledger_id
        for info in ledgers
        if info.hot
        and info.offloaded_ms is not None
        and lag != DISABLED
        and now_ms >= info.offloaded_ms + lag
    )
    return OffloadPlan(tuple(reversed(chosen)), doomed)


def first_unoffloaded(ledgers: Sequence[OffloadCandidate]) -> int | None:
    """The id of the oldest ledger not offloaded (Pulsar's ``firstUnoffloadedMessage``
    is its entry 0), or None when every ledger is.

    >>> first_unoffloaded([OffloadCandidate(1, 5, 0, offloaded_ms=1), OffloadCandidate(2, 5, None)])
    2
    """
    for info in ledgers:
        if info.offloaded_ms is None:
            return info.ledger_id
    return None
