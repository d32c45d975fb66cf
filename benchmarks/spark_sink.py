"""Spark sink benchmark: rows/s of ``writeStream.format("anabranch")`` with
``deliveryGuarantee=exactly_once`` next to ``at_least_once``, in one run on one local[2]
session against one broker process.

1. A broker subprocess (``BrokerProcess``, fsync=never) with two 2-segment scalable output
   topics (one per guarantee).
2. The input is the trivial in-memory Python Arrow source of ``benchmarks/spark_source.py``
   (``value binary`` of S bytes, ``position long``), with ``key = position % 1000``: the
   source costs next to nothing, so the difference is the sink's.
3. Each guarantee writes N rows under ``Trigger.AvailableNow`` in micro-batches of
   ``--batch-rows``; the two alternate ``--reps`` times after ``--warmup`` uncounted runs;
   rows/s is rows over summed ``triggerExecution``; medians are reported, and the ratio
   exactly_once / at_least_once of the medians.
4. Per-batch commit overhead: 2-row micro-batches (21 batches, batch 0 left out), mean
   ``triggerExecution`` and ``addBatch`` of each guarantee; the difference is what a batch
   transaction costs per micro-batch (get-or-create, resume, commit CAS).
5. Every run's output is counted with a read-committed reader afterwards (exactly N per
   exactly_once run).

The broker's peak RSS (``VmHWM``) is reported. The last printed line is one JSON object.

Usage: ``python benchmarks/spark_sink.py [--messages 500000] [--size 100] [--reps 3]``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import peak_rss_bytes
from spark_source import memory_source

from anabranch.testing.broker import BrokerProcess
from pyspark_anabranch import _io

GUARANTEES = ("exactly_once", "at_least_once")


def run(df: Any, opts: dict[str, str], checkpoint: str, max_batches: int | None) -> list[Any]:
    """Write ``df`` with ``opts``; the progress reports of its batches."""
    writer = (
        df.writeStream.format("anabranch").options(**opts).option("checkpointLocation", checkpoint)
    )
    if max_batches is None:
        query = writer.trigger(availableNow=True).start()
        query.awaitTermination()
        return list(query.recentProgress)
    query = writer.trigger(processingTime="0 seconds").start()
    try:
        while len([p for p in query.recentProgress if p["numInputRows"]]) < max_batches:
            time.sleep(0.1)
    finally:
        query.stop()
    return [p for p in query.recentProgress if p["numInputRows"]]


def rate(progress: list[Any]) -> dict[str, Any]:
    rows = sum(p["numInputRows"] for p in progress)
    seconds = sum(p["durationMs"]["triggerExecution"] for p in progress) / 1000
    return {
        "rows": rows,
        "batches": len([p for p in progress if p["numInputRows"]]),
        "seconds": round(seconds, 3),
        "rows_per_s": round(rows / seconds) if seconds else None,
    }


def overhead(progress: list[Any]) -> dict[str, float]:
    steady = progress[1:]  # batch 0 starts the Python workers
    return {
        "trigger_ms": round(
            statistics.mean(p["durationMs"]["triggerExecution"] for p in steady), 1
        ),
        "add_batch_ms": round(statistics.mean(p["durationMs"]["addBatch"] for p in steady), 1),
    }


def count_committed(service_url: str, topic: str) -> int:
    """Messages a read-committed reader sees (until 2 s without one)."""
    client = _io.client_for(service_url)

    async def go() -> int:
        reader = await client.create_checkpoint_consumer(topic)
        n = 0
        try:
            while await reader.receive(timeout=2.0) is not None:
                n += 1
        finally:
            await reader.close()
        return n

    return _io.run(go())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--messages", type=int, default=500_000)
    parser.add_argument("--size", type=int, default=100)
    parser.add_argument("--batch-rows", type=int, default=100_000)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1, help="uncounted runs of each first")
    args = parser.parse_args()
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["SPARK_LOCAL_IP"] = "127.0.0.1"
    tmp = Path(tempfile.mkdtemp(prefix="spark-sink-bench-"))
    proc = BrokerProcess(tmp / "data", fsync="never")
    asyncio.run(proc.start())
    result: dict[str, Any] = {
        "messages": args.messages,
        "size": args.size,
        "batch_rows": args.batch_rows,
    }
    try:
        admin_url = f"http://127.0.0.1:{proc.http_port}"
        from pyspark.sql import SparkSession
        from pyspark.sql import functions as F

        spark = (
            SparkSession.builder.master("local[2]")
            .config("spark.ui.enabled", "false")
            .config("spark.ui.showConsoleProgress", "false")
            .config("spark.sql.shuffle.partitions", "2")
            .getOrCreate()
        )
        spark.sparkContext.setLogLevel("ERROR")

        def source(total: int, batch: int) -> Any:
            made = memory_source(total, batch, args.size, full=False)
            spark.dataSource.register(made)
            df = spark.readStream.format(made.name()).load()
            return df.select((F.col("position") % 1000).cast("string").alias("key"), "value")

        runs: dict[str, list[dict[str, Any]]] = {g: [] for g in GUARANTEES}
        counted: dict[str, list[int]] = {g: [] for g in GUARANTEES}
        for rep in range(args.warmup + args.reps):
            for guarantee in GUARANTEES:
                topic = f"topic://public/default/sink-bench-{guarantee.replace('_', '-')}-{rep}"
                _io.run(_io.admin_for(admin_url).create_scalable_topic(topic, 2))
                opts = {
                    "serviceUrl": proc.service_url,
                    "adminUrl": admin_url,
                    "topic": topic,
                    "deliveryGuarantee": guarantee,
                }
                df = source(args.messages, args.batch_rows)
                got = rate(run(df, opts, str(tmp / f"cp-{guarantee}-{rep}"), None))
                print(guarantee, rep, got, flush=True)
                counted[guarantee].append(count_committed(proc.service_url, topic))
                if rep >= args.warmup:
                    runs[guarantee].append(got)
        for guarantee, guarantee_runs in runs.items():
            result[guarantee] = {
                "rows_per_s": statistics.median(r["rows_per_s"] or 0 for r in guarantee_runs),
                "per_rep_rows_per_s": [r["rows_per_s"] for r in guarantee_runs],
                "batches_per_run": guarantee_runs[0]["batches"],
            }
        result["exactly_once_vs_at_least_once"] = round(
            result["exactly_once"]["rows_per_s"] / (result["at_least_once"]["rows_per_s"] or 1),
            3,
        )
        result["exactly_once_output_exact"] = all(
            n == args.messages for n in counted["exactly_once"]
        )
        result["committed_counts"] = counted

        tiny: dict[str, dict[str, float]] = {}
        for guarantee in GUARANTEES:
            topic = f"topic://public/default/sink-bench-tiny-{guarantee.replace('_', '-')}"
            _io.run(_io.admin_for(admin_url).create_scalable_topic(topic, 2))
            opts = {
                "serviceUrl": proc.service_url,
                "adminUrl": admin_url,
                "topic": topic,
                "deliveryGuarantee": guarantee,
            }
            progress = run(source(10**9, 2), opts, str(tmp / f"cp-tiny-{guarantee}"), 21)
            tiny[guarantee] = overhead(progress)
            print("tiny", guarantee, tiny[guarantee], flush=True)
        result["per_batch"] = tiny
        result["per_batch_commit_overhead_ms"] = round(
            tiny["exactly_once"]["trigger_ms"] - tiny["at_least_once"]["trigger_ms"], 1
        )
        spark.stop()
    finally:
        pid = proc.pid
        result["broker_peak_rss_mb"] = round((peak_rss_bytes(pid) or 0) / 1e6) if pid else None
        asyncio.run(proc.stop())
    print(json.dumps(result))


if __name__ == "__main__":
    main()
