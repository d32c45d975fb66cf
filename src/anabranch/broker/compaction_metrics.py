"""The ``anabranch_compaction_*`` metric families (upstream's ``pulsar_compaction_*``).

Example:
    >>> from anabranch.broker.compaction import CompactionCounters
    >>> c = CompactionCounters(runs=2, removed_messages=7)
    >>> sorted(m.name for m in CompactionCollector(lambda: c, "standalone").collect())
    ... # doctest: +NORMALIZE_WHITESPACE
    ['anabranch_compaction_duration_seconds', 'anabranch_compaction_failed',
     'anabranch_compaction_removed_messages', 'anabranch_compaction_succeeded']
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from anabranch.broker.compaction import CompactionCounters


class CompactionCollector(Collector):
    """Compactions run, failed, messages removed and time spent, broker-wide."""

    def __init__(self, counters: Callable[[], CompactionCounters], cluster: str) -> None:
        self._counters = counters
        self._cluster = cluster

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        c = self._counters()
        for name, text, value in (
            ("compaction_succeeded", "Compactions that completed (pulsar_compaction_succeed_"
             "count).", c.runs),
            ("compaction_failed", "Compactions that failed (pulsar_compaction_failed_count).",
             c.failures),
            ("compaction_removed_messages", "Messages compacted away (pulsar_compaction_"
             "removed_event_count).", c.removed_messages),
            ("compaction_duration_seconds", "Time spent in successful compactions "
             "(pulsar_compaction_duration_time_in_mills, in seconds).", c.duration_s),
        ):  # fmt: skip
            family = CounterMetricFamily(f"anabranch_{name}", text, labels=["cluster"])
            family.add_metric([self._cluster], value)
            yield family
