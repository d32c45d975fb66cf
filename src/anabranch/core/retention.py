"""What may be deleted, and what must be expired or evicted: retention, TTL, backlog quotas.

Theory of operation
-------------------
Pure decisions, no I/O and no clock (``now_ms`` comes in). The storage and broker shells
ask these functions and then act (delete ledger files, move cursors, refuse producers).

*Retention* (Pulsar's ``RetentionPolicies``) keeps **consumed** data: a ledger every
subscription has acknowledged wholly is deleted once it is outside retention, that is
when it has been closed for longer than the retention time **or** the retained data is over
the retention size. ``-1`` means unbounded (that bound never deletes), ``0`` means none.
Unconsumed data is never deleted by retention: only TTL and the backlog quota's eviction
move cursors, and then retention deletes what the moved cursors left behind.

    | time | size | a fully consumed, closed ledger is deleted ...              |
    |------|------|-------------------------------------------------------------|
    |  0   |  0   | at once (Pulsar's default: no retention)                    |
    | 0 / S| T / 0| at once too: either bound at 0 disables retention (Pulsar) |
    |  T   |  -1  | T ms after it was closed                                    |
    |  -1  |  S   | while the retained total is over S bytes                    |
    |  T   |  S   | when either bound says so                                   |
    |  -1  |  -1  | never (infinite retention)                                  |

Ledgers are deleted oldest first and only as a prefix (the list stays contiguous); the
open (last) ledger is never deleted.

*Message TTL*: a message whose publish time is older than ``now - ttl`` is expired and is
acknowledged for every subscription (Pulsar: ``now > publishTime + ttl``); ``ttl <= 0``
disables it. Only a prefix of a subscription's backlog expires (a message published later
than an unexpired one is not skipped over it).

*Backlog quota* (``destination_storage`` on the slowest subscription's backlog bytes,
``message_age`` on its oldest unacknowledged message): over the limit, ``producer_exception``
refuses producers and sends, ``producer_request_hold`` holds sends until the backlog shrinks,
and ``consumer_backlog_eviction`` moves the slowest cursor forward until the backlog is back
under the limit. A limit of ``-1`` (or no quota) is unlimited.

*Sealed segments* of a scalable topic (PIP-468 ``pruneSegment``): a sealed root segment is
prunable when every subscription has drained it and it is outside retention (timed from
when it was sealed). :func:`prunable_segments` also keeps a change block together (a merge's
two parents go at once), so the children become roots.

Example:
    >>> r = Retention.of(minutes=0, mb=0)
    >>> ledgers = [LedgerSpan(1, 10, 100, closed_ms=5), LedgerSpan(2, 3, 30, closed_ms=None)]
    >>> trimmable_ledgers(ledgers, slowest=(2, 0), retention=r, now_ms=10)
    1
    >>> trimmable_ledgers(ledgers, slowest=(1, 5), retention=r, now_ms=10)   # not consumed
    0
    >>> trimmable_ledgers(ledgers, (2, 0), Retention.of(minutes=1, mb=-1), now_ms=10)
    0
    >>> expired_prefix([100, 200, 300], cutoff_ms=250)
    2
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence, Set
from dataclasses import dataclass
from enum import StrEnum

from anabranch.errors import InvalidArgument

UNBOUNDED = -1
"""A retention bound or quota limit that never acts."""

Pos = tuple[int, int]
"""``(ledger_id, entry_id)``; positions order as tuples."""

MB = 1024 * 1024

EVICTION_TARGET_RATIO = 0.9
"""consumer_backlog_eviction brings the backlog down to 90% of the limit (Pulsar's rule),
so it does not run again for the next message."""


@dataclass(frozen=True, slots=True)
class Retention:
    """Retention bounds in milliseconds and bytes; ``-1`` unbounded, ``0`` none.

    Example:
        >>> Retention.of(minutes=2, mb=1)
        Retention(time_ms=120000, size_bytes=1048576)
        >>> Retention.of(minutes=-1, mb=0).is_infinite
        False
    """

    time_ms: int = 0
    size_bytes: int = 0

    def __post_init__(self) -> None:
        if self.time_ms < UNBOUNDED or self.size_bytes < UNBOUNDED:
            raise InvalidArgument("retention bounds must be -1 (unbounded) or >= 0")

    @classmethod
    def of(cls, minutes: int, mb: int) -> Retention:
        """From Pulsar's ``retentionTimeInMinutes`` / ``retentionSizeInMB``."""
        if minutes < UNBOUNDED or mb < UNBOUNDED:
            raise InvalidArgument("retention time and size must be -1 (unbounded) or >= 0")
        return cls(
            UNBOUNDED if minutes == UNBOUNDED else minutes * 60_000,
            UNBOUNDED if mb == UNBOUNDED else mb * MB,
        )

    @property
    def is_infinite(self) -> bool:
        """Both bounds unbounded: retention never deletes."""
        return self.time_ms == UNBOUNDED and self.size_bytes == UNBOUNDED

    def expired(self, closed_ms: int, now_ms: int, retained_bytes: int) -> bool:
        """Whether data closed at ``closed_ms`` is outside retention while ``retained_bytes``
        are kept (Pulsar: over the size quota, or older than the time).

        Example:
            >>> Retention(time_ms=10, size_bytes=UNBOUNDED).expired(0, 9, 1 << 40)
            False
            >>> Retention(time_ms=UNBOUNDED, size_bytes=100).expired(0, 0, 101)
            True
        """
        over_size = self.size_bytes != UNBOUNDED and retained_bytes > self.size_bytes
        too_old = self.time_ms != UNBOUNDED and now_ms - closed_ms >= self.time_ms
        return over_size or too_old


@dataclass(frozen=True, slots=True)
class LedgerSpan:
    """One ledger of a managed ledger as the decisions see it."""

    ledger_id: int
    entries: int
    size: int
    closed_ms: int | None
    """When it was closed; None while it is the open ledger."""


def trimmable_ledgers(
    ledgers: Sequence[LedgerSpan], slowest: Pos | None, retention: Retention, now_ms: int
) -> int:
    """How many leading ledgers may be deleted: closed, wholly at or below ``slowest`` (the
    slowest cursor's mark-delete position; None when there are no cursors: everything
    counts as consumed) and outside retention. The last ledger is always kept.

    Example:
        >>> spans = [LedgerSpan(i, 1, 10, closed_ms=0) for i in range(4)]
        >>> trimmable_ledgers(spans, None, Retention(UNBOUNDED, 15), now_ms=0)   # keep 10 B
        3
    """
    total = sum(info.size for info in ledgers)
    count = 0
    for info in ledgers[:-1]:
        if info.closed_ms is None:
            break
        if info.entries and slowest is not None and (info.ledger_id, info.entries - 1) > slowest:
            break
        if not retention.expired(info.closed_ms, now_ms, total):
            break
        count += 1
        total -= info.size
    return count


# --- message TTL ----------------------------------------------------------------------------


def ttl_cutoff_ms(now_ms: int, ttl_s: int | None) -> int | None:
    """Messages published before this instant are expired; None when TTL is off.

    Example:
        >>> ttl_cutoff_ms(10_000, 3), ttl_cutoff_ms(10_000, 0)
        (7000, None)
    """
    if ttl_s is None or ttl_s <= 0:
        return None
    return now_ms - ttl_s * 1000


def expired_prefix(publish_times_ms: Sequence[int], cutoff_ms: int) -> int:
    """How many leading messages (in log order) are expired: published before
    ``cutoff_ms``. Stops at the first unexpired one.

    Example:
        >>> expired_prefix([1, 5, 2], cutoff_ms=4)
        1
    """
    count = 0
    for published in publish_times_ms:
        if published >= cutoff_ms:
            break
        count += 1
    return count


# --- backlog quotas -------------------------------------------------------------------------


class BacklogQuotaType(StrEnum):
    """What a quota limits (Pulsar's ``backlogQuotaType``)."""

    DESTINATION_STORAGE = "destination_storage"
    MESSAGE_AGE = "message_age"


class BacklogPolicy(StrEnum):
    """What happens over a backlog quota (Pulsar's ``BacklogQuota.RetentionPolicy``)."""

    PRODUCER_REQUEST_HOLD = "producer_request_hold"
    PRODUCER_EXCEPTION = "producer_exception"
    CONSUMER_BACKLOG_EVICTION = "consumer_backlog_eviction"


@dataclass(frozen=True, slots=True)
class BacklogQuota:
    """One quota: ``limit_size`` bytes (storage) or ``limit_time_s`` seconds (age); -1
    unlimited."""

    limit_size: int = UNBOUNDED
    limit_time_s: int = UNBOUNDED
    policy: BacklogPolicy = BacklogPolicy.PRODUCER_REQUEST_HOLD


def quota_fits_retention(quota: BacklogQuota, retention_minutes: int, retention_mb: int) -> bool:
    """Pulsar's rule that a backlog quota stays under positive retention bounds: a size
    quota below ``retentionSizeInMB``, an age quota below ``retentionTimeInMinutes``.

    Example:
        >>> quota_fits_retention(BacklogQuota(limit_size=2 * MB), 60, 1)
        False
        >>> quota_fits_retention(BacklogQuota(limit_size=2 * MB), 60, -1)
        True
    """
    if retention_mb > 0 and quota.limit_size >= retention_mb * MB:
        return False
    return not (retention_minutes > 0 and quota.limit_time_s >= retention_minutes * 60)


def storage_quota_exceeded(backlog_bytes: int, quota: BacklogQuota | None) -> bool:
    """Whether the slowest subscription's backlog is over the storage quota.

    Example:
        >>> q = BacklogQuota(limit_size=100)
        >>> storage_quota_exceeded(101, q), storage_quota_exceeded(100, q)
        (True, False)
    """
    return quota is not None and quota.limit_size >= 0 and backlog_bytes > quota.limit_size


def age_quota_exceeded(
    oldest_unacked_ms: int | None, now_ms: int, quota: BacklogQuota | None
) -> bool:
    """Whether the oldest unacknowledged message is older than the age quota.

    Example:
        >>> age_quota_exceeded(0, 5_000, BacklogQuota(limit_time_s=4))
        True
        >>> age_quota_exceeded(None, 5_000, BacklogQuota(limit_time_s=4))
        False
    """
    if quota is None or quota.limit_time_s < 0 or oldest_unacked_ms is None:
        return False
    return now_ms - oldest_unacked_ms > quota.limit_time_s * 1000


def backlog_bytes(ledgers: Sequence[LedgerSpan], mark_delete: Pos) -> int:
    """Estimated bytes after ``mark_delete`` (a ledger's entries weigh its average size).

    Example:
        >>> backlog_bytes([LedgerSpan(1, 4, 40, 0), LedgerSpan(2, 2, 20, None)], (1, 1))
        40
    """
    total = 0
    for info in ledgers:
        if info.entries == 0 or (info.ledger_id, info.entries - 1) <= mark_delete:
            continue
        if info.ledger_id == mark_delete[0]:
            unacked = info.entries - (mark_delete[1] + 1)
            total += info.size * unacked // info.entries
        else:
            total += info.size
    return total


def eviction_position(ledgers: Sequence[LedgerSpan], mark_delete: Pos, limit_bytes: int) -> Pos:
    """Where the slowest cursor's mark-delete moves so its estimated backlog is at most
    90% of ``limit_bytes`` (``mark_delete`` itself when it already is). Never moves back,
    never past the last entry.

    Example:
        >>> spans = [LedgerSpan(1, 10, 100, 0), LedgerSpan(2, 10, 100, None)]
        >>> eviction_position(spans, (-1, -1), limit_bytes=100)
        (2, 0)
    """
    target = int(limit_bytes * EVICTION_TARGET_RATIO)
    position = mark_delete
    if backlog_bytes(ledgers, mark_delete) <= target:
        return position
    for info in ledgers:
        if info.entries == 0 or (info.ledger_id, info.entries - 1) <= position:
            continue
        last = (info.ledger_id, info.entries - 1)
        rest = backlog_bytes(ledgers, last)  # what the later ledgers hold
        if rest > target:
            position = last
            continue
        first = position[1] + 1 if info.ledger_id == position[0] else 0
        # Keep the most entries k of this ledger with size * k // entries <= target - rest.
        allowed = target - rest
        keep = info.entries if info.size == 0 else allowed * info.entries // info.size
        if keep >= info.entries - first:
            return position  # keeping all that is left here is within the target
        return (info.ledger_id, info.entries - 1 - keep)
    return position


# --- sealed segments (PIP-468 pruneSegment) ---------------------------------------------------


@dataclass(frozen=True, slots=True)
class SealedSegment:
    """A sealed segment as the prune decision sees it."""

    segment_id: int
    parent_ids: tuple[int, ...]
    child_ids: tuple[int, ...]
    sealed_at_ms: int
    size: int = 0


def prunable_segments(
    sealed: Mapping[int, SealedSegment],
    drained: Set[int],
    retention: Retention,
    now_ms: int,
    total_bytes: int,
) -> list[int]:
    """Sealed segments that may be pruned now, oldest seal first: each is a root (no
    parents left), drained by every subscription (``drained``), outside retention (timed
    from its seal; ``total_bytes`` is the topic's retained size) and sealed together with
    segments that all qualify too (a merge's parents are pruned at once, so every child
    of a pruned block becomes a root).

    Example:
        >>> s = {0: SealedSegment(0, (), (1, 2), sealed_at_ms=10)}
        >>> prunable_segments(s, {0}, Retention(), now_ms=10, total_bytes=0)
        [0]
        >>> prunable_segments(s, set(), Retention(), now_ms=10, total_bytes=0)   # backlog
        []
    """
    out: list[int] = []
    done: set[int] = set()
    for seg in sorted(sealed.values(), key=lambda s: (s.sealed_at_ms, s.segment_id)):
        if seg.segment_id in done:
            continue
        block = sorted(
            {p for c in seg.child_ids for p in _co_parents(sealed, c)} | {seg.segment_id}
        )
        members = [sealed.get(i) for i in block]
        if any(m is None or m.parent_ids for m in members):
            continue
        if not all(i in drained for i in block):
            continue
        newest = max(m.sealed_at_ms for m in members if m is not None)
        if not retention.expired(newest, now_ms, total_bytes):
            continue
        out.extend(block)
        done.update(block)
        total_bytes -= sum(m.size for m in members if m is not None)
    return out


def _co_parents(sealed: Mapping[int, SealedSegment], child: int) -> set[int]:
    return {s.segment_id for s in sealed.values() if child in s.child_ids}
