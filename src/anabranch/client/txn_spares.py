"""Pre-opened ("spare") transactions: NEW_TXN off the critical path of ``new_transaction``.

Why: a loop of transactions otherwise waits, before each one, for a NEW_TXN round trip
whose answer needs a durable header write on the broker. The client keeps spares
instead: a ``new_transaction`` that finds one returns at once and starts one NEW_TXN in
the background for the next call; one that finds none sends NEW_TXN itself and starts
one too. So the number of spares follows the application's concurrency, bounded by
``SPARES_MAX`` (spares plus the NEW_TXNs in flight for them).

Timeouts: a transaction's clock starts when its NEW_TXN is sent. A spare is asked for
``ttl + SPARE_MAX_AGE_S`` and handed out only while younger than ``SPARE_MAX_AGE_S``,
with a client deadline of ``now + ttl``; so the client's deadline is never later than
the broker's (sent at ``s``, taken at ``t <= s + max_age``: ``t + ttl <= s + ttl +
max_age``), and the application gets the whole timeout it asked for.

No leaks: a spare has no participants, so while open it pins nothing. An unused spare
is aborted once it is too old to hand out (a timer), and every spare is aborted when
the client closes; a spare whose client died is aborted by the broker's timeout sweep.

:class:`SparePool` is the decision logic only (no clock, no I/O): callers pass ``now``
and abort what it returns.

Example:
    >>> pool = SparePool(max_spares=2, max_age_s=1.0)
    >>> pool.want_refill()
    True
    >>> pool.refill_started()
    >>> pool.refilled(Spare(TxnId(0, 7), ttl_ms=30_000, sent_at=10.0), now=10.01)
    []
    >>> spare, stale = pool.take(30_000, now=10.5)
    >>> spare.txn_id, stale
    (TxnId(most_bits=0, least_bits=7), [])
    >>> pool.take(30_000, now=10.6)
    (None, [])
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Final

from anabranch.core.txn_id import TxnId

SPARES_MAX: Final[int] = 64
"""Spares one client keeps (plus NEW_TXNs in flight for them): the concurrency of
transactions it can start without a round trip; beyond it, ``new_transaction`` waits for
its NEW_TXN as without spares."""

SPARE_MAX_AGE_S: Final[float] = 2.0
"""How long after its NEW_TXN a spare may still be handed out (and the extra time it is
opened for on the broker). Long enough for a loop of transactions to find its spare,
short enough that an idle client's spares end soon."""


@dataclass(frozen=True)
class Spare:
    """A transaction opened ahead of use: ``ttl_ms`` is the timeout the application asked
    for (the broker holds ``ttl_ms`` plus the max age), ``sent_at`` when its NEW_TXN was
    sent (the caller's clock)."""

    txn_id: TxnId
    ttl_ms: int
    sent_at: float


class SparePool:
    """Which spares exist, which may be handed out, which must be aborted (no I/O).

    Every spare given to :meth:`refilled` leaves exactly once: handed out by
    :meth:`take`, or returned for aborting by :meth:`take`, :meth:`refilled`,
    :meth:`expire` or :meth:`drain`.
    """

    def __init__(self, max_spares: int = SPARES_MAX, max_age_s: float = SPARE_MAX_AGE_S) -> None:
        self.max_spares = max_spares
        self.max_age_s = max_age_s
        self._spares: deque[Spare] = deque()
        self.in_flight = 0
        """NEW_TXNs sent for spares and not yet answered."""
        self.closed = False

    def __len__(self) -> int:
        return len(self._spares)

    def fresh(self, spare: Spare, now: float) -> bool:
        """May ``spare`` still be handed out at ``now``?"""
        return now - spare.sent_at < self.max_age_s

    def take(self, ttl_ms: int, now: float) -> tuple[Spare | None, list[Spare]]:
        """``(a fresh spare opened for ttl_ms or None, stale spares to abort)``."""
        stale = self.expire(now)
        for spare in self._spares:
            if spare.ttl_ms == ttl_ms:
                self._spares.remove(spare)
                return spare, stale
        return None, stale

    def want_refill(self) -> bool:
        """Should one more NEW_TXN be sent for a spare?"""
        return not self.closed and len(self._spares) + self.in_flight < self.max_spares

    def refill_started(self) -> None:
        self.in_flight += 1

    def refilled(self, spare: Spare | None, now: float) -> list[Spare]:
        """A refill ended (``None``: it failed); returns ``[spare]`` when it must be aborted
        at once (the pool closed meanwhile, or it is already too old)."""
        self.in_flight -= 1
        if spare is None:
            return []
        if self.closed or not self.fresh(spare, now):
            return [spare]
        self._spares.append(spare)
        return []

    def expire(self, now: float) -> list[Spare]:
        """Remove and return the spares too old to hand out."""
        stale = [s for s in self._spares if not self.fresh(s, now)]
        if stale:
            self._spares = deque(s for s in self._spares if self.fresh(s, now))
        return stale

    def next_expiry(self) -> float | None:
        """When the oldest spare goes stale (None: no spares)."""
        if not self._spares:
            return None
        return min(s.sent_at for s in self._spares) + self.max_age_s

    def clear(self) -> list[Spare]:
        """Remove and return every spare (to abort), staying open for refills."""
        spares, self._spares = list(self._spares), deque()
        return spares

    def drain(self) -> list[Spare]:
        """Close: no more refills; returns every spare (to abort)."""
        self.closed = True
        spares, self._spares = list(self._spares), deque()
        return spares


__all__ = ["SPARES_MAX", "SPARE_MAX_AGE_S", "Spare", "SparePool"]
