"""Key_Shared: the entry's key picks the consumer, and a key's messages never overtake.

Selection (upstream ``HashRangeAutoSplitStickyKeyConsumerSelector`` and
``HashRangeExclusiveStickyKeyConsumerSelector``): the slot is
``(Murmur3_32(sticky key) & 0x7fffffff) % 65536``. AUTO_SPLIT keeps a map from range upper
bounds to consumers: the first consumer owns ``[0, 65536]``, each later one splits the
biggest range, and a leaving consumer's range goes to its neighbour. STICKY consumers bring
their own inclusive ``hashRanges``; an overlap with another consumer's is refused.

Ordering rule (the "draining hashes" rule of upstream PIP-379, which never reorders a key):
an entry of slot ``s`` is sent to the selected consumer only when

1. no earlier entry of ``s`` waits in the replay set (so replayed entries go first), and
2. no *other* consumer still has unacknowledged entries of ``s`` (after a consumer joins
   and takes over part of a range, the old owner drains first).

Anything that cannot go now joins the replay set and is retried on the next pass, in
position order.

A batch of several keys names each message's slot in its metadata (``core/batch_keys``):
it is split by consumer, each consumer getting the stored entry with an ``ack_set`` that
leaves only its messages (a *part*). Each part goes when the rule above holds for its own
slots; the rest waits in the replay set holding only its slots (``_replay_held``). A
consumer's ack of the entry acknowledges its part only (``part_of``), and a departed
consumer's part is replayed alone (indexes acknowledged or out with others are skipped).

Example:
    >>> sel = AutoSplitSelector()
    >>> sel.add("a"); sel.add("b")
    >>> sel.select(0), sel.select(65535)
    ('b', 'a')
"""

from __future__ import annotations

import heapq
from bisect import bisect_left, bisect_right
from collections import Counter
from collections.abc import Container, Iterable, Sequence
from itertools import pairwise
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from anabranch import limits
from anabranch.broker.consumer import Consumer, PendingEntry
from anabranch.broker.dispatcher import SharedDispatcher
from anabranch.broker.dispatcher_entries import (
    HASH_RANGE_SIZE,
    EntryInfo,
    acked_to_wire,
    entry_info,
    hash_slot,
)
from anabranch.errors import ConsumerAssignError
from anabranch.protocol._generated import pulsar_api_pb2 as pb
from anabranch.storage.api import Entry, Position

if TYPE_CHECKING:
    from anabranch.broker.subscription import Subscription

C = TypeVar("C")


class AutoSplitSelector(Generic[C]):
    """Upstream's auto-split hash ranges over ``[0, 65536]`` (keys are upper bounds)."""

    def __init__(self, range_size: int = HASH_RANGE_SIZE) -> None:
        self.range_size = range_size
        self._bounds: list[int] = []
        self._owner: dict[int, C] = {}
        self._bound_of: dict[C, int] = {}

    def add(self, consumer: C) -> None:
        if not self._bounds:
            self._put(self.range_size, consumer)
            return
        lower, upper = self._biggest()
        if upper - lower <= 1:
            raise ConsumerAssignError(
                f"no more hash range can be assigned ({len(self._bounds)} consumers)"
            )
        self._put(upper - ((upper - lower) >> 1), consumer)

    def _put(self, bound: int, consumer: C) -> None:
        i = bisect_left(self._bounds, bound)
        self._bounds.insert(i, bound)
        self._owner[bound] = consumer
        self._bound_of[consumer] = bound

    def _biggest(self) -> tuple[int, int]:
        best = (0, self._bounds[0])
        previous = 0
        for bound in self._bounds:
            if bound - previous > best[1] - best[0]:
                best = (previous, bound)
            previous = bound
        return best

    def remove(self, consumer: C) -> None:
        bound = self._bound_of.pop(consumer, None)
        if bound is None:
            return
        i = self._bounds.index(bound)
        if bound == self.range_size and len(self._bounds) > 1:
            # The top range is taken over by the consumer just below it.
            lower = self._bounds[i - 1]
            heir = self._owner.pop(lower)
            del self._bounds[i - 1]
            self._owner[bound] = heir
            self._bound_of[heir] = bound
        else:
            del self._bounds[i]
            del self._owner[bound]

    def select(self, slot: int) -> C | None:
        i = bisect_left(self._bounds, slot)
        return self._owner[self._bounds[i]] if i < len(self._bounds) else None

    def ranges(self) -> dict[C, tuple[int, int]]:
        """Each consumer's inclusive slot range (for stats and tests)."""
        out: dict[C, tuple[int, int]] = {}
        previous = -1
        for bound in self._bounds:
            out[self._owner[bound]] = (previous + 1, min(bound, self.range_size - 1))
            previous = bound
        return out


class StickySelector(Generic[C]):
    """Consumer-declared inclusive slot ranges; overlaps are refused. The ranges are kept
    sorted by start, so adding checks only neighbours and ``select`` is a bisection: the
    cost of a client's range list is O(n log n), never quadratic."""

    def __init__(self) -> None:
        self._ranges: list[tuple[int, int, C]] = []
        self._starts: list[int] = []

    def add(self, consumer: C, ranges: Sequence[tuple[int, int]]) -> None:
        if not ranges:
            raise ConsumerAssignError("a STICKY Key_Shared consumer must declare hash ranges")
        if len(ranges) > limits.KEY_SHARED_STICKY_RANGES_MAX:
            raise ConsumerAssignError(
                f"{len(ranges)} hash ranges (at most {limits.KEY_SHARED_STICKY_RANGES_MAX})"
            )
        for start, end in ranges:
            if not 0 <= start <= end < HASH_RANGE_SIZE:
                raise ConsumerAssignError(f"hash range [{start}, {end}] is outside [0, 65535]")
        mine = sorted(ranges)
        for (start, end), (other_start, other_end) in pairwise(mine):
            if other_start <= end:
                raise ConsumerAssignError(
                    f"hash ranges [{start}, {end}] and [{other_start}, {other_end}] overlap"
                )
        for start, end in mine:
            i = bisect_right(self._starts, end)  # existing ranges starting at or before end
            if i > 0:
                s, e, owner = self._ranges[i - 1]
                if start <= e:
                    raise ConsumerAssignError(
                        f"range conflict: [{start}, {end}] overlaps [{s}, {e}] of {owner}"
                    )
        merged = sorted(self._ranges + [(s, e, consumer) for s, e in mine], key=_range_start)
        self._ranges = merged
        self._starts = [r[0] for r in merged]

    def remove(self, consumer: C) -> None:
        self._ranges = [r for r in self._ranges if r[2] is not consumer]
        self._starts = [r[0] for r in self._ranges]

    def select(self, slot: int) -> C | None:
        i = bisect_right(self._starts, slot)
        if i == 0:
            return None
        _, end, consumer = self._ranges[i - 1]
        return consumer if slot <= end else None


def _range_start(entry: tuple[int, int, Any]) -> int:
    return entry[0]


def join_selector(
    selector: AutoSplitSelector[Consumer] | StickySelector[Consumer] | None,
    mode: int | None,
    consumer: Consumer,
) -> tuple[AutoSplitSelector[Consumer] | StickySelector[Consumer], int]:
    """Add a Key_Shared ``consumer`` to its subscription's selector: (the selector, its
    mode). None starts a selector of the consumer's mode; a consumer of the other mode, or
    with more sticky ranges than ``limits.KEY_SHARED_STICKY_RANGES_MAX``, is refused."""
    meta = consumer.key_shared_meta
    wanted = meta.keySharedMode if meta is not None else pb.AUTO_SPLIT
    if selector is None:
        mode = wanted
        selector = StickySelector() if wanted == pb.STICKY else AutoSplitSelector()
    elif wanted != mode:
        raise ConsumerAssignError("Key_Shared mode differs from the subscription's")
    if isinstance(selector, StickySelector):
        assert meta is not None
        if len(meta.hashRanges) > limits.KEY_SHARED_STICKY_RANGES_MAX:
            raise ConsumerAssignError(
                f"{len(meta.hashRanges)} hash ranges "
                f"(at most {limits.KEY_SHARED_STICKY_RANGES_MAX})"
            )
        selector.add(consumer, [(r.start, r.end) for r in meta.hashRanges])
    else:
        selector.add(consumer)
    return selector, wanted


class KeySharedDispatcher(SharedDispatcher):
    """Key_Shared over the Shared machinery (replay set, permits); see the module doc."""

    delayed_delivery = True

    def __init__(self, subscription: Subscription) -> None:
        super().__init__(subscription)
        self.mode: int | None = None
        self.selector: AutoSplitSelector[Consumer] | StickySelector[Consumer] | None = None
        self._owners: dict[int, tuple[Consumer, int]] = {}
        """slot -> (consumer holding unacked entries of it, how many)."""
        self._replay_slots: Counter[int] = Counter()
        self._mixed: dict[Position, tuple[int, ...]] = {}
        """Mixed-key batches out, waiting or delayed: their distinct slots."""
        self._parts: dict[Position, dict[Consumer, tuple[int, tuple[int, ...]]]] = {}
        """Mixed-key batches out: each holder's part (index bit mask, slots)."""
        self._replay_held: dict[Position, tuple[int, ...]] = {}
        """The slots each waiting entry holds (a mixed batch: those of its unsent part)."""
        self._delayed_slots: dict[Position, int] = {}
        """The slot of each entry held for delayed delivery (it joins the replay set when
        due, keyed like any other)."""

    # --- consumers ------------------------------------------------------------------------

    def add_consumer(self, consumer: Consumer) -> None:
        self.selector, self.mode = join_selector(
            self.selector if self.consumers else None, self.mode, consumer
        )
        super().add_consumer(consumer)

    def remove_consumer(self, consumer: Consumer) -> None:
        if self.selector is not None:
            self.selector.remove(consumer)
        super().remove_consumer(consumer)

    # --- slot bookkeeping -----------------------------------------------------------------

    def _slots(self, position: Position, slot: int) -> tuple[int, ...]:
        """Every slot the entry at ``position`` holds: all of a mixed batch's, else ``slot``."""
        return self._mixed.get(position) or (slot,)

    def _add_replay(
        self, position: Position, slot: int | None, slots: Iterable[int] | None = None
    ) -> None:
        """Put ``position`` in the replay set holding ``slots`` (default: all the entry's):
        later entries of those slots wait behind it. Already there, it holds the union (a
        mixed batch's returning part joins its waiting remainder)."""
        if slot is None:
            self.replay[position] = None
            return
        held = set(self._slots(position, slot) if slots is None else slots)
        if position in self.replay:
            before = self._replay_held.get(position, ())
            if held <= set(before):
                return
            held.update(before)
            self._take_replay(position)
        for s in held:
            self._replay_slots[s] += 1
        self.replay[position] = slot
        self._replay_held[position] = tuple(sorted(held))

    def _take_replay(self, position: Position) -> None:
        if position in self.replay:
            self.replay.pop(position)
            for s in self._replay_held.pop(position, ()):
                self._replay_slots[s] -= 1
                if self._replay_slots[s] <= 0:
                    del self._replay_slots[s]

    def _held(self, position: Position, slot: int) -> tuple[int, ...]:
        """The slots a waiting entry holds (what later entries of those slots wait for)."""
        return self._replay_held.get(position) or self._slots(position, slot)

    def _settle(self, position: Position) -> None:
        """Forget a mixed batch's slots once nothing of it is waiting or out."""
        if (
            position in self._mixed
            and position not in self.replay
            and position not in self._parts
            and position not in self._delayed_slots
        ):
            del self._mixed[position]

    def part_of(self, consumer: Consumer, position: Position) -> int | None:
        parts = self._parts.get(position)
        part = parts.get(consumer) if parts is not None else None
        return part[0] if part is not None else None

    def is_split(self, position: Position) -> bool:
        return position in self._mixed

    def forgotten(self, consumer: Consumer, position: Position, entry: PendingEntry) -> None:
        parts = self._parts.get(position)
        part = parts.pop(consumer, None) if parts is not None else None
        if parts is not None and not parts:
            del self._parts[position]
        if part is not None:
            slots: Sequence[int] = part[1]
        elif entry.slot is None:
            return
        else:
            slots = self._slots(position, entry.slot)
        for s in slots:
            owner = self._owners.get(s)
            if owner is not None and owner[0] is consumer:
                if owner[1] <= 1:
                    del self._owners[s]
                else:
                    self._owners[s] = (consumer, owner[1] - 1)

    def _can_send(self, consumer: Consumer | None, slots: Sequence[int]) -> bool:
        if consumer is None or not self.available(consumer):
            return False
        meta = consumer.key_shared_meta
        if meta is not None and meta.allowOutOfOrderDelivery:
            return True
        for slot in slots:
            owner = self._owners.get(slot)
            if owner is not None and owner[0] is not consumer:
                return False
        return True

    def _ready(self, position: Position, slot: int, blocked: set[int]) -> bool:
        """Whether the entry could go now, at least in part (before reading it): one of a
        mixed batch's waiting slots to its consumer, else the entry's slot."""
        if position not in self._mixed:
            return slot not in blocked and self._can_send(self._select(slot), (slot,))
        return any(
            s not in blocked and self._can_send(self._select(s), (s,))
            for s in self._held(position, slot)
        )

    def _own(self, consumer: Consumer, slots: Sequence[int]) -> None:
        for s in slots:
            owner = self._owners.get(s)
            count = owner[1] if owner is not None and owner[0] is consumer else 0
            self._owners[s] = (consumer, count + 1)

    def _send_keyed(self, consumer: Consumer, entry: Entry, slot: int) -> None:
        self.send(consumer, entry, entry_info(entry.data), slot)
        self._own(consumer, (slot,))

    # --- mixed-key batches: one part per consumer -----------------------------------------

    def _plan(
        self, position: Position, index_slots: Sequence[int], blocked: Container[int]
    ) -> tuple[dict[Consumer, tuple[int, tuple[int, ...]]], set[int]]:
        """Split a mixed batch's messages not yet acknowledged and not out with a consumer
        by the consumer of their slot: (consumer -> (index mask, slots) of the parts that
        can go now, the slots of the rest). A part waits when one of its slots is
        ``blocked`` (an earlier waiting entry holds it) or held by another consumer, its
        consumer has no room, or still holds an earlier part of this entry."""
        acked_bits = self.sub.cursor.batch_ack_state(position)
        done = int.from_bytes(acked_bits, "little") if acked_bits else 0
        parts = self._parts.get(position, {})
        for mask, _ in parts.values():
            done |= mask
        chosen: dict[int, Consumer | None] = {}
        masks: dict[Consumer, int] = {}
        slots: dict[Consumer, set[int]] = {}
        rest: set[int] = set()
        for index, slot in enumerate(index_slots):
            if done >> index & 1:
                continue
            if slot in chosen:
                consumer = chosen[slot]
            else:
                consumer = chosen[slot] = self._select(slot)
            if consumer is None or consumer in parts:
                rest.add(slot)
                continue
            masks[consumer] = masks.get(consumer, 0) | 1 << index
            slots.setdefault(consumer, set()).add(slot)
        plan: dict[Consumer, tuple[int, tuple[int, ...]]] = {}
        for consumer, mask in masks.items():
            mine = slots[consumer]
            if any(s in blocked for s in mine) or not self._can_send(consumer, tuple(mine)):
                rest.update(mine)
            else:
                plan[consumer] = (mask, tuple(sorted(mine)))
        return plan, rest

    def _send_parts(
        self, entry: Entry, info: EntryInfo, plan: dict[Consumer, tuple[int, tuple[int, ...]]]
    ) -> None:
        """Send each consumer its part: the stored bytes, with an ack set that leaves only
        its indexes unacknowledged (the client skips the others)."""
        size = info.batch_size
        full = (1 << size) - 1
        position = entry.position
        for consumer, (mask, slots) in plan.items():
            ack_set: list[int] = []
            unacked = size
            if mask != full:  # else all of it to one consumer: the plain frame, no ack set
                acked = (full & ~mask).to_bytes((size + 7) // 8, "little")
                ack_set, unacked = acked_to_wire(acked, size)
            consumer.send_entry(
                position,
                entry.data,
                batch_size=size,
                redelivery_count=self.redelivery_counts.get(position, 0),
                ack_set=ack_set,
                unacked_in_batch=unacked if ack_set else None,
                slot=slots[0],
                permits_cost=size,
            )
            self.sub.count_out(unacked, len(entry.data))
            self._parts.setdefault(position, {})[consumer] = (mask, slots)
            self._own(consumer, slots)

    def _send_mixed(self, entry: Entry, info: EntryInfo, blocked: Container[int]) -> set[int]:
        """Send the parts of a mixed batch that can go now; returns the slots of the rest
        (empty: nothing of it waits any more)."""
        plan, rest = self._plan(entry.position, info.key_slots, blocked)
        self._send_parts(entry, info, plan)
        return rest

    def acked(self, consumer: Consumer, positions: Iterable[Position]) -> None:
        positions = list(positions)
        super().acked(consumer, positions)
        for pos in positions:
            self._settle(pos)

    def settled(self, positions: Iterable[Position], upto: Position | None) -> None:
        positions = list(positions)
        super().settled(positions, upto)
        for pos in positions:
            self._settle(pos)

    # --- dispatch -------------------------------------------------------------------------

    def _select(self, slot: int) -> Consumer | None:
        return self.selector.select(slot) if self.selector is not None else None

    async def _dispatch_replay(self) -> bool:
        if not self.replay or self._blocked_on_unacked():
            return False
        if not any(self.available(c) for c in self.consumers):
            return False
        budget = self._read_budget_replay()
        if budget <= 0:
            return False
        generation = self.generation
        blocked: set[int] = set()
        chosen: list[Position] = []
        for pos in sorted(self.replay):
            slot = self.replay[pos]
            assert slot is not None
            slots = self._held(pos, slot)
            if not self._ready(pos, slot, blocked):
                blocked.update(slots)  # later entries of the slots must wait behind this one
                continue
            chosen.append(pos)
            if len(chosen) >= budget:
                break
        if not chosen:
            return False
        entries = await self._read_replay(chosen)
        if generation != self.generation:
            return True
        fresh, aborted = self._filter(entries)
        live = {e.position for e in fresh}
        for pos in chosen:
            if pos not in live:
                self._take_replay(pos)
                self._settle(pos)
        if aborted:
            await self.sub.cursor.acknowledge(aborted)
        sent = False
        for entry in fresh:
            pos = entry.position
            slot = self.replay.get(pos)
            if slot is None:
                continue
            slots = self._held(pos, slot)
            if pos in self._mixed:
                info = entry_info(entry.data)
                if len(info.key_slots) != info.batch_size:  # cannot happen: it was mixed
                    blocked.update(slots)
                    continue
                out = len(self._parts.get(pos, ()))
                rest = self._send_mixed(entry, info, blocked)
                sent = sent or len(self._parts.get(pos, ())) > out
                self._take_replay(pos)
                if rest:
                    self._add_replay(pos, min(rest), rest)
                    blocked.update(rest)
                else:
                    self._settle(pos)
                continue
            if any(s in blocked for s in slots):
                blocked.update(slots)  # its other slots' later entries wait behind it too
                continue
            consumer = self._select(slot)
            if consumer is None or not self._can_send(consumer, slots):
                blocked.update(slots)
                continue
            self._take_replay(pos)
            self._send_keyed(consumer, entry, slot)
            sent = True
        return sent

    def _before_pass(self) -> None:
        now = self.sub.clock.wall_ms()
        while self._delayed and self._delayed[0][0] <= now:
            _, pos = heapq.heappop(self._delayed)
            slot = self._delayed_slots.pop(pos, None)
            if slot is not None:
                self._add_replay(pos, slot)

    def _dispatch_new(self, entries: Sequence[Entry]) -> None:
        now = self.sub.clock.wall_ms()
        for entry in entries:
            pos = entry.position
            info = entry_info(entry.data)
            mixed = len(info.key_slots) == info.batch_size > 1
            if mixed:
                self._mixed[pos] = tuple(sorted(set(info.key_slots)))
                slot = self._mixed[pos][0]
            else:
                slot = hash_slot(info.sticky_key)
            if info.deliver_at_ms is not None and info.deliver_at_ms > now:
                # Held until due, then replayed under the per-key rule; a key's later
                # undelayed messages do not wait for it (upstream's Key_Shared too).
                heapq.heappush(self._delayed, (info.deliver_at_ms, pos))
                self._delayed_slots[pos] = slot
                continue
            slots = self._slots(pos, slot)
            if mixed:
                rest = self._send_mixed(entry, info, self._replay_slots)
                if rest:
                    self._add_replay(pos, min(rest), rest)
                self._settle(pos)
                continue
            if any(s in self._replay_slots for s in slots):
                self._add_replay(pos, slot)
                continue
            consumer = self._select(slot)
            if not self._can_send(consumer, slots):
                self._add_replay(pos, slot)
                continue
            assert consumer is not None
            self._send_keyed(consumer, entry, slot)

    def reset(self) -> None:
        self._owners.clear()
        self._replay_slots.clear()
        self._mixed.clear()
        self._parts.clear()
        self._replay_held.clear()
        self._delayed_slots.clear()
        super().reset()

    def stats(self) -> dict[str, Any]:
        out = super().stats()
        if isinstance(self.selector, AutoSplitSelector):
            out["consumerHashRanges"] = {c.name: list(r) for c, r in self.selector.ranges().items()}
        return out
