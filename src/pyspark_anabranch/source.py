"""The Spark data source: streaming and batch readers (the sink: :mod:`pyspark_anabranch.sink`).

Driver-side calls (``initialOffset``, ``latestOffset``, ``partitions``, ``commit``) use the
admin API for layouts and short-lived readers for segment ends; ``read`` runs on executors on a
*pickled* reader that holds only options, and gets its client from the per-process cache in
:mod:`pyspark_anabranch._io`. Planning decisions are in :mod:`pyspark_anabranch.planning`.

Example::

    df = (spark.readStream.format("anabranch")
          .option("serviceUrl", "pulsar://localhost:6650").option("topic", "orders").load())
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import time
from collections.abc import Generator, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql.datasource import (
    DataSource,
    DataSourceReader,
    DataSourceStreamReader,
    InputPartition,
)
from pyspark.sql.pandas.types import to_arrow_schema
from pyspark.sql.streaming.datasource import (
    ReadAllAvailable,
    ReadLimit,
    ReadMaxBytes,
    ReadMaxRows,
    ReadMinRows,
    SupportsTriggerAvailableNow,
)
from pyspark.sql.types import (
    BinaryType,
    IntegerType,
    LongType,
    MapType,
    StringType,
    StructField,
    StructType,
    TimestampType,
)

from anabranch.client.client import Client
from anabranch.client.consumer import Consumer
from anabranch.client.message_id import MessageId
from anabranch.core.segment_layout import SegmentLayout
from anabranch.errors import InvalidArgument
from pyspark_anabranch import _io
from pyspark_anabranch.columns import Chunk
from pyspark_anabranch.options import SinkOptions, SourceOptions
from pyspark_anabranch.planning import (
    FIRST_POSITION,
    Frontier,
    Range,
    TopicFrontier,
    allocate,
    batch_ranges,
    cut_by_bytes,
    decode_position,
    earliest_frontier,
    expand_topic,
    latest_frontier,
    should_wait,
    stream_ranges,
    timestamp_frontier,
)
from pyspark_anabranch.sink import AnabranchBatchWriter, AnabranchStreamWriter

log = logging.getLogger("pyspark_anabranch")

READ_CHUNK_ROWS = 32768
"""Messages per Arrow record batch yielded by ``read`` (about that many: whole entries). Larger
batches cost Spark less per row (~8% fewer from 8192 to 32768, measured with
``benchmarks/spark_source.py``); at 100 B a batch holds ~5 MB."""


def source_schema(include_properties: bool = False) -> StructType:
    """The fixed output schema (DESIGN.md §3.7)."""
    fields = [
        StructField("key", BinaryType(), True),
        StructField("value", BinaryType(), True),
        StructField("topic", StringType(), False),
        StructField("segmentId", LongType(), False),
        StructField("segmentEpoch", IntegerType(), False),
        StructField("position", LongType(), False),
        StructField("publishTime", TimestampType(), True),
        StructField("eventTime", TimestampType(), True),
    ]
    if include_properties:
        fields.append(StructField("properties", MapType(StringType(), StringType()), True))
    return StructType(fields)


@dataclass(frozen=True)
class SegmentRange(InputPartition):
    """One Spark partition: positions ``[start, end)`` of one segment (picklable, no client)."""

    topic: str
    segment_id: int
    hash_start: int
    hash_end: int
    epoch: int
    start: int
    end: int

    @property
    def segment(self) -> str:
        return _io.segment_topic_of(self.topic, (self.hash_start, self.hash_end), self.segment_id)


def _partition(layout: SegmentLayout, r: Range) -> SegmentRange:
    seg = layout.segments[r.segment_id]
    return SegmentRange(
        r.topic,
        r.segment_id,
        seg.hash_range.start,
        seg.hash_range.end,
        seg.created_at_epoch,
        r.start,
        r.end,
    )


# --- shared reading ---------------------------------------------------------------------------


def read_range(opts: SourceOptions, part: SegmentRange) -> Generator[pa.RecordBatch, None, None]:
    """Arrow batches of one partition's messages (runs on an executor).

    The next chunk is read and decoded on the connector's loop thread while this one is
    handed to Spark, so that decoding overlaps Spark's serialization of the previous batch.
    """
    schema = to_arrow_schema(source_schema(opts.include_properties), timezone="UTC")
    client = _io.client_for(opts.service_url, **opts.client)
    reader = _io.RangeReader(
        client,
        part.segment,
        part.start,
        part.end,
        opts.poll_timeout_s,
        fail_on_data_loss=opts.fail_on_data_loss,
        read_compacted=opts.read_compacted,
    )
    constants = _Constants(part)
    _io.run(reader.__aenter__())
    ahead: concurrent.futures.Future[Chunk | None] | None = None
    try:
        ahead = _io.submit(reader.chunk(READ_CHUNK_ROWS, properties=opts.include_properties))
        while ahead is not None:
            cols = ahead.result()
            ahead = None
            if cols is None:
                return
            if not reader.done:
                ahead = _io.submit(
                    reader.chunk(READ_CHUNK_ROWS, properties=opts.include_properties)
                )
            yield _batch(schema, constants, cols, opts.include_properties)
    finally:
        if ahead is not None:  # Spark stopped early: let the read in flight end first
            ahead.cancel()
            with contextlib.suppress(BaseException):
                ahead.result()
        _io.run(reader.__aexit__())


class _Constants:
    """A partition's constant columns (topic, segment id, epoch), built once and sliced."""

    def __init__(self, part: SegmentRange) -> None:
        self.part = part
        self.arrays: list[pa.Array] = []

    def columns(self, n: int) -> list[pa.Array]:
        if not self.arrays or len(self.arrays[0]) < n:
            size = max(n, READ_CHUNK_ROWS * 2)
            self.arrays = [
                pa.repeat(pa.scalar(f"topic://{self.part.topic}", pa.string()), size),
                pa.repeat(pa.scalar(self.part.segment_id, pa.int64()), size),
                pa.repeat(pa.scalar(self.part.epoch, pa.int32()), size),
            ]
        return [a.slice(0, n) for a in self.arrays]


def _batch(
    schema: pa.Schema, constants: _Constants, cols: Chunk, with_props: bool
) -> pa.RecordBatch:
    ts = schema.field("publishTime").type
    publish_us = cols.publish_ms * 1000
    arrays = [
        cols.keys,
        cols.values,
        *constants.columns(len(cols)),
        pa.array(cols.positions, pa.int64()),
        pa.array(publish_us, pa.int64()).view(ts),
        pc.multiply(cols.event_ms, 1000).view(ts),
    ]
    if with_props:
        arrays.append(cols.properties)
    return pa.RecordBatch.from_arrays(arrays, schema=schema)


# --- driver-side helpers ----------------------------------------------------------------------


class _Driver:
    """What the long-lived driver-side reader process keeps: a client, end probes, layouts."""

    def __init__(self, opts: SourceOptions) -> None:
        self.opts = opts
        self.client: Client = _io.client_for(opts.service_url, **opts.client)
        self.admin = _io.admin_for(opts.admin_url)
        self.probe = _io.EndProbe(self.client, read_compacted=opts.read_compacted)
        self.scanner = _io.Scanner(
            self.client, opts.poll_timeout_s, read_compacted=opts.read_compacted
        )
        self.last_layouts: dict[str, SegmentLayout] = {}
        self.acks: dict[str, Consumer] = {}
        """ackSubscription consumers, one per segment, kept open across commits."""

    async def close(self) -> None:
        await self.probe.close()
        acks, self.acks = self.acks, {}
        for consumer in acks.values():
            await consumer.close()

    def layouts(self) -> dict[str, SegmentLayout]:
        """The current layouts (also remembered for :meth:`known_layouts`)."""

        async def fetch() -> dict[str, SegmentLayout]:
            return {t: await _io.fetch_layout(self.admin, t) for t in self.opts.topics}

        self.last_layouts = _io.run(fetch())
        return self.last_layouts

    def known_layouts(self, ranges: Sequence[Range]) -> dict[str, SegmentLayout]:
        """The last layouts fetched if they know every segment of ``ranges`` (a segment's
        range and creation epoch never change), else fresh ones."""
        known = self.last_layouts
        if all(r.topic in known and r.segment_id in known[r.topic].segments for r in ranges):
            return known
        return self.layouts()

    def ends(self, topic: str, layout: SegmentLayout, ids: Sequence[int]) -> dict[int, int]:
        async def probe() -> dict[int, int]:
            out: dict[int, int] = {}
            for sid in ids:
                seg = layout.segments[sid]
                name = _io.segment_topic(topic, layout, sid)
                out[sid] = await self.probe.end(name, sealed=not seg.is_active)
            return out

        return _io.run(probe())

    def sealed_finals(
        self, topic: str, layout: SegmentLayout, frontier: TopicFrontier
    ) -> dict[int, int]:
        """Final ends of the sealed segments in ``frontier`` and their sealed descendants."""
        ids: set[int] = set()
        for sid in frontier.segs:
            if sid in layout.segments:
                ids.add(sid)
                ids |= layout.descendants(sid)
        sealed = sorted(i for i in ids if not layout.segments[i].is_active)
        return self.ends(topic, layout, sealed)

    def at_timestamp(self, topic: str, layout: SegmentLayout, timestamp_ms: int) -> TopicFrontier:
        """The resolved start frontier of ``startingTimestamp`` (segments reached by the walk
        are scanned lazily: a segment is only read once all its parents were complete)."""
        ends = self.ends(topic, layout, sorted(layout.segments))
        finals = {sid: end for sid, end in ends.items() if not layout.segments[sid].is_active}
        starts: dict[int, int] = {}
        while True:
            frontier = timestamp_frontier(topic, layout, starts, finals)
            todo = [sid for sid in sorted(frontier.segs) if sid not in starts]
            if not todo:
                return frontier
            for sid in todo:
                name = _io.segment_topic(topic, layout, sid)
                starts[sid] = _io.run(
                    _io.find_timestamp_start(
                        self.client, name, ends[sid], timestamp_ms, self.opts.poll_timeout_s
                    )
                )

    def scan(
        self,
        layouts: Mapping[str, SegmentLayout],
        backlog: Mapping[tuple[str, int], tuple[int, int]],
        count: int,
        sizes: bool,
    ) -> dict[tuple[str, int], Scan]:
        """Positions (and value sizes) of up to ``count`` next messages of each segment range
        in ``backlog``; what was scanned ahead for other segments is dropped."""
        names = {key: _io.segment_topic(key[0], layouts[key[0]], key[1]) for key in backlog}

        async def scan_all() -> dict[tuple[str, int], Scan]:
            self.scanner.retain(set(names.values()))
            return {
                key: await self.scanner.scan(names[key], lo, hi, count, sizes)
                for key, (lo, hi) in backlog.items()
            }

        return _io.run(scan_all())


Scan = tuple[npt.NDArray[np.int64], npt.NDArray[np.int64] | None]
"""Positions of a segment's next messages, and their value sizes when a byte limit needs them."""


def _sizes(scan: Scan) -> npt.NDArray[np.int64]:
    assert scan[1] is not None, "value sizes are scanned when a byte limit is set"
    return scan[1]


def _initial(opts: SourceOptions, spec: str, layouts: Mapping[str, SegmentLayout]) -> Frontier:
    if opts.starting_timestamp is not None:
        return Frontier.symbolic_timestamp(opts.starting_timestamp)
    if spec == "earliest":
        return Frontier({t: earliest_frontier(layouts[t]) for t in opts.topics})
    if spec == "latest":
        return Frontier.symbolic_latest()
    frontier = Frontier.from_json(spec)
    missing = set(opts.topics) - set(frontier.topics)
    extra = set(frontier.topics) - set(opts.topics)
    if extra:
        raise ValueError(f"startingOffsets names topics not subscribed: {sorted(extra)}")
    topics = dict(frontier.topics)
    for t in missing:  # a topic not named in the JSON starts at earliest
        topics[t] = earliest_frontier(layouts[t])
    return Frontier(topics)


class AnabranchStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """Micro-batch reader (see the module docstring). Holds no client when pickled."""

    def __init__(self, opts: SourceOptions) -> None:
        self.opts = opts
        self._driver: _Driver | None = None
        self._target: tuple[dict[str, SegmentLayout], dict[str, dict[int, int]]] | None = None
        self._last_batch_s = time.monotonic()

    def __getstate__(self) -> dict[str, Any]:
        return {"opts": self.opts}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["opts"])  # type: ignore[misc]

    @property
    def driver(self) -> _Driver:
        if self._driver is None:
            self._driver = _Driver(self.opts)
        return self._driver

    # --- offsets ---------------------------------------------------------------------------

    def initialOffset(self) -> dict[str, Any]:
        spec = self.opts.starting_offsets
        symbolic = spec == "latest" or self.opts.starting_timestamp is not None
        layouts = {} if symbolic else self.driver.layouts()
        return _initial(self.opts, spec, layouts).to_dict()

    def getDefaultReadLimit(self) -> ReadLimit:
        if self.opts.max_records is not None:
            return ReadMaxRows(self.opts.max_records)
        if self.opts.max_bytes is not None:
            return ReadMaxBytes(self.opts.max_bytes)
        if self.opts.min_records is not None:
            return ReadMinRows(self.opts.min_records)
        return ReadAllAvailable()

    def prepareForTriggerAvailableNow(self) -> None:
        layouts = self.driver.layouts()
        ends: dict[str, dict[int, int]] = {}
        for topic, layout in layouts.items():
            ends[topic] = self.driver.ends(topic, layout, sorted(layout.segments))
        self._target = (layouts, ends)

    def latestOffset(self, start: dict[str, Any], limit: ReadLimit) -> dict[str, Any]:
        begin = Frontier.from_dict(start)
        if self._target is not None:
            layouts, target_ends = self._target
        else:
            layouts, target_ends = self.driver.layouts(), {}
        if begin.latest:  # resolve the symbolic start: batch 0 reads nothing
            topics = {}
            for topic, layout in layouts.items():
                active = [s.segment_id for s in layout.active_segments()]
                ends = target_ends.get(topic) or self.driver.ends(topic, layout, active)
                topics[topic] = latest_frontier(layout, ends)
            self._last_batch_s = time.monotonic()
            return Frontier(topics).to_dict()
        if begin.timestamp is not None:  # resolve the timestamp start: batch 0 reads nothing
            resolved = {
                topic: self.driver.at_timestamp(topic, layout, begin.timestamp)
                for topic, layout in layouts.items()
            }
            self._last_batch_s = time.monotonic()
            return Frontier(resolved).to_dict()
        end_topics: dict[str, TopicFrontier] = {}
        backlog: dict[tuple[str, int], tuple[int, int]] = {}
        for topic, tf in begin.topics.items():
            layout = layouts[topic]
            if target_ends:
                finals = {
                    sid: target_ends[topic][sid]
                    for sid in layout.segments
                    if not layout.segments[sid].is_active
                }
            else:
                finals = self.driver.sealed_finals(topic, layout, tf)
            expanded = expand_topic(
                topic, tf, layout, finals, fail_on_data_loss=self.opts.fail_on_data_loss
            )
            live = [sid for sid in expanded.segs if sid in layout.segments]
            ends = (
                {sid: target_ends[topic].get(sid, FIRST_POSITION) for sid in live}
                if target_ends
                else self.driver.ends(topic, layout, live)
            )
            segs = dict(expanded.segs)
            for sid in live:
                if ends[sid] > segs[sid]:
                    backlog[(topic, sid)] = (segs[sid], ends[sid])
            end_topics[topic] = expanded.with_segs(segs)
        caps = self._admit(layouts, backlog, limit)
        if caps is None:
            return start  # minRecordsPerTrigger: wait for more
        for (topic, sid), stop in caps.items():
            segs = dict(end_topics[topic].segs)
            segs[sid] = stop
            end_topics[topic] = end_topics[topic].with_segs(segs)
        result = Frontier(end_topics).to_dict()
        if Frontier.from_dict(result) == begin:
            return start
        self._last_batch_s = time.monotonic()
        return result

    def _admit(
        self,
        layouts: Mapping[str, SegmentLayout],
        backlog: Mapping[tuple[str, int], tuple[int, int]],
        limit: ReadLimit,
    ) -> dict[tuple[str, int], int] | None:
        """Where each segment's range stops under the read limit (None: wait for more)."""
        full = {key: hi for key, (_lo, hi) in backlog.items()}
        if isinstance(limit, ReadAllAvailable) or not backlog:
            return full
        max_rows = limit.max_rows if isinstance(limit, ReadMaxRows) else self.opts.max_records
        max_bytes = limit.max_bytes if isinstance(limit, ReadMaxBytes) else self.opts.max_bytes
        min_rows = limit.min_rows if isinstance(limit, ReadMinRows) else self.opts.min_records
        if self._target is not None:
            min_rows = None  # AvailableNow must reach its target, not wait for more rows
        if max_rows is None and max_bytes is None and min_rows is None:
            return full
        cap = max(x for x in (max_rows, min_rows, 1) if x is not None)
        if max_bytes is not None and max_rows is None:
            cap = max(cap, 10_000)
        scans = self.driver.scan(layouts, backlog, cap, max_bytes is not None)
        if min_rows is not None:
            waited_ms = int((time.monotonic() - self._last_batch_s) * 1000)
            total = sum(len(positions) for positions, _ in scans.values())
            if should_wait(total, min_rows, waited_ms, self.opts.max_trigger_delay_ms):
                return None
        counts = {key: len(positions) for key, (positions, _) in scans.items()}
        if max_rows is not None:
            counts = allocate(max_rows, counts)
        if max_bytes is not None:
            sizes = {key: _sizes(scans[key])[: counts[key]].tolist() for key in scans}
            budget = allocate(max_bytes, {key: sum(v) for key, v in sizes.items()})
            counts = {
                key: cut_by_bytes(sizes[key], budget[key] or 1) if counts[key] else 0
                for key in scans
            }
        out: dict[tuple[str, int], int] = {}
        for key, (lo, hi) in backlog.items():
            n = counts[key]
            scanned = scans[key][0]
            if max_rows is None and max_bytes is None:
                out[key] = hi
            elif n == 0:
                out[key] = lo
            elif n >= len(scanned) and len(scanned) < cap:
                out[key] = hi  # the whole backlog was scanned and fits
            else:
                out[key] = int(scanned[n - 1]) + 1
        return out

    def partitions(self, start: dict[str, Any], end: dict[str, Any]) -> Sequence[InputPartition]:
        ranges = stream_ranges(Frontier.from_dict(start), Frontier.from_dict(end))
        if not ranges:
            return []
        layouts = self.driver.known_layouts(ranges)
        return [_partition(layouts[r.topic], r) for r in ranges]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        if not isinstance(partition, SegmentRange):
            return iter(())  # Spark's stand-in partition when there are none: nothing to read
        return read_range(self.opts, partition)

    def commit(self, end: dict[str, Any]) -> None:
        if self.opts.ack_subscription is None:
            return
        try:
            frontier = Frontier.from_dict(end)
            if not frontier.symbolic:
                _io.run(self._ack(frontier))
        except Exception as err:  # best effort: the checkpoint is the truth
            log.warning("ackSubscription %s: %s", self.opts.ack_subscription, err)

    async def _ack(self, frontier: Frontier) -> None:
        """Cumulatively ack, on a durable subscription per frontier segment, everything before
        the frontier (conservatively: a message inside a batch acks up to the entry before)."""
        sub = self.opts.ack_subscription
        assert sub is not None
        driver = self.driver
        for topic, tf in frontier.topics.items():
            layout = await _io.fetch_layout(driver.admin, topic)
            for sid, pos in tf.segs.items():
                if pos == FIRST_POSITION or sid not in layout.segments:
                    continue
                ledger_id, entry_id, batch_index = decode_position(pos - 1)
                if batch_index >= 0:
                    entry_id -= 1
                name = _io.segment_topic(topic, layout, sid)
                consumer = driver.acks.get(name)
                if consumer is None:
                    made = await driver.client.subscribe(
                        name, sub, initial_position="earliest", receiver_queue_size=1
                    )
                    assert isinstance(made, Consumer)
                    consumer = driver.acks[name] = made
                if entry_id >= 0:
                    await consumer.acknowledge_cumulative(MessageId(ledger_id, entry_id))

    def stop(self) -> None:
        if self._driver is not None:
            _io.run(self._driver.close())


class AnabranchBatchReader(DataSourceReader):
    """Batch read between ``startingOffsets`` and ``endingOffsets`` over the whole DAG."""

    def __init__(self, opts: SourceOptions) -> None:
        self.opts = opts

    def partitions(self) -> Sequence[InputPartition]:
        driver = _Driver(self.opts)
        try:
            layouts = driver.layouts()
            start = _initial(self.opts, self.opts.starting_offsets, layouts)
            out: list[InputPartition] = []
            for topic in self.opts.topics:
                layout = layouts[topic]
                if start.timestamp is not None:
                    start_tf = driver.at_timestamp(topic, layout, start.timestamp)
                else:
                    start_tf = start.topics[topic]
                ends = driver.ends(topic, layout, sorted(layout.segments))
                if self.opts.ending_offsets == "latest":
                    end_tf = latest_frontier(layout, ends)
                else:
                    ending = Frontier.from_json(self.opts.ending_offsets).topics
                    if topic not in ending:
                        raise InvalidArgument(f"endingOffsets does not name topic {topic}")
                    end_tf = ending[topic]
                ranges = batch_ranges(topic, layout, start_tf, end_tf, ends)
                out.extend(_partition(layout, r) for r in ranges)
            return out
        finally:
            _io.run(driver.probe.close())

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        if not isinstance(partition, SegmentRange):
            return iter(())  # Spark's stand-in partition when there are none: nothing to read
        return read_range(self.opts, partition)


class DefaultSource(DataSource):
    """``format("anabranch")``: scalable topics as a Spark source and sink."""

    @classmethod
    def name(cls) -> str:
        return "anabranch"

    def schema(self) -> StructType:
        raw = {k.lower(): v for k, v in self.options.items()}.get("includeproperties", "false")
        return source_schema(raw.strip().lower() in ("true", "1", "yes"))

    def reader(self, schema: StructType) -> DataSourceReader:
        return AnabranchBatchReader(SourceOptions.parse(self.options, batch=True))

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        return AnabranchStreamReader(SourceOptions.parse(self.options))

    def writer(self, schema: StructType, overwrite: bool) -> AnabranchBatchWriter:
        return AnabranchBatchWriter(SinkOptions.parse(self.options))

    def streamWriter(self, schema: StructType, overwrite: bool) -> AnabranchStreamWriter:
        return AnabranchStreamWriter(SinkOptions.parse(self.options))
