"""Metadata-store CAS benchmark: ops/s and latency per backend at concurrency 1 and 64.

Each of ``c`` workers owns one key and loops ``put(key, value, expected_version=v)``
with the version its previous put returned, for ``--seconds`` per case. Backends:
memory, sqlite (``synchronous=FULL``, group commit) and etcd (a real server from
``anabranch.testing.etcd`` when that module and the binary are present), twice: ``etcd``
as the broker runs it (concurrent commits share Txns, ``metadata/etcd_coalesce.py``) and
``etcd_single``, its baseline in the same run (a Txn per commit, each on a fresh server).
The last printed line is one JSON object with every figure (and the etcd ratios).

Usage: ``python benchmarks/metadata_cas.py [--seconds 3] [--backends memory,sqlite,etcd]``
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import json
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from anabranch.metadata.api import MetadataStore

CONCURRENCIES = (1, 64)
VALUE = b"x" * 100


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def cas_worker(store: MetadataStore, key: str, stop_at: float, lat: list[float]) -> int:
    version = (await store.put(key, VALUE)).version
    ops = 0
    while time.perf_counter() < stop_at:
        started = time.perf_counter()
        version = (await store.put(key, VALUE, expected_version=version)).version
        lat.append(time.perf_counter() - started)
        ops += 1
    return ops


async def run_case(store: MetadataStore, concurrency: int, seconds: float) -> dict[str, float]:
    latencies: list[float] = []
    started = time.perf_counter()
    stop_at = started + seconds
    counts = await asyncio.gather(
        *(
            cas_worker(store, f"/bench/c{concurrency}/w{i}", stop_at, latencies)
            for i in range(concurrency)
        )
    )
    elapsed = time.perf_counter() - started
    return {
        "ops_per_s": round(sum(counts) / elapsed),
        "p50_ms": round(pct(latencies, 0.50) * 1000, 3),
        "p99_ms": round(pct(latencies, 0.99) * 1000, 3),
    }


@contextlib.asynccontextmanager
async def open_backend(name: str, workdir: Path) -> AsyncIterator[MetadataStore]:
    store: Any
    server: Any = None
    if name == "memory":
        from anabranch.metadata.memory import MemoryMetadataStore

        store = MemoryMetadataStore()
    elif name == "sqlite":
        from anabranch.metadata.sqlite import SqliteMetadataStore

        store = await SqliteMetadataStore.open(workdir / "meta.db", synchronous="FULL")
    else:
        from anabranch.metadata.etcd import EtcdMetadataStore
        from anabranch.testing.etcd import EtcdServer

        server = await asyncio.to_thread(EtcdServer.start, workdir / "etcd")
        # etcd_single: every commit in a Txn of its own (the baseline of coalescing).
        store = await EtcdMetadataStore.open(server.endpoint, coalesce=name == "etcd")
    try:
        yield store
    finally:
        await store.close()
        if server is not None:
            await asyncio.to_thread(server.stop)


def available_backends() -> list[str]:
    backends = ["memory", "sqlite"]
    if importlib.util.find_spec("anabranch.metadata.etcd") and importlib.util.find_spec(
        "anabranch.testing.etcd"
    ):
        backends += ["etcd_single", "etcd"]
    return backends


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--backends", default=",".join(available_backends()))
    args = parser.parse_args()
    results: dict[str, dict[str, dict[str, float]]] = {}
    for backend in args.backends.split(","):
        with tempfile.TemporaryDirectory(prefix=f"cas-{backend}-") as tmp:
            async with open_backend(backend, Path(tmp)) as store:
                results[backend] = {}
                for concurrency in CONCURRENCIES:
                    figures = await run_case(store, concurrency, args.seconds)
                    results[backend][f"c{concurrency}"] = figures
                    print(
                        f"{backend:7} c={concurrency:<3} {figures['ops_per_s']:>8} CAS/s"
                        f"  p50 {figures['p50_ms']:.3f} ms  p99 {figures['p99_ms']:.3f} ms",
                        flush=True,
                    )
    out: dict[str, object] = {"benchmark": "metadata_cas", "seconds": args.seconds}
    out["results"] = results
    if "etcd" in results and "etcd_single" in results:
        out["etcd_coalesced_vs_single"] = {
            case: round(
                results["etcd"][case]["ops_per_s"] / results["etcd_single"][case]["ops_per_s"], 3
            )
            for case in results["etcd"]
        }
    print(json.dumps(out))


if __name__ == "__main__":
    asyncio.run(main())
