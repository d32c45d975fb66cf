"""The per-subscription assignment state of a scalable topic as the admin ``/stats`` shows
it (PIP-468's admin section: "per-subscription state, consumer counts").

Pure: a :class:`~anabranch.core.assignment.SubscriptionAssignment` and the controller's
``now_ms`` in, a JSON-ready dict out. Per consumer: connected or in its grace period (with
the milliseconds left before eviction), and the segments it holds; per segment: who holds
it (several consumers in Key_Shared dispatch mode: ``sharedSegments``); the segments nobody
holds (no consumer, or waiting for an ancestor to drain) and the drained (retired) ones.

Example:
    >>> from anabranch.core.assignment import ConsumerDisconnected, SubscriptionAssignment
    >>> from anabranch.core.segment_layout import SegmentLayout
    >>> s, _ = SubscriptionAssignment.restore("s", SegmentLayout.initial(1, 0), ["a", "b"],
    ...     now_ms=0, grace_period_ms=500, fan_out=True)
    >>> out = assignment_stats(s, now_ms=100)
    >>> out["consumers"]["a"]
    {'connected': False, 'segments': [0], 'graceRemainingMs': 400}
    >>> out["sharedSegments"], out["consumerCount"]
    ({'0': ['a', 'b']}, 2)
"""

from __future__ import annotations

from typing import Any

from anabranch.core.assignment import SubscriptionAssignment


def subscription_type(state: SubscriptionAssignment) -> str:
    """The subscription kind a state was built for (the controller's record ``type``):
    ``STREAM``, ``STREAM_KEY_SHARED`` (fan-out) or ``CHECKPOINT``."""
    if not state.ordered:
        return "CHECKPOINT"
    return "STREAM_KEY_SHARED" if state.fan_out else "STREAM"


def assignment_stats(state: SubscriptionAssignment, now_ms: int) -> dict[str, Any]:
    """The admin view of one subscription's assignment (see the module docstring)."""
    consumers: dict[str, Any] = {}
    for name, session in sorted(state.sessions.items()):
        entry: dict[str, Any] = {
            "connected": session.connected,
            "segments": list(state.assignment.get(name, ())),
        }
        if session.deadline_ms is not None:
            entry["graceRemainingMs"] = max(0, session.deadline_ms - now_ms)
        consumers[name] = entry
    owners: dict[str, list[str]] = {}
    for name, segments in sorted(state.assignment.items()):
        for segment_id in segments:
            owners.setdefault(str(segment_id), []).append(name)
    held = {int(s) for s in owners}
    return {
        "type": subscription_type(state),
        "layoutEpoch": state.layout.epoch,
        "consumerCount": len(state.sessions),
        "connectedConsumers": sum(1 for s in state.sessions.values() if s.connected),
        "gracePeriodMs": state.grace_period_ms,
        "consumers": consumers,
        "segmentOwners": owners,
        "sharedSegments": {s: names for s, names in owners.items() if len(names) > 1},
        "unassignedSegments": sorted(
            s.segment_id
            for s in state.layout.segments.values()
            if s.segment_id not in held and s.segment_id not in state.drained
        ),
        "drainedSegments": sorted(state.drained),
        "pendingDrains": list(state.pending_drains()),
    }


__all__ = ["assignment_stats", "subscription_type"]
