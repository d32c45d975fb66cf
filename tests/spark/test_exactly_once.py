"""The exactly-once sink on a real local Spark (``local[2,3]``: failed tasks are retried)
against a broker process. Output is checked with a read-committed reader of our client: the
multiset of values equals the input's, and each key's sequence numbers ascend."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from anabranch.client.checkpoint_consumer import CheckpointConsumer
from pyspark_anabranch import _io
from pyspark_anabranch.options import SinkOptions
from pyspark_anabranch.sink import (
    CRASH_AFTER_COMMIT_ENV,
    CRASH_BEFORE_COMMIT_ENV,
    FAIL_WRITE_ENV,
    AnabranchStreamWriter,
    BatchCommitFailed,
    BranchCommit,
    TaskIdentity,
    write_branch,
)
from tests.spark.conftest import Broker, keyed

RETRY_SINK = "eo-task-retry"
FAIL_AFTER_ROWS = 7
SCRIPT = Path(__file__).with_name("eo_query.py")


@pytest.fixture(scope="module")
def spark() -> Iterator[Any]:
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
    os.environ["SPARK_LOCAL_IP"] = "127.0.0.1"
    os.environ[FAIL_WRITE_ENV] = f"{RETRY_SINK}:{FAIL_AFTER_ROWS}"  # Python workers inherit it
    from pyspark.sql import SparkSession

    session = (
        SparkSession.builder.master("local[2,3]")
        .appName("anabranch-exactly-once")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.sql.streaming.pollingDelay", "50ms")
        .getOrCreate()
    )
    session.sparkContext.setLogLevel("ERROR")
    try:
        yield session
    finally:
        session.stop()
        os.environ.pop(FAIL_WRITE_ENV, None)


def committed(broker: Broker, topic: str, expect: int, settle_s: float = 1.5) -> list[Any]:
    """Every message a read-committed reader sees (waits for ``expect``, then ``settle_s`` more
    for any extra)."""
    client = _io.client_for(broker.service_url)

    async def go() -> list[Any]:
        reader = await client.create_checkpoint_consumer(topic)
        assert isinstance(reader, CheckpointConsumer)
        out: list[Any] = []
        deadline = time.monotonic() + 60
        try:
            while time.monotonic() < deadline:
                msg = await reader.receive(timeout=settle_s if len(out) >= expect else 1.0)
                if msg is None:
                    if len(out) >= expect:
                        break
                    continue
                out.append(msg)
        finally:
            await reader.close()
        return out

    return _io.run(go())


def check_exactly_once(broker: Broker, topic: str, rows: list[tuple[str, bytes]]) -> None:
    msgs = committed(broker, topic, len(rows))
    got = Counter(m.value for m in msgs)
    want = Counter(v for _k, v in rows)
    assert got == want, (sum(got.values()), sum(want.values()), got - want, want - got)
    per_key: dict[str, list[int]] = {}
    for m in msgs:
        assert "__txn_branch" in m.properties
        per_key.setdefault(m.key, []).append(int(m.value.decode().split(":")[2]))
    for key, seqs in per_key.items():
        assert seqs == sorted(seqs), key


def run_query(
    broker: Broker, source: str, sink: str, cp: Path, *, sink_id: str, env: dict[str, str]
) -> int:
    pidfile = cp.parent / f"{cp.name}.pids"
    args = [broker.service_url, broker.admin_url, source, sink, str(cp), sink_id, str(pidfile)]
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), *args, "40"],
        env={**os.environ, **env, "PYTHONPATH": os.pathsep.join(sys.path)},
        capture_output=True,
        timeout=180,
        check=False,
    )
    return proc.returncode


def restart(spark: Any, broker: Broker, source: str, sink: str, cp: Path, *, sink_id: str) -> None:
    """The crashed query again, on its checkpoint, in this process's session (the driver
    that was killed ran in its own process; a fresh one would only add a JVM start)."""
    writer = stream(spark, broker, source, sink, cp, sinkId=sink_id)
    writer.trigger(availableNow=True).start().awaitTermination()


def stream(spark: Any, broker: Broker, source: str, sink: str, cp: Path, **extra: str) -> Any:
    df = (
        spark.readStream.format("anabranch")
        .options(**broker.options(source, startingOffsets="earliest", maxRecordsPerTrigger="40"))
        .load()
    )
    writer = (
        df.select("key", "value")
        .writeStream.format("anabranch")
        .options(**broker.options(sink, **extra))
        .option("checkpointLocation", str(cp))
    )
    return writer


def test_driver_killed_between_broker_commit_and_spark_commit_log(
    spark: Any, broker: Broker, tmp_path: Path
) -> None:
    source, sink = "topic://public/default/eo-kill-in", "topic://public/default/eo-kill-out"
    broker.create(source, 2)
    broker.create(sink, 2)
    rows = keyed("kill", 8, 12)
    broker.produce(source, rows)
    cp = tmp_path / "cp"
    pids = tmp_path / "cp.pids"
    crash = {CRASH_AFTER_COMMIT_ENV: f"eo-kill:1:{pids}"}
    assert run_query(broker, source, sink, cp, sink_id="eo-kill", env=crash) != 0  # SIGKILLed
    assert (cp / "offsets" / "1").exists() and not (cp / "commits" / "1").exists()
    state = _io.run(_io.get_batch(_io.admin_for(broker.admin_url), "eo-kill", 1))
    assert state is not None and state.state == "COMMITTED"  # the broker commit happened
    # the restart replays batch 1: its tasks see it COMMITTED and skip
    restart(spark, broker, source, sink, cp, sink_id="eo-kill")
    assert (cp / "commits" / "1").exists()
    check_exactly_once(broker, sink, rows)


def test_restart_with_an_uncommitted_batch(spark: Any, broker: Broker, tmp_path: Path) -> None:
    source, sink = "topic://public/default/eo-open-in", "topic://public/default/eo-open-out"
    broker.create(source, 2)
    broker.create(sink, 2)
    rows = keyed("open", 8, 12)
    broker.produce(source, rows)
    cp = tmp_path / "cp"
    crash = {CRASH_BEFORE_COMMIT_ENV: f"eo-open:1:{tmp_path / 'cp.pids'}"}
    assert run_query(broker, source, sink, cp, sink_id="eo-open", env=crash) != 0
    assert (cp / "offsets" / "1").exists() and not (cp / "commits" / "1").exists()
    state = _io.run(_io.get_batch(_io.admin_for(broker.admin_url), "eo-open", 1))
    assert state is not None and state.state == "OPEN"  # its branches are written, invisible
    restart(spark, broker, source, sink, cp, sink_id="eo-open")
    check_exactly_once(broker, sink, rows)


def test_a_task_failing_after_part_of_its_rows_is_retried_exactly_once(
    spark: Any, broker: Broker, tmp_path: Path
) -> None:
    source, sink = "topic://public/default/eo-retry-in", "topic://public/default/eo-retry-out"
    broker.create(source, 2)
    broker.create(sink, 2)
    rows = keyed("retry", 6, 10)
    broker.produce(source, rows)
    writer = stream(spark, broker, source, sink, tmp_path / "cp", sinkId=RETRY_SINK)
    writer.trigger(availableNow=True).start().awaitTermination()
    check_exactly_once(broker, sink, rows)
    admin = _io.admin_for(broker.admin_url)
    batches = [_io.run(_io.get_batch(admin, RETRY_SINK, b)) for b in range(3)]
    done = [b for b in batches if b is not None]
    assert len(done) >= 2 and all(b.state == "COMMITTED" for b in done)
    for b in done:  # one winner per task: a failed attempt never is one
        partitions = [w.split("-")[0] for w in b.winners]
        assert partitions and len(partitions) == len(set(partitions)), b.winners


def _arrow(rows: list[tuple[str, bytes]]) -> pa.RecordBatch:
    return pa.RecordBatch.from_pydict(
        {"key": [k for k, _v in rows], "value": [v for _k, v in rows]}
    )


def test_two_attempts_of_one_task_only_the_winner_is_visible(spark: Any, broker: Broker) -> None:
    sink = "topic://public/default/eo-spec-out"
    broker.create(sink, 2)
    opts = SinkOptions.parse(broker.options(sink, sinkId="eo-spec"))
    first = [(k, b"a" + v) for k, v in keyed("spec", 4, 5)]
    second = [(k, b"b" + v) for k, v in keyed("spec", 4, 5)]
    slow = TaskIdentity("eo-spec", 0, "q-spec", 0, "attempt-a")
    fast = TaskIdentity("eo-spec", 0, "q-spec", 0, "attempt-b")
    msg_a = write_branch(opts, iter([_arrow(first)]), slow)
    msg_b = write_branch(opts, iter([_arrow(second)]), fast)
    assert msg_a.rows == msg_b.rows == 20 and msg_a.epoch == msg_b.epoch
    writer = AnabranchStreamWriter(opts)
    writer.commit([msg_b], 0)
    writer.abort([msg_b], 0)  # Spark's abort after a commit that succeeded: the commit stands
    replay = write_branch(opts, iter([_arrow(first)]), TaskIdentity("eo-spec", 0, "q-spec", 0, "c"))
    assert isinstance(replay, BranchCommit) and replay.skipped
    writer.commit([replay], 0)  # a replay of the committed batch: no-op
    msgs = committed(broker, sink, len(second))
    assert sorted(m.value for m in msgs) == sorted(v for _k, v in second)
    with pytest.raises(Exception, match=r"409"):
        _io.run(_io.begin_batch(_io.admin_for(broker.admin_url), "eo-spec", 0, "q-other", 60000))
    # The source reads committed data only, and neither an open batch nor an aborted tail
    # (entries the broker never dispatches) makes it wait.
    open_batch = TaskIdentity("eo-spec", 1, "q-spec", 0, "open")
    write_branch(opts, iter([_arrow([("k0", b"open:k0:0")] * 5)]), open_batch)
    want = sorted(v for _k, v in second)
    for step in ("open", "aborted"):
        t0 = time.monotonic()
        df = spark.read.format("anabranch").options(**broker.options(sink)).load()
        assert sorted(r["value"] for r in df.select("value").collect()) == want, step
        assert time.monotonic() - t0 < 20, step
        _io.run(_io.abort_batch(_io.admin_for(broker.admin_url), "eo-spec", 1, msg_a.epoch))


def test_split_and_merge_of_the_input_mid_stream(
    spark: Any, broker: Broker, tmp_path: Path
) -> None:
    source, sink = "topic://public/default/eo-dag-in", "topic://public/default/eo-dag-out"
    broker.create(source, 2)
    broker.create(sink, 2)
    rows = keyed("dag", 10, 6)
    broker.produce(source, rows)
    query = stream(spark, broker, source, sink, tmp_path / "cp", sinkId="eo-dag")
    query = query.trigger(processingTime="200 milliseconds").start()
    try:
        committed(broker, sink, 40, settle_s=0.1)
        assert query.isActive  # the split and the merge happen mid-stream
        broker.split(source, 0)
        more = keyed("dag", 10, 6, offset=6)
        broker.produce(source, more)
        broker.merge(source, *broker.active(source)[:2])
        last = keyed("dag", 10, 6, offset=12)
        broker.produce(source, last)
        rows += more + last
        deadline = time.monotonic() + 90
        while query.lastProgress is None or _progress_rows(query) < len(rows):
            assert time.monotonic() < deadline, "the query did not catch up"
            time.sleep(0.3)
    finally:
        query.stop()
    check_exactly_once(broker, sink, rows)


def _progress_rows(query: Any) -> int:
    return sum(p["numInputRows"] for p in query.recentProgress)


def test_bad_sink_options_fail_at_planning(spark: Any, broker: Broker) -> None:
    df = spark.createDataFrame([("k", "v")], "key string, value string")
    topic = "topic://public/default/eo-bad"
    for extra, message in (
        ({"deliveryGuarantee": "exactly-twice"}, "deliveryGuarantee"),
        ({"sinkId": "a&b"}, "cannot go in a sink key"),
        ({"sinkId": "a\x01b"}, "control characters"),
        ({"sinkId": "x" * 600}, "at most 512"),
        ({"txnTimeoutMs": "99999999999"}, "over the limit"),
    ):
        with pytest.raises(Exception, match=message):
            df.write.format("anabranch").options(**broker.options(topic, **extra)).mode(
                "append"
            ).save()


def test_a_batch_aborted_before_its_commit_fails_and_its_replay_gets_a_new_epoch(
    broker: Broker,
) -> None:
    sink = "topic://public/default/eo-timeout-out"
    broker.create(sink, 1)
    opts = SinkOptions.parse(broker.options(sink, sinkId="eo-timeout"))
    rows = keyed("late", 3, 4)
    first = write_branch(opts, iter([_arrow(rows)]), TaskIdentity("eo-timeout", 0, "q", 0, "a"))
    admin = _io.admin_for(broker.admin_url)
    _io.run(_io.abort_batch(admin, "eo-timeout", 0, first.epoch))  # as the timeout sweep does
    writer = AnabranchStreamWriter(opts)
    with pytest.raises(BatchCommitFailed, match="cannot commit"):
        writer.commit([first], 0)
    replay = write_branch(opts, iter([_arrow(rows)]), TaskIdentity("eo-timeout", 0, "q", 0, "b"))
    assert replay.epoch == first.epoch + 1
    writer.commit([replay], 0)
    assert sorted(m.value for m in committed(broker, sink, len(rows))) == sorted(
        v for _k, v in rows
    )
