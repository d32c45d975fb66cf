"""Managed-ledger append benchmark against the raw disk, in one run on one disk.

1. raw group commit: write + fdatasync of 1 KiB records in batches of 64 (the ceiling);
2. ledger append throughput, 1 KiB entries, fsync=always, ``--inflight`` concurrent
   appenders (spread over ``--ledgers`` ledgers, which share the factory's writer threads),
   with append latency p50/p99 at saturation;
3. append latency at a fixed rate of 50% of the measured maximum.

Each is repeated ``--reps`` times (fresh directory each time); medians are reported. The
raw figure is measured right before and right after each ledger run (the disk is shared,
so its speed drifts; both measurements count, and the median is over all of them). The
last printed line is one JSON object (``ratio_vs_raw`` = ledger / raw entries per second).

The ledger runs on uvloop by default, the loop the broker runs on (``use_uvloop``);
``--loop asyncio`` measures the stdlib loop.

Usage: ``python benchmarks/ledger_append.py [--entries 100000] [--reps 3] [--loop asyncio]``
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
from collections import deque
from pathlib import Path

from anabranch.metadata.memory import MemoryMetadataStore
from anabranch.storage.api import ManagedLedger, ManagedLedgerConfig
from anabranch.storage.ledger import FileManagedLedgerFactory

ENTRY = 1024
TICK_S = 0.001
"""The fixed-rate pacer's period: it hands out every send due since its last tick (uvloop's
timers have 1 ms resolution: a shorter sleep would spin the pacer on the loop it measures)."""
CONFIG = ManagedLedgerConfig(fsync="always", ledger_entries_max=10**9, ledger_bytes_max=2**40)


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def raw_group_commit(directory: Path, entries: int, batch: int = 64) -> float:
    payload = os.urandom(ENTRY) * batch
    path = directory / "raw.log"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o644)
    try:
        start = time.perf_counter()
        for _ in range(entries // batch):
            os.write(fd, payload)
            os.fdatasync(fd)
        elapsed = time.perf_counter() - start
    finally:
        os.close(fd)
        path.unlink()
    return (entries // batch) * batch / elapsed


async def saturate(
    directory: Path, entries: int, inflight: int, ledgers: int = 1
) -> tuple[float, list[float]]:
    store = MemoryMetadataStore()
    factory = FileManagedLedgerFactory(directory, store)
    mls = [await factory.open(f"bench-{i}", CONFIG) for i in range(ledgers)]
    payload = os.urandom(ENTRY)
    latencies: list[float] = []
    remaining = entries

    async def appender(ml: ManagedLedger) -> None:
        nonlocal remaining
        clock = time.perf_counter
        while remaining > 0:
            remaining -= 1
            t0 = clock()
            await ml.append(payload)
            latencies.append(clock() - t0)

    start = time.perf_counter()
    await asyncio.gather(*(appender(mls[i % ledgers]) for i in range(inflight)))
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
    loop = asyncio.get_running_loop()
    # Open loop: the pacer hands each scheduled send time to an idle long-lived worker
    # (a future per hand-off, no task per append, so the harness does not eat the CPU it
    # measures); sends due while every worker is busy wait in `backlog` and go to the
    # next free worker. Latency counts from the scheduled time, so a stalled ledger shows
    # up in full (no coordinated omission).
    idle: deque[asyncio.Future[float | None]] = deque()
    backlog: deque[float | None] = deque()
    clock = time.perf_counter

    async def worker() -> None:
        while True:
            t0: float | None
            if backlog:
                t0 = backlog.popleft()
            else:
                parked: asyncio.Future[float | None] = loop.create_future()
                idle.append(parked)
                t0 = await parked
            if t0 is None:
                return
            await ml.append(payload)
            latencies.append(clock() - t0)

    tasks = [asyncio.ensure_future(worker()) for _ in range(workers)]
    start = clock()
    sent = 0
    total = int(rate * seconds)
    while sent < total:
        due = min(total, int((clock() - start) * rate) + 1)
        while sent < due:
            at = start + sent / rate
            if idle:
                idle.popleft().set_result(at)
            else:
                backlog.append(at)
            sent += 1
        await asyncio.sleep(TICK_S)
    # Idle workers stop now; busy ones finish the backlog first (it is empty while any
    # worker is idle), then stop.
    while idle:
        idle.popleft().set_result(None)
    backlog.extend([None] * workers)
    await asyncio.gather(*tasks)
    achieved = len(latencies) / (clock() - start)
    await factory.close()
    await store.close()
    return achieved, latencies


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--entries", type=int, default=100_000)
    parser.add_argument("--inflight", type=int, default=256)
    parser.add_argument(
        "--ledgers",
        type=int,
        default=1,
        help="spread the saturation appenders over this many ledgers (the writer pool's case)",
    )
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--rate-seconds", type=float, default=3.0)
    parser.add_argument("--loop", choices=("uvloop", "asyncio"), default="uvloop")
    parser.add_argument("--uvloop", action="store_true", help="same as --loop uvloop")
    args = parser.parse_args()
    if args.uvloop:
        args.loop = "uvloop"
    if args.loop == "uvloop":
        import uvloop

        uvloop.install()

    raws, rates, sat_p50, sat_p99, half_p50, half_p99, half_rate = [], [], [], [], [], [], []
    for rep in range(args.reps):
        base = Path(tempfile.mkdtemp(prefix="ledger-bench-", dir="/tmp"))
        try:
            raws.append(raw_group_commit(base, args.entries))
            rate, lat = asyncio.run(
                saturate(base / "sat", args.entries, args.inflight, args.ledgers)
            )
            raws.append(raw_group_commit(base, args.entries))
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
            f"rep {rep}: raw {raws[-2]:,.0f}/s, {raws[-1]:,.0f}/s ledger {rates[-1]:,.0f}/s "
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
        "ledgers": args.ledgers,
        "loop": args.loop,
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
