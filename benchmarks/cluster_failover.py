"""Cluster benchmark: takeover time after SIGKILL of a topic's (and a segment's) owner, and
publish throughput of a 4-segment scalable topic on a 3-broker vs a 1-broker cluster.

1. **Takeover** (3 brokers + etcd, ``LocalCluster``, session TTL ``--session-ttl``): per
   repetition a fresh persistent topic; our client (``anabranch.aio``), bootstrapped at a
   broker that does not own the topic, sends one message at a time (dedup on); after
   ``WARM_ACKS`` acknowledged sends the owner is SIGKILLed. Takeover = time from the kill to
   the acknowledgement of the first send *started* after the kill (a receipt already on its
   way when the owner died does not count; client reconnect backoff is included, since
   that is what an application sees). The killed broker is restarted between repetitions.
   Median of ``--reps`` (default 5). Target: session TTL + 2 s. The same again for the one
   segment of a scalable topic, sent to through a ``ScalableProducer`` (``topic://``).
2. **Throughput**: a scalable topic with 4 segments; one ``ScalableProducer`` (batching
   on, ``send_async``, 64 keys routed by hash to the segments), ``--messages`` messages of
   ``--size`` bytes; msgs/s from first send to last ack. Run on the 3-broker
   cluster (segments spread over the brokers by ownership) and on a 1-broker cluster (same
   etcd-backed code path), alternating, ``--tput-reps`` times each; medians. Everything
   runs on one machine, so no gain is expected from 3 brokers: the ratio shows the cost
   (or not) of routing.

The last printed line is one JSON object.

Usage: ``python benchmarks/cluster_failover.py [--reps 5] [--session-ttl 3] [--quick]``
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

from anabranch.aio import Client
from anabranch.testing.cluster import ClusterBroker, LocalCluster

WARM_ACKS = 50
"""Acknowledged sends before the kill (the producer is connected and steady)."""
KEYS = 64
"""Distinct message keys in the throughput phase (spread over the 4 segments by hash)."""
RECOVERY_TIMEOUT_S = 120.0
"""A repetition whose producer does not recover in this long fails the benchmark."""


async def takeover_once(cluster: LocalCluster, rep: int) -> dict[str, float]:
    topic = f"persistent://public/default/failover-{rep}-{time.time_ns() % 10**6}"
    owner = await cluster.owner_of(topic)
    bootstrap = next(b for b in cluster.brokers if b is not owner)
    acks: list[tuple[float, float]] = []
    """(send started, acknowledged) per message."""
    stop = asyncio.Event()
    async with Client(bootstrap.service_url) as client:
        producer = await client.create_producer(topic, batching=False)

        async def send_loop() -> None:
            i = 0
            while not stop.is_set():
                started = time.monotonic()
                await producer.send(f"m{i}".encode())
                acks.append((started, time.monotonic()))
                i += 1
                if i >= WARM_ACKS:
                    warm.set()

        warm = asyncio.Event()
        task = asyncio.ensure_future(send_loop())
        await warm.wait()
        owner.kill()
        killed = time.monotonic()
        deadline = killed + RECOVERY_TIMEOUT_S
        while not any(started > killed for started, _ in acks):
            if task.done():
                task.result()
            if time.monotonic() > deadline:
                raise TimeoutError(f"no publish within {RECOVERY_TIMEOUT_S}s of the kill")
            await asyncio.sleep(0.005)
        first = next(acked for started, acked in acks if started > killed)
        stop.set()
        await task
    new_owner = await cluster.owner_of(topic, via=bootstrap)
    assert new_owner is not owner
    await owner.start()
    await cluster.wait_registered(len(cluster.brokers))
    return {"takeover_s": first - killed}


async def segment_takeover_once(cluster: LocalCluster, rep: int) -> dict[str, float]:
    """The same measure for a scalable topic's segment: a 1-segment topic, a
    ``ScalableProducer`` (DAG session at a broker that does not own the segment)."""
    topic = f"topic://public/default/seg-failover-{rep}-{time.time_ns() % 10**6}"
    short = topic.split("://", 1)[1]
    status, body, _ = await cluster.http_follow(
        "PUT", f"/admin/v2/scalable/{short}?numInitialSegments=1"
    )
    if status != 204:
        raise RuntimeError(f"create {topic}: {status} {body}")
    segment = f"segment://{short}/0000-ffff-0"
    owner = await cluster.segment_owner(segment)
    if owner is None:
        raise RuntimeError(f"{segment} has no owner after creation")
    bootstrap = next(b for b in cluster.brokers if b is not owner)
    acks: list[tuple[float, float]] = []
    stop = asyncio.Event()
    warm = asyncio.Event()
    async with Client(bootstrap.service_url) as client:
        producer = await client.create_producer(topic, batching=False)

        async def send_loop() -> None:
            i = 0
            while not stop.is_set():
                started = time.monotonic()
                await producer.send(f"m{i}".encode(), key="hot")
                acks.append((started, time.monotonic()))
                i += 1
                if i >= WARM_ACKS:
                    warm.set()

        task = asyncio.ensure_future(send_loop())
        await warm.wait()
        owner.kill()
        killed = time.monotonic()
        deadline = killed + RECOVERY_TIMEOUT_S
        while not any(started > killed for started, _ in acks):
            if task.done():
                task.result()
            if time.monotonic() > deadline:
                raise TimeoutError(f"no publish within {RECOVERY_TIMEOUT_S}s of the kill")
            await asyncio.sleep(0.005)
        first = next(acked for started, acked in acks if started > killed)
        stop.set()
        await task
    await owner.start()
    await cluster.wait_registered(len(cluster.brokers))
    return {"takeover_s": first - killed}


async def throughput_once(cluster: LocalCluster, messages: int, size: int) -> dict[str, Any]:
    topic = f"topic://public/default/tput-{time.time_ns() % 10**9}"
    short = topic.split("://", 1)[1]
    status, body, _ = await cluster.http_follow(
        "PUT", f"/admin/v2/scalable/{short}?numInitialSegments=4"
    )
    if status != 204:
        raise RuntimeError(f"create {topic}: {status} {body}")
    status, layout = await cluster.http("GET", f"/admin/v2/scalable/{short}")
    segments = [
        f"segment://{short}/{s['hashRange']['start']:04x}-{s['hashRange']['end']:04x}-{i}"
        for i, s in layout["segments"].items()
    ]
    payload = os.urandom(size)
    owners = [await cluster.segment_owner(s) for s in segments]
    keys = [f"key-{i}" for i in range(KEYS)]
    async with Client(cluster.brokers[0].service_url) as client:
        producer = await client.create_producer(topic)
        await producer.send(payload, key=keys[0])  # DAG session and first segment up
        started = time.perf_counter()
        futures = [await producer.send_async(payload, key=keys[i % KEYS]) for i in range(messages)]
        await asyncio.gather(*futures)
        elapsed = time.perf_counter() - started
        owners = [await cluster.segment_owner(s) for s in segments]
    spread = len({o.broker_id for o in owners if isinstance(o, ClusterBroker)})
    return {
        "msgs_per_s": messages / elapsed,
        "mb_per_s": messages * size / elapsed / 1e6,
        "brokers_used": spread,
    }


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def summary(samples: list[float], target_s: float) -> dict[str, Any]:
    return {
        "median": median(samples),
        "min": min(samples),
        "max": max(samples),
        "samples": samples,
        "target_s": target_s,
    }


async def main(args: argparse.Namespace) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="cluster-bench-"))
    result: dict[str, Any] = {
        "session_ttl_s": args.session_ttl,
        "cpus": os.cpu_count(),
        "loadavg_start": os.getloadavg()[0],
    }
    three = LocalCluster(root / "three", 3, session_ttl_s=args.session_ttl)
    one = LocalCluster(root / "one", 1, session_ttl_s=args.session_ttl)
    await three.start()
    try:
        status, body = await three.http(
            "POST", "/admin/v2/namespaces/public/default/deduplication", json=True
        )
        assert status == 204, body
        takeovers = []
        for rep in range(args.reps):
            sample = await takeover_once(three, rep)
            takeovers.append(sample["takeover_s"])
            print(f"takeover {rep}: {sample['takeover_s']:.2f} s", file=sys.stderr, flush=True)
        result["takeover_s"] = summary(takeovers, args.session_ttl + 2.0)
        segment_takeovers = []
        for rep in range(args.reps):
            sample = await segment_takeover_once(three, rep)
            segment_takeovers.append(sample["takeover_s"])
            print(f"segment takeover {rep}: {sample['takeover_s']:.2f} s", file=sys.stderr)
        result["segment_takeover_s"] = summary(segment_takeovers, args.session_ttl + 2.0)
        await one.start()
        tput: dict[str, list[dict[str, Any]]] = {"three_brokers": [], "one_broker": []}
        for rep in range(args.tput_reps):
            order = [("three_brokers", three), ("one_broker", one)]
            if rep % 2:
                order.reverse()
            for name, cluster in order:
                sample = await throughput_once(cluster, args.messages, args.size)
                tput[name].append(sample)
                print(f"throughput {name} {rep}: {sample}", file=sys.stderr, flush=True)
        for name, samples in tput.items():
            result[name] = {
                "msgs_per_s": median([s["msgs_per_s"] for s in samples]),
                "mb_per_s": median([s["mb_per_s"] for s in samples]),
                "brokers_used": max(s["brokers_used"] for s in samples),
            }
        result["three_vs_one_ratio"] = (
            result["three_brokers"]["msgs_per_s"] / result["one_broker"]["msgs_per_s"]
        )
        result["messages"] = args.messages
        result["size_bytes"] = args.size
        result["loadavg_end"] = os.getloadavg()[0]
    finally:
        await three.stop()
        await one.stop()
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--tput-reps", type=int, default=3)
    parser.add_argument("--session-ttl", type=float, default=3.0)
    parser.add_argument("--messages", type=int, default=40_000)
    parser.add_argument("--size", type=int, default=256)
    parser.add_argument("--quick", action="store_true", help="2 takeovers, 1 throughput rep")
    ns = parser.parse_args()
    if ns.quick:
        ns.reps, ns.tput_reps, ns.messages = 2, 1, 8_000
    print(json.dumps(asyncio.run(main(ns)), sort_keys=True))
