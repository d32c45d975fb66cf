"""The controller's auto-scaling loop: sample segment load, ask the policy, split or merge.

Theory of operation
-------------------
One :class:`Autoscaler` per broker runs next to its
:class:`~anabranch.scalable.service.ScalableTopicService`. Every ``interval_s`` it visits
the topics whose controller **leads** on this broker (only a leader may change a layout;
a follower keeps no history), and for each:

1. resolves the topic's policy (broker defaults, namespace and topic overrides); a topic
   whose automation is off costs nothing more. Otherwise it reads each active segment's
   :class:`~anabranch.scalable.segment_ops.SegmentLoad` through the controller's
   :class:`~anabranch.scalable.segment_ops.SegmentOps` -- the channel the controller
   creates and seals segments through, so in cluster mode the segment's owner answers
   (``GET .../cluster/segments/.../load``), in standalone the local broker. Owners keep
   plain integer counters on the data path already; nothing is added per message;
2. folds the readings into a bounded per-segment :class:`~anabranch.core.autoscale.
   LoadHistory` (rates between readings; sealed segments are forgotten);
3. calls the pure :func:`~anabranch.core.autoscale.decide`;
4. runs the actions one after the other through the controller's ordinary split and merge
   (PIP-468's protocol, under the controller's lock: one change in flight per topic, and a
   manual change waits for it), counting each by action and reason.

The last decision per topic is kept for ``admin scalable stats`` (rates and next intent).
A topic this broker no longer leads is dropped from the tables, so memory is bounded by
the led topics times their active segments times ``max_samples``.

Example:
    >>> import asyncio
    >>> from anabranch.clock import SystemClock
    >>> from anabranch.metadata.memory import MemoryMetadataStore
    >>> from anabranch.scalable.segment_ops import StorageSegmentOps
    >>> from anabranch.storage.memory import MemoryManagedLedgerFactory
    >>> async def demo(service: ScalableTopicService) -> None:
    ...     async def policy(topic: TopicName) -> AutoscalePolicy:
    ...         return AutoscalePolicy(enabled=True)
    ...     autoscaler = Autoscaler(service, policy, interval_s=5.0)
    ...     autoscaler.start()
    ...     await autoscaler.evaluate_all()     # or wait for the interval
    ...     print(autoscaler.counters)          # no load yet: nothing to split or merge
    ...     await autoscaler.close()
    >>> async def main() -> None:
    ...     store = MemoryMetadataStore()
    ...     ops = StorageSegmentOps(MemoryManagedLedgerFactory())
    ...     service = ScalableTopicService(store, ops, SystemClock(), "http://127.0.0.1:8080")
    ...     await service.start()
    ...     await service.create("topic://public/default/orders", 2)   # led here
    ...     await demo(service)
    ...     await service.close()
    ...     await ops.close()
    ...     await store.close()
    >>> asyncio.run(main())
    AutoscaleCounters(evaluations=1, failures=0, decisions={})
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from anabranch import limits
from anabranch.core.autoscale import (
    MERGE,
    SPLIT,
    AutoscalePolicy,
    Decision,
    LoadHistory,
    decide,
)
from anabranch.core.names import TopicName
from anabranch.core.segment_layout import segment_name
from anabranch.errors import NotFound
from anabranch.metadata.api import MetadataStore
from anabranch.scalable.controller import ScalableTopicController
from anabranch.scalable.paths import TopicPaths
from anabranch.scalable.service import ScalableTopicService
from anabranch.supervisor import GiveUp, Supervised

log = logging.getLogger(__name__)

PolicySource = Callable[[TopicName], Awaitable[AutoscalePolicy]]
"""The policy in force for a topic (broker defaults under namespace and topic overrides)."""


@dataclass
class AutoscaleCounters:
    """Plain-int counters of one broker's autoscaler (read by ``/metrics``)."""

    evaluations: int = 0
    failures: int = 0
    """Evaluations or actions that raised (logged; retried at the next interval)."""
    decisions: dict[tuple[str, str], int] = field(default_factory=dict)
    """Changes made, by (action, reason)."""


@dataclass
class _TopicState:
    history: LoadHistory
    policy: AutoscalePolicy = field(default_factory=AutoscalePolicy)
    decision: Decision = field(default_factory=Decision)
    evaluated_ms: int = 0


class Autoscaler:
    """Periodic load-driven split/merge of the topics this broker's controllers lead."""

    def __init__(
        self,
        service: ScalableTopicService,
        policy_of: PolicySource,
        *,
        interval_s: float,
        max_samples: int = limits.SCALABLE_AUTOSCALE_SAMPLES_MAX,
        on_give_up: GiveUp | None = None,
    ) -> None:
        self.service = service
        self.policy_of = policy_of
        self.interval_s = interval_s
        self.max_samples = max_samples
        self.counters = AutoscaleCounters()
        self._on_give_up = on_give_up
        self._topics: dict[TopicName, _TopicState] = {}
        self._loop: Supervised | None = None
        self._closed = False

    def start(self) -> None:
        """Start the periodic loop (idempotent)."""
        if self._loop is None:
            self._loop = Supervised("scalable-autoscaler", self._run, on_give_up=self._on_give_up)
            self._loop.start()

    async def close(self) -> None:
        """Stop the loop (an evaluation in progress is cancelled between steps)."""
        self._closed = True
        if self._loop is not None:
            await self._loop.stop()
            self._loop = None

    async def _run(self) -> None:
        while not self._closed:
            await self.service.clock.sleep(self.interval_s)
            await self.evaluate_all()

    async def evaluate_all(self) -> None:
        """One round over every topic led here; a topic's failure is logged and counted."""
        led: set[TopicName] = set()
        for controller in self.service.local_controllers():
            if not controller.is_leader:
                continue
            led.add(controller.topic)
            try:
                await self.evaluate(controller)
            except Exception as err:
                self.counters.failures += 1
                log.warning("%s: autoscale evaluation failed: %s", controller.topic, err)
        for topic in [t for t in self._topics if t not in led]:
            del self._topics[topic]

    async def evaluate(self, controller: ScalableTopicController) -> Decision:
        """Sample, decide and act for one topic; returns the decision."""
        topic = controller.topic
        layout = await controller.get_layout()
        state = self._topics.get(topic)
        if state is None:
            state = self._topics[topic] = _TopicState(LoadHistory(self.max_samples))
        now_ms = self.service.clock.wall_ms()
        active = layout.active_segments()
        state.policy = await self.policy_of(topic)
        if not state.policy.enabled:
            # Off (the default): no load reads at all, which in a cluster are HTTP calls.
            state.history.retain(set())
            state.decision = Decision((), {s.segment_id: "disabled" for s in active})
            state.evaluated_ms = now_ms
            return state.decision
        for segment in active:
            load = await self.service.ops.segment_load(segment_name(topic, segment))
            state.history.observe(segment.segment_id, now_ms, load.counters(), load.backlog)
        state.history.retain({s.segment_id for s in active})
        state.decision = decide(layout, state.history.history(), state.policy, now_ms)
        state.evaluated_ms = now_ms
        self.counters.evaluations += 1
        for action in state.decision.actions:
            ids = action.segment_ids
            log.info("%s: autoscale %s of %s (%s)", topic, action.kind, ids, action.reason)
            if action.kind == SPLIT:
                await controller.split(ids[0])
            elif action.kind == MERGE:
                await controller.merge(ids[0], ids[1])
            key = (action.kind, action.reason)
            self.counters.decisions[key] = self.counters.decisions.get(key, 0) + 1
        return state.decision

    def topic_stats(self, topic: TopicName) -> dict[str, Any] | None:
        """Per active segment the latest rates and the intent, plus the policy in force;
        None unless this broker leads the topic and has evaluated it."""
        state = self._topics.get(topic)
        if state is None or not state.evaluated_ms:
            return None
        segments: dict[str, Any] = {}
        for sid, intent in sorted(state.decision.intents.items()):
            samples = state.history.samples(sid)
            rates = samples[-1].to_dict() if samples else None
            segments[str(sid)] = {"rates": rates, "intent": intent}
        actions = [
            {"action": a.kind, "segmentIds": list(a.segment_ids), "reason": a.reason}
            for a in state.decision.actions
        ]
        return {
            "evaluatedAtMs": state.evaluated_ms,
            "policy": state.policy.to_dict(),
            "segments": segments,
            "lastActions": actions,
        }


def topic_policy_path(topic: TopicName) -> str:
    """Where a scalable topic's autoscale overrides live: under the topic's own key, so
    deleting the topic deletes them.

    Example:
        >>> topic_policy_path(TopicName.parse("topic://public/default/orders"))
        '/topics/public/default/orders/autoscale'
    """
    return f"{TopicPaths(topic).layout}/autoscale"


async def read_topic_overrides(store: MetadataStore, topic: TopicName) -> dict[str, Any] | None:
    """The topic's autoscale overrides (camelCase), None when it sets none."""
    record = await store.get(topic_policy_path(topic))
    if record is None:
        return None
    doc = json.loads(record.value)
    return dict(doc) if isinstance(doc, dict) else None


async def write_topic_overrides(
    store: MetadataStore, topic: TopicName, overrides: dict[str, Any] | None
) -> None:
    """Set (or with None remove) the topic's overrides; NotFound unless the topic exists."""
    if await store.get(TopicPaths(topic).layout) is None:
        raise NotFound(str(topic))
    path = topic_policy_path(topic)
    if overrides is None:
        await store.delete(path)
        return
    await store.put(path, json.dumps(overrides, sort_keys=True).encode())
