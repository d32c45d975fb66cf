"""Topic compaction: the compactor, the compacted ledger and compacted reads.

Theory of operation
-------------------
* **The compacted view** of a topic is (horizon, compacted ledger): every message up to
  the *horizon* that survives compaction (:mod:`anabranch.core.compaction`: the latest
  message per key, tombstones delete, keyless ones dropped unless retained), stored in
  its own managed ledger ``<topic ledger>/__compacted-<generation>``. Each compacted entry
  is ``[original ledger id][original entry id][removed-bits length][removed bits][the
  original entry]``: readers see the original message ids, and a batch keeps its
  position and indexes, the compacted-away indexes being marked acknowledged (the bits).
* **The record** ``/compaction/<quoted ledger name>`` (JSON: horizon, ledger name,
  generation) is the switch: the new compacted ledger is written and durable (appends
  return once fsynced) before the record is compare-and-set to point at it; only then is
  the previous compacted ledger deleted. A crash before the switch leaves the previous
  view in force (a half-written ledger of the next generation is deleted by the next run).
* **The ``__compaction`` cursor** of the topic sits just before the horizon entry, so
  retention never trims what the next compaction still has to read, and keeps the ledger
  holding the horizon: the topic's last confirmed position (which a restart recomputes from
  the stored ledgers) then never falls behind the view, and acknowledgements of its ids stay
  valid once everything before it was trimmed. A run reads the previous compacted
  view and then the live topic after the previous horizon up to the new one, twice (phase
  one keeps key -> position only, phase two copies the survivors), in bounded reads.
* **Reads.** A consumer or reader with ``read_compacted`` (Exclusive/Failover only) at a
  position at or before the horizon reads the compacted ledger from there, then the live
  topic from just after the horizon: positions only grow, so there is neither gap nor
  duplicate, and a new compaction between two reads changes nothing about that.
* **Automatic compaction.** :class:`Compactions` checks each loaded topic every
  ``compaction_check_interval_s``: when the bytes after the ``__compaction`` cursor (the
  whole topic before the first run) pass the topic's, else its namespace's, else the
  broker's threshold, a compaction starts.

Example:
    >>> import tempfile
    >>> from pathlib import Path
    >>> from anabranch.protocol.frames import encode_entry
    >>> from anabranch.testing.broker import InProcessBroker
    >>> async def demo(compactions: Compactions, topic: PersistentTopic) -> None:
    ...     for seq, key in enumerate(["a", "b", "a"]):
    ...         md = pb.MessageMetadata(producer_name="p", sequence_id=seq, publish_time=0,
    ...                                 partition_key=key)
    ...         await topic.publish("p", seq, None, encode_entry(md, b"v"), 1)
    ...     run = compactions.of(topic)
    ...     await run.trigger()                  # CompactionInProgress if one runs
    ...     await run.wait()
    ...     print(run.status, run.last_removed)  # the first "a" is gone from the view
    >>> async def main() -> None:
    ...     with tempfile.TemporaryDirectory() as tmp:
    ...         async with InProcessBroker(Path(tmp)) as broker:
    ...             service = broker.service
    ...             topic = await service.get_topic("persistent://public/default/t", create=True)
    ...             await demo(service.compactions, topic)
    >>> asyncio.run(main())
    SUCCESS 1
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
import signal
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal
from urllib.parse import quote

from anabranch import failpoints
from anabranch.broker.compacted_ledger import (
    READ_BATCH_ENTRIES,
    CompactedView,
    decode_compacted,
    encode_compacted,
)
from anabranch.broker.compaction_messages import ChunkGroups, entry_messages
from anabranch.broker.dispatcher_entries import entry_info
from anabranch.broker.policies import NamespacePolicies
from anabranch.broker.retention import COMPACTION_CURSOR, ledger_spans
from anabranch.core.compaction import CompactionPlan, removed_bits
from anabranch.core.names import TopicName, parse_name
from anabranch.core.retention import backlog_bytes
from anabranch.errors import (
    AnabranchError,
    BadVersion,
    Closed,
    CompactionInProgress,
    NotFound,
    StorageError,
)
from anabranch.metadata.api import MUST_NOT_EXIST, MetadataStore
from anabranch.protocol._generated import pulsar_api_pb2 as pb
from anabranch.storage.api import (
    EARLIEST,
    Entry,
    ManagedLedgerConfig,
    ManagedLedgerFactory,
    Position,
)
from anabranch.supervisor import Supervised

if TYPE_CHECKING:
    from anabranch.broker.service import BrokerService
    from anabranch.broker.topic import PersistentTopic

log = logging.getLogger(__name__)

COMPACTION_PREFIX = "/compaction/"
CURSOR_NAME = COMPACTION_CURSOR
"""The topic's compaction cursor (upstream's ``__compaction`` subscription)."""
WRITE_BATCH_ENTRIES = 128
YIELD_EVERY_MESSAGES = 2000
"""Phase one gives the event loop a turn after parsing this many messages."""

INLINE_BATCH_MESSAGES_MAX = 1000
"""A batch entry of more messages than this is folded into the plan in a worker thread
(a few milliseconds of parsing at most stay on the event loop)."""

Status = Literal["NOT_RUN", "RUNNING", "SUCCESS", "ERROR"]


def holding(horizon: Position) -> Position:
    """Where the ``__compaction`` cursor goes after a run up to ``horizon``: just before the
    horizon entry (see the module docstring).

    >>> holding(Position(7, 4)), holding(Position(7, -1))
    (Position(ledger_id=7, entry_id=3), Position(ledger_id=7, entry_id=-1))
    """
    return Position(horizon[0], horizon[1] - 1) if horizon[1] >= 0 else horizon


def _fold(plan: CompactionPlan, entry: Entry, removed: bytes) -> int:
    """Fold one entry's messages into ``plan`` (in a worker thread: nothing else touches
    the plan meanwhile); returns how many."""
    messages = entry_messages(entry, removed)
    plan.add_all(messages)
    return len(messages)


@dataclass(slots=True)
class CompactionCounters:
    """Broker-wide compaction counters for /metrics."""

    runs: int = 0
    failures: int = 0
    removed_messages: int = 0
    duration_s: float = 0.0
    """Total seconds spent compacting (successful runs)."""


class TopicCompaction:
    """One topic's compacted view, status and runs (see the module docstring)."""

    def __init__(
        self,
        topic: PersistentTopic,
        factory: ManagedLedgerFactory,
        config: ManagedLedgerConfig,
        *,
        retain_null_key: bool = False,
        counters: CompactionCounters | None = None,
    ) -> None:
        self.topic = topic
        self._factory = factory
        # No cursors on a compacted ledger: unbounded retention keeps trim() away.
        self._config = ManagedLedgerConfig(fsync=config.fsync, retention_ms=-1, retention_bytes=-1)
        self.retain_null_key = retain_null_key
        self.counters = counters or CompactionCounters()
        self.status: Status = "NOT_RUN"
        self.last_error = ""
        self.last_removed = 0
        self.last_success_ms = 0
        self.last_failed_ms = 0
        self.last_duration_ms = 0
        self._store: MetadataStore = topic.store
        self._path = COMPACTION_PREFIX + quote(topic.ledger.name, safe="")
        self._version: int = MUST_NOT_EXIST
        self._view: CompactedView | None = None
        self._loaded = False
        self._load_lock = asyncio.Lock()
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self._swept = False
        """Whether a leftover ledger of the generation before the view was deleted."""

    # --- the view -------------------------------------------------------------------------

    async def view(self) -> CompactedView | None:
        """The compacted view in force (loaded from the record on first use)."""
        if self._loaded:
            return self._view
        async with self._load_lock:
            if not self._loaded:
                self._view = await self._load()
                self._loaded = True
        return self._view

    async def _load(self) -> CompactedView | None:
        record = await self._store.get(self._path)
        if record is None:
            return None
        self._version = record.stat.version
        data = json.loads(record.value)
        ledger = await self._factory.open(str(data["ledger"]), self._config)
        view = CompactedView(
            Position(*data["horizon"]), ledger.name, int(data["generation"]), ledger
        )
        at = EARLIEST
        while True:  # the sparse index: one pass over the headers
            entries = await ledger.read(at, READ_BATCH_ENTRIES)
            if not entries:
                break
            for entry in entries:
                original, removed, _ = decode_compacted(entry.data)
                view.note(original, entry.position, removed)
            at = entries[-1].position.next()
        if self.status == "NOT_RUN":
            self.status = "SUCCESS"  # a compaction ran before this broker loaded the topic
        return view

    async def horizon(self) -> Position | None:
        view = await self.view()
        return view.horizon if view is not None else None

    async def read(self, start: Position, max_entries: int) -> list[tuple[Entry, bytes]] | None:
        """Up to ``max_entries`` of the compacted view from original position ``start``
        with their removed-index bits, continuing into the live topic after the horizon;
        None when ``start`` is past the horizon (or there is no view): read the topic."""
        for _ in range(2):
            view = await self.view()
            if view is None or start > view.horizon:
                return None
            try:
                got = await view.read_from(start, max_entries)
            except (Closed, StorageError):
                if self._view is view:
                    raise
                continue  # a compaction replaced (and deleted) that ledger meanwhile
            if got:
                return got
            live = await self.topic.ledger.read(view.horizon.next(), max_entries)
            return [(entry, b"") for entry in live]
        return None

    async def last_in_view(self) -> tuple[Position, int] | None:
        """The last message of the compacted view: (position, batch index or -1)."""
        view = await self.view()
        if view is None or view.last is None:
            return None
        entries = await view.read_from(view.last, 1)
        if not entries:
            return None
        entry, removed = entries[0]
        size = entry_info(entry.data).batch_size
        if size <= 1:
            return entry.position, -1
        gone = int.from_bytes(removed, "little")
        index = max((i for i in range(size) if not gone >> i & 1), default=size - 1)
        return entry.position, index

    # --- runs -----------------------------------------------------------------------------

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    async def trigger(self) -> None:
        """Start a compaction in the background; CompactionInProgress if one runs."""
        if self.running:
            raise CompactionInProgress(self.topic.name)
        if self._closed:
            raise Closed(f"{self.topic.name} is closing")
        self.status = "RUNNING"
        self.last_error = ""
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def wait(self) -> None:
        """Until the running compaction (if any) ends."""
        task = self._task
        if task is not None:
            await asyncio.wait([task])

    async def _run(self) -> None:
        started = asyncio.get_running_loop().time()
        try:
            removed = await self.compact()
        except asyncio.CancelledError:
            self.status = "ERROR"
            self.last_error = "the compaction was cancelled (topic unloaded)"
            raise
        except Exception as err:
            self.status = "ERROR"
            self.counters.failures += 1
            self.last_failed_ms = self.topic.clock.wall_ms()
            # Clients see the kind of failure, never a path or a trace.
            self.last_error = str(err) if isinstance(err, AnabranchError) else type(err).__name__
            log.exception("%s: compaction failed", self.topic.name)
            return
        elapsed = asyncio.get_running_loop().time() - started
        self.status = "SUCCESS"
        self.counters.runs += 1
        self.counters.removed_messages += removed
        self.counters.duration_s += elapsed
        self.last_removed = removed
        self.last_success_ms = self.topic.clock.wall_ms()
        self.last_duration_ms = round(elapsed * 1000)

    def stats(self) -> dict[str, int]:
        """Upstream's ``CompactionStats`` of the topic stats (0: never)."""
        return {
            "lastCompactionRemovedEventCount": self.last_removed,
            "lastCompactionSucceedTimestamp": self.last_success_ms,
            "lastCompactionFailedTimestamp": self.last_failed_ms,
            "lastCompactionDurationTimeInMills": self.last_duration_ms,
        }

    async def _scan(
        self, old: CompactedView | None, horizon: Position
    ) -> AsyncIterator[tuple[Entry, bytes]]:
        """The previous compacted view, then the live topic after its horizon up to
        ``horizon``; entries of aborted transactions are left out."""
        if old is not None:
            async for item in old.scan():
                yield item
        ledger = self.topic.ledger
        buffer = self.topic.transaction_buffer
        at = old.horizon.next() if old is not None else EARLIEST
        while True:
            entries = await ledger.read(at, READ_BATCH_ENTRIES)
            for entry in entries:
                if entry.position > horizon:
                    return
                if not buffer.is_aborted(entry.position):
                    yield entry, b""
            if not entries:
                return
            at = entries[-1].position.next()

    async def compact(self) -> int:
        """Run one compaction now (the caller guards against concurrent runs); returns
        how many messages were removed from the view."""
        topic = self.topic
        old = await self.view()
        sub = await topic.get_or_create_subscription(
            CURSOR_NAME, pb.CommandSubscribe.Exclusive, EARLIEST
        )
        horizon = min(topic.ledger.last_confirmed, topic.transaction_buffer.max_read_position())
        if horizon[1] < 0 or (old is not None and horizon <= old.horizon):
            return 0  # nothing new since the last run
        while True:
            plan, chunks = await self._phase_one(old, horizon)
            held = chunks.unfinished_before(horizon, topic.ledger)
            if held is None:
                break
            # A chunked message still being written at the horizon: compact up to just
            # before its first chunk, so that its chunks stay together in the tail.
            horizon = held
            if old is not None and horizon <= old.horizon:
                return 0
        keep = chunks.with_earlier_chunks(plan.survivor_map())
        generation = (old.generation if old is not None else 0) + 1
        name = f"{topic.ledger.name}/__compacted-{generation}"
        stale = await self._factory.open(name, self._config)  # left by a crashed run?
        await stale.delete()
        if old is not None and old.generation > 1 and not self._swept:
            # A crash between a switch and the deletion it is followed by leaves the
            # generation before the view in force behind: delete it once per load.
            previous = f"{topic.ledger.name}/__compacted-{old.generation - 1}"
            await (await self._factory.open(previous, self._config)).delete()
            self._swept = True
        ledger = await self._factory.open(name, self._config)
        view = CompactedView(horizon, name, generation, ledger)
        try:
            kept = await self._write(view, old, horizon, keep)
            if failpoints.enabled(failpoints.COMPACTION_CRASH_BEFORE_SWITCH):
                os.kill(os.getpid(), signal.SIGKILL)
            record = {"horizon": list(horizon), "ledger": name, "generation": generation}
            stat = await self._store.put(
                self._path, json.dumps(record).encode(), expected_version=self._version
            )
            self._version = stat.version
        except BaseException:
            try:
                await ledger.delete()
            except Exception:
                log.exception("%s: deleting an unfinished compacted ledger failed", topic.name)
            raise
        self._view = view
        await sub.cursor.acknowledge_cumulative(holding(horizon))
        await sub.cursor.flush()
        if old is not None:
            try:
                await old.ledger.delete()
            except Exception:  # an orphan costs disk only; the record no longer names it
                log.exception("%s: deleting the previous compacted ledger failed", topic.name)
        log.info(
            "%s: compacted up to %s: %d of %d messages kept",
            topic.name, horizon, kept, plan.messages_seen,
        )  # fmt: skip
        return plan.messages_seen - kept

    async def _phase_one(
        self, old: CompactedView | None, horizon: Position
    ) -> tuple[CompactionPlan, ChunkGroups]:
        """Fold every message up to ``horizon`` into a plan; chunked messages count once,
        at their last chunk."""
        plan = CompactionPlan(retain_null_key=self.retain_null_key)
        chunks = ChunkGroups()
        parsed = 0
        async for entry, removed in self._scan(old, horizon):
            info = entry_info(entry.data)
            if info.chunk is not None:
                messages = chunks.add(entry, info.chunk)
            elif info.batch_size > INLINE_BATCH_MESSAGES_MAX:
                # One producer's batch of 100,000 tiny messages took 0.3 s to fold: done
                # on the loop, every client of the broker waited that long.
                parsed += await asyncio.to_thread(_fold, plan, entry, removed)
                continue
            else:
                messages = entry_messages(entry, removed)
            plan.add_all(messages)
            parsed += len(messages)
            if parsed >= YIELD_EVERY_MESSAGES:
                parsed = 0
                await asyncio.sleep(0)  # parsing is CPU work: let the broker's I/O run
        return plan, chunks

    async def _write(
        self,
        view: CompactedView,
        old: CompactedView | None,
        horizon: Position,
        keep: dict[tuple[int, int], frozenset[int]],
    ) -> int:
        pending: list[bytes] = []
        notes: list[tuple[Position, bytes]] = []
        kept = 0

        async def flush() -> None:
            positions = await view.ledger.append_many(pending)
            for at, (original, removed) in zip(positions, notes, strict=True):
                view.note(original, at, removed)
            pending.clear()
            notes.clear()

        async for entry, _ in self._scan(old, horizon):
            survivors = keep.get(entry.position)
            if not survivors:
                continue
            size = entry_info(entry.data).batch_size
            removed = removed_bits(survivors, size) if len(survivors) < size else b""
            pending.append(encode_compacted(entry.position, removed, entry.data))
            notes.append((entry.position, removed))
            kept += len(survivors)
            if len(pending) >= WRITE_BATCH_ENTRIES:
                await flush()
        if pending:
            await flush()
        return kept

    # --- lifecycle ------------------------------------------------------------------------

    async def close(self) -> None:
        """Stop a running compaction (the previous view stays in force) and close the
        compacted ledger."""
        self._closed = True
        task, self._task = self._task, None
        if task is not None and not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        view, self._view = self._view, None
        if view is not None:
            await view.ledger.close()

    async def delete(self) -> None:
        """Remove the compacted view with its topic (the topic is closed first)."""
        await self.close()
        record = await self._store.get(self._path)
        if record is None:
            return
        ledger = await self._factory.open(str(json.loads(record.value)["ledger"]), self._config)
        await ledger.delete()
        try:
            await self._store.delete(self._path)
        except (NotFound, BadVersion):
            pass

    def estimated_backlog_bytes(self) -> int:
        """Bytes after the compaction cursor (the whole topic before a first run)."""
        ledger = self.topic.ledger
        cursor = next((c for c in ledger.cursors() if c.name == CURSOR_NAME), None)
        after = cursor.mark_delete_position if cursor is not None else EARLIEST
        return backlog_bytes(ledger_spans(ledger), after)


class Compactions:
    """The broker's compactions: one :class:`TopicCompaction` per loaded topic, and the
    periodic threshold check."""

    def __init__(self, service: BrokerService) -> None:
        self.service = service
        self.counters = CompactionCounters()
        self._loop: Supervised | None = None
        self._topic_policies = service.topic_policies

    def of(self, topic: PersistentTopic) -> TopicCompaction:
        """``topic``'s compaction state (made on first use; it lives as long as the topic)."""
        found = topic.compaction
        if found is None:
            config = ManagedLedgerConfig(fsync=self.service.config.fsync)
            found = topic.compaction = TopicCompaction(
                topic,
                self.service.ledgers,
                config,
                retain_null_key=self.service.config.compaction_retain_null_key,
                counters=self.counters,
            )
        assert isinstance(found, TopicCompaction)
        return found

    def start(self) -> None:
        if self._loop is None:
            loop = functools.partial(self._every, self.service.config.compaction_check_interval_s)
            self._loop = Supervised(
                "compaction-check", loop, on_give_up=self.service.fatal.fail
            ).start()

    async def close(self) -> None:
        loop, self._loop = self._loop, None
        if loop is not None:
            await loop.stop()

    async def _every(self, interval_s: float) -> None:
        while True:
            await self.service.clock.sleep(interval_s)
            try:
                await self.check()
            except Exception:
                log.exception("the compaction threshold check failed")

    async def threshold(
        self,
        topic: PersistentTopic,
        cache: dict[str, tuple[NamespacePolicies | None, frozenset[str]]] | None = None,
    ) -> int:
        """The topic's compaction threshold in bytes (0: off): its override, else its
        namespace's, else the broker's. ``cache`` keeps each namespace's policies and the
        names of its topics with overrides over one check (one listing, not a read per
        topic, as the retention sweeps do)."""
        cache = {} if cache is None else cache
        name = parse_name(topic.name)
        base = name.topic if not isinstance(name, TopicName) else name
        ns = f"{base.tenant}/{base.namespace}"
        if ns not in cache:
            try:
                namespace: (
                    NamespacePolicies | None
                ) = await self.service.policies.namespace_policies(ns)
            except NotFound:
                namespace = None
            cache[ns] = (namespace, await self._topic_policies.overridden(ns))
        policies, overridden = cache[ns]
        if policies is None:
            return 0
        if isinstance(name, TopicName) and name.base.local_name in overridden:
            policies = (await self._topic_policies.get(name)).over(policies)
        if policies.compaction_threshold is not None:
            return policies.compaction_threshold
        return self.service.config.compaction_threshold_default_bytes

    async def check(self) -> list[str]:
        """Start a compaction of every loaded topic over its threshold; their names."""
        started: list[str] = []
        cache: dict[str, tuple[NamespacePolicies | None, frozenset[str]]] = {}
        for topic in self.service.loaded_topics():
            try:
                threshold = await self.threshold(topic, cache)
                if threshold <= 0:
                    continue
                run = self.of(topic)
                if run.running or run.estimated_backlog_bytes() < threshold:
                    continue
                await run.trigger()
                started.append(topic.name)
            except Exception:
                log.exception("%s: the compaction threshold check failed", topic.name)
        return started
