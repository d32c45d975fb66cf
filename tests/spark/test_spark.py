"""The connector on a real local Spark (one session for the module) against a broker process."""

from __future__ import annotations

import dataclasses
import importlib.util
import pickle
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from pyspark import cloudpickle
from pyspark.sql.streaming.datasource import ReadAllAvailable, ReadMaxBytes, ReadMinRows

from anabranch.core.hash_range import segment_hash
from anabranch.core.segment_layout import SegmentLayout
from pyspark_anabranch import _io
from pyspark_anabranch.options import SinkOptions, SourceOptions
from pyspark_anabranch.planning import DataLoss, Frontier, encode_position
from pyspark_anabranch.sink import AnabranchStreamWriter
from pyspark_anabranch.source import (
    READ_CHUNK_ROWS,
    AnabranchStreamReader,
    SegmentRange,
    read_range,
)
from tests.spark.conftest import Broker, keyed

Batches = list[tuple[int, list[dict[str, Any]]]]


def collect(
    spark: Any,
    opts: dict[str, str],
    checkpoint: Path,
    *,
    available_now: bool = True,
    batches: Batches | None = None,
) -> tuple[Any, Batches]:
    """Run a streaming read into foreachBatch, collecting (batchId, rows)."""
    out: Batches = [] if batches is None else batches

    def sink(df: Any, batch_id: int) -> None:
        out.append((batch_id, [r.asDict() for r in df.collect()]))

    writer = (
        spark.readStream.format("anabranch").options(**opts).load()
        .writeStream.foreachBatch(sink).option("checkpointLocation", str(checkpoint))
    )  # fmt: skip
    if available_now:
        query = writer.trigger(availableNow=True).start()
        query.awaitTermination()
    else:
        query = writer.trigger(processingTime="200 milliseconds").start()
    return query, out


def rows_of(batches: Batches) -> list[dict[str, Any]]:
    return [row for _b, rows in batches for row in rows]


def wait_for(predicate: Callable[[], bool], what: str, deadline_s: float = 90.0) -> None:
    end = time.monotonic() + deadline_s
    while not predicate():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


def check_key_order(batches: Batches) -> None:
    """Per key: sequence numbers ascend in (batchId, segmentEpoch, position) order and in
    (segmentEpoch, position) order alone."""
    per_key: dict[str, list[tuple[int, int, int, int]]] = {}
    for batch_id, rows in batches:
        for r in rows:
            _tag, key, seq = r["value"].decode().split(":")
            per_key.setdefault(key, []).append(
                (batch_id, r["segmentEpoch"], r["position"], int(seq))
            )
    for key, items in per_key.items():
        by_batch = [s for *_x, s in sorted(items)]
        by_position = [s for *_x, s in sorted(items, key=lambda t: (t[1], t[2]))]
        assert by_batch == sorted(by_batch), key
        assert by_position == sorted(by_position), key


def test_batch_read_over_the_whole_dag(spark: Any, broker: Broker, topic: str) -> None:
    broker.create(topic, 2)
    broker.produce(topic, keyed("a", 10, 10))
    broker.split(topic, 0)
    broker.produce(topic, keyed("b", 10, 5))
    broker.merge(topic, *broker.active(topic)[:2])
    broker.produce(topic, keyed("c", 10, 5))
    df = spark.read.format("anabranch").options(**broker.options(topic)).load()
    rows = df.select("value", "segmentEpoch", "position").collect()
    values = [r["value"] for r in rows]
    assert len(values) == 200 and len(set(values)) == 200
    child = next(s for s in broker.layout(topic)["segments"].values() if s["createdAtEpoch"] == 2)
    lo, hi = child["hashRange"]["start"], child["hashRange"]["end"]
    expected = sorted(v for k, v in keyed("c", 10, 5) if lo <= segment_hash(k) <= hi)
    assert expected  # the merge child holds some keys
    merged = df.where("segmentEpoch = 2").select("value").collect()
    assert sorted(r["value"] for r in merged) == expected


def test_stream_across_splits_and_merges_reads_each_message_once_in_key_order(
    spark: Any, broker: Broker, topic: str, tmp_path: Path
) -> None:
    broker.create(topic, 2)
    broker.produce(topic, keyed("a", 12, 5))
    opts = broker.options(topic, startingOffsets="earliest", maxRecordsPerTrigger="40")
    query, batches = collect(spark, opts, tmp_path / "cp", available_now=False)
    try:
        wait_for(lambda: len(rows_of(batches)) >= 40, "the first batch")
        broker.split(topic, 0)  # while the query runs, parent partly read
        broker.produce(topic, keyed("a", 12, 5, offset=5))
        first, second = broker.active(topic)[:2]
        broker.merge(topic, first, second)
        broker.produce(topic, keyed("a", 12, 5, offset=10))
        broker.split(topic, broker.active(topic)[-1])
        broker.produce(topic, keyed("a", 12, 5, offset=15))
        wait_for(lambda: len(rows_of(batches)) >= 240, "all 240 rows")
        time.sleep(1.0)  # a duplicate would show up now
    finally:
        query.stop()
    values = [r["value"] for r in rows_of(batches)]
    assert len(values) == 240 and len(set(values)) == 240
    assert [b for b, _ in batches] == sorted(b for b, _ in batches)
    assert len(batches) >= 6
    check_key_order(batches)
    # A parent's tail and its children's head are never in one micro-batch.
    layout = broker.layout(topic)["segments"]
    for batch_id, rows in batches:
        segs = {r["segmentId"] for r in rows}
        for sid in segs:
            parents = set(layout[str(sid)]["parentIds"])
            assert not parents & segs, (batch_id, sid)


def test_restart_replays_the_uncommitted_batch_identically(
    spark: Any, broker: Broker, topic: str, tmp_path: Path
) -> None:
    broker.create(topic, 2)
    broker.produce(topic, keyed("r", 9, 10))
    opts = broker.options(topic, startingOffsets="earliest", maxRecordsPerTrigger="30")
    cp = tmp_path / "cp"
    _q, first = collect(spark, opts, cp)
    assert len(rows_of(first)) == 90
    last_id, last_rows = first[-1]
    (cp / "commits" / str(last_id)).unlink()  # the last batch never committed
    (cp / "commits" / f".{last_id}.crc").unlink(missing_ok=True)
    broker.produce(topic, keyed("s", 9, 2))  # new data must not leak into the replay
    _q, second = collect(spark, opts, cp)
    assert second[0][0] == last_id
    key = lambda r: (r["segmentId"], r["position"])  # noqa: E731
    assert sorted(second[0][1], key=key) == sorted(last_rows, key=key)
    assert len(rows_of(second)) == len(last_rows) + 18


def test_latest_start_is_deterministic_and_loses_nothing(broker: Broker, topic: str) -> None:
    broker.create(topic, 2)
    broker.produce(topic, keyed("before", 4, 3))
    reader = AnabranchStreamReader(SourceOptions.parse(broker.options(topic)))
    try:
        init = reader.initialOffset()
        broker.produce(topic, keyed("between", 4, 3))  # between Spark's two initialOffset calls
        assert reader.initialOffset() == init
        resolved = reader.latestOffset(init, ReadAllAvailable())
        assert reader.partitions(init, resolved) == []  # batch 0 is empty by design
        broker.produce(topic, keyed("after", 4, 3))
        end = reader.latestOffset(resolved, ReadAllAvailable())
        parts = reader.partitions(resolved, end)
        values = [v for p in parts for b in reader.read(p) for v in b.column("value").to_pylist()]
        assert sorted(values) == sorted(v for _k, v in keyed("after", 4, 3))
        assert reader.latestOffset(end, ReadAllAvailable()) == end  # nothing new: same offset
    finally:
        reader.stop()


def test_starting_timestamp_reads_exactly_the_later_messages(
    spark: Any, broker: Broker, topic: str, tmp_path: Path
) -> None:
    broker.create(topic, 2)
    broker.produce(topic, keyed("old", 8, 3))
    broker.split(topic, 0)  # sealed, every message older than the timestamp: complete
    time.sleep(0.05)
    ts = int(time.time() * 1000)
    time.sleep(0.05)
    broker.produce(topic, keyed("new", 8, 3))
    broker.split(topic, 1)  # sealed with messages on both sides of the timestamp
    broker.produce(topic, keyed("new", 8, 3, offset=3))
    expected = sorted(v for _k, v in keyed("new", 8, 6))
    opts = broker.options(topic, startingTimestamp=str(ts))
    reader = AnabranchStreamReader(SourceOptions.parse(opts))
    try:  # the start is symbolic until the first latestOffset resolves it
        init = reader.initialOffset()
        assert init == {"v": 1, "init": "timestamp", "ts": ts} == reader.initialOffset()
        resolved = Frontier.from_dict(reader.latestOffset(init, ReadAllAvailable()))
        segs = resolved.topics[topic.removeprefix("topic://")].segs
        assert 0 not in segs and segs[2] == segs[3] == 0  # children of the complete root
        assert segs[1] > 0  # past its older messages
    finally:
        reader.stop()
    _q, batches = collect(spark, opts, tmp_path / "cp")
    values = [r["value"] for r in rows_of(batches)]
    assert sorted(values) == expected
    check_key_order(batches)
    df = spark.read.format("anabranch").options(**opts).load()
    assert sorted(r["value"] for r in df.select("value").collect()) == expected
    with pytest.raises(Exception, match="mutually exclusive"):
        SourceOptions.parse({**opts, "startingOffsets": "earliest"})


def test_ack_subscription_shows_progress_to_the_broker(broker: Broker, topic: str) -> None:
    broker.create(topic, 1)
    broker.produce(topic, [(f"k{i}", f"v{i}".encode()) for i in range(10)])
    broker.produce(topic, [(f"k{i}", f"v{i}".encode()) for i in range(10, 20)])  # a later entry
    opts = broker.options(topic, startingOffsets="earliest", ackSubscription="spark-progress")
    reader = AnabranchStreamReader(SourceOptions.parse(opts))
    try:
        start = reader.initialOffset()
        end = reader.latestOffset(start, ReadAllAvailable())
        reader.commit(end)
    finally:
        reader.stop()
    broker.produce(topic, [("k", b"after")])
    client = _io.client_for(broker.service_url)
    layout = SegmentLayout.from_dict(broker.layout(topic))
    name = _io.segment_topic(topic.removeprefix("topic://"), layout, 0)

    async def first_unacked() -> bytes | None:
        consumer = await client.subscribe(name, "spark-progress")
        try:
            msg = await consumer.receive(timeout=5)
            return None if msg is None else msg.value
        finally:
            await consumer.close()

    # Conservative: a frontier inside the last batch entry leaves that entry unacked.
    value = _io.run(first_unacked())
    assert value in {f"v{i}".encode() for i in range(10, 20)}


def test_batches_of_one_message_are_read(broker: Broker, topic: str) -> None:
    # GET_LAST_MESSAGE_ID names a one-message batch with batch index -1, its message has 0.
    broker.create(topic, 1)
    broker.produce(topic, [("k", b"first")])
    reader = AnabranchStreamReader(
        SourceOptions.parse(broker.options(topic, startingOffsets="earliest"))
    )
    try:
        start = reader.initialOffset()
        end = reader.latestOffset(start, ReadAllAvailable())
        broker.produce(topic, [("k", b"second")])
        later = reader.latestOffset(end, ReadAllAvailable())

        def values(a: dict[str, Any], b: dict[str, Any]) -> list[bytes]:
            parts = reader.partitions(a, b)
            return [
                v for p in parts for batch in reader.read(p) for v in batch["value"].to_pylist()
            ]

        assert values(start, end) == [b"first"]
        assert values(end, later) == [b"second"]
    finally:
        reader.stop()


def test_trimmed_position_is_data_loss_unless_told_otherwise(broker: Broker, topic: str) -> None:
    broker.create(topic, 1)
    broker.produce(topic, keyed("d", 2, 5))
    name = topic.removeprefix("topic://")
    opts = SourceOptions.parse(broker.options(topic, startingOffsets="earliest"))
    reader = AnabranchStreamReader(opts)
    try:
        end = Frontier.from_dict(reader.latestOffset(reader.initialOffset(), ReadAllAvailable()))
    finally:
        reader.stop()
    # Resume inside ledger 0, which never exists (ledger ids start at 1): as if trimmed.
    gone = SegmentRange(
        name, 0, 0, 0xFFFF, 0, encode_position(0, 0, 3) + 1, end.topics[name].segs[0]
    )
    with pytest.raises(DataLoss, match="is gone"):
        list(read_range(opts, gone))
    lenient = dataclasses.replace(opts, fail_on_data_loss=False)
    assert sum(b.num_rows for b in read_range(lenient, gone)) == 10


def test_min_records_waits_up_to_the_delay_and_max_bytes_caps(broker: Broker, topic: str) -> None:
    broker.create(topic, 2)
    broker.produce(topic, keyed("b", 4, 5))
    options = broker.options(
        topic, startingOffsets="earliest", minRecordsPerTrigger="50", maxTriggerDelay="1s"
    )
    reader = AnabranchStreamReader(SourceOptions.parse(options))
    try:
        start = reader.initialOffset()
        limit = reader.getDefaultReadLimit()
        assert isinstance(limit, ReadMinRows)
        assert reader.latestOffset(start, limit) == start  # 20 < 50: wait
        time.sleep(1.1)
        end = reader.latestOffset(start, limit)  # the delay is over: take what there is
        assert reader.partitions(start, end)
    finally:
        reader.stop()
    reader = AnabranchStreamReader(
        SourceOptions.parse(broker.options(topic, startingOffsets="earliest"))
    )
    try:
        start = reader.initialOffset()
        capped = reader.latestOffset(start, ReadMaxBytes(25))  # values are 5-6 bytes
        parts = reader.partitions(start, capped)
        rows = sum(b.num_rows for p in parts for b in reader.read(p))
        assert 2 <= rows <= 5
    finally:
        reader.stop()


def test_batch_write_then_read_between_offsets(spark: Any, broker: Broker, topic: str) -> None:
    broker.create(topic, 2)
    first = spark.createDataFrame(
        [(f"k{i % 7}", f"w{i}") for i in range(30)], "key string, value string"
    )
    first.write.format("anabranch").options(**broker.options(topic)).mode("append").save()
    reader = AnabranchStreamReader(
        SourceOptions.parse(broker.options(topic, startingOffsets="earliest"))
    )
    try:
        mark = Frontier.from_dict(reader.latestOffset(reader.initialOffset(), ReadAllAvailable()))
    finally:
        reader.stop()
    second = spark.createDataFrame(
        [(f"k{i % 7}", f"x{i}") for i in range(20)], "key string, value string"
    )
    second.write.format("anabranch").options(**broker.options(topic)).mode("append").save()

    def read(**offsets: str) -> list[Any]:
        frame = spark.read.format("anabranch").options(**broker.options(topic, **offsets))
        return list(frame.load().collect())

    after = read(startingOffsets=mark.to_json())
    assert sorted(r["value"] for r in after) == sorted(f"x{i}".encode() for i in range(20))
    assert read(startingOffsets=mark.to_json(), endingOffsets=mark.to_json()) == []
    before = read(endingOffsets=mark.to_json())
    assert sorted(r["value"] for r in before) == sorted(f"w{i}".encode() for i in range(30))
    assert {r["key"] for r in before} == {f"k{i}".encode() for i in range(7)}


def test_max_records_per_trigger_is_honoured(
    spark: Any, broker: Broker, topic: str, tmp_path: Path
) -> None:
    broker.create(topic, 3)
    broker.produce(topic, keyed("m", 10, 10))
    opts = broker.options(topic, startingOffsets="earliest", maxRecordsPerTrigger="25")
    _q, batches = collect(spark, opts, tmp_path / "cp")
    sizes = [len(rows) for _b, rows in batches]
    assert sum(sizes) == 100 and max(sizes) <= 25 and len(sizes) >= 4


def test_available_now_stops_at_its_snapshot_while_producers_continue(
    spark: Any, broker: Broker, topic: str, tmp_path: Path
) -> None:
    broker.create(topic, 2)
    broker.produce(topic, keyed("n", 10, 10))
    stop = threading.Event()
    produced = [100]

    def keep_producing() -> None:
        seq = 10
        while not stop.is_set():
            produced[0] += broker.produce(topic, keyed("n", 10, 1, offset=seq))
            seq += 1

    thread = threading.Thread(target=keep_producing)
    thread.start()
    try:
        opts = broker.options(topic, startingOffsets="earliest", maxRecordsPerTrigger="60")
        query, batches = collect(spark, opts, tmp_path / "cp")
        assert not query.isActive
        read = len(rows_of(batches))
        time.sleep(0.5)
    finally:
        stop.set()
        thread.join()
    assert 100 <= read < produced[0]
    values = [r["value"] for r in rows_of(batches)]
    assert len(set(values)) == len(values)
    check_key_order(batches)


def test_readers_writers_and_partitions_pickle_without_a_client(broker: Broker, topic: str) -> None:
    broker.create(topic, 1)
    reader = AnabranchStreamReader(
        SourceOptions.parse(broker.options(topic, startingOffsets="earliest"))
    )
    try:
        start = reader.initialOffset()  # the driver side now holds a live client
        assert reader._driver is not None
        clone = pickle.loads(
            cloudpickle.dumps(  # type: ignore[no-untyped-call]
                reader
            )
        )
        assert clone._driver is None and clone.opts == reader.opts
        assert reader.latestOffset(start, ReadAllAvailable()) == start  # empty topic
    finally:
        reader.stop()
    writer = AnabranchStreamWriter(SinkOptions.parse(broker.options(topic)))
    assert (
        pickle.loads(
            cloudpickle.dumps(  # type: ignore[no-untyped-call]
                writer
            )
        ).opts
        == writer.opts
    )
    part = SegmentRange("public/default/x", 0, 0, 0xFFFF, 0, 0, 5)
    assert pickle.loads(pickle.dumps(part)) == part


def test_unknown_delivery_guarantee_is_refused_at_planning(
    spark: Any, broker: Broker, topic: str
) -> None:
    df = spark.createDataFrame([("k", "v")], "key string, value string")
    opts = broker.options(topic, deliveryGuarantee="twice")
    with pytest.raises(Exception, match="deliveryGuarantee"):
        df.write.format("anabranch").options(**opts).mode("append").save()


def test_example_pipeline_consume_transform_produce(
    spark: Any, broker: Broker, tmp_path: Path
) -> None:
    source, sink = "topic://public/default/pipe-in", "topic://public/default/pipe-out"
    broker.create(source, 2)
    broker.create(sink, 3)
    broker.produce(source, keyed("order", 8, 10))
    path = Path(__file__).parents[2] / "examples" / "pipeline.py"
    spec = importlib.util.spec_from_file_location("pipeline_example", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    query = module.start(
        spark,
        service_url=broker.service_url,
        admin_url=broker.admin_url,
        source=source,
        sink=sink,
        checkpoint=str(tmp_path / "cp"),
        available_now=True,
    )
    query.awaitTermination()
    out = spark.read.format("anabranch").options(**broker.options(sink)).load().collect()
    assert sorted(r["value"] for r in out) == sorted(v.upper() for _k, v in keyed("order", 8, 10))
    per_key: dict[bytes, list[int]] = {}
    for r in sorted(out, key=lambda r: (r["segmentEpoch"], r["position"])):
        per_key.setdefault(r["key"], []).append(int(r["value"].decode().split(":")[2]))
    assert all(seqs == sorted(seqs) for seqs in per_key.values())


def test_driver_scan_cuts_exactly_and_reuses_what_it_read_ahead(
    broker: Broker, topic: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    broker.create(topic, 1)
    rows = [(f"k{i % 7}", b"v" * (i % 13)) for i in range(700)]
    broker.produce(topic, rows)
    layout = SegmentLayout.from_dict(broker.layout(topic))
    name = _io.segment_topic(topic.removeprefix("topic://"), layout, 0)
    client = _io.client_for(broker.service_url)
    end = _io.run(_io.segment_end(client, name))
    everything = [
        (pos, len(value))
        for batch in read_range(
            SourceOptions.parse(broker.options(topic)),
            SegmentRange(topic.removeprefix("topic://"), 0, 0, 0xFFFF, 0, 0, end),
        )
        for pos, value in zip(
            batch["position"].to_pylist(), batch["value"].to_pylist(), strict=True
        )
    ]
    assert [size for _p, size in everything] == [len(v) for _k, v in rows]
    positions = [p for p, _s in everything]
    reads = 0
    real_read = _io.Scanner._read

    async def counting_read(self: _io.Scanner, *args: Any) -> None:
        nonlocal reads
        reads += 1
        await real_read(self, *args)

    monkeypatch.setattr(_io.Scanner, "_read", counting_read)
    for sizes in (False, True):
        scanner = _io.Scanner(client, 30.0)
        lo, got = 0, list[int]()
        reads = 0
        while lo < end:
            cut, cut_sizes = _io.run(scanner.scan(name, lo, end, 150, sizes))
            assert len(cut) == min(150, len(positions) - len(got))
            if sizes:
                assert cut_sizes is not None
                assert [
                    (int(p), int(s)) for p, s in zip(cut, cut_sizes, strict=True)
                ] == everything[len(got) : len(got) + len(cut)]
            got += cut.tolist()
            lo = int(cut[-1]) + 1 if len(cut) else end
        assert got == positions
        # Five cuts of up to 150 of the 700 messages read less often than once per cut: what
        # a scan read beyond a cut (whole entries) serves the next cut.
        assert reads < 5
        # A replay from before what was kept scans afresh, and identically.
        again, _ = _io.run(scanner.scan(name, 0, end, 150, sizes))
        assert again.tolist() == positions[:150]


def test_a_read_stopped_early_leaves_no_consumer_and_reads_again(
    broker: Broker, topic: str
) -> None:
    # More than two Arrow batches' worth: the read has the next chunk in flight when it stops.
    broker.create(topic, 1)
    broker.produce(topic, [(f"k{i % 5}", b"%d" % i) for i in range(2 * READ_CHUNK_ROWS + 500)])
    opts = SourceOptions.parse(broker.options(topic))
    layout = SegmentLayout.from_dict(broker.layout(topic))
    name = topic.removeprefix("topic://")
    client = _io.client_for(broker.service_url)
    end = _io.run(_io.segment_end(client, _io.segment_topic(name, layout, 0)))
    part = SegmentRange(name, 0, 0, 0xFFFF, 0, 0, end)

    def consumers() -> int:
        async def count() -> int:
            conns = [await c for c in client._pool._connections.values()]
            return sum(len(c._consumers) for c in conns)

        return _io.run(count())

    before = consumers()
    batches = read_range(opts, part)
    first = next(batches)
    assert first.num_rows >= READ_CHUNK_ROWS
    batches.close()  # what Spark does when a task stops early
    assert consumers() == before
    values = [v for b in read_range(opts, part) for v in b["value"].to_pylist()]
    assert values == [b"%d" % i for i in range(2 * READ_CHUNK_ROWS + 500)]


def test_read_compacted_reads_the_latest_value_per_key_then_the_tail(
    spark: Any, broker: Broker, topic: str
) -> None:
    """``readCompacted``: each segment's compacted view (batched entries keep only their
    surviving messages; tombstones delete keys), then what was written after compaction."""
    broker.create(topic, 2)
    history = [*keyed("a", 12, 4), ("k3", b""), ("k7", b"")]
    broker.produce(topic, history)
    admin = _io.admin_for(broker.admin_url)
    _io.run(admin.compact(topic))
    segments = [
        _io.segment_topic(
            topic.removeprefix("topic://"), SegmentLayout.from_dict(broker.layout(topic)), sid
        )
        for sid in broker.active(topic)
    ]
    for _ in range(1200):  # a hang guard while the compactions run
        if all(_io.run(admin.compaction_status(s))["status"] == "SUCCESS" for s in segments):
            break
        time.sleep(0.05)
    tail = [("k1", b"tail:k1"), ("k3", b"tail:k3")]
    broker.produce(topic, tail)
    opts = broker.options(topic, readCompacted="true")
    rows = spark.read.format("anabranch").options(**opts).load().select("key", "value").collect()
    full = spark.read.format("anabranch").options(**broker.options(topic)).load().count()
    latest: dict[str, bytes] = {}
    for key, value in history:
        if value:
            latest[key] = value
        else:
            latest.pop(key, None)
    got = sorted((bytes(r["key"]).decode(), bytes(r["value"])) for r in rows)
    assert got == sorted([*latest.items(), *tail])
    assert full == len(history) + len(tail)  # without the option: every message
