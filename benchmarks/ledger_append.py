"""Managed-ledger append benchmark against the raw disk, in one run on one disk.

1. raw group commit: write + fdatasync of 1 KiB records in batches of 64 (the ceiling);
2. ledger append throughput, 1 KiB entries, fsync=always, ``--inflight`` concurrent
   appenders, with append latency p50/p99 at saturation;
3. append latency at a fixed rate of 50% of the measured maximum.

Each is repeated ``--reps`` times (fresh directory each time); medians are reported. The
last printed line is one JSON object (``ratio_vs_raw`` = ledger / raw entries per second).

Usage: ``python benchmarks/ledger_append.py [--entries 100000] [--reps 3] [--uvloop]``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from anabranch.metadata.memory import MemoryMetadataStore
from anabranch.storage.api import ManagedLedgerConfig
from anabranch.storage.ledger import FileManagedLedgerFactory

ENTRY = 1024
CONFIG = ManagedLedgerConfig(fsync="always", ledger_entries_max=10**9, ledger_bytes_max=2**40)


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def raw_group_commit(directory: Path, entries: int, batch: int = 64) -> float:
    payload = os.urandom(ENTRY) * batch
    fd = os.open(directory / "raw.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        start = time.perf_counter()
        for _ in range(entries // batch):
            os.write(fd, payload)
            os.fdatasync(fd)
        elapsed = time.perf_counter() - start
    finally:
        os.close(fd)
    return (entries // batch) * batch / elapsed


async def saturate(directory: Path, entries: int, inflight: int) -> tuple[float, list[float]]:
    store = MemoryMetadataStore()
    factory = FileManagedLedgerFactory(directory, store)
    ml = await factory.open("bench", CONFIG)
    payload = os.urandom(ENTRY)
    latencies: list[float] = []
    remaining = entries

    async def appender() -> None:
        nonlocal remaining
        clock = time.perf_counter
        while remaining > 0:
            remaining -= 1
            t0 = clock()
            await ml.append(payload)
            latencies.append(clock() - t0)

    start = time.perf_counter()
    await asyncio.gather(*(appender() for _ in range(inflight)))
    elapsed = time.perf_counter() - start
    await factory.close()
    await store.close()
    return len(latencies) / elapsed, latencies


async def fixed_rate(
    directory: Path, rate: float, seconds: float, workers: int = 256
) -> tuple[float, list[float]]:
    store = MemoryMetadataStore()
    factory = FileManagedLedgerFactory(directory, store)
    ml = await factory.open("bench", CONFIG)
    payload = os.urandom(ENTRY)
    latencies: list[float] = []
    # The pacer hands scheduled send times to long-lived workers (no task per append, so
    # the harness does not eat the CPU it measures); latency counts from the scheduled
    # time, so a stalled ledger shows up in full (no coordinated omission).
    due_times: asyncio.Queue[float | None] = asyncio.Queue()

    async def worker() -> None:
        clock = time.perf_counter
        while (t0 := await due_times.get()) is not None:
            await ml.append(payload)
            latencies.append(clock() - t0)

    tasks = [asyncio.ensure_future(worker()) for _ in range(workers)]
    start = time.perf_counter()
    sent = 0
    total = int(rate * seconds)
    while sent < total:
        due = min(total, int((time.perf_counter() - start) * rate) + 1)
        while sent < due:
            due_times.put_nowait(start + sent / rate)
            sent += 1
        await asyncio.sleep(0.0005)
    for _ in tasks:
        due_times.put_nowait(None)
    await asyncio.gather(*tasks)
    achieved = len(latencies) / (time.perf_counter() - start)
    await factory.close()
    await store.close()
    return achieved, latencies


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--entries", type=int, default=100_000)
    parser.add_argument("--inflight", type=int, default=256)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--rate-seconds", type=float, default=3.0)
    parser.add_argument("--uvloop", action="store_true")
    args = parser.parse_args()
    if args.uvloop:
        import uvloop

        uvloop.install()

    raws, rates, sat_p50, sat_p99, half_p50, half_p99, half_rate = [], [], [], [], [], [], []
    for rep in range(args.reps):
        base = Path(tempfile.mkdtemp(prefix="ledger-bench-", dir="/tmp"))
        try:
            raws.append(raw_group_commit(base, args.entries))
            rate, lat = asyncio.run(saturate(base / "sat", args.entries, args.inflight))
            rates.append(rate)
            sat_p50.append(pct(lat, 0.5) * 1e3)
            sat_p99.append(pct(lat, 0.99) * 1e3)
            achieved, lat = asyncio.run(fixed_rate(base / "half", rate / 2, args.rate_seconds))
            half_rate.append(achieved)
            half_p50.append(pct(lat, 0.5) * 1e3)
            half_p99.append(pct(lat, 0.99) * 1e3)
        finally:
            shutil.rmtree(base, ignore_errors=True)
        print(
            f"rep {rep}: raw {raws[-1]:,.0f}/s ledger {rates[-1]:,.0f}/s "
            f"sat p50/p99 {sat_p50[-1]:.2f}/{sat_p99[-1]:.2f} ms; "
            f"50% load {half_rate[-1]:,.0f}/s p50/p99 {half_p50[-1]:.2f}/{half_p99[-1]:.2f} ms",
            flush=True,
        )
    med = statistics.median
    result = {
        "benchmark": "ledger_append",
        "entry_bytes": ENTRY,
        "entries": args.entries,
        "inflight": args.inflight,
        "loop": "uvloop" if args.uvloop else "asyncio",
        "reps": args.reps,
        "raw_entries_per_s": round(med(raws)),
        "ledger_entries_per_s": round(med(rates)),
        "ratio_vs_raw": round(med(rates) / med(raws), 3),
        "saturation_p50_ms": round(med(sat_p50), 3),
        "saturation_p99_ms": round(med(sat_p99), 3),
        "half_load_rate_per_s": round(med(half_rate)),
        "half_load_p50_ms": round(med(half_p50), 3),
        "half_load_p99_ms": round(med(half_p99), 3),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
