"""Non-persistent vs persistent topics on one broker, official client, one run.

Per repetition (fresh temp dir, fresh broker subprocess with ``fsync=always``; the order of
the two topic kinds alternates per rep): a consumer (Exclusive, receiver queue 1000) drains
in its own thread while a producer publishes ``--messages`` x ``--size`` bytes with
``send_async`` (batching on) and flushes. Reported per kind: the publish rate (every
receipt in), the rate messages reached the consumer, how many arrived (a non-persistent
topic drops what a slow consumer cannot take: the difference is its ``msgDropCounter``),
and publish latency percentiles sampled on every 100th message. The baseline is the
persistent topic in the same run; ratios are medians of per-rep ratios. The broker's peak
RSS (``VmHWM``) is reported beside. The last printed line is one JSON object.

Usage: ``python benchmarks/nonpersistent.py [--quick] [--messages 100000] [--reps 3]``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import pulsar
from _common import loadavg, median_tree, pct, peak_rss_bytes

from anabranch.testing.broker import BrokerProcess

SAMPLE_EVERY = 100
PHASE_S = 120.0
"""Hang guard per phase."""


def log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def run_kind(url: str, topic: str, messages: int, size: int) -> dict[str, Any]:
    quiet = logging.getLogger("pulsar-client")
    quiet.setLevel(logging.WARNING)
    client = pulsar.Client(url, operation_timeout_seconds=30, logger=quiet)
    try:
        consumer = client.subscribe(topic, "bench", receiver_queue_size=1000)
        producer = client.create_producer(
            topic, batching_enabled=True, max_pending_messages=10_000, block_if_queue_full=True
        )
        got = 0
        last_at = time.perf_counter()
        done = threading.Event()

        def drain() -> None:
            nonlocal got, last_at
            quiet_ms = 2000
            while got < messages:
                try:
                    consumer.receive(quiet_ms)
                except pulsar.Timeout:
                    if done.is_set():
                        return
                    continue
                got += 1
                last_at = time.perf_counter()

        thread = threading.Thread(target=drain, daemon=True)
        time.sleep(0.5)  # the consumer's FLOW is in before the first message
        thread.start()
        payload = b"x" * size
        latencies: list[float] = []
        acked = 0
        lock = threading.Lock()
        start = time.perf_counter()
        for i in range(messages):
            if i % SAMPLE_EVERY == 0:
                sent_at = time.perf_counter()

                def on_ack(_res: Any, _id: Any, sent_at: float = sent_at) -> None:
                    nonlocal acked
                    with lock:
                        acked += 1
                        latencies.append((time.perf_counter() - sent_at) * 1000)

                producer.send_async(payload, on_ack)
            else:

                def on_plain(_res: Any, _id: Any) -> None:
                    nonlocal acked
                    with lock:
                        acked += 1

                producer.send_async(payload, on_plain)
            if time.perf_counter() - start > PHASE_S:
                break
        producer.flush()
        publish_s = time.perf_counter() - start
        done.set()
        thread.join(PHASE_S)
        consume_s = max(last_at - start, 1e-9)
        return {
            "publish_msgs_per_s": acked / publish_s,
            "delivered_msgs_per_s": got / consume_s,
            "delivered": got,
            "delivered_fraction": got / messages,
            "publish_ms_p50": pct(latencies, 0.5),
            "publish_ms_p99": pct(latencies, 0.99),
        }
    finally:
        client.close()


async def one_rep(rep: int, messages: int, size: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="np-bench-") as tmp:
        broker = BrokerProcess(Path(tmp) / "data")
        await broker.start()
        try:
            out: dict[str, Any] = {}
            kinds = ["persistent", "non-persistent"]
            if rep % 2:
                kinds.reverse()
            for kind in kinds:
                topic = f"{kind}://public/default/bench-{rep}"
                log(f"rep {rep}: {kind}")
                out[kind] = await asyncio.to_thread(
                    run_kind, broker.service_url, topic, messages, size
                )
            pid = broker.pid
            out["broker_peak_rss_mb"] = (peak_rss_bytes(pid) or 0) / 2**20 if pid else None
            out["publish_ratio"] = (
                out["non-persistent"]["publish_msgs_per_s"]
                / out["persistent"]["publish_msgs_per_s"]
            )
            return out
        finally:
            await broker.stop()


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--messages", type=int, default=100_000)
    parser.add_argument("--size", type=int, default=100)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="20,000 messages, 2 reps")
    args = parser.parse_args()
    if args.quick:
        args.messages, args.reps = 20_000, 2
    load_before = loadavg()
    reps = [await one_rep(rep, args.messages, args.size) for rep in range(args.reps)]
    summary = median_tree(reps)
    summary["publish_ratio"] = statistics.median(r["publish_ratio"] for r in reps)
    result = {
        "benchmark": "nonpersistent",
        "baseline": "persistent topic, same broker, same run",
        "messages": args.messages,
        "size": args.size,
        "reps": args.reps,
        "loadavg_before": load_before,
        **summary,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    asyncio.run(main())
