"""Autoscale: a step load (low -> 10x -> low) on a scalable topic that starts at 1 segment.

Per repetition (fresh temp dir, a fresh standalone broker subprocess evaluating its policy
every ``--interval`` s):

1. create ``topic://public/default/auto-<rep>`` with 1 segment and a stream subscription,
   and set its autoscale policy over the admin API (enabled; split above ``--threshold``
   msg/s in per segment sustained ``--sustain`` s; buddies merge below half of it);
2. produce open-loop (coordinated omission corrected) over ``--keys`` keys: ``--low``
   msg/s for ``--warmup`` s, then ``10 x low`` for ``--high-seconds`` s, then ``--low``
   again until the topic is back at 1 segment (at most ``--merge-wait`` s);
3. a stream consumer reads throughout; afterwards every (key, seq) must have arrived
   exactly once and, per key, in order.

Figures per repetition: time from the step up to the first split (the split children's
``createdAtMs`` in the layout), segments reached, publish (ack) latency p99 during the high
phase (the transition) and before it, time from the step down until the topic is back at
one segment, lost / duplicated / reordered. The baseline, same broker, same run: the same
step load on a topic whose autoscale is off (it stays at 1 segment): its p99 in the high
phase. Medians over ``--reps``; the broker's peak RSS; the last printed line is one JSON
object.

Usage: ``python benchmarks/autoscale.py [--reps 3] [--quick]``
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
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


@dataclass(frozen=True, slots=True)
class Config:
    reps: int
    low: float
    keys: int
    warmup: float
    high_seconds: float
    merge_wait: float
    threshold: float
    sustain: float
    interval: float
    size: int


def log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def policy(cfg: Config, enabled: bool) -> dict[str, Any]:
    return {
        "enabled": enabled,
        "splitMsgRateIn": cfg.threshold,
        "splitThroughputIn": 0,
        "minSegments": 1,
        "maxSegments": 16,
        "mergeLowWater": 0.5,
        "splitSustainMs": round(cfg.sustain * 1000),
        "mergeSustainMs": round(cfg.sustain * 1500),
        "splitCooldownMs": round(cfg.sustain * 1000),
        "mergeCooldownMs": round(cfg.sustain * 2500),
    }


async def call(session: aiohttp.ClientSession, method: str, url: str, body: Any = None) -> Any:
    async with session.request(method, url, json=body) as resp:
        text = await resp.text()
        if resp.status >= 300:
            raise RuntimeError(f"{method} {url} -> {resp.status}: {text}")
        return json.loads(text) if text else None


async def consume(
    client: Client, topic: str, received: list[tuple[int, int]], done: asyncio.Event
) -> None:
    stream = await client.subscribe_stream(topic, subscription="audit", consumer_name="c1")
    try:
        idle_since = clock()
        while True:
            msg = await stream.receive(timeout=0.5)
            if msg is None:
                if done.is_set() and clock() - idle_since > 2e9:
                    break
                continue
            idle_since = clock()
            key_index, seq, _ = PAYLOAD.unpack_from(msg.value)
            received.append((key_index, seq))
            # Every message: a sealed parent's children are handed out once it is drained.
            await stream.acknowledge_cumulative(msg)
    finally:
        await stream.close()


async def watch_layout(
    session: aiohttp.ClientSession, base: str, counts: list[tuple[float, int]], stop: asyncio.Event
) -> None:
    """(wall s, active segments) every 100 ms."""
    while not stop.is_set():
        layout = await call(session, "GET", base)
        active = sum(1 for s in layout["segments"].values() if s["state"] == "ACTIVE")
        counts.append((time.time(), active))
        await asyncio.sleep(0.1)


async def step_rep(cfg: Config, broker: BrokerProcess, name: str, enabled: bool) -> dict[str, Any]:
    topic = f"topic://public/default/{name}"
    base = f"http://{broker.host}:{broker.http_port}/admin/v2/scalable/public/default/{name}"
    intended_ns: list[int] = []
    acked_ns: list[int] = []
    phase_of: list[str] = []
    errors = 0
    received: list[tuple[int, int]] = []
    counts: list[tuple[float, int]] = []
    done, stop = asyncio.Event(), asyncio.Event()
    marks: dict[str, float] = {}
    async with aiohttp.ClientSession() as session, Client(broker.service_url) as client:
        await call(session, "PUT", f"{base}?numInitialSegments=1")
        await call(session, "PUT", f"{base}/subscriptions/audit")
        await call(session, "POST", f"{base}/autoscale", policy(cfg, enabled))
        producer = await client.create_producer(topic, batch_delay_s=0.001)
        consumer = asyncio.ensure_future(consume(client, topic, received, done))
        watcher = asyncio.ensure_future(watch_layout(session, base, counts, stop))

        def on_ack(index: int, fut: asyncio.Future[Any]) -> None:
            nonlocal errors
            if fut.cancelled() or fut.exception() is not None:
                errors += 1
            else:
                acked_ns[index] = clock()

        seqs = [0] * cfg.keys
        index = 0

        async def produce(rate: float, seconds: float, phase: str, until_one: bool) -> None:
            nonlocal index
            start = clock()
            interval = 1e9 / rate
            i = 0
            while True:
                intended = start + int(i * interval)
                if intended - start >= seconds * 1e9:
                    break
                if until_one and i % 50 == 0 and counts and counts[-1][1] == 1:
                    break
                delay = (intended - clock()) / 1e9
                if delay > 0:
                    await asyncio.sleep(delay)
                k = index % cfg.keys
                body = PAYLOAD.pack(k, seqs[k], intended) + bytes(max(0, cfg.size - PAYLOAD.size))
                seqs[k] += 1
                intended_ns.append(intended)
                acked_ns.append(0)
                phase_of.append(phase)
                fut = await producer.send_async(body, key=f"key-{k}")
                fut.add_done_callback(partial(on_ack, index))
                index += 1
                i += 1

        await produce(cfg.low, cfg.warmup, "low", False)
        marks["up"] = time.time()
        await produce(cfg.low * 10, cfg.high_seconds, "high", False)
        marks["down"] = time.time()
        await asyncio.sleep(1.0)  # let the watcher see the last split
        await produce(cfg.low, cfg.merge_wait, "after", enabled)
        await producer.flush()
        marks["end"] = time.time()
        done.set()
        await asyncio.wait_for(consumer, IDLE_LIMIT_S * 3)
        stop.set()
        await watcher
        layout = await call(session, "GET", base)
        await producer.close()

    def p99(phase: str) -> float | None:
        lat = [
            (acked_ns[i] - intended_ns[i]) / 1e6
            for i in range(len(intended_ns))
            if acked_ns[i] and phase_of[i] == phase
        ]
        return round(pct(lat, 0.99), 3) if lat else None

    children = [s for s in layout["segments"].values() if s["createdAtEpoch"] > 0]
    first_split_ms = min((s["createdAtMs"] for s in children), default=None)
    reached = max((n for _, n in counts), default=1)
    back_at = next((t for t, n in counts if t >= marks["down"] and n == 1), None)
    seen: dict[tuple[int, int], int] = {}
    reorders = 0
    last_seq = [-1] * cfg.keys
    for k, seq in received:
        seen[(k, seq)] = seen.get((k, seq), 0) + 1
        if seq < last_seq[k]:
            reorders += 1
        last_seq[k] = max(last_seq[k], seq)
    expected = {(k, s) for k in range(cfg.keys) for s in range(seqs[k])}
    result = {
        "messages": len(intended_ns),
        "send_errors": errors,
        "first_split_after_step_s": (
            round(first_split_ms / 1000 - marks["up"], 3) if first_split_ms else None
        ),
        "segments_reached": reached,
        "ack_p99_low_ms": p99("low"),
        "ack_p99_transition_ms": p99("high"),
        "merged_back_after_step_down_s": (
            round(back_at - marks["down"], 3) if back_at is not None and reached > 1 else None
        ),
        "lost": len(expected - seen.keys()),
        "duplicates": sum(c - 1 for c in seen.values() if c > 1),
        "reordered": reorders,
    }
    log(f"  {name}: {result}")
    return result


async def main_async(cfg: Config) -> dict[str, Any]:
    reps: list[dict[str, Any]] = []
    baselines: list[dict[str, Any]] = []
    rss: list[float] = []
    env = {"ANABRANCH_SCALABLE_AUTOSCALE_INTERVAL_S": str(cfg.interval)}
    with tempfile.TemporaryDirectory(prefix="autoscale-") as tmp:
        for rep in range(cfg.reps):
            broker = BrokerProcess(Path(tmp) / f"broker-{rep}", env=env)
            try:
                await broker.start()
                baselines.append(await step_rep(cfg, broker, f"static-{rep}", enabled=False))
                reps.append(await step_rep(cfg, broker, f"auto-{rep}", enabled=True))
                peak = peak_rss_bytes(broker.pid) if broker.pid is not None else None
                if peak is not None:
                    rss.append(peak / 1e6)
            finally:
                with contextlib.suppress(Exception):
                    await broker.stop()
    return {
        "benchmark": "autoscale",
        "reps": cfg.reps,
        "low_msgs_per_s": cfg.low,
        "high_msgs_per_s": cfg.low * 10,
        "split_threshold_msgs_per_s": cfg.threshold,
        "sustain_s": cfg.sustain,
        "interval_s": cfg.interval,
        "median": median_tree(reps),
        "baseline_static_1_segment": median_tree(baselines),
        "total_lost": sum(r["lost"] for r in reps),
        "total_duplicates": sum(r["duplicates"] for r in reps),
        "total_reordered": sum(r["reordered"] for r in reps),
        "broker_peak_rss_mb": round(statistics.median(rss), 1) if rss else None,
    }


def parse_args(argv: list[str] | None = None) -> Config:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--low", type=float, default=200.0, help="msg/s before and after the step")
    p.add_argument("--keys", type=int, default=64)
    p.add_argument("--warmup", type=float, default=4.0)
    p.add_argument("--high-seconds", type=float, default=12.0)
    p.add_argument("--merge-wait", type=float, default=40.0)
    p.add_argument("--threshold", type=float, default=600.0, help="split msg/s per segment")
    p.add_argument("--sustain", type=float, default=2.0)
    p.add_argument("--interval", type=float, default=0.5)
    p.add_argument("--size", type=int, default=100)
    p.add_argument("--quick", action="store_true", help="1 rep")
    a = p.parse_args(argv)
    if a.quick:
        a.reps = 1
    return Config(
        a.reps, a.low, a.keys, a.warmup, a.high_seconds, a.merge_wait, a.threshold, a.sustain,
        a.interval, a.size,
    )  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(argv)
    result = asyncio.run(main_async(cfg))
    print(json.dumps(result, sort_keys=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
