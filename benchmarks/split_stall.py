"""Split stall: what a producer at a fixed rate sees while its scalable topic splits and merges.

Per repetition (fresh temp dir, a fresh standalone broker subprocess, ``fsync=always``):

1. create ``topic://public/default/stall-<rep>`` with 2 segments and a stream subscription;
2. produce ``--rate`` msg/s (open loop, coordinated omission corrected) over ``--keys`` keys
   for ``--seconds`` s with our scalable producer; each payload carries (key, seq, intended
   send time); every ack time is recorded;
3. at ``--split-at`` s split the segment owning the keyspace's lower half; at ``--merge-at`` s
   merge its two children back (admin REST, timed round trip = the broker-side duration plus
   one loopback HTTP hop);
4. a stream consumer reads concurrently; afterwards every (key, seq) must have arrived
   exactly once and, per key, in order.

Figures per repetition: max gap between consecutive acks over the run, ack latency p50/p99
before the split and in the second around it (and around the merge), split and merge
duration, loss / duplicates / reorderings. Then the cost of the scalable layer: publish and
consume msgs/s of our client on a 4-segment scalable topic vs a persistent topic, same
broker, same run. Medians over ``--reps``; the last printed line is one JSON object.

Usage: ``python benchmarks/split_stall.py [--reps 5] [--quick]``
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import statistics
import struct
import sys
import tempfile
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import aiohttp
from _common import median_tree, pct, peak_rss_bytes

from anabranch.aio import Client
from anabranch.testing.broker import BrokerProcess

clock = time.perf_counter_ns
PAYLOAD = struct.Struct("<IIq")
"""key index, sequence number within the key, intended send time (perf_counter_ns)."""
IDLE_LIMIT_S = 20.0
"""The consumer gives up when nothing arrives for this long after the producer stopped."""


@dataclass(frozen=True, slots=True)
class Config:
    reps: int
    rate: float
    keys: int
    seconds: float
    split_at: float
    merge_at: float
    throughput_messages: int
    size: int


def log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def ms(ns: float) -> float:
    return round(ns / 1e6, 3)


def key_name(index: int) -> str:
    return f"key-{index}"


async def admin(session: aiohttp.ClientSession, method: str, url: str) -> float:
    """Issue one admin call; return its round-trip time in ms (raise on a non-2xx)."""
    start = clock()
    async with session.request(method, url) as resp:
        body = await resp.text()
        if resp.status >= 300:
            raise RuntimeError(f"{method} {url} -> {resp.status}: {body}")
    return ms(clock() - start)


async def segment_for(session: aiohttp.ClientSession, base: str, hash_value: int) -> int:
    """The id of the active segment whose range holds ``hash_value``."""
    async with session.get(base) as resp:
        layout = await resp.json()
    for seg in layout["segments"].values():
        r = seg["hashRange"]
        if seg["state"] == "ACTIVE" and r["start"] <= hash_value <= r["end"]:
            return int(seg["segmentId"])
    raise RuntimeError(f"no active segment holds {hash_value:#06x}")


async def children_of(session: aiohttp.ClientSession, base: str, segment_id: int) -> list[int]:
    async with session.get(base) as resp:
        layout = await resp.json()
    return [int(c) for c in layout["segments"][str(segment_id)]["childIds"]]


async def consume(
    client: Client, topic: str, expected: int, received: list[tuple[int, int]], done: asyncio.Event
) -> None:
    stream = await client.subscribe_stream(topic, subscription="stall", consumer_name="c1")
    try:
        idle_since = clock()
        unacked = None
        while len(received) < expected or not done.is_set():
            msg = await stream.receive(timeout=0.5)
            if msg is None:
                if unacked is not None:
                    # Idle: ack what is held, or a drained parent's children never come.
                    await stream.acknowledge_cumulative(unacked)
                    unacked = None
                if done.is_set() and clock() - idle_since > IDLE_LIMIT_S * 1e9:
                    break
                continue
            idle_since = clock()
            key_index, seq, _ = PAYLOAD.unpack_from(msg.value)
            received.append((key_index, seq))
            unacked = msg
            if len(received) % 256 == 0:
                await stream.acknowledge_cumulative(msg)
                unacked = None
            if done.is_set() and len(received) >= expected:
                break
    finally:
        await stream.close()


async def stall_rep(cfg: Config, broker: BrokerProcess, rep: int) -> dict[str, Any]:
    name = f"stall-{rep}"
    topic = f"topic://public/default/{name}"
    http = f"http://{broker.host}:{broker.http_port}"
    base = f"{http}/admin/v2/scalable/public/default/{name}"
    total = int(cfg.rate * cfg.seconds)
    intended_ns: list[int] = [0] * total
    acked_ns: list[int] = [0] * total
    errors = 0
    received: list[tuple[int, int]] = []
    done = asyncio.Event()
    async with aiohttp.ClientSession() as session, Client(broker.service_url) as client:
        await admin(session, "PUT", f"{base}?numInitialSegments=2")
        await admin(session, "PUT", f"{base}/subscriptions/stall")
        producer = await client.create_producer(topic, batch_delay_s=0.001)
        consumer = asyncio.ensure_future(consume(client, topic, total, received, done))
        timings: dict[str, float] = {}

        async def reshape() -> None:
            start = clock()
            await asyncio.sleep(cfg.split_at)
            target = await segment_for(session, base, 0x0000)
            timings["split_at_ns"] = clock() - start
            timings["split_ms"] = await admin(session, "POST", f"{base}/split/{target}")
            first, second = await children_of(session, base, target)
            await asyncio.sleep(max(0.0, cfg.merge_at - (clock() - start) / 1e9))
            timings["merge_at_ns"] = clock() - start
            timings["merge_ms"] = await admin(session, "POST", f"{base}/merge/{first}/{second}")

        def on_ack(index: int, fut: asyncio.Future[Any]) -> None:
            nonlocal errors
            if fut.cancelled() or fut.exception() is not None:
                errors += 1
            else:
                acked_ns[index] = clock()

        reshaper = asyncio.ensure_future(reshape())
        seqs = [0] * cfg.keys
        start = clock()
        interval = 1e9 / cfg.rate
        for i in range(total):
            intended = start + int(i * interval)
            delay = (intended - clock()) / 1e9
            if delay > 0:
                await asyncio.sleep(delay)
            k = i % cfg.keys
            payload = PAYLOAD.pack(k, seqs[k], intended) + bytes(max(0, cfg.size - PAYLOAD.size))
            seqs[k] += 1
            intended_ns[i] = intended
            fut = await producer.send_async(payload, key=key_name(k))
            fut.add_done_callback(partial(on_ack, i))
        await producer.flush()
        await asyncio.sleep(0)
        await reshaper
        done.set()
        await asyncio.wait_for(consumer, IDLE_LIMIT_S * 3)
        await producer.close()

    acks = sorted(t for t in acked_ns if t)
    gaps = [b - a for a, b in itertools.pairwise(acks)]
    split_t = start + int(timings["split_at_ns"])
    merge_t = start + int(timings["merge_at_ns"])

    def latencies(lo: int, hi: int) -> list[float]:
        return [
            (acked_ns[i] - intended_ns[i]) / 1e6
            for i in range(total)
            if acked_ns[i] and lo <= intended_ns[i] < hi
        ]

    before = latencies(start, split_t)
    around_split = latencies(split_t - 500_000_000, split_t + 500_000_000)
    around_merge = latencies(merge_t - 500_000_000, merge_t + 500_000_000)
    seen: dict[tuple[int, int], int] = {}
    reorders = 0
    last_seq = [-1] * cfg.keys
    for k, seq in received:
        seen[(k, seq)] = seen.get((k, seq), 0) + 1
        if seq < last_seq[k]:
            reorders += 1
        last_seq[k] = max(last_seq[k], seq)
    expected = {(i % cfg.keys, i // cfg.keys) for i in range(total)}
    lost = len(expected - seen.keys())
    duplicates = sum(c - 1 for c in seen.values() if c > 1)
    result = {
        "messages": total,
        "send_errors": errors,
        "max_ack_gap_ms": ms(max(gaps)) if gaps else None,
        "ack_p50_before_ms": round(pct(before, 0.50), 3) if before else None,
        "ack_p99_before_ms": round(pct(before, 0.99), 3) if before else None,
        "ack_p99_around_split_ms": round(pct(around_split, 0.99), 3) if around_split else None,
        "ack_p99_around_merge_ms": round(pct(around_merge, 0.99), 3) if around_merge else None,
        "split_ms": timings["split_ms"],
        "merge_ms": timings["merge_ms"],
        "lost": lost,
        "duplicates": duplicates,
        "reordered": reorders,
    }
    log(f"  rep {rep}: {result}")
    return result


async def publish_consume(client: Client, topic: str, cfg: Config, sub: str) -> dict[str, float]:
    """Saturation publish then consume of ``cfg.throughput_messages`` on ``topic``."""
    n = cfg.throughput_messages
    producer = await client.create_producer(topic)
    payload = bytes(cfg.size)
    start = clock()
    for i in range(n):
        await producer.send_async(payload, key=key_name(i % 64))
    await producer.flush()
    publish_s = (clock() - start) / 1e9
    await producer.close()
    if topic.startswith("topic://"):
        consumer: Any = await client.subscribe_stream(topic, subscription=sub, consumer_name=sub)
    else:
        consumer = await client.subscribe(topic, sub, initial_position="earliest")
    got = 0
    start = clock()
    last: Any = None
    while got < n:
        msg = await consumer.receive(timeout=IDLE_LIMIT_S)
        if msg is None:
            break
        got += 1
        last = msg
        if got % 1000 == 0:
            await consumer.acknowledge_cumulative(msg)
    consume_s = (clock() - start) / 1e9
    if last is not None:
        await consumer.acknowledge_cumulative(last)
    await consumer.close()
    return {
        "publish_msgs_per_s": round(n / publish_s),
        "consume_msgs_per_s": round(got / consume_s) if consume_s else 0.0,
        "consumed": got,
    }


async def layer_cost(cfg: Config, broker: BrokerProcess) -> dict[str, Any]:
    http = f"http://{broker.host}:{broker.http_port}"
    async with aiohttp.ClientSession() as session:
        await admin(
            session, "PUT", f"{http}/admin/v2/scalable/public/default/cost?numInitialSegments=4"
        )
        await admin(
            session, "PUT", f"{http}/admin/v2/scalable/public/default/cost/subscriptions/cost"
        )
    async with Client(broker.service_url) as client:
        persistent = await publish_consume(client, "persistent://public/default/cost", cfg, "cost")
        scalable = await publish_consume(client, "topic://public/default/cost", cfg, "cost")
    return {
        "persistent": persistent,
        "scalable_4_segments": scalable,
        "publish_ratio": round(
            scalable["publish_msgs_per_s"] / persistent["publish_msgs_per_s"], 3
        ),
        "consume_ratio": round(
            scalable["consume_msgs_per_s"] / max(1.0, persistent["consume_msgs_per_s"]), 3
        ),
    }


async def main_async(cfg: Config) -> dict[str, Any]:
    reps: list[dict[str, Any]] = []
    costs: list[dict[str, Any]] = []
    rss: list[float] = []
    with tempfile.TemporaryDirectory(prefix="split-stall-") as tmp:
        for rep in range(cfg.reps):
            broker = BrokerProcess(Path(tmp) / f"broker-{rep}")
            try:
                await broker.start()
                reps.append(await stall_rep(cfg, broker, rep))
                costs.append(await layer_cost(cfg, broker))
                log(f"  layer cost: {costs[-1]}")
                peak = peak_rss_bytes(broker.pid) if broker.pid is not None else None
                if peak is not None:
                    rss.append(peak / 1e6)
            finally:
                with contextlib.suppress(Exception):
                    await broker.stop()
    summary = median_tree(reps)
    return {
        "benchmark": "split_stall",
        "reps": cfg.reps,
        "rate_msgs_per_s": cfg.rate,
        "keys": cfg.keys,
        "median": summary,
        "worst_max_ack_gap_ms": max(r["max_ack_gap_ms"] or 0.0 for r in reps),
        "total_lost": sum(r["lost"] for r in reps),
        "total_duplicates": sum(r["duplicates"] for r in reps),
        "total_reordered": sum(r["reordered"] for r in reps),
        "layer_cost": median_tree(costs),
        "broker_peak_rss_mb": round(statistics.median(rss), 1) if rss else None,
        "targets": {"max_ack_gap_ms": 100, "split_ms": 50},
    }


def parse_args(argv: list[str] | None = None) -> Config:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--rate", type=float, default=2000.0)
    p.add_argument("--keys", type=int, default=16)
    p.add_argument("--seconds", type=float, default=15.0)
    p.add_argument("--split-at", type=float, default=5.0)
    p.add_argument("--merge-at", type=float, default=10.0)
    p.add_argument("--throughput-messages", type=int, default=100_000)
    p.add_argument("--size", type=int, default=100)
    p.add_argument("--quick", action="store_true", help="1 rep, 6 s, split at 2 s, merge at 4 s")
    a = p.parse_args(argv)
    if a.quick:
        a.reps, a.seconds, a.split_at, a.merge_at, a.throughput_messages = 1, 6.0, 2.0, 4.0, 20_000
    return Config(
        a.reps, a.rate, a.keys, a.seconds, a.split_at, a.merge_at, a.throughput_messages, a.size
    )


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(argv)
    result = asyncio.run(main_async(cfg))
    print(json.dumps(result, sort_keys=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
