"""Tail cache: broker memory with many written topics, and what the budget costs readers.

Per repetition, two fresh broker processes (standalone, SQLite metadata,
``fsync=always``) in turn, the only difference their ``storage_cache_bytes``:

* ``budget`` — the default (``STORAGE_TAIL_CACHE_TOTAL_BYTES``, 64 MiB over all topics);
* ``per_topic_only`` — the baseline: a budget too large to matter (1 TiB), so each
  ledger keeps up to its own ``STORAGE_TAIL_CACHE_BYTES_MAX`` (32 MiB), as before the
  budget existed.

Our client (``anabranch.aio``) writes ``--topics`` topics one after another,
``--mb-per-topic`` MB each (10 KB messages, flushed every 100), then reads back from
the earliest position (after a short warm-up read of a middle topic): the newest topic
(still cached under both settings) and the oldest one (evicted under the budget: read
from disk, most likely the page cache). Reported: the broker's peak and
final RSS, the write rate, and each read's msgs/s. The ratios are budget / baseline of
the same repetition; medians over ``--reps``. The last line is JSON.

Usage: ``python benchmarks/tail_cache.py [--topics 200] [--mb-per-topic 3] [--reps 3]``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import loadavg, peak_rss_bytes

from anabranch import limits
from anabranch.aio import Client
from anabranch.testing.broker import BrokerProcess

MB = 1_000_000
MESSAGE = b"m" * 10_000
SETTINGS = {
    "budget": limits.STORAGE_TAIL_CACHE_TOTAL_BYTES,
    "per_topic_only": 1 << 40,
}


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


async def read_all(client: Client, topic: str, count: int) -> float:
    """Messages/s of one consumer reading ``count`` messages of ``topic`` from the start."""
    consumer = await client.subscribe(topic, "bench", initial_position="earliest")
    start = time.perf_counter()
    for _ in range(count):
        msg = await consumer.receive(timeout=30)
        assert msg is not None, f"{topic}: a written message never arrived"
        await consumer.acknowledge(msg)
    rate = count / (time.perf_counter() - start)
    await consumer.close()
    return rate


async def one(tmp: Path, cache_bytes: int, args: argparse.Namespace) -> dict[str, Any]:
    broker = BrokerProcess(tmp, env={"ANABRANCH_STORAGE_CACHE_BYTES": str(cache_bytes)})
    await broker.start()
    try:
        assert broker.pid is not None
        per_topic = max(1, args.mb_per_topic * MB // len(MESSAGE))
        topics = [f"persistent://public/default/cache-{i}" for i in range(args.topics)]
        async with Client(broker.service_url) as client:
            start = time.perf_counter()
            for topic in topics:
                producer = await client.create_producer(topic)
                for n in range(per_topic):
                    await producer.send_async(MESSAGE)
                    if n % 100 == 99:
                        await producer.flush()
                await producer.flush()
                await producer.close()
            write_mb_s = args.topics * per_topic * len(MESSAGE) / MB / (time.perf_counter() - start)
            await read_all(client, topics[len(topics) // 2], min(per_topic, 100))  # warm-up
            newest = await read_all(client, topics[-1], per_topic)
            oldest = await read_all(client, topics[0], per_topic)
        peak = peak_rss_bytes(broker.pid) or 0
        final = rss_bytes(broker.pid)
    finally:
        await broker.stop()
    return {
        "peak_rss_mb": peak / 2**20,
        "final_rss_mb": final / 2**20,
        "write_mb_s": write_mb_s,
        "read_newest_msgs_s": newest,
        "read_oldest_msgs_s": oldest,
    }


async def main(args: argparse.Namespace) -> dict[str, Any]:
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in SETTINGS}
    ratios: dict[str, list[float]] = {"peak_rss": [], "read_newest": [], "read_oldest": []}
    with tempfile.TemporaryDirectory(prefix="ab-tailcache-") as tmp:
        for rep in range(args.reps):
            for name, cache_bytes in SETTINGS.items():
                result = await one(Path(tmp) / f"{rep}-{name}", cache_bytes, args)
                runs[name].append(result)
                print(f"rep {rep} {name}: {result}", file=sys.stderr)
            budget, base = runs["budget"][-1], runs["per_topic_only"][-1]
            ratios["peak_rss"].append(budget["peak_rss_mb"] / base["peak_rss_mb"])
            ratios["read_newest"].append(budget["read_newest_msgs_s"] / base["read_newest_msgs_s"])
            ratios["read_oldest"].append(budget["read_oldest_msgs_s"] / base["read_oldest_msgs_s"])
    return {
        "benchmark": "tail_cache",
        "reps": args.reps,
        "topics": args.topics,
        "mb_per_topic": args.mb_per_topic,
        "baseline": "per_topic_only",
        "loadavg": loadavg(),
        **{
            name: {k: statistics.median(r[k] for r in results) for k in results[0]}
            for name, results in runs.items()
        },
        "ratio_budget_vs_baseline": {k: statistics.median(v) for k, v in ratios.items()},
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--topics", type=int, default=200)
    parser.add_argument("--mb-per-topic", type=int, default=3)
    parser.add_argument("--reps", type=int, default=3)
    print(json.dumps(asyncio.run(main(parser.parse_args()))))
