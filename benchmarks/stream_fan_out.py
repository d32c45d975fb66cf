"""Stream fan-out: consumers beyond the segment count, Key_Shared dispatch mode vs the
default (one consumer per segment), on a one-segment scalable topic.

Per repetition (fresh temp dir, a fresh standalone broker subprocess):

1. per mode, a fresh one-segment topic and ``--consumers`` stream consumers: **baseline**
   ``exclusive`` (the default mode: one holds the segment, the others idle), **candidate**
   ``key_shared`` (``dispatch_mode="key_shared"``: they share the segment by key);
2. then ``--messages`` messages over ``--keys`` keys from our batching scalable producer
   (mixed-key batches);
3. each consumer's handler awaits ``--handler-ms`` per message (an I/O-bound handler: the
   case where fan-out pays) and acknowledges it; measured: msgs/s until every message was
   acknowledged once, and whether per-key order held. ``--handler-ms 0`` measures the
   dispatch cost alone (ack sets on split batch entries vs whole entries).

Medians over ``--reps``; the broker's peak RSS beside the figures; the last printed line
is one JSON object.

Usage: ``python benchmarks/stream_fan_out.py [--reps 3] [--quick]``
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
from _common import median_tree, peak_rss_bytes

from anabranch.aio import Client
from anabranch.client.stream_consumer import StreamConsumer
from anabranch.testing.broker import BrokerProcess

IDLE_LIMIT_S = 20.0


@dataclass(frozen=True, slots=True)
class Config:
    reps: int
    messages: int
    keys: int
    consumers: int
    handler_ms: float


def log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


async def run_mode(client: Client, http: str, topic: str, mode: str, cfg: Config) -> dict[str, Any]:
    """Create ``topic`` (1 segment), start ``cfg.consumers`` stream consumers in ``mode``,
    then produce; msgs/s from the first send until every message was acknowledged."""
    path = topic.removeprefix("topic://")
    async with aiohttp.ClientSession() as session:
        url = f"{http}/admin/v2/scalable/{path}?numInitialSegments=1"
        async with session.put(url) as response:
            response.raise_for_status()
    streams: list[StreamConsumer] = [
        await client.subscribe_stream(topic, "bench", consumer_name=f"c{i}", dispatch_mode=mode)
        for i in range(cfg.consumers)
    ]
    seen: dict[int, list[int]] = defaultdict(list)
    per_consumer: dict[str, int] = defaultdict(int)
    done = asyncio.Event()
    count = 0
    handler_s = cfg.handler_ms / 1000

    async def run(stream: StreamConsumer) -> None:
        nonlocal count
        while not done.is_set():
            msg = await stream.receive(timeout=0.2)
            if msg is None:
                continue
            if handler_s:
                await asyncio.sleep(handler_s)
            key, seq = (int(x) for x in msg.value.split(b":"))
            seen[key].append(seq)
            await stream.acknowledge(msg)
            count += 1
            per_consumer[stream.consumer_name] += 1
            if count >= cfg.messages:
                done.set()

    await asyncio.sleep(0.5)  # every consumer has joined its segment
    producer = await client.create_producer(topic, batch_delay_s=0.005)
    started = time.perf_counter()
    tasks = [asyncio.create_task(run(s)) for s in streams]
    try:
        futures = []
        for i in range(cfg.messages):
            key = i % cfg.keys
            value = f"{key}:{i // cfg.keys}".encode()
            futures.append(await producer.send_async(value, key=f"k{key}"))
        await asyncio.gather(*futures)
        await asyncio.wait_for(done.wait(), IDLE_LIMIT_S + cfg.messages * handler_s)
    finally:
        elapsed = time.perf_counter() - started
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for stream in streams:
            await stream.close()
        await producer.close()
    return {
        "msgs_per_s": round(count / elapsed, 1),
        "active_consumers": len(per_consumer),
        "per_key_order": all(seqs == sorted(seqs) for seqs in seen.values()),
    }


async def one_rep(cfg: Config, broker: BrokerProcess, rep: int) -> dict[str, Any]:
    http = f"http://{broker.host}:{broker.http_port}"
    async with Client(broker.service_url) as client:
        base = f"topic://public/default/fan-{rep}"
        exclusive = await run_mode(client, http, f"{base}-x", "exclusive", cfg)
        key_shared = await run_mode(client, http, f"{base}-k", "key_shared", cfg)
    log(f"  rep {rep}: exclusive {exclusive}, key_shared {key_shared}")
    return {
        "exclusive": exclusive,
        "key_shared": key_shared,
        "speedup": round(key_shared["msgs_per_s"] / max(1.0, exclusive["msgs_per_s"]), 2),
    }


async def main_async(cfg: Config) -> dict[str, Any]:
    reps: list[dict[str, Any]] = []
    rss: list[float] = []
    with tempfile.TemporaryDirectory(prefix="fan-out-") as tmp:
        for rep in range(cfg.reps):
            broker = BrokerProcess(Path(tmp) / f"broker-{rep}")
            try:
                await broker.start()
                reps.append(await one_rep(cfg, broker, rep))
                peak = peak_rss_bytes(broker.pid) if broker.pid is not None else None
                if peak is not None:
                    rss.append(peak / 1e6)
            finally:
                with contextlib.suppress(Exception):
                    await broker.stop()
    return {
        "benchmark": "stream_fan_out",
        "reps": cfg.reps,
        "messages": cfg.messages,
        "keys": cfg.keys,
        "consumers": cfg.consumers,
        "handler_ms": cfg.handler_ms,
        "baseline": "exclusive",
        "median": median_tree(reps),
        "per_key_order_always": all(
            r[m]["per_key_order"] for r in reps for m in ("exclusive", "key_shared")
        ),
        "broker_peak_rss_mb": round(statistics.median(rss), 1) if rss else None,
    }


def parse_args(argv: list[str] | None = None) -> Config:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--messages", type=int, default=4000)
    p.add_argument("--keys", type=int, default=64)
    p.add_argument("--consumers", type=int, default=4)
    p.add_argument("--handler-ms", type=float, default=1.0)
    p.add_argument("--quick", action="store_true", help="1 rep, 1000 messages")
    a = p.parse_args(argv)
    if a.quick:
        a.reps, a.messages = 1, 1000
    return Config(a.reps, a.messages, a.keys, a.consumers, a.handler_ms)


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(argv)
    result = asyncio.run(main_async(cfg))
    print(json.dumps(result, sort_keys=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
