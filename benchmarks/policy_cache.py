"""Policy cache benchmark: what a producer or consumer costs to create, with the broker's
policy cache (``policy_cache_enabled``, the default) and without it, in the same run.

Every producer and consumer our client creates costs a PARTITIONED_METADATA lookup and a
topic attach, which read the partitioned metadata, the namespace policies and the topic
policies. Per repetition and per metadata backend (SQLite, the embedded default, and a
real etcd) two fresh broker processes (``fsync=always``), cache on and cache off, serve
``--rounds`` sequential create + close of a producer, then of a consumer, on one warm
topic (our client, ``anabranch.aio``); the two alternate per block so the machine's noise
falls on both. Figures: p50/p99 of a create + close, the ratio off/on of the medians
(how much faster the cache makes it), and each broker's peak RSS.

Medians over ``--reps``; the last line is JSON.

Usage: ``python benchmarks/policy_cache.py [--quick] [--reps 3] [--rounds 300] [--skip-etcd]``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import loadavg, median_tree, pct, peak_rss_bytes

from anabranch.aio import Client
from anabranch.testing.broker import BrokerProcess
from anabranch.testing.etcd import EtcdServer

BLOCK = 50
"""Create + close rounds per block; blocks alternate between the two brokers."""


async def rounds(client: Client, topic: str, kind: str, count: int) -> list[float]:
    """``count`` create + close of a producer (``kind`` "producer") or consumer, in ms."""
    out = []
    for _ in range(count):
        start = time.perf_counter()
        if kind == "producer":
            producer = await client.create_producer(topic)
            await producer.close()
        else:
            consumer = await client.subscribe(topic, "bench")
            await consumer.close()
        out.append(1000 * (time.perf_counter() - start))
    return out


async def one_rep(tmp: Path, metadata_url: str, total: int) -> dict[str, Any]:
    brokers: dict[str, BrokerProcess] = {}
    for mode, enabled in (("cached", "true"), ("uncached", "false")):
        env = {"ANABRANCH_POLICY_CACHE_ENABLED": enabled}
        if metadata_url:  # two standalone brokers: each its own key namespace of etcd
            env["ANABRANCH_METADATA_URL"] = f"{metadata_url}/{tmp.name}-{mode}"
        brokers[mode] = BrokerProcess(tmp / mode, env=env)
    out: dict[str, Any] = {}
    try:
        for broker in brokers.values():
            await broker.start()
        clients = {mode: Client(b.service_url) for mode, b in brokers.items()}
        try:
            topic = f"persistent://public/default/policy-cache-{time.time_ns() % 10**9}"
            for client in clients.values():  # warm: the topic loaded, connections open
                await rounds(client, topic, "producer", 5)
                await rounds(client, topic, "consumer", 5)
            for kind in ("producer", "consumer"):
                times: dict[str, list[float]] = {mode: [] for mode in clients}
                for _ in range(max(1, total // BLOCK)):
                    for mode, client in clients.items():
                        times[mode] += await rounds(client, topic, kind, BLOCK)
                p50 = {mode: pct(t, 0.5) for mode, t in times.items()}
                out[kind] = {
                    "cached_ms": {"p50": p50["cached"], "p99": pct(times["cached"], 0.99)},
                    "uncached_ms": {"p50": p50["uncached"], "p99": pct(times["uncached"], 0.99)},
                    "speedup": p50["uncached"] / p50["cached"],
                }
        finally:
            for client in clients.values():
                await client.close()
        out["broker_peak_rss_mb"] = {
            mode: (peak_rss_bytes(b.pid) or 0) / 2**20 if b.pid else None
            for mode, b in brokers.items()
        }
    finally:
        for broker in brokers.values():
            await broker.stop()
    return out


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=300)
    parser.add_argument("--quick", action="store_true", help="100 rounds, one rep")
    parser.add_argument("--skip-etcd", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.reps, args.rounds = 1, 100
    results: dict[str, list[dict[str, Any]]] = {"sqlite": [], "etcd": []}
    with tempfile.TemporaryDirectory(prefix="bench-policy-cache-") as tmpdir:
        tmp = Path(tmpdir)
        etcd = None if args.skip_etcd else EtcdServer.start(tmp / "etcd")
        try:
            for rep in range(args.reps):
                results["sqlite"].append(await one_rep(tmp / f"s{rep}", "", args.rounds))
                print(f"rep {rep} sqlite: {results['sqlite'][-1]}", file=sys.stderr)
                if etcd is not None:
                    url = f"etcd://{etcd.endpoint.removeprefix('http://')}"
                    results["etcd"].append(await one_rep(tmp / f"e{rep}", url, args.rounds))
                    print(f"rep {rep} etcd: {results['etcd'][-1]}", file=sys.stderr)
        finally:
            if etcd is not None:
                etcd.stop()
    summary = {
        "benchmark": "policy_cache",
        "reps": args.reps,
        "rounds": args.rounds,
        "cpus": os.cpu_count(),
        "loadavg": loadavg(),
        "sqlite": median_tree(results["sqlite"]),
        "etcd": median_tree(results["etcd"]) if results["etcd"] else None,
    }
    print(json.dumps(summary, sort_keys=True))


if __name__ == "__main__":
    asyncio.run(main())
