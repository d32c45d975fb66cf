"""Awaited sends one at a time: what ``await producer.send(...)`` (and the sync facade's
``send``) costs per message under the default batching, against the same sends with
batching off (the baseline) and against the official client's synchronous send.

Before session 21 an awaited send sat in its open batch for the whole batch delay (10 ms)
before it went out; upstream's synchronous send triggers a flush, and so does ours now (at
the end of the loop turn, so concurrent senders still share a batch).

One broker subprocess (``fsync=always``: every answer waited for an fsync). Per
repetition, ``--messages`` sends to a fresh persistent topic and to a fresh scalable topic
(2 segments, 16 keys) for each case:

* ``ours_batching``: ``anabranch.aio`` producer, default options, ``await send``;
* ``ours_unbatched`` (the baseline): the same with ``batching=False``;
* ``ours_sync``: the blocking facade's ``send`` (default options);
* ``official_batching``: ``pulsar-client``'s ``send`` with ``batching_enabled=True`` (a
  persistent topic only: it refuses ``topic://``).

Reported: p50/p99 latency (ms) and msgs/s per case, medians over ``--reps``; the ratio of
``ours_batching`` to ``ours_unbatched`` msgs/s; the broker's peak RSS. The last printed
line is one JSON object.

Usage: ``python benchmarks/awaited_send.py [--messages 2000] [--reps 3]``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pulsar
from _common import loadavg, median_tree, pct, peak_rss_bytes

import anabranch
from anabranch.admin.client import AdminClient
from anabranch.aio import Client
from anabranch.testing.broker import BrokerProcess

KEYS = [f"key-{i}" for i in range(16)]


def summary(latencies: list[float], elapsed: float) -> dict[str, float]:
    return {
        "p50_ms": round(pct(latencies, 0.5) * 1000, 3),
        "p99_ms": round(pct(latencies, 0.99) * 1000, 3),
        "msgs_per_s": round(len(latencies) / elapsed),
    }


async def timed(n: int, send: Callable[[int], Awaitable[Any]]) -> dict[str, float]:
    latencies = []
    started = time.perf_counter()
    for i in range(n):
        t = time.perf_counter()
        await send(i)
        latencies.append(time.perf_counter() - t)
    return summary(latencies, time.perf_counter() - started)


def timed_sync(n: int, send: Callable[[int], Any]) -> dict[str, float]:
    latencies = []
    started = time.perf_counter()
    for i in range(n):
        t = time.perf_counter()
        send(i)
        latencies.append(time.perf_counter() - t)
    return summary(latencies, time.perf_counter() - started)


async def ours(url: str, topic: str, n: int, **options: Any) -> dict[str, float]:
    async with Client(url) as client:
        producer = await client.create_producer(topic, **options)
        await producer.send(b"warm-up", key=KEYS[0])
        result = await timed(n, lambda i: producer.send(b"m%d" % i, key=KEYS[i % 16]))
        await producer.close()
    return result


def ours_sync(url: str, topic: str, n: int) -> dict[str, float]:
    with anabranch.Client(url) as client:
        producer = client.create_producer(topic)
        producer.send(b"warm-up", key=KEYS[0])
        result = timed_sync(n, lambda i: producer.send(b"m%d" % i, key=KEYS[i % 16]))
        producer.close()
    return result


def official(url: str, topic: str, n: int) -> dict[str, float]:
    client = pulsar.Client(url)
    try:
        producer = client.create_producer(topic, batching_enabled=True)
        producer.send(b"warm-up", partition_key=KEYS[0])
        result = timed_sync(n, lambda i: producer.send(b"m%d" % i, partition_key=KEYS[i % 16]))
        producer.close()
    finally:
        client.close()
    return result


async def one_rep(broker: BrokerProcess, admin: AdminClient, rep: int, n: int) -> Any:
    url = broker.service_url
    out: dict[str, dict[str, Any]] = {}
    for kind in ("persistent", "scalable"):
        cases: dict[str, Any] = {}
        for case in ("ours_batching", "ours_unbatched", "ours_sync", "official_batching"):
            name = f"public/default/{case}-{rep}"
            if kind == "persistent":
                topic = f"persistent://{name}"
            elif case == "official_batching":
                continue  # the official client refuses topic:// names
            else:
                topic = f"topic://{name}"
                await admin.create_scalable_topic(topic, 2)
            if case == "ours_sync":
                cases[case] = await asyncio.to_thread(ours_sync, url, topic, n)
            elif case == "official_batching":
                cases[case] = await asyncio.to_thread(official, url, topic, n)
            else:
                cases[case] = await ours(url, topic, n, batching=case == "ours_batching")
        cases["ratio_batching_vs_unbatched"] = round(
            cases["ours_batching"]["msgs_per_s"] / cases["ours_unbatched"]["msgs_per_s"], 3
        )
        out[kind] = cases
    return out


async def main(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        broker = BrokerProcess(Path(tmp) / "data", fsync="always")
        await broker.start()
        try:
            async with AdminClient(f"http://127.0.0.1:{broker.http_port}") as admin:
                runs = [await one_rep(broker, admin, r, args.messages) for r in range(args.reps)]
            rss = peak_rss_bytes(broker.pid) if broker.pid is not None else None
        finally:
            await broker.stop()
    return {
        "benchmark": "awaited_send",
        "messages": args.messages,
        "reps": args.reps,
        "baseline": "ours_unbatched",
        **median_tree(runs),
        "broker_peak_rss_mb": None if rss is None else round(rss / 2**20, 1),
        "loadavg": round(loadavg(), 2),
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=2000)
    parser.add_argument("--reps", type=int, default=3)
    result = asyncio.run(main(parser.parse_args()))
    print(json.dumps(result))
