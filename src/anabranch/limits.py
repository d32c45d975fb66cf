"""Every bound in one place, each with what happens at the bound and why the number.

Names are nouns with units last. Modules import the constant they need; configuration
may lower (never silently raise) a bound.
"""

from __future__ import annotations

# --- metadata store -----------------------------------------------------------------------

METADATA_VALUE_BYTES_MAX = 1024 * 1024
"""A put over this fails with ValueTooLarge. etcd's default request limit is 1.5 MiB."""

METADATA_PATH_BYTES_MAX = 1024
"""Longer paths fail with InvalidArgument; keys are copied into every index and event."""

METADATA_TXN_OPS_MAX = 128
"""Ops in one atomic commit; more fails with InvalidArgument. etcd's --max-txn-ops default."""

METADATA_LIST_LIMIT_MAX = 10_000
"""Largest page a range listing returns; callers page with ``start_after``."""

METADATA_CHANGELOG_REVISIONS_MAX = 100_000
"""Revisions of history the embedded stores keep for watches; older ones are compacted and
a watch that asks for them gets Compacted (like etcd's auto-compaction)."""

METADATA_WATCH_QUEUE_EVENTS_MAX = 10_000
"""Events buffered for one slow watcher; past this the watch is cancelled with Compacted
so the watcher re-lists instead of the store growing without bound."""

METADATA_WRITE_QUEUE_MAX = 10_000
"""Writes queued for the SQLite writer thread; callers wait for room (backpressure)."""

METADATA_GROUP_COMMIT_OPS_MAX = 512
"""Writes applied per SQLite transaction; bounds commit latency under load."""

METADATA_SESSION_TTL_MIN_S = 0.2
METADATA_SESSION_TTL_MAX_S = 3600.0
"""Session TTL bounds: shorter is unusable over a real network, longer hides dead brokers."""

SEQUENTIAL_KEY_DIGITS = 20
"""Zero-padding of sequential keys: 2^64 has 20 decimal digits, so order is lexicographic."""
