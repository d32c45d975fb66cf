"""Spark source benchmark: rows/s of ``format("anabranch")`` into a ``noop`` sink, next to
(a) a trivial in-memory Python Arrow data source (the ceiling of any Python source here) and
(b) Spark's own ``rate-micro-batch`` source, in one run on one local[2] session.

(a) comes in two shapes: ``python_arrow_memory`` yields rows of our source's schema (8 columns:
key, value, topic, ...), so the ratio to it is the cost of our source alone;
``python_arrow_memory_2col`` yields only ``value, position``, as in earlier reports. Spark's
own per-row cost grows with the columns (here about 1.3x from 2 to 8), so the 2-column ratio
also counts what Spark spends on our schema.

1. A broker subprocess (``BrokerProcess``, fsync=never) with a 2-segment scalable topic; N
   messages of S bytes are produced with the client's scalable producer (keys ``k0..k999``).
2. Per-micro-batch overhead, measured after the warm-up runs of step 3: 2-row batches, mean
   ``triggerExecution`` after batch 0, for our source (which then scans ahead on the driver to
   cut at 2 rows) and for the in-memory one of our schema.
3. Each source reads all N rows into ``noop`` under ``Trigger.AvailableNow`` (one batch; the
   rate source: three batches of N); rows/s is rows over summed ``triggerExecution``. Ours and
   the in-memory sources alternate ``--reps`` times after ``--warmup`` uncounted runs each (the
   JVM's JIT and the Python workers warm up over the first runs); the medians are reported,
   and the ratios are those of the medians. Ours runs again with
   ``maxRecordsPerTrigger=--batch-rows`` to show the cost of cutting at a limit. Spark's phase
   durations are reported per run.

The broker's peak RSS (``VmHWM``) is reported. The last printed line is one JSON object.

Usage: ``python benchmarks/spark_source.py [--messages 1000000] [--size 100] [--reps 3]``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from _common import peak_rss_bytes

from anabranch.testing.broker import BrokerProcess
from pyspark_anabranch import _io

TOPIC = "topic://public/default/spark-bench"


def produce(service_url: str, admin_url: str, messages: int, size: int) -> float:
    """Produce ``messages`` values of ``size`` bytes; returns msgs/s."""
    sink = _io.TopicSink(_io.client_for(service_url))
    name = TOPIC.removeprefix("topic://")
    payload = b"x" * size

    async def go() -> None:
        for start in range(0, messages, 4096):
            end = min(messages, start + 4096)
            await sink.send(
                [(name, payload, f"k{i % 1000}", None, None) for i in range(start, end)]
            )
        await sink.finish()
        await sink.close()

    t0 = time.perf_counter()
    _io.run(go())
    return messages / (time.perf_counter() - t0)


def memory_source(total: int, batch_rows: int, size: int, *, full: bool) -> Any:
    """A trivial Python Arrow streaming source of ``total`` rows, all built before reading.

    ``full``: rows of our source's schema (same columns and types, constant topic/segment,
    keys ``k0..k999``); else only ``value binary, position long``.
    """
    from pyspark.sql.datasource import DataSource, DataSourceStreamReader, InputPartition
    from pyspark.sql.streaming.datasource import SupportsTriggerAvailableNow

    from pyspark_anabranch.source import source_schema

    chunk = 8192

    class MemReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
        def initialOffset(self) -> dict[str, int]:
            return {"n": 0}

        def prepareForTriggerAvailableNow(self) -> None:
            pass  # the data is fixed: `total` rows

        def latestOffset(self, start: dict[str, int], limit: Any) -> dict[str, int]:
            return {"n": min(total, start["n"] + batch_rows)}

        def partitions(self, start: dict[str, int], end: dict[str, int]) -> list[InputPartition]:
            lo, hi = start["n"], end["n"]
            mid = lo + (hi - lo) // 2
            return [InputPartition((lo, mid)), InputPartition((mid, hi))]

        def read(self, partition: InputPartition) -> Iterator[Any]:
            import numpy as np
            import pyarrow as pa
            from pyspark.sql.pandas.types import to_arrow_schema

            lo, hi = partition.value
            value = pa.array([b"x" * size] * chunk, pa.binary())
            if not full:
                for s in range(lo, hi, chunk):
                    n = min(chunk, hi - s)
                    yield pa.RecordBatch.from_arrays(
                        [value.slice(0, n), pa.array(np.arange(s, s + n, dtype=np.int64))],
                        names=["value", "position"],
                    )
                return
            schema = to_arrow_schema(source_schema(), timezone="UTC")
            ts = schema.field("publishTime").type
            fixed = [
                pa.array([b"k%d" % (i % 1000) for i in range(chunk)], pa.binary()),
                value,
                pa.repeat(pa.scalar(TOPIC, pa.string()), chunk),
                pa.repeat(pa.scalar(1, pa.int64()), chunk),
                pa.repeat(pa.scalar(0, pa.int32()), chunk),
            ]
            times = [
                pa.array(np.full(chunk, 1_700_000_000_000_000, np.int64)).view(ts),
                pa.nulls(chunk, ts),
            ]
            for s in range(lo, hi, chunk):
                n = min(chunk, hi - s)
                position = pa.array(np.arange(s, s + n, dtype=np.int64))
                yield pa.RecordBatch.from_arrays(
                    [*(a.slice(0, n) for a in fixed), position, *(a.slice(0, n) for a in times)],
                    schema=schema,
                )

    class MemSource(DataSource):
        @classmethod
        def name(cls) -> str:
            return "bench_memory_full" if full else "bench_memory"

        def schema(self) -> Any:
            return source_schema() if full else "value binary, position long"

        def streamReader(self, schema: Any) -> MemReader:
            return MemReader()

    return MemSource


def overhead_ms(progress: list[Any]) -> int:
    """Mean triggerExecution of the batches after the first."""
    steady = progress[1:]
    return int(sum(p["durationMs"]["triggerExecution"] for p in steady) / max(1, len(steady)))


def run_noop(df: Any, checkpoint: str, *, available_now: bool, max_batches: int = 0) -> list[Any]:
    writer = df.writeStream.format("noop").option("checkpointLocation", checkpoint)
    if available_now:
        query = writer.trigger(availableNow=True).start()
        query.awaitTermination()
    else:
        query = writer.trigger(processingTime="0 seconds").start()
        while len(query.recentProgress) < max_batches:
            time.sleep(0.1)
        query.stop()
    return [p for p in query.recentProgress if p["numInputRows"] > 0]


def rate(progress: list[Any]) -> dict[str, Any]:
    rows = sum(p["numInputRows"] for p in progress)
    seconds = sum(p["durationMs"]["triggerExecution"] for p in progress) / 1000
    steady = progress[1:] or progress
    steady_rows = sum(p["numInputRows"] for p in steady)
    steady_s = sum(p["durationMs"]["triggerExecution"] for p in steady) / 1000
    phases: dict[str, int] = {}
    for p in progress:
        for name, ms in p["durationMs"].items():
            phases[name] = phases.get(name, 0) + ms
    return {
        "rows": rows,
        "batches": len(progress),
        "phases_ms": phases,
        "rows_per_s": round(rows / seconds) if seconds else None,
        "rows_per_s_after_batch0": round(steady_rows / steady_s) if steady_s else None,
    }


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run with the median rows/s."""
    return sorted(runs, key=lambda r: r["rows_per_s"] or 0)[len(runs) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--messages", type=int, default=1_000_000)
    parser.add_argument("--size", type=int, default=100)
    parser.add_argument("--batch-rows", type=int, default=250_000)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1, help="uncounted runs of each first")
    args = parser.parse_args()
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["SPARK_LOCAL_IP"] = "127.0.0.1"
    tmp = Path(tempfile.mkdtemp(prefix="spark-bench-"))
    proc = BrokerProcess(tmp / "data", fsync="never")
    asyncio.run(proc.start())
    result: dict[str, Any] = {"messages": args.messages, "size": args.size}
    try:
        admin_url = f"http://127.0.0.1:{proc.http_port}"
        _io.run(_io.admin_for(admin_url).create_scalable_topic(TOPIC, 2))
        result["produce_msgs_per_s"] = round(
            produce(proc.service_url, admin_url, args.messages, args.size)
        )
        from pyspark.sql import SparkSession

        spark = (
            SparkSession.builder.master("local[2]")
            .config("spark.ui.enabled", "false")
            .config("spark.ui.showConsoleProgress", "false")
            .config("spark.sql.shuffle.partitions", "2")
            .getOrCreate()
        )
        spark.sparkContext.setLogLevel("ERROR")
        opts = {"serviceUrl": proc.service_url, "adminUrl": admin_url, "topic": TOPIC}

        def ours(limit: int | None) -> Any:
            reader = spark.readStream.format("anabranch").options(**opts)
            reader = reader.option("startingOffsets", "earliest")
            if limit is not None:
                reader = reader.option("maxRecordsPerTrigger", str(limit))
            return reader.load()

        def memory(total: int, batch: int, *, full: bool) -> Any:
            source = memory_source(total, batch, args.size, full=full)
            spark.dataSource.register(source)
            return spark.readStream.format(source.name()).load()

        # Ours and the in-memory ceilings alternate, so all see the same machine load.
        kinds: dict[str, Any] = {
            "anabranch": lambda: ours(None),
            "python_arrow_memory": lambda: memory(args.messages, args.messages, full=True),
            "python_arrow_memory_2col": lambda: memory(args.messages, args.messages, full=False),
        }
        runs: dict[str, list[dict[str, Any]]] = {kind: [] for kind in kinds}

        def overheads() -> None:
            tiny = run_noop(ours(2), str(tmp / "cp-t1"), available_now=False, max_batches=21)
            result["per_batch_overhead_ms"] = overhead_ms(tiny)
            tiny = run_noop(
                memory(10**9, 2, full=True), str(tmp / "cp-t2"), available_now=False, max_batches=21
            )
            result["per_batch_overhead_ms_python_arrow_memory"] = overhead_ms(tiny)
            print("overheads", result, flush=True)

        for rep in range(args.warmup + args.reps):
            if rep == args.warmup:  # tiny batches, on the warm JVM and workers
                overheads()
            for kind, make in kinds.items():
                t0 = time.perf_counter()
                got = rate(run_noop(make(), str(tmp / f"cp-{kind}-{rep}"), available_now=True))
                got["wall_s"] = round(time.perf_counter() - t0, 2)
                print(kind, got, flush=True)
                if rep >= args.warmup:  # the first runs warm the JVM's JIT and the workers
                    runs[kind].append(got)
        for kind, kind_runs in runs.items():
            result[kind] = median_run(kind_runs)
        result["per_rep_rows_per_s"] = {
            kind: [r["rows_per_s"] for r in kind_runs] for kind, kind_runs in runs.items()
        }
        ours_runs = runs["anabranch"]
        limited = run_noop(ours(args.batch_rows), str(tmp / "cp-2"), available_now=True)
        result["anabranch_max_records"] = rate(limited)
        result["anabranch_max_records"]["maxRecordsPerTrigger"] = args.batch_rows
        print("anabranch limited", result["anabranch_max_records"], flush=True)

        rate_df = (
            spark.readStream.format("rate-micro-batch")
            .option("rowsPerBatch", str(args.messages)).option("numPartitions", "2").load()
        )  # fmt: skip
        result["spark_rate"] = rate(
            run_noop(rate_df, str(tmp / "cp-4"), available_now=False, max_batches=3)
        )
        print("rate", result["spark_rate"], flush=True)
        result["anabranch_read_every_message"] = all(
            r["rows"] == args.messages for r in [*ours_runs, result["anabranch_max_records"]]
        )
        ours_rate = result["anabranch"]["rows_per_s"] or 0
        for kind in ("python_arrow_memory", "python_arrow_memory_2col"):
            ceiling = result[kind]["rows_per_s"] or 1
            result[kind.replace("python_arrow_memory", "anabranch_vs_python_arrow")] = round(
                ours_rate / ceiling, 3
            )
        spark.stop()
    finally:
        pid = proc.pid
        result["broker_peak_rss_mb"] = round((peak_rss_bytes(pid) or 0) / 1e6) if pid else None
        asyncio.run(proc.stop())
    print(json.dumps(result))


if __name__ == "__main__":
    main()
