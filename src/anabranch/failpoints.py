"""Test-only failpoints: named switches that each break one guarantee on purpose.

The fault-injection harness (:mod:`anabranch.testing.faults`) must prove it can fail: for
every guarantee it checks there is a deliberately broken variant of the code behind a
failpoint, and a test that the checker flags it. A failpoint is off unless it is named in
the ``ANABRANCH_FAILPOINTS`` environment variable (comma-separated) of the process, read
once at import, or switched on in-process with :func:`activate` (tests of one process).
An unknown name is a ``ValueError`` at start-up, so a typo never silently tests nothing.

Production code asks ``failpoints.enabled(NAME)`` at the one place it would break; the
check is a frozenset lookup and costs nothing measurable when nothing is active.

Example:
    >>> activate({SKIP_PARENT_CURSOR_FLUSH})
    >>> enabled(SKIP_PARENT_CURSOR_FLUSH), enabled(ACK_BEFORE_FSYNC)
    (True, False)
    >>> activate(())
    >>> enabled(SKIP_PARENT_CURSOR_FLUSH)
    False
"""

from __future__ import annotations

import os
from collections.abc import Iterable

ENV_VAR = "ANABRANCH_FAILPOINTS"

SKIP_PARENT_CURSOR_FLUSH = "skip-parent-cursor-flush"
"""A sealed parent's cursors are not made durable before its children are dispatched."""
ACK_BEFORE_FSYNC = "ack-before-fsync"
"""The ledger acknowledges appends before they are on disk (group commit skips fdatasync)."""
DROP_DEDUP_CARRY = "drop-dedup-carry"
"""A split or merge does not carry the parents' dedup state into the children."""
NO_RECAMPAIGN = "no-recampaign"
"""A controller whose metadata session expired never campaigns again."""
NO_ASSIGNMENT_REFRESH = "no-assignment-refresh"
"""A stream consumer re-registers only when its connection drops, not after a failover."""

TXN_HOLD_OUTCOMES = "txn-hold-outcomes"
"""Participants never apply transaction outcomes (no wake-up, watch or reconcile applies
them): a crash test kills the broker between a commit's header CAS and the apply."""

BREAK_CONNECTION_TIMER = "break-connection-timer"
"""The broker's connection timer loop raises on every tick: its supervisor restarts it
until it gives up and the broker process exits non-zero (the supervision tests)."""

STALE_OWNER_SERVES = "stale-owner-serves"
"""A cluster broker whose metadata session ran out keeps serving the topics it owned
(no unload, no refusal of SENDs): only the storage fence can stop its appends (the
JetStream cluster tests show it does)."""

COMPACTION_CRASH_BEFORE_SWITCH = "compaction-crash-before-switch"
"""The broker SIGKILLs itself once a compaction wrote its new compacted ledger and before
it switched the record to it (the crash-safety test: the previous view stays in force)."""

DISPATCH_READ_FAILS = "dispatch-read-fails"
"""Every ledger read of a dispatch pass raises a storage error while this is on (a
transient storage fault: the dispatcher must retry by itself once it heals)."""

KNOWN: frozenset[str] = frozenset(
    {
        DISPATCH_READ_FAILS,
        COMPACTION_CRASH_BEFORE_SWITCH,
        STALE_OWNER_SERVES,
        BREAK_CONNECTION_TIMER,
        TXN_HOLD_OUTCOMES,
        SKIP_PARENT_CURSOR_FLUSH,
        ACK_BEFORE_FSYNC,
        DROP_DEDUP_CARRY,
        NO_RECAMPAIGN,
        NO_ASSIGNMENT_REFRESH,
    }
)


def parse(text: str) -> frozenset[str]:
    """The failpoints named in ``text`` (comma-separated); unknown names raise ValueError.

    Example:
        >>> sorted(parse("ack-before-fsync, no-recampaign"))
        ['ack-before-fsync', 'no-recampaign']
        >>> parse("")
        frozenset()
    """
    names = frozenset(part.strip() for part in text.split(",") if part.strip())
    unknown = names - KNOWN
    if unknown:
        raise ValueError(f"unknown failpoints {sorted(unknown)}; known: {sorted(KNOWN)}")
    return names


_active: frozenset[str] = parse(os.environ.get(ENV_VAR, ""))


def enabled(name: str) -> bool:
    """Whether failpoint ``name`` is active in this process."""
    return name in _active


def activate(names: Iterable[str]) -> None:
    """Replace the active set in this process (tests of one process; ``()`` clears it)."""
    global _active
    _active = parse(",".join(names))


def active() -> frozenset[str]:
    """The failpoints active in this process."""
    return _active
