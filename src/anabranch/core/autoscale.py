"""When a scalable topic splits or merges by itself: the pure auto-scaling decision.

Theory of operation
-------------------
Pure: no I/O and no clock (``now_ms`` comes in, on the wall clock the layout's
``created_at_ms`` uses). The controller shell samples each active segment's counters on its
owning broker, turns them into :class:`RateSample` values (rates over the last sampling
interval), keeps a bounded history per segment (:class:`LoadHistory`), and asks
:func:`decide` what to do; it runs the actions one at a time through the ordinary split and
merge protocol.

*Pressure.* A sample's pressure is its largest ratio to a split threshold
(messages/s and bytes/s, in and out, and the backlog of the slowest subscription; a
threshold of 0 is off). Pressure 1 is "at the threshold".

*Split* an active segment when its pressure stayed >= 1 for ``split_sustain_ms`` (every
sample in the window, and the segment was observed for the whole window), it is older than
``split_cooldown_ms`` (so a merge's child is not split again at once), its range has two
hashes, and the topic is below ``max_segments``. The hottest segments go first.

*Merge* two **buddies** only (PIP-460's buddy rule: the two halves of one split, both
active; see :func:`buddies`) when the sum of their largest pressures over
``merge_sustain_ms`` stayed under ``merge_low_water``, both are older than
``merge_cooldown_ms`` (a split's children are not merged back at once) and the topic is
above its floor ``max(min_segments, target_segments)``.

*Hysteresis.* ``merge_low_water`` < 1 leaves a band where nothing happens: a load
fluctuating inside (low water, threshold) per segment neither splits nor merges; a merged
segment carries at most ``merge_low_water`` pressure, so it is not split again at once.

*Target.* Below ``target_segments`` the widest old-enough segments are split even without
load (after the load-driven splits); merges never go below it.

    | condition (sustained)                     | action           | reason           |
    |-------------------------------------------|------------------|------------------|
    | pressure >= 1, count < max, aged          | split            | the top metric   |
    | count < target, aged                      | split (widest)   | target           |
    | buddies' pressure sum < low water, > floor| merge            | lowWater         |
    | anything else                             | nothing          | (intent only)    |

Example:
    >>> from anabranch.core.segment_layout import SegmentLayout
    >>> policy = AutoscalePolicy(enabled=True, split_msg_rate_in=100.0, split_sustain_ms=0)
    >>> layout = SegmentLayout.initial(1, now_ms=0)
    >>> hot = {0: (RateSample(60_000, msg_rate_in=250.0),)}
    >>> decide(layout, hot, policy, now_ms=60_000).actions
    (Action(kind='split', segment_ids=(0,), reason='msgRateIn'),)
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from anabranch.core.segment_layout import Segment, SegmentLayout
from anabranch.errors import InvalidArgument

SPLIT = "split"
MERGE = "merge"
TARGET = "target"
LOW_WATER = "lowWater"

METRICS = ("msgRateIn", "throughputIn", "msgRateOut", "throughputOut", "backlog")
"""The per-segment rates, in :class:`RateSample` field order (camelCase as in stats)."""


@dataclass(frozen=True, slots=True)
class AutoscalePolicy:
    """When to split and merge (broker defaults, overridable per namespace and topic).

    Thresholds of 0 are off. Example:
        >>> AutoscalePolicy().enabled, AutoscalePolicy().max_segments
        (False, 16)
    """

    enabled: bool = False
    split_msg_rate_in: float = 5_000.0
    split_throughput_in: float = 5.0 * 1024 * 1024
    split_msg_rate_out: float = 0.0
    split_throughput_out: float = 0.0
    split_backlog: float = 0.0
    min_segments: int = 1
    max_segments: int = 16
    target_segments: int = 0
    merge_low_water: float = 0.3
    """Buddies merge when their pressures add up to less than this (0 < x < 1)."""
    split_sustain_ms: int = 30_000
    merge_sustain_ms: int = 120_000
    split_cooldown_ms: int = 60_000
    merge_cooldown_ms: int = 300_000

    def thresholds(self) -> tuple[float, ...]:
        """Split thresholds in :data:`METRICS` order."""
        return (
            self.split_msg_rate_in,
            self.split_throughput_in,
            self.split_msg_rate_out,
            self.split_throughput_out,
            self.split_backlog,
        )

    def validate(self) -> AutoscalePolicy:
        """Itself, or InvalidArgument naming the first bad value.

        Example:
            >>> AutoscalePolicy(min_segments=4, max_segments=2).validate()
            Traceback (most recent call last):
            ...
            anabranch.errors.InvalidArgument: minSegments 4 is above maxSegments 2
        """
        if any(t < 0 for t in self.thresholds()):
            raise InvalidArgument("split thresholds must be >= 0 (0: off)")
        if self.min_segments < 1:
            raise InvalidArgument(f"minSegments must be at least 1, not {self.min_segments}")
        if self.min_segments > self.max_segments:
            raise InvalidArgument(
                f"minSegments {self.min_segments} is above maxSegments {self.max_segments}"
            )
        if self.target_segments < 0 or self.target_segments > self.max_segments:
            raise InvalidArgument(
                f"targetSegments {self.target_segments} is outside [0, {self.max_segments}]"
            )
        if not 0.0 < self.merge_low_water < 1.0:
            raise InvalidArgument(f"mergeLowWater {self.merge_low_water} is outside (0, 1)")
        for name in ("split_sustain_ms", "merge_sustain_ms", "split_cooldown_ms"):
            if getattr(self, name) < 0:
                raise InvalidArgument(f"{_camel(name)} must be >= 0")
        if self.merge_cooldown_ms < 0:
            raise InvalidArgument("mergeCooldownMs must be >= 0")
        return self

    @property
    def floor(self) -> int:
        """The active-segment count merges never go below."""
        return max(self.min_segments, self.target_segments)

    def to_dict(self) -> dict[str, Any]:
        """The camelCase JSON form (every field).

        Example:
            >>> AutoscalePolicy().to_dict()["mergeLowWater"]
            0.3
        """
        return {_camel(f.name): getattr(self, f.name) for f in dataclasses.fields(self)}

    def overridden(self, overrides: Mapping[str, Any]) -> AutoscalePolicy:
        """This policy with the camelCase ``overrides`` applied (a namespace's or topic's
        partial record; ``None`` values are inherited), validated.

        Example:
            >>> AutoscalePolicy().overridden({"enabled": True, "maxSegments": 4}).max_segments
            4
            >>> AutoscalePolicy().overridden({"bogus": 1})
            Traceback (most recent call last):
            ...
            anabranch.errors.InvalidArgument: unknown autoscale setting 'bogus'
        """
        return dataclasses.replace(self, **check_overrides(overrides)).validate()


_FIELDS = {f.name: f for f in dataclasses.fields(AutoscalePolicy)}


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(part.capitalize() for part in rest)


_BY_CAMEL = {_camel(name): name for name in _FIELDS}


def check_overrides(overrides: Mapping[str, Any]) -> dict[str, Any]:
    """Field-name → value of camelCase ``overrides`` (``None`` values dropped), typed;
    InvalidArgument for an unknown name or a value of the wrong type.

    Example:
        >>> check_overrides({"maxSegments": 8, "mergeLowWater": None})
        {'max_segments': 8}
    """
    if not isinstance(overrides, Mapping):
        raise InvalidArgument("an autoscale policy is a JSON object")
    out: dict[str, Any] = {}
    for key, value in overrides.items():
        name = _BY_CAMEL.get(key)
        if name is None:
            raise InvalidArgument(f"unknown autoscale setting {key!r}")
        if value is None:
            continue
        kind = _FIELDS[name].type
        if kind == "bool":
            if not isinstance(value, bool):
                raise InvalidArgument(f"{key} must be true or false")
        elif kind == "int":
            if isinstance(value, bool) or not isinstance(value, int):
                raise InvalidArgument(f"{key} must be an integer")
        elif isinstance(value, bool) or not isinstance(value, int | float):
            raise InvalidArgument(f"{key} must be a number")
        out[name] = float(value) if kind == "float" else value
    return out


@dataclass(frozen=True, slots=True)
class RateSample:
    """One segment's rates over the sampling interval that ended at ``at_ms``."""

    at_ms: int
    msg_rate_in: float = 0.0
    throughput_in: float = 0.0
    msg_rate_out: float = 0.0
    throughput_out: float = 0.0
    backlog: float = 0.0
    """Unacknowledged messages of the segment's slowest subscription (a level, not a rate)."""

    def values(self) -> tuple[float, ...]:
        """The rates in :data:`METRICS` order."""
        return (
            self.msg_rate_in,
            self.throughput_in,
            self.msg_rate_out,
            self.throughput_out,
            self.backlog,
        )

    def to_dict(self) -> dict[str, float]:
        """camelCase rates for stats."""
        return dict(zip(METRICS, self.values(), strict=True))


def pressure(sample: RateSample, policy: AutoscalePolicy) -> tuple[float, str]:
    """The sample's largest ratio to a split threshold, and that threshold's metric.

    Example:
        >>> pressure(RateSample(0, msg_rate_in=50.0, throughput_in=4096.0),
        ...          AutoscalePolicy(split_msg_rate_in=100.0, split_throughput_in=2048.0))
        (2.0, 'throughputIn')
    """
    best, metric = 0.0, METRICS[0]
    for name, value, threshold in zip(METRICS, sample.values(), policy.thresholds(), strict=True):
        if threshold > 0 and value / threshold > best:
            best, metric = value / threshold, name
    return best, metric


@dataclass(frozen=True, slots=True)
class Action:
    """A change the controller should make, and why (``reason``: a metric, ``target`` or
    ``lowWater``)."""

    kind: str
    segment_ids: tuple[int, ...]
    reason: str


@dataclass(frozen=True, slots=True)
class Decision:
    """What :func:`decide` answers: the actions, and per active segment the intent (what
    the policy leans to and why, for ``admin scalable stats``)."""

    actions: tuple[Action, ...] = ()
    intents: Mapping[int, str] = field(default_factory=dict)


def _window(samples: Sequence[RateSample], now_ms: int, span_ms: int) -> list[RateSample] | None:
    """Samples of the last ``span_ms`` (at least the newest one), or None unless the
    history reaches back over the whole span."""
    if not samples:
        return None
    start = now_ms - span_ms
    if samples[0].at_ms > start and span_ms > 0:
        return None  # not observed long enough to claim "sustained"
    recent = [s for s in samples if s.at_ms >= start]
    return recent or [samples[-1]]


def buddies(layout: SegmentLayout) -> list[tuple[Segment, Segment]]:
    """Adjacent active pairs that are the two halves of one split (the only merges allowed).

    Two ways to know: both were created by the same change (equal ``created_at_epoch`` >
    0: every change bumps the epoch and only a split makes two segments; this survives the
    parent being pruned, which drops the links), or a split segment still in the DAG has
    exactly their ranges as halves (so a merged-back half pairs with its sibling again).

    Example:
        >>> layout = SegmentLayout.initial(1, 0).split(0, 1).split(2, 2)
        >>> [(a.segment_id, b.segment_id) for a, b in buddies(layout)]
        [(3, 4)]
        >>> [(a.segment_id, b.segment_id) for a, b in buddies(layout.merge(3, 4, 3))]
        [(1, 5)]
    """
    active = layout.active_segments()  # sorted by range
    halves = {
        s.hash_range.split()
        for s in layout.sealed_segments()
        if len(s.child_ids) == 2 and s.hash_range.size >= 2
    }
    pairs = []
    for first, second in itertools.pairwise(active):
        if first.hash_range.end + 1 != second.hash_range.start:
            continue
        same_split = first.created_at_epoch == second.created_at_epoch > 0
        if same_split or (first.hash_range, second.hash_range) in halves:
            pairs.append((first, second))
    return pairs


def decide(
    layout: SegmentLayout,
    history: Mapping[int, Sequence[RateSample]],
    policy: AutoscalePolicy,
    now_ms: int,
) -> Decision:
    """The actions ``policy`` calls for now (see the module docstring); none when disabled.

    ``history`` maps active segment ids to their samples, oldest first.
    """
    active = layout.active_segments()
    count = len(active)
    intents: dict[int, str] = {}
    hot: list[tuple[float, int, str]] = []
    for segment in active:
        samples = history.get(segment.segment_id, ())
        current = pressure(samples[-1], policy)[0] if samples else 0.0
        window = _window(samples, now_ms, policy.split_sustain_ms)
        if current < 1.0:
            intents[segment.segment_id] = f"hold (pressure {current:.2f})"
            continue
        if window is None or any(pressure(s, policy)[0] < 1.0 for s in window):
            intents[segment.segment_id] = f"split when sustained (pressure {current:.2f})"
        elif now_ms - segment.created_at_ms < policy.split_cooldown_ms:
            intents[segment.segment_id] = "split after cooldown"
        elif segment.hash_range.size < 2:
            intents[segment.segment_id] = "hold (range too small to split)"
        elif count >= policy.max_segments:
            intents[segment.segment_id] = f"hold (at maxSegments {policy.max_segments})"
        else:
            level, metric = min(pressure(s, policy) for s in window)
            hot.append((level, segment.segment_id, metric))
    budget = max(0, policy.max_segments - count)
    hot.sort(key=lambda h: (-h[0], h[1]))
    actions = [Action(SPLIT, (sid,), metric) for _, sid, metric in hot[:budget]]
    for action in actions:
        intents[action.segment_ids[0]] = f"split ({action.reason})"
    for _, sid, _ in hot[budget:]:
        intents[sid] = f"split deferred (maxSegments {policy.max_segments})"
    splitting = {a.segment_ids[0] for a in actions}
    grow = min(policy.target_segments - count - len(actions), budget - len(actions))
    if grow > 0:
        aged = [
            s
            for s in active
            if s.segment_id not in splitting
            and s.hash_range.size >= 2
            and now_ms - s.created_at_ms >= policy.split_cooldown_ms
        ]
        aged.sort(key=lambda s: (-s.hash_range.size, s.segment_id))
        for segment in aged[:grow]:
            actions.append(Action(SPLIT, (segment.segment_id,), TARGET))
            intents[segment.segment_id] = f"split ({TARGET} {policy.target_segments})"
            splitting.add(segment.segment_id)
    if not actions:
        merges = count - policy.floor
        merging: set[int] = set()
        for first, second in buddies(layout):
            if merges <= 0:
                break
            if first.segment_id in merging or second.segment_id in merging:
                continue
            peak = 0.0
            windows = []
            for segment in (first, second):
                samples = history.get(segment.segment_id, ())
                window = _window(samples, now_ms, policy.merge_sustain_ms)
                windows.append(window)
                if window:
                    peak += max(pressure(s, policy)[0] for s in window)
            if any(w is None for w in windows) or peak >= policy.merge_low_water:
                continue
            pair = (first.segment_id, second.segment_id)
            if any(now_ms - s.created_at_ms < policy.merge_cooldown_ms for s in (first, second)):
                for sid in pair:
                    intents[sid] = "merge after cooldown"
                continue
            actions.append(Action(MERGE, pair, LOW_WATER))
            merging.update(pair)
            for sid in pair:
                intents[sid] = f"merge with {pair[1] if sid == pair[0] else pair[0]} ({LOW_WATER})"
            merges -= 1
    if not policy.enabled:
        return Decision((), {sid: f"disabled; would {text}" for sid, text in intents.items()})
    return Decision(tuple(actions), intents)


class LoadHistory:
    """Bounded per-segment rate history built from cumulative counters.

    :meth:`observe` takes a segment's counters (messages and bytes in and out since its
    topic was loaded, and its backlog) and appends the rates since the previous call; a
    counter that went backwards (the topic was reloaded elsewhere) restarts the baseline.
    At most ``max_samples`` per segment; segments no longer active are forgotten by
    :meth:`retain`.

    Example:
        >>> h = LoadHistory(max_samples=3)
        >>> h.observe(7, 0, (0, 0, 0, 0), backlog=0)
        >>> h.observe(7, 2_000, (400, 4_000, 0, 0), backlog=5)
        >>> h.samples(7)[-1].msg_rate_in, h.samples(7)[-1].backlog
        (200.0, 5.0)
    """

    def __init__(self, max_samples: int) -> None:
        self.max_samples = max_samples
        self._last: dict[int, tuple[int, tuple[int, ...]]] = {}
        self._samples: dict[int, deque[RateSample]] = {}

    def observe(
        self, segment_id: int, at_ms: int, counters: tuple[int, int, int, int], backlog: int
    ) -> None:
        """Record a counter reading taken at ``at_ms``."""
        previous = self._last.get(segment_id)
        self._last[segment_id] = (at_ms, counters)
        if previous is None:
            return
        then, old = previous
        elapsed_s = (at_ms - then) / 1000
        if elapsed_s <= 0 or any(n < o for n, o in zip(counters, old, strict=True)):
            return
        msg_in, bytes_in, msg_out, bytes_out = (
            (n - o) / elapsed_s for n, o in zip(counters, old, strict=True)
        )
        samples = self._samples.setdefault(segment_id, deque(maxlen=self.max_samples))
        samples.append(RateSample(at_ms, msg_in, bytes_in, msg_out, bytes_out, float(backlog)))

    def samples(self, segment_id: int) -> tuple[RateSample, ...]:
        """The segment's samples, oldest first."""
        return tuple(self._samples.get(segment_id, ()))

    def history(self) -> dict[int, tuple[RateSample, ...]]:
        """Every tracked segment's samples (the input of :func:`decide`)."""
        return {sid: tuple(samples) for sid, samples in self._samples.items()}

    def retain(self, segment_ids: set[int]) -> None:
        """Forget segments not in ``segment_ids`` (sealed ones)."""
        for table in (self._last, self._samples):
            for sid in [s for s in table if s not in segment_ids]:
                del table[sid]
