"""The connector's I/O: one event-loop thread and one client per service URL per process, the
layout and segment-end probes the driver uses, and the range reader and router the executors use.

Spark calls the connector from plain threads, so every coroutine runs on a module-level loop
thread (:func:`run`). Clients are cached per process (:func:`client_for`); Spark's Python worker
reuse keeps them across micro-batches. Nothing here is ever pickled: reader and writer objects
hold only options and call these functions when they run.

Example::

    client = client_for("pulsar://127.0.0.1:6650")
    end = run(segment_end(client, "segment://public/default/t/0000-ffff-0"))
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import logging
import threading
import uuid
from collections import deque
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar
from urllib.parse import quote

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.compute as pc

from anabranch.admin.client import AdminClient, AdminHttpError
from anabranch.client.client import Client
from anabranch.client.consumer import (
    Consumer,
    ConsumerOptions,
    InitialPosition,
)
from anabranch.client.message_id import MessageId
from anabranch.client.reader import Reader
from anabranch.client.scalable_producer import ScalableProducer
from anabranch.client.transaction import Transaction
from anabranch.core.hash_range import HashRange
from anabranch.core.names import TopicName
from anabranch.core.segment_layout import SegmentLayout, segment_name
from anabranch.core.txn_id import BRANCH_PROPERTY
from anabranch.errors import AnabranchError, NotFound
from anabranch.protocol._generated import pulsar_api_pb2 as pb
from anabranch.protocol.frames import Frame
from pyspark_anabranch.columns import Chunk, ChunkBuilder, EntryDecoder
from pyspark_anabranch.planning import (
    FIRST_POSITION,
    DataLoss,
    decode_position,
    encode_position,
    entry_end,
    resume_entry,
    timestamp_start,
)

T = TypeVar("T")
log = logging.getLogger("pyspark_anabranch")

RANGE_READER_QUEUE_MESSAGES = 10_000
"""Receiver queue of an executor's range reader: deep enough that flow permits never stall a
bulk read (a 100 B message costs ~0.3 KB queued, so ~3 MB per reader)."""

SKIP_PROBE_S = 1.0
"""A range reader that waited this long for its next entry asks whether the broker passed
over the rest of its range (entries of aborted transactions or losing branches)."""

SCAN_CHUNK_MESSAGES = 4096
"""Messages per chunk while scanning (for a segment's first message at a timestamp, or for
value sizes to cut a range at a byte limit)."""

_lock = threading.Lock()
_loop: asyncio.AbstractEventLoop | None = None
_clients: dict[tuple[str, tuple[tuple[str, float], ...]], Client] = {}
_admins: dict[str, AdminClient] = {}


def _loop_thread() -> asyncio.AbstractEventLoop:
    global _loop
    with _lock:
        if _loop is None or _loop.is_closed():
            loop = asyncio.new_event_loop()
            thread = threading.Thread(
                target=loop.run_forever, name="anabranch-spark-loop", daemon=True
            )
            thread.start()
            _loop = loop
            atexit.register(_shutdown)
        return _loop


def run(coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
    """Run ``coro`` on the process's connector loop and wait for its result."""
    return submit(coro).result(timeout)


def submit(coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
    """Start ``coro`` on the process's connector loop; its result comes later."""
    return asyncio.run_coroutine_threadsafe(coro, _loop_thread())


def client_for(service_url: str, **options: float) -> Client:
    """The process's cached client for ``service_url`` (created on first use)."""
    key = (service_url, tuple(sorted(options.items())))
    with _lock:
        client = _clients.get(key)
    if client is None:

        async def make() -> Client:
            return Client(service_url, **options)  # type: ignore[arg-type]

        client = run(make())
        with _lock:
            client = _clients.setdefault(key, client)
    return client


def admin_for(admin_url: str) -> AdminClient:
    """The process's cached admin client for ``admin_url``."""
    with _lock:
        admin = _admins.get(admin_url)
    if admin is None:

        async def make() -> AdminClient:
            return AdminClient(admin_url)

        admin = run(make())
        with _lock:
            admin = _admins.setdefault(admin_url, admin)
    return admin


def _shutdown() -> None:
    loop = _loop
    if loop is None or loop.is_closed():
        return

    async def close_all() -> None:
        for client in list(_clients.values()):
            await client.close()
        for admin in list(_admins.values()):
            await admin.close()

    try:
        asyncio.run_coroutine_threadsafe(close_all(), loop).result(10)
    except Exception:
        pass
    _clients.clear()
    _admins.clear()


def position_after(mid: MessageId) -> int:
    """The next position after the whole entry of ``mid`` (0 when ``mid`` says "no message").

    Ends are entry-granular: GET_LAST_MESSAGE_ID names the last entry, and its batch index
    (-1 for a batch of one message) cannot be trusted to name the entry's last message.
    """
    if mid.entry_id < 0 or mid.ledger_id < 0:
        return FIRST_POSITION
    return entry_end(mid.ledger_id, mid.entry_id)


def skipped_positions(
    ledger_id: int, entry_id: int, ack_set: list[int], batch_size: int
) -> list[int]:
    """Positions of the batch indexes a MESSAGE's ``ack_set`` marks acknowledged (a set bit
    is a message to deliver; a missing word: all acknowledged).

    Example:
        >>> base = encode_position(3, 4, 0)
        >>> [p - base for p in skipped_positions(3, 4, [0b101], 4)]
        [1, 3]
    """
    out = []
    for i in range(batch_size):
        word = ack_set[i // 64] if i // 64 < len(ack_set) else 0
        if not (word >> (i % 64)) & 1:
            out.append(encode_position(ledger_id, entry_id, i))
    return out


# --- driver side ------------------------------------------------------------------------------


async def fetch_layout(admin: AdminClient, topic: str) -> SegmentLayout:
    """The scalable topic's layout (``topic`` is ``t/ns/x``)."""
    doc = await admin.get_scalable_topic(f"topic://{topic}")
    return SegmentLayout.from_dict(doc)


def segment_topic(topic: str, layout: SegmentLayout, segment_id: int) -> str:
    """The ``segment://`` name of one of the topic's segments."""
    return str(segment_name(TopicName.parse(f"topic://{topic}"), layout.segments[segment_id]))


def segment_topic_of(topic: str, hash_range: tuple[int, int], segment_id: int) -> str:
    """The ``segment://`` name from its parts (what a pickled partition carries)."""
    lo, hi = hash_range
    return f"segment://{topic}/{HashRange(lo, hi).to_hex()}-{segment_id}"


@dataclass
class EndProbe:
    """Driver-side: current end positions of segments; a reader per segment kept open (the
    driver process is long-lived), final ends of sealed segments remembered forever.

    Ends are read-committed: the broker caps GET_LAST_MESSAGE_ID at its transaction buffer's
    ``max_read_position`` (just before the first entry of the oldest OPEN transaction). So a
    micro-batch stops before an open transaction and never waits on it; the frontier stays
    there until the transaction ends (at the latest its timeout, when the broker's sweep
    aborts it), and the next batch continues past it."""

    client: Client
    readers: dict[str, Reader] = field(default_factory=dict)
    finals: dict[str, int] = field(default_factory=dict)
    read_compacted: bool = False
    """Probe the compacted view's end (its last surviving message when nothing follows the
    compaction horizon: the topic's last entry may have been compacted away)."""

    async def end(self, name: str, sealed: bool) -> int:
        if name in self.finals:
            return self.finals[name]
        reader = self.readers.get(name)
        if reader is None:
            reader = await self.client.create_reader(
                name, "latest", receiver_queue_size=1, read_compacted=self.read_compacted
            )
            self.readers[name] = reader
        last = await reader._consumer.get_last_message_id()
        end = position_after(last)
        if sealed:
            self.finals[name] = end
            self.readers.pop(name, None)
            await reader.close()
        return end

    async def close(self) -> None:
        readers, self.readers = self.readers, {}
        for reader in readers.values():
            await reader.close()


async def segment_end(client: Client, name: str) -> int:
    """One segment's current end (next position after its last readable message)."""
    reader = await client.create_reader(name, "latest", receiver_queue_size=1)
    try:
        return position_after(await reader._consumer.get_last_message_id())
    finally:
        await reader.close()


@dataclass
class _Scanned:
    """What is known of one segment's messages in ``[start, next)``: their positions (and
    value sizes)."""

    start: int
    next: int
    positions: npt.NDArray[np.int64]
    sizes: npt.NDArray[np.int64] | None


@dataclass
class Scanner:
    """Driver-side: the positions (and value sizes) of a segment's next messages, which the
    driver needs to cut a range at a record or byte limit.

    What one batch scanned beyond its cut is kept for the next one, so over a stream every
    message is scanned about once, not once per batch that could have taken it. A record limit
    alone needs no payload: positions come from the entries' metadata.
    """

    client: Client
    timeout_s: float
    kept: dict[str, _Scanned] = field(default_factory=dict)
    read_compacted: bool = False

    async def scan(
        self, name: str, lo: int, hi: int, count: int, sizes: bool
    ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64] | None]:
        """Up to ``count`` (at least all of a first entry's) next positions in ``[lo, hi)``,
        with their value sizes if asked for."""
        got = self.kept.get(name)
        if got is None or lo < got.start or (sizes and got.sizes is None):
            empty = np.zeros(0, np.int64)
            got = _Scanned(lo, lo, empty, empty if sizes else None)
        skip = int(np.searchsorted(got.positions, lo))
        got.positions = got.positions[skip:]
        got.sizes = None if got.sizes is None else got.sizes[skip:]
        got.start = lo
        got.next = max(got.next, lo)
        if len(got.positions) < count and got.next < hi:
            await self._read(name, got, hi, count - len(got.positions))
        self.kept[name] = got
        positions = got.positions[got.positions < hi][:count]
        return positions, None if got.sizes is None else got.sizes[: len(positions)]

    async def _read(self, name: str, got: _Scanned, hi: int, count: int) -> None:
        more_pos: list[npt.NDArray[np.int64]] = [got.positions]
        more_sizes: list[npt.NDArray[np.int64]] = [] if got.sizes is None else [got.sizes]
        async with RangeReader(
            self.client, name, got.next, hi, self.timeout_s, read_compacted=self.read_compacted
        ) as reader:
            while count > 0:
                if got.sizes is None:
                    positions = await reader.positions(count)
                    if positions is None:
                        break
                else:
                    cols = await reader.chunk(min(count, SCAN_CHUNK_MESSAGES))
                    if cols is None:
                        break
                    positions = cols.positions
                    lengths = pc.binary_length(cols.values).fill_null(0)
                    more_sizes.append(lengths.to_numpy().astype(np.int64))
                more_pos.append(positions)
                count -= len(positions)
            if reader.done:
                got.next = hi
            elif reader.decoder.last >= got.next:
                got.next = reader.decoder.last + 1
        got.positions = np.concatenate(more_pos)
        got.sizes = np.concatenate(more_sizes) if got.sizes is not None else None

    def retain(self, names: set[str]) -> None:
        """Forget what was scanned ahead in segments other than ``names``."""
        for name in set(self.kept) - names:
            del self.kept[name]


async def find_timestamp_start(
    client: Client, name: str, end: int, timestamp_ms: int, timeout_s: float
) -> int:
    """Where the segment ``name`` (current end ``end``) starts for ``startingTimestamp``
    (:func:`~pyspark_anabranch.planning.timestamp_start`): reads from its first message,
    comparing publish times, and stops at the first one at or after ``timestamp_ms``. A segment
    whose last entry is older (typically a sealed ancestor) is not scanned: it starts at its end.
    """
    if end == FIRST_POSITION:
        return end
    if await _entry_publish_ms(client, name, end - 1, timeout_s) < timestamp_ms:
        return end  # publish times grow along a segment: every message is older
    previous = FIRST_POSITION
    async with RangeReader(client, name, FIRST_POSITION, end, timeout_s) as reader:
        while True:
            cols = await reader.chunk(SCAN_CHUNK_MESSAGES)
            if cols is None:
                return end
            pairs = list(zip(cols.positions.tolist(), cols.publish_ms.tolist(), strict=True))
            found = timestamp_start(pairs, timestamp_ms, -1)
            if found != -1:
                return found if found != FIRST_POSITION else previous
            previous = pairs[-1][0] + 1


async def _entry_publish_ms(client: Client, name: str, position: int, timeout_s: float) -> int:
    """The publish time of the entry holding ``position`` (one entry read)."""
    ledger_id, entry_id, _ = decode_position(position)
    consumer = _EntryConsumer(client._pool, name, MessageId(ledger_id, entry_id), queue=1)
    await consumer._start()
    try:
        _ledger, _entry, md, _payload = await consumer.next_entry(timeout_s)
    except TimeoutError:
        raise AnabranchError(
            f"{name}: entry {ledger_id}:{entry_id} not read in {timeout_s}s"
        ) from None
    finally:
        await consumer.close()
    return int(md.publish_time)


# --- executor side ----------------------------------------------------------------------------


class _EntryConsumer(Consumer):
    """A non-durable consumer that queues whole stored entries ``(ledger, entry, metadata,
    payload)`` instead of building a ``Message`` per message: the range reader decodes batches
    straight into columns. Flow permits are returned as entries are taken.

    ``queue`` is the receiver queue in messages; a read of one entry asks for one message's
    worth, which is one entry: the broker dispatches whole entries while permits remain, and
    more would only be sent to be thrown away (and delay the close behind them).
    """

    def __init__(
        self,
        pool: Any,
        topic: str,
        start: MessageId | None,
        queue: int = RANGE_READER_QUEUE_MESSAGES,
        read_compacted: bool = False,
    ) -> None:
        options = ConsumerOptions(
            initial_position=InitialPosition.EARLIEST,
            receiver_queue_size=queue,
            read_compacted=read_compacted,
        )
        super().__init__(
            pool,
            topic,
            f"spark-{uuid.uuid4().hex[:12]}",
            options,
            durable=False,
            start_message_id=MessageId.earliest() if start is None else start,
            start_inclusive=start is not None,
        )
        self.entries: deque[tuple[int, int, pb.MessageMetadata, bytes]] = deque()
        self.arrived = asyncio.Event()
        self.removed: set[int] = set()
        """Positions of batch messages the broker marked acknowledged in an entry it sent
        (compaction removed them from a compacted view): not rows. Bounded by the entries
        queued; taken out as their rows are filtered."""

    def _on_message(self, frame: Frame) -> None:
        body = frame.command.message
        if body.HasField("consumer_epoch") and body.consumer_epoch < self._epoch:
            return
        md = frame.metadata
        if md is None or frame.checksum_ok is False:
            raise AnabranchError(f"{self.topic}: a corrupt entry at {body.message_id}")
        mid = body.message_id
        if body.ack_set and md.HasField("num_messages_in_batch"):
            self.removed.update(
                skipped_positions(int(mid.ledgerId), int(mid.entryId), list(body.ack_set),
                                  int(md.num_messages_in_batch))
            )  # fmt: skip
        self.entries.append((int(mid.ledgerId), int(mid.entryId), md, frame.payload))
        self.arrived.set()

    async def mark_delete(self) -> tuple[int, int]:
        """The subscription's mark-delete position (from GET_LAST_MESSAGE_ID's answer)."""

        def build(request_id: int) -> pb.BaseCommand:
            body = pb.CommandGetLastMessageId(consumer_id=self._id, request_id=request_id)
            return pb.BaseCommand(type=pb.BaseCommand.GET_LAST_MESSAGE_ID, getLastMessageId=body)

        frame = await self._request(build)
        md = frame.command.getLastMessageIdResponse.consumer_mark_delete_position
        return int(md.ledgerId), int(md.entryId)

    async def next_entry(self, timeout_s: float) -> tuple[int, int, pb.MessageMetadata, bytes]:
        while not self.entries:
            self.arrived.clear()
            try:
                await asyncio.wait_for(self.arrived.wait(), timeout_s)
            except TimeoutError:
                if not self.entries:
                    raise
        entry = self.entries.popleft()
        md = entry[2]
        count = int(md.num_messages_in_batch) if md.HasField("num_messages_in_batch") else 1
        self._count_consumed(count)
        return entry


class RangeReader:
    """Messages of one segment with positions in ``[start, end)``, in order, as column chunks.

    ``end - 1`` is always a stored message's position (ends come from message ids), so the
    reader stops on it without waiting, unless the broker passes over it (an entry of an
    aborted transaction, or of a branch that lost its batch commit, is never dispatched):
    after SKIP_PROBE_S without an entry the reader acks what it got and asks where the
    subscription's mark-delete is (the broker acks what it passes over), and ends the range
    once that is at or past ``end - 1``. A first entry later in the same ledger than the one
    asked for is such a pass-over too (retention trims whole ledgers), not data loss.

    A message that does not arrive within ``timeout_s`` raises; resuming inside an entry that
    no longer exists raises :class:`DataLoss`. Whatever a reconnect delivers twice is dropped
    (positions only grow).
    """

    def __init__(  # noqa: PLR0917 (mirrors a range)
        self,
        client: Client,
        name: str,
        start: int,
        end: int,
        timeout_s: float,
        fail_on_data_loss: bool = True,
        *,
        read_compacted: bool = False,
    ) -> None:
        self.client = client
        self.fail_on_data_loss = fail_on_data_loss
        self.read_compacted = read_compacted
        self.name = name
        self.start = start
        self.end = end
        self.timeout_s = timeout_s
        self.consumer: _EntryConsumer | None = None
        self.decoder = EntryDecoder(name, start, end)
        self.end_entry = decode_position(end - 1)[:2] if end > start else (0, 0)
        self._past_end = False
        """An entry at or after the one holding ``end - 1`` was read."""
        self._first = True
        self._last: tuple[int, int] | None = None

    @property
    def done(self) -> bool:
        """Nothing more of the range can come."""
        return self._past_end or self.decoder.done

    async def __aenter__(self) -> RangeReader:
        if not self.done:
            entry = resume_entry(self.start)
            begin = None if entry is None else MessageId(*entry)
            one_entry = entry is not None and entry == self.end_entry
            queue = 1 if one_entry else RANGE_READER_QUEUE_MESSAGES
            self.consumer = _EntryConsumer(
                self.client._pool, self.name, begin, queue, read_compacted=self.read_compacted
            )
            await self.consumer._start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.consumer is not None:
            await self.consumer.close()
            self.consumer = None

    async def chunk(self, max_rows: int, *, properties: bool = False) -> Chunk | None:
        """At least one and about ``max_rows`` next messages (whole entries), or None at the end."""
        builder = ChunkBuilder(self.decoder, properties)
        while True:
            while not self.done and builder.rows < max_rows:
                got = await self._next_entry()
                if got is None:
                    break
                builder.add(*got)
            chunk = self._without_removed(builder.finish())
            if chunk is not None or self.done:
                return chunk

    async def positions(self, max_rows: int) -> npt.NDArray[np.int64] | None:
        """Like :meth:`chunk`, positions only, from the entries' metadata (nothing decoded)."""
        parts: list[npt.NDArray[np.int64]] = []
        rows = 0
        while not self.done and (rows < max_rows or rows == 0):
            entry = await self._next_entry()
            if entry is None:
                break
            ledger_id, entry_id, md, _payload = entry
            got = self.decoder.positions(encode_position(ledger_id, entry_id, -1), md)
            parts.append(got)
            rows += len(got)
        if not rows:
            return None
        positions = np.concatenate(parts)
        removed = self._take_removed(positions)
        return positions[~np.isin(positions, removed)] if len(removed) else positions

    def _take_removed(self, positions: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        """The removed positions among ``positions`` (forgotten once taken)."""
        assert self.consumer is not None
        if not self.consumer.removed:
            return np.zeros(0, np.int64)
        removed = np.fromiter(self.consumer.removed, np.int64)
        hit = removed[np.isin(removed, positions)]
        self.consumer.removed.difference_update(hit.tolist())
        return hit

    def _without_removed(self, chunk: Chunk | None) -> Chunk | None:
        """``chunk`` without the rows compaction removed (batch indexes the broker sent as
        acknowledged); None when nothing is left."""
        if chunk is None or self.consumer is None:
            return chunk
        removed = self._take_removed(chunk.positions)
        if not len(removed):
            return chunk
        keep = ~np.isin(chunk.positions, removed)
        mask = pa.array(keep)
        props = chunk.properties
        filtered = Chunk(
            chunk.keys.filter(mask),
            chunk.values.filter(mask),
            chunk.positions[keep],
            chunk.publish_ms[keep],
            chunk.event_ms.filter(mask),
            None if props is None else props.filter(mask),
        )
        return filtered if len(filtered) else None

    async def _next_entry(self) -> tuple[int, int, pb.MessageMetadata, bytes] | None:
        """The next entry, or None when the broker skipped the rest of the range (entries of
        aborted transactions, or of branches that lost a batch commit, are never
        dispatched; the range's last entry can be one of them)."""
        assert self.consumer is not None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        while True:
            wait = min(SKIP_PROBE_S, max(0.0, deadline - loop.time()))
            try:
                ledger_id, entry_id, md, payload = await self.consumer.next_entry(wait)
                break
            except TimeoutError:
                if await self._skipped_to_end():
                    self._past_end = True
                    return None
                if loop.time() >= deadline:
                    raise AnabranchError(
                        f"{self.name}: no message within {self.timeout_s}s while reading "
                        f"[{self.start}, {self.end})"
                    ) from None
        if self._first:
            self._first = False
            entry = resume_entry(self.start)
            # Retention trims whole ledgers: a later entry of the same ledger means the broker
            # passed over entries (aborted ones), not that positions are gone.
            # A compacted view skips whatever compaction removed: never a loss.
            moved = entry is not None and (ledger_id, entry_id) != entry
            if moved and entry is not None and ledger_id != entry[0] and not self.read_compacted:
                problem = (
                    f"{self.name}: position {self.start} is gone (first available entry "
                    f"is {ledger_id}:{entry_id})"
                )
                if self.fail_on_data_loss:
                    raise DataLoss(problem)
                log.warning("%s; skipping to it (failOnDataLoss=false)", problem)
        self._last = (ledger_id, entry_id)
        if (ledger_id, entry_id) >= self.end_entry:
            self._past_end = True  # the range ends after (or inside) this entry
        return ledger_id, entry_id, md, payload

    async def _skipped_to_end(self) -> bool:
        """Whether every entry up to the range's last one was received or passed over: ack
        what was received, then ask where the subscription's mark-delete is."""
        assert self.consumer is not None
        if self.consumer.entries:
            return False
        if self._last is not None:
            await self.consumer.acknowledge_cumulative(MessageId(*self._last))
        return await self.consumer.mark_delete() >= self.end_entry


# --- the sink ---------------------------------------------------------------------------------

Row = tuple[str, bytes, str | None, dict[str, str] | None, int | None]
"""A row to produce: (topic ``t/ns/x``, value, key, properties, event time ms)."""


SINK_LOOKUP_ATTEMPTS = 5
"""How often the sink looks a topic up before its NotFound counts."""


class TopicSink:
    """Produces rows with one scalable producer per topic (key routing, transparent re-route
    at splits and merges) and collects their futures until :meth:`finish`."""

    def __init__(
        self, client: Client, txn: Transaction | None = None, branch: str | None = None
    ) -> None:
        self.client = client
        self.txn = txn
        self.branch = branch
        """Every message carries ``{BRANCH_PROPERTY: branch}`` (the batch transaction's
        branch of this task attempt)."""
        self.producers: dict[str, ScalableProducer] = {}
        self.futures: list[asyncio.Future[MessageId]] = []
        self.stored = 0

    async def send(self, rows: list[Row]) -> None:
        per_topic: dict[str, list[tuple[bytes, str | None, dict[str, str] | None, int | None]]]
        per_topic = {}
        branch = self.branch
        tag = None if branch is None else {BRANCH_PROPERTY: branch}
        for topic, value, key, properties, event_time in rows:
            props = properties
            if tag is not None:
                props = tag if not properties else {**properties, **tag}
            per_topic.setdefault(topic, []).append((value, key, props, event_time))
        for topic, messages in per_topic.items():
            producer = self.producers.get(topic)
            if producer is None:
                producer = self.producers[topic] = await self._open(topic)
            self.futures += await producer.send_many(messages, txn=self.txn)
        self._reap()

    async def _open(self, topic: str) -> ScalableProducer:
        # A DAG lookup right after the topic was created can answer "deleted" (seen in tests):
        # retry a few times before giving up.
        for attempt in range(SINK_LOOKUP_ATTEMPTS):
            try:
                made = await self.client.create_producer(f"topic://{topic}")
            except NotFound:
                if attempt == SINK_LOOKUP_ATTEMPTS - 1:
                    raise
                await asyncio.sleep(0.2 * (attempt + 1))
                continue
            assert isinstance(made, ScalableProducer)
            return made
        raise AssertionError("unreachable")

    def _reap(self) -> None:
        """Drop answered futures (raising the first failure) so the list stays bounded."""
        pending: list[asyncio.Future[MessageId]] = []
        for fut in self.futures:
            if fut.done():
                fut.result()
                self.stored += 1
            else:
                pending.append(fut)
        self.futures = pending

    async def finish(self) -> int:
        """Wait until every row is stored; returns how many were. Raises the first failure."""
        for producer in self.producers.values():
            await producer.flush()
        await asyncio.gather(*self.futures)
        self._reap()
        return self.stored

    async def close(self) -> None:
        producers, self.producers = self.producers, {}
        for producer in producers.values():
            await producer.close()


# --- batch transactions (the exactly-once sink) ------------------------------------------------


@dataclass(frozen=True)
class BatchState:
    """A batch transaction as the admin API answers it."""

    txn_id: tuple[int, int]
    epoch: int
    state: str
    query_id: str
    winners: tuple[str, ...]

    @staticmethod
    def of(doc: Any) -> BatchState:
        txn = doc["txnId"]
        return BatchState(
            (int(txn["mostSigBits"]), int(txn["leastSigBits"])),
            int(doc["epoch"]),
            str(doc["state"]),
            str(doc.get("queryId", "")),
            tuple(doc.get("winners") or ()),
        )


def _batch_path(sink_key: str, batch_id: int) -> str:
    return f"/admin/v2/transactions/batches/{quote(sink_key, safe='')}/{int(batch_id)}"


async def begin_batch(
    admin: AdminClient, sink_key: str, batch_id: int, query_id: str, timeout_ms: int
) -> BatchState:
    """Get or create the batch's transaction (a new epoch after an abort or a timeout); a batch
    COMMITTED by another query raises (HTTP 409)."""
    path = _batch_path(sink_key, batch_id)
    query = f"?queryId={quote(query_id, safe='')}&timeoutMs={int(timeout_ms)}"
    return BatchState.of(await admin.request("PUT", path + query))


async def commit_batch(  # noqa: PLR0917 (the batch's identity)
    admin: AdminClient,
    sink_key: str,
    batch_id: int,
    query_id: str,
    epoch: int,
    winners: list[str],
) -> BatchState | None:
    """The one CAS that commits the batch's ``winners``; idempotent for the same query."""
    body = {"queryId": query_id, "epoch": epoch, "winners": winners}
    doc = await admin.request("POST", _batch_path(sink_key, batch_id) + "/commit", body)
    return None if not isinstance(doc, dict) or "txnId" not in doc else BatchState.of(doc)


async def abort_batch(admin: AdminClient, sink_key: str, batch_id: int, epoch: int) -> None:
    """Abort the batch's transaction unless it is COMMITTED (never undoes a commit)."""
    await admin.request("POST", _batch_path(sink_key, batch_id) + "/abort", {"epoch": epoch})


async def get_batch(admin: AdminClient, sink_key: str, batch_id: int) -> BatchState | None:
    """The batch's transaction, or None if it never began."""
    try:
        return BatchState.of(await admin.request("GET", _batch_path(sink_key, batch_id)))
    except NotFound:
        return None
    except AdminHttpError as err:
        if err.status == 404:
            return None
        raise
