"""The broker's offloader: namespace offload policies applied to loaded topics, the manual
``admin topics offload`` trigger and its status.

Theory of operation. One :class:`Offloader` per broker. When an offload driver is
configured, a :class:`~anabranch.supervisor.Supervised` loop runs a sweep every
``offload_check_interval_s``: for each loaded topic it asks
:func:`anabranch.core.offload.plan_offload` (the namespace's thresholds and deletion lag,
plus any pending manual request) and then copies the planned sealed ledgers to the object
store (``ManagedLedger.offload_ledger``) and drops hot copies whose deletion lag has
passed (``delete_offloaded_hot``). An object-store failure leaves the ledger in the hot
tier (nothing in the metadata changed), records ``lastError``, sets the topic's status to
ERROR, and the next sweep comes sooner (a backoff from 0.5 s doubling up to the
interval): S3 coming back is noticed quickly without hammering it while it is down.

A manual request (``PUT .../offload`` with a message id) runs at once in a background
task and stays pending until it succeeds, so a failed one is retried by the sweeps. The
status document is Pulsar's ``OffloadProcessStatus``: ``NOT_RUN``, ``RUNNING``,
``SUCCESS`` or ``ERROR``, ``lastError`` and ``firstUnoffloadedMessage``.

Example (a broker without ``offload_driver``: the status is NOT_RUN, a trigger refused):
    >>> import tempfile
    >>> from pathlib import Path
    >>> from anabranch.testing.broker import InProcessBroker
    >>> async def demo(service: BrokerService) -> None:
    ...     topic = await service.get_topic("persistent://public/default/t", create=True)
    ...     print(service.offloader.status(topic)["status"])
    ...     try:
    ...         await service.offloader.trigger(topic, Position(9, 0))
    ...     except OffloadNotConfigured as err:
    ...         print(type(err).__name__)
    >>> async def main() -> None:
    ...     with tempfile.TemporaryDirectory() as tmp:
    ...         async with InProcessBroker(Path(tmp)) as broker:
    ...             await demo(broker.service)
    >>> asyncio.run(main())
    NOT_RUN
    OffloadNotConfigured
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Any

from anabranch.broker.retention import namespace_of
from anabranch.core.names import TopicName, parse_name
from anabranch.core.offload import (
    DISABLED,
    OffloadCandidate,
    OffloadPolicy,
    first_unoffloaded,
    plan_offload,
)
from anabranch.errors import (
    AnabranchError,
    NotFound,
    ObjectStoreUnavailable,
    OffloadNotConfigured,
    StorageError,
)
from anabranch.storage.api import Position
from anabranch.supervisor import Supervised

if TYPE_CHECKING:
    from anabranch.broker.config import BrokerConfig
    from anabranch.broker.policies import NamespacePolicies
    from anabranch.broker.service import BrokerService
    from anabranch.broker.topic import PersistentTopic
    from anabranch.storage.base import ManagedLedgerBase

log = logging.getLogger(__name__)

RETRY_MIN_S = 0.5
"""The first retry after a failed offload; it doubles up to the check interval."""


class OffloadStatus(StrEnum):
    NOT_RUN = "NOT_RUN"
    RUNNING = "RUNNING"
    SUCCESS = "SUCCESS"
    ERROR = "ERROR"


@dataclass(slots=True)
class _TopicState:
    status: OffloadStatus = OffloadStatus.NOT_RUN
    last_error: str = ""
    pending_before: int | None = None
    """Ledger id a manual request offloads up to (exclusive) until it has succeeded."""


def policy_of(config: BrokerConfig, policies: NamespacePolicies | None) -> OffloadPolicy:
    """The offload policy in force: the namespace's ``offloadThreshold`` /
    ``offloadThresholdInSeconds`` / ``offloadDeletionLagMs``, else its
    ``offloadPolicies``, else the broker's (no thresholds, ``offload_deletion_lag_ms``).

    >>> from anabranch.broker.config import BrokerConfig
    >>> from anabranch.broker.policies import NamespacePolicies
    >>> policy_of(BrokerConfig(), NamespacePolicies(offload_threshold=10))
    OffloadPolicy(threshold_bytes=10, threshold_s=-1, deletion_lag_ms=14400000)
    """
    threshold = seconds = DISABLED
    lag = config.offload_deletion_lag_ms
    if policies is not None:
        record = policies.offload_policies
        if record is not None:
            if record.managed_ledger_offload_threshold_in_bytes is not None:
                threshold = record.managed_ledger_offload_threshold_in_bytes
            if record.managed_ledger_offload_threshold_in_seconds is not None:
                seconds = record.managed_ledger_offload_threshold_in_seconds
            if record.managed_ledger_offload_deletion_lag_in_millis is not None:
                lag = record.managed_ledger_offload_deletion_lag_in_millis
        if policies.offload_threshold != DISABLED:
            threshold = policies.offload_threshold
        if policies.offload_threshold_in_seconds != DISABLED:
            seconds = policies.offload_threshold_in_seconds
        if policies.offload_deletion_lag_ms is not None:
            lag = policies.offload_deletion_lag_ms
    return OffloadPolicy(threshold, seconds, lag)


def candidates(ledger: ManagedLedgerBase) -> list[OffloadCandidate]:
    """The managed ledger's ledgers as the planner sees them."""
    return [
        OffloadCandidate(
            i.ledger_id,
            i.size,
            i.closed_ms,
            i.offload.offloaded_ms if i.offload else None,
            i.hot,
            i.entries,
        )
        for i in ledger.ledgers
    ]


class Offloader:
    """Periodic and manual offloads of one broker; see the module docstring."""

    def __init__(self, service: BrokerService) -> None:
        self.service = service
        self.config = service.config
        self.clock = service.clock
        self._states: dict[str, _TopicState] = {}
        self._manual: dict[str, asyncio.Task[None]] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._topic_policies = service.topic_policies
        self._loop: Supervised | None = None
        self._closed = False
        self._retry_s = RETRY_MIN_S
        self.sweeps = 0
        """Completed sweeps (tests wait on it)."""
        self.ledgers_offloaded = 0
        self.hot_copies_deleted = 0
        self.failures = 0

    @property
    def configured(self) -> bool:
        return bool(self.config.offload_driver)

    def start(self) -> None:
        if self._loop is None and self.configured:
            self._loop = Supervised(
                "offload-sweeps", self._run, on_give_up=self.service.fatal.fail
            ).start()

    async def close(self) -> None:
        self._closed = True
        loop, self._loop = self._loop, None
        if loop is not None:
            await loop.stop()
        tasks = list(self._manual.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def check_store(self) -> None:
        """Log a clear error at start when the object store refuses the credentials or
        does not answer (offloads would fail; the broker serves the hot tier meanwhile)."""
        tiered = getattr(self.service.ledgers, "tiered", None)
        if tiered is None:
            return
        try:
            await tiered.store.check()
        except StorageError as err:
            log.error("tiered storage: %s", err)

    async def _run(self) -> None:
        await self.check_store()
        while not self._closed:
            interval = self.config.offload_check_interval_s
            failed = self.failures
            try:
                await self.sweep()
            except Exception:  # e.g. the metadata store is unreachable: try again later
                self.failures += 1
                log.exception("the offload sweep failed; it runs again soon")
            if self.failures > failed:
                delay = min(self._retry_s, interval)
                self._retry_s = min(self._retry_s * 2, interval)
            else:
                delay = interval
                self._retry_s = RETRY_MIN_S
            await self.clock.sleep(delay)

    # --- the sweep ---------------------------------------------------------------------------

    async def sweep(self) -> None:
        """One pass over the loaded topics (policies, pending manual requests, deletion
        lags)."""
        cache: dict[str, tuple[NamespacePolicies | None, frozenset[str]]] = {}
        loaded = self.service.loaded_topics()
        names = {topic.name for topic in loaded}
        for name in [n for n in self._states if n not in names and n not in self._manual]:
            del self._states[name]  # unloaded elsewhere: the bound is the loaded topics
        for name in [n for n in self._locks if n not in names and not self._locks[n].locked()]:
            del self._locks[name]
        for topic in loaded:
            try:
                policy = await self._policy(topic, cache)
                await self._offload_topic(topic, policy)
            except Exception:
                log.exception("%s: offload step failed", topic.name)
        self.sweeps += 1

    async def _policy(
        self,
        topic: PersistentTopic,
        cache: dict[str, tuple[NamespacePolicies | None, frozenset[str]]],
    ) -> OffloadPolicy:
        """The namespace's offload policy with the topic's override (if any) applied."""
        name = parse_name(topic.name)
        ns = namespace_of(name)
        if ns not in cache:
            try:
                policies: NamespacePolicies | None = await self.service.policies.namespace_policies(
                    ns
                )
            except NotFound:
                policies = None
            cache[ns] = (policies, await self._topic_policies.overridden(ns))
        policies, overridden = cache[ns]
        named = isinstance(name, TopicName) and name.local_name in overridden
        if policies is not None and named and isinstance(name, TopicName):
            policies = (await self._topic_policies.get(name)).over(policies)
        return policy_of(self.config, policies)

    def _ledger(self, topic: PersistentTopic) -> ManagedLedgerBase | None:
        from anabranch.storage.base import ManagedLedgerBase

        ledger = topic.ledger
        if not isinstance(ledger, ManagedLedgerBase) or ledger.tiered is None:
            return None
        return ledger

    async def _offload_topic(self, topic: PersistentTopic, policy: OffloadPolicy) -> None:
        ledger = self._ledger(topic)
        if ledger is None:
            return
        state = self._states.get(topic.name)
        before = state.pending_before if state is not None else None
        plan = plan_offload(candidates(ledger), policy, self.clock.wall_ms(), before)
        if not plan.offload and not plan.delete_hot and before is None:
            return
        lock = self._locks.setdefault(topic.name, asyncio.Lock())
        async with lock:
            state = self._states.setdefault(topic.name, _TopicState())
            if plan.offload or before is not None:
                state.status = OffloadStatus.RUNNING
            try:
                for ledger_id in plan.offload:
                    if await ledger.offload_ledger(ledger_id, policy.deletion_lag_ms):
                        self.ledgers_offloaded += 1
                        self.service.counters.ledgers_offloaded += 1
                        log.info("%s: ledger %d offloaded", topic.name, ledger_id)
                if plan.offload or before is not None:
                    state.status = OffloadStatus.SUCCESS
                    state.last_error = ""
                    state.pending_before = None
            except Exception as err:
                self.failures += 1
                self.service.counters.offload_failures += 1
                state.status = OffloadStatus.ERROR
                # Our errors' messages name no path or secret; anything else stays in the log.
                state.last_error = (
                    str(err)
                    if isinstance(err, AnabranchError)
                    else f"internal error ({type(err).__name__}); see the broker log"
                )
                # An object store out of reach is expected (retried with backoff): one line
                # per attempt; anything else keeps its traceback.
                log.warning(
                    "%s: offload failed (the ledger stays hot): %r",
                    topic.name,
                    err,
                    exc_info=not isinstance(err, ObjectStoreUnavailable),
                )
            # Hot copies whose lag has passed go whatever became of this round's offloads.
            for ledger_id in plan.delete_hot:
                if await ledger.delete_offloaded_hot(ledger_id):
                    self.hot_copies_deleted += 1

    # --- the manual trigger --------------------------------------------------------------------

    async def trigger(self, topic: PersistentTopic, before: Position) -> None:
        """Offload the sealed ledgers before ``before`` (Pulsar's ``PUT .../offload``);
        returns once started. OffloadNotConfigured without a driver."""
        if not self.configured or self._ledger(topic) is None:
            raise OffloadNotConfigured()
        state = self._states.setdefault(topic.name, _TopicState())
        running = self._manual.get(topic.name)
        if state.pending_before is None or before.ledger_id > state.pending_before:
            state.pending_before = before.ledger_id
        state.status = OffloadStatus.RUNNING
        if running is None or running.done():
            task = asyncio.get_running_loop().create_task(self._manual_run(topic))
            self._manual[topic.name] = task

    async def _manual_run(self, topic: PersistentTopic) -> None:
        try:
            policy = await self._policy(topic, {})
            # Only the manual request: thresholds are the sweep's business.
            manual = OffloadPolicy(DISABLED, DISABLED, policy.deletion_lag_ms)
            await self._offload_topic(topic, manual)
        except Exception:
            log.exception("%s: manual offload failed", topic.name)
        finally:
            self._manual.pop(topic.name, None)

    def status(self, topic: PersistentTopic) -> dict[str, Any]:
        """Pulsar's ``OffloadProcessStatus`` for ``topic``."""
        state = self._states.get(topic.name) or _TopicState()
        first: dict[str, int] | None = None
        ledger = self._ledger(topic)
        if ledger is not None:
            ledger_id = first_unoffloaded(candidates(ledger))
            if ledger_id is not None:
                first = {"ledgerId": ledger_id, "entryId": 0, "partitionIndex": -1}
        return {
            "status": state.status.value,
            "lastError": state.last_error,
            "firstUnoffloadedMessage": first,
        }
