"""Transaction metrics (PIP-473): the ``anabranch_txn_*`` families on ``/metrics``.

Read at scrape time from plain ints, like :mod:`anabranch.broker.metrics`: the
coordinator's :class:`~anabranch.transactions.coordinator.TxnMetrics` and the participants
of the topics loaded here (each topic's ``transaction_buffer`` and each subscription's
``pending_acks``). Registered by ``broker_registry`` only when the broker serves
transactions (``service.txn_coordinator`` is not None). Every family carries the
``cluster`` label; help texts name the upstream metric mirrored.

* ``anabranch_txn_created_total`` / ``_committed_total`` / ``_aborted_total`` /
  ``_timeout_total``: ``pulsar_txn_created_total`` ... ``pulsar_txn_timeout_total``;
* ``anabranch_txn_active_count`` (gauge): ``pulsar_txn_active_count``;
* ``anabranch_txn_gc_collected_total``: final headers removed by the PIP-473 GC;
* ``anabranch_txn_commit_latency_seconds`` (histogram):
  ``pulsar_txn_execution_latency_le_*``;
* ``anabranch_txn_transaction_key_count`` (gauge), ``anabranch_txn_transaction_key_epoch``
  and ``anabranch_txn_transaction_key_age_seconds`` (gauges labelled ``owner`` and
  ``transaction_key``): the key PIP's ``pulsar_txn_transaction_key_*``, over every key
  (this broker's key watch sees them all; per-key series capped at
  ``limits.TXN_KEY_METRICS_SERIES_MAX``);
* ``anabranch_txn_metadata_store_op_writes_total``,
  ``anabranch_txn_metadata_store_header_cas_total{result="ok|conflict|reject"}`` and
  ``anabranch_txn_metadata_store_outstanding_op_records`` (gauge): PIP-473's
  ``pulsar_txn_metadata_store_*`` families of the same names.

Counts are this broker's since it started (any broker's coordinator serves every
partition, so a cluster-wide total is the sum over brokers). ``op_writes`` sums the
loaded participants' counters (a topic unloaded from here takes its count with it);
``outstanding_op_records`` is the loaded participants' transactions that still hold op
records (open, or ended with the outcome not yet persisted): a proxy for the GC backlog,
as upstream describes its gauge.

Example:
    >>> from types import SimpleNamespace
    >>> from prometheus_client import CollectorRegistry
    >>> from anabranch.transactions.coordinator import TxnMetrics
    >>> metrics = TxnMetrics(committed=3)
    >>> service = SimpleNamespace(
    ...     txn_coordinator=SimpleNamespace(metrics=metrics),
    ...     config=SimpleNamespace(cluster_name="c1"),
    ...     loaded_topics=list,
    ... )
    >>> registry = CollectorRegistry(auto_describe=False)
    >>> registry.register(TxnCollector(service))
    >>> registry.get_sample_value("anabranch_txn_committed_total", {"cluster": "c1"})
    3
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from anabranch import limits

PREFIX = "anabranch_txn"
LABELS = ["cluster"]
CAS_RESULTS = ("ok", "conflict", "reject")


def participants(topics: Iterable[Any]) -> Iterator[Any]:
    """Each loaded topic's transaction buffer, then its subscriptions' pending-ack stores.

    Example:
        >>> list(participants([]))
        []
    """
    for topic in topics:
        buffer = getattr(topic, "transaction_buffer", None)
        if buffer is not None:
            yield buffer
        for subscription in list(getattr(topic, "subscriptions", {}).values()):
            store = getattr(subscription, "pending_acks", None)
            if store is not None:
                yield store


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _outstanding(participant: Any) -> int | None:
    """Transactions holding op records at ``participant``; None for a non-participant."""
    stats = getattr(participant, "stats", None)
    if not callable(stats):
        return None
    data = stats()
    return _int(data.get("ongoingTxnSize")) + _int(data.get("outcomesPending"))


class TxnCollector(Collector):
    """The coordinator's and the loaded participants' counters as ``anabranch_txn_*``."""

    def __init__(self, service: Any) -> None:
        self.service = service

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        coordinator = getattr(self.service, "txn_coordinator", None)
        if coordinator is None:
            return
        cluster = [str(self.service.config.cluster_name)]
        m = coordinator.metrics
        for name, text, value in (
            ("created", "Transactions created (pulsar_txn_created_total).", m.created),
            ("committed", "Transactions committed (pulsar_txn_committed_total).", m.committed),
            ("aborted", "Transactions aborted, timed out included "
             "(pulsar_txn_aborted_total).", m.aborted),
            ("timeout", "Transactions aborted by the timeout sweep "
             "(pulsar_txn_timeout_total).", m.timed_out),
            ("gc_collected", "Final transaction headers removed by GC (PIP-473).",
             m.gc_collected),
        ):  # fmt: skip
            counter = CounterMetricFamily(f"{PREFIX}_{name}", text, labels=LABELS)
            counter.add_metric(cluster, _int(value))
            yield counter
        active = GaugeMetricFamily(
            f"{PREFIX}_active_count",
            "Open transactions created by this broker (pulsar_txn_active_count).",
            labels=LABELS,
        )
        active.add_metric(cluster, _int(m.open))
        yield active
        yield self._latency(m.commit_latency, cluster)
        cas = CounterMetricFamily(
            f"{PREFIX}_metadata_store_header_cas",
            "Transaction header CAS attempts by result: ok, conflict (lost a race, "
            "re-judged), reject (refused) (pulsar_txn_metadata_store_header_cas_total).",
            labels=[*LABELS, "result"],
        )
        counts = dict(m.header_cas)
        for result in (*CAS_RESULTS, *sorted(set(counts) - set(CAS_RESULTS))):
            cas.add_metric([*cluster, result], _int(counts.get(result, 0)))
        yield cas
        op_writes = 0
        outstanding = 0
        for participant in participants(self.service.loaded_topics()):
            op_writes += _int(getattr(participant, "op_writes", 0))
            outstanding += _outstanding(participant) or 0
        writes = CounterMetricFamily(
            f"{PREFIX}_metadata_store_op_writes",
            "Op records written by the transaction participants loaded here "
            "(pulsar_txn_metadata_store_op_writes_total).",
            labels=LABELS,
        )
        writes.add_metric(cluster, op_writes)
        yield writes
        backlog = GaugeMetricFamily(
            f"{PREFIX}_metadata_store_outstanding_op_records",
            "Transactions holding op records at the participants loaded here: open, or "
            "ended with the outcome not yet persisted "
            "(pulsar_txn_metadata_store_outstanding_op_records).",
            labels=LABELS,
        )
        backlog.add_metric(cluster, outstanding)
        yield backlog
        keys = getattr(self.service, "txn_keys", None)
        if keys is not None:
            yield from self._transaction_keys(keys, cluster)

    def _transaction_keys(self, keys: Any, cluster: list[str]) -> Iterator[Metric]:
        """The key PIP's ``pulsar_txn_transaction_key_*`` families, from the records this
        broker's key watch sees (so every broker reports every key)."""
        known = sorted(keys.known(), key=lambda r: (r.owner, r.key))
        count = GaugeMetricFamily(
            f"{PREFIX}_transaction_key_count",
            "Transaction keys in the system (pulsar_txn_transaction_key_count).",
            labels=LABELS,
        )
        count.add_metric(cluster, len(known))
        yield count
        key_labels = [*LABELS, "owner", "transaction_key"]
        epoch = GaugeMetricFamily(
            f"{PREFIX}_transaction_key_epoch",
            "The latest epoch of each transaction key (pulsar_txn_transaction_key_epoch).",
            labels=key_labels,
        )
        age = GaugeMetricFamily(
            f"{PREFIX}_transaction_key_age_seconds",
            "Seconds since each transaction key was first claimed "
            "(pulsar_txn_transaction_key_age).",
            labels=key_labels,
        )
        now_ms = self.service.clock.wall_ms()
        # Per-key series are capped (limits.TXN_KEY_METRICS_SERIES_MAX): the count above
        # still counts every key.
        for rec in known[: limits.TXN_KEY_METRICS_SERIES_MAX]:
            labels = [*cluster, rec.owner, rec.key]
            epoch.add_metric(labels, rec.epoch)
            age.add_metric(labels, max(0.0, (now_ms - rec.created_at) / 1000))
        yield epoch
        yield age

    @staticmethod
    def _latency(histogram: Any, cluster: list[str]) -> HistogramMetricFamily:
        family = HistogramMetricFamily(
            f"{PREFIX}_commit_latency_seconds",
            "Commit latency: END_TXN(COMMIT) request to the committed header CAS "
            "(pulsar_txn_execution_latency_le_*).",
            labels=LABELS,
        )
        buckets: list[tuple[str, float]] = []
        cumulative = 0
        for bound, count in zip(histogram.buckets, histogram.counts, strict=True):
            cumulative += _int(count)
            buckets.append((repr(float(bound)), cumulative))
        buckets.append(("+Inf", _int(histogram.count)))
        family.add_metric(cluster, buckets, sum_value=float(histogram.sum))
        return family
