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

``--jetstream`` measures the across-machines cluster instead (3 brokers with their own
data directories + a 3-node NATS JetStream cluster, R3 streams, ``sync_interval: always``
+ etcd; ``LocalCluster(storage="jetstream")``):

3. **Stream leader kill**: per repetition a fresh topic, one producer (batching off, one
   send at a time) through a broker that does not own it; after ``WARM_ACKS`` acks the
   NATS node leading the topic's stream is SIGKILLed. Write pause = the longest gap
   between two acknowledgements from the kill on (target ≤ 6 s); failed sends (expected
   0). The node is restarted between repetitions.
4. **Broker failover** on JetStream: as in 1 (target: session TTL + 2 s).
5. **Publish rate through a broker**, JetStream vs files in the same run: one producer
   (batching on, ``send_async``) of ``--messages`` messages of ``--size`` bytes to a
   persistent topic, on the JetStream cluster and on a file-backed 3-broker cluster
   (``LocalCluster`` default, one shared data dir), alternating, ``--tput-reps`` times
   each; medians, with the owning broker's peak RSS.

The last printed line is one JSON object.

Usage: ``python benchmarks/cluster_failover.py [--reps 5] [--session-ttl 3] [--quick]
[--jetstream]``
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import peak_rss_bytes

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


async def leader_kill_once(cluster: LocalCluster, rep: int) -> dict[str, float]:
    """Write pause of one producer when its topic's stream leader is SIGKILLed."""
    assert cluster.nats is not None
    topic = f"persistent://public/default/js-leader-{rep}-{time.time_ns() % 10**6}"
    owner = await cluster.owner_of(topic)
    bootstrap = next(b for b in cluster.brokers if b is not owner)
    acks: list[float] = []
    failed = 0
    stop = asyncio.Event()
    warm = asyncio.Event()
    async with Client(bootstrap.service_url) as client:
        producer = await client.create_producer(topic, batching=False)

        async def send_loop() -> None:
            nonlocal failed
            i = 0
            while not stop.is_set():
                try:
                    await producer.send(f"m{i}".encode())
                except Exception as err:  # counted: the figure says how many failed
                    failed += 1
                    print(f"send failed: {err!r}", file=sys.stderr)
                    continue
                acks.append(time.monotonic())
                i += 1
                if i >= WARM_ACKS:
                    warm.set()

        task = asyncio.ensure_future(send_loop())
        await warm.wait()
        leader = await cluster.stream_leader(topic)
        leader.kill()
        killed = time.monotonic()
        deadline = killed + RECOVERY_TIMEOUT_S
        # Sends must be flowing again for a while after the kill: the pause is over.
        while sum(t > killed for t in acks) < WARM_ACKS:
            if task.done():
                task.result()
            if time.monotonic() > deadline:
                raise TimeoutError(f"no publish within {RECOVERY_TIMEOUT_S}s of the kill")
            await asyncio.sleep(0.01)
        stop.set()
        await task
    last_before = max((t for t in acks if t <= killed), default=killed)
    after = [t for t in acks if t > killed]
    gaps = [b - a for a, b in itertools.pairwise([last_before, *after])]
    cluster.nats.start_node(leader.name)
    await asyncio.to_thread(cluster.nats.wait_ready)
    return {"pause_s": max(gaps), "failed": float(failed)}


async def publish_rate_once(cluster: LocalCluster, messages: int, size: int) -> dict[str, Any]:
    """Messages/s of one batching producer through the broker owning a fresh topic."""
    topic = f"persistent://public/default/js-tput-{time.time_ns() % 10**9}"
    owner = await cluster.owner_of(topic)
    payload = os.urandom(size)
    async with Client(owner.service_url) as client:
        producer = await client.create_producer(topic)
        await producer.send(payload)  # topic loaded, ledger open
        started = time.perf_counter()
        futures = [await producer.send_async(payload) for _ in range(messages)]
        await asyncio.gather(*futures)
        elapsed = time.perf_counter() - started
    return {
        "msgs_per_s": messages / elapsed,
        "mb_per_s": messages * size / elapsed / 1e6,
        "broker_peak_rss_bytes": peak_rss_bytes(owner.pid) if owner.pid else None,
    }


async def main_jetstream(args: argparse.Namespace) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="cluster-bench-js-"))
    result: dict[str, Any] = {
        "mode": "jetstream",
        "session_ttl_s": args.session_ttl,
        "cpus": os.cpu_count(),
        "loadavg_start": os.getloadavg()[0],
        "replicas": 3,
    }
    js = LocalCluster(
        root / "js", 3, session_ttl_s=args.session_ttl, storage="jetstream", nats_nodes=3
    )
    files = LocalCluster(root / "files", 3, session_ttl_s=args.session_ttl)
    await js.start()
    try:
        status, body = await js.http(
            "POST", "/admin/v2/namespaces/public/default/deduplication", json=True
        )
        assert status == 204, body
        pauses, failed = [], []
        for rep in range(args.reps):
            sample = await leader_kill_once(js, rep)
            pauses.append(sample["pause_s"])
            failed.append(sample["failed"])
            print(f"stream leader kill {rep}: {sample}", file=sys.stderr, flush=True)
        result["stream_leader_kill_pause_s"] = summary(pauses, 6.0)
        result["stream_leader_kill_failed_sends"] = sum(failed)
        takeovers = []
        for rep in range(args.reps):
            sample = await takeover_once(js, rep)
            takeovers.append(sample["takeover_s"])
            print(f"broker takeover {rep}: {sample['takeover_s']:.2f} s", file=sys.stderr)
        result["broker_failover_s"] = summary(takeovers, args.session_ttl + 2.0)
        await files.start()
        tput: dict[str, list[dict[str, Any]]] = {"jetstream": [], "file": []}
        for rep in range(args.tput_reps):
            order = [("jetstream", js), ("file", files)]
            if rep % 2:
                order.reverse()
            for name, cluster in order:
                sample = await publish_rate_once(cluster, args.messages, args.size)
                tput[name].append(sample)
                print(f"publish {name} {rep}: {sample}", file=sys.stderr, flush=True)
        for name, samples in tput.items():
            result[f"publish_{name}"] = {
                "msgs_per_s": median([s["msgs_per_s"] for s in samples]),
                "mb_per_s": median([s["mb_per_s"] for s in samples]),
                "broker_peak_rss_bytes": max((s["broker_peak_rss_bytes"] or 0) for s in samples),
            }
        result["jetstream_vs_file"] = (
            result["publish_jetstream"]["msgs_per_s"] / result["publish_file"]["msgs_per_s"]
        )
        result["messages"] = args.messages
        result["size_bytes"] = args.size
        result["loadavg_end"] = os.getloadavg()[0]
    finally:
        await js.stop()
        await files.stop()
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--tput-reps", type=int, default=3)
    parser.add_argument("--session-ttl", type=float, default=3.0)
    parser.add_argument("--messages", type=int, default=40_000)
    parser.add_argument("--size", type=int, default=256)
    parser.add_argument("--quick", action="store_true", help="2 takeovers, 1 throughput rep")
    parser.add_argument(
        "--jetstream", action="store_true", help="the JetStream cluster (see the docstring)"
    )
    ns = parser.parse_args()
    if ns.quick:
        ns.reps, ns.tput_reps, ns.messages = 2, 1, 8_000
    run = main_jetstream if ns.jetstream else main
    print(json.dumps(asyncio.run(run(ns)), sort_keys=True))
