"""Managed-ledger append benchmark against the raw disk, in one run on one disk.

1. raw group commit: write + fdatasync of 1 KiB records in batches of 64 (the ceiling);
2. ledger append throughput, 1 KiB entries, fsync=always, ``--inflight`` concurrent
   appenders (spread over ``--ledgers`` ledgers, which share the factory's writer threads),
   with append latency p50/p99 at saturation;
3. append latency at a fixed rate of 50% of the measured maximum.

``--jetstream`` adds the same two measurements on the JetStream backend: a 3-node NATS
cluster (``sync_interval: always``, fsync before every ack) started by the benchmark on
loopback in a temp dir, streams with ``--replicas`` copies (R3 by default); the file
backend's figures of the same repetition are its baseline (``jetstream_vs_file``). Each
repetition then SIGKILLs the stream leader under load and reports the write pause (the
longest gap between two acknowledgements) and failed appends (expected: 0).

Each is repeated ``--reps`` times (fresh directory each time); medians are reported. The
raw figure is measured right before and right after each ledger run (the disk is shared,
so its speed drifts; both measurements count, and the median is over all of them). The
last printed line is one JSON object (``ratio_vs_raw`` = ledger / raw entries per second).

The ledger runs on uvloop by default, the loop the broker runs on (``use_uvloop``);
``--loop asyncio`` measures the stdlib loop.

Usage: ``python benchmarks/ledger_append.py [--entries 100000] [--reps 3] [--loop asyncio]
[--jetstream [--js-entries 30000] [--replicas 3]]``
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import shutil
import statistics
import tempfile
import time
from collections import deque
from pathlib import Path

from anabranch.metadata.memory import MemoryMetadataStore
from anabranch.storage.api import ManagedLedger, ManagedLedgerConfig, ManagedLedgerFactory
from anabranch.storage.jetstream_ledger import JetStreamManagedLedgerFactory
from anabranch.storage.ledger import FileManagedLedgerFactory
from anabranch.testing.nats import NatsCluster

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


class Target:
    """Which backend a run measures: files under a directory, or JetStream streams."""

    def __init__(self, urls: list[str] | None = None, replicas: int = 3) -> None:
        self.urls = urls
        self.replicas = replicas
        self.runs = 0

    def factory(self, directory: Path, store: MemoryMetadataStore) -> ManagedLedgerFactory:
        if self.urls is None:
            return FileManagedLedgerFactory(directory, store)
        self.runs += 1  # a fresh stream per run
        return JetStreamManagedLedgerFactory(
            self.urls, store, replicas=self.replicas, prefix=f"bench{self.runs}"
        )


FILES = Target()


async def saturate(
    directory: Path, entries: int, inflight: int, target: Target = FILES, ledgers: int = 1
) -> tuple[float, list[float]]:
    store = MemoryMetadataStore()
    factory = target.factory(directory, store)
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
    directory: Path, rate: float, seconds: float, workers: int = 256, target: Target = FILES
) -> tuple[float, list[float]]:
    store = MemoryMetadataStore()
    factory = target.factory(directory, store)
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
    parser.add_argument("--jetstream", action="store_true", help="also the JetStream backend")
    parser.add_argument("--js-entries", type=int, default=30_000)
    parser.add_argument("--replicas", type=int, default=3)
    args = parser.parse_args()
    if args.uvloop:
        args.loop = "uvloop"
    if args.loop == "uvloop":
        import uvloop

        uvloop.install()

    raws, rates, sat_p50, sat_p99, half_p50, half_p99, half_rate = [], [], [], [], [], [], []
    js: dict[str, list[float]] = {
        k: [] for k in ("rate", "p50", "p99", "hrate", "hp50", "hp99", "pause", "failed")
    }
    for rep in range(args.reps):
        base = Path(tempfile.mkdtemp(prefix="ledger-bench-", dir="/tmp"))
        try:
            if args.jetstream:
                run_jetstream(base, args, js)
            raws.append(raw_group_commit(base, args.entries))
            rate, lat = asyncio.run(
                saturate(base / "sat", args.entries, args.inflight, ledgers=args.ledgers)
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
    if args.jetstream:
        result.update(
            {
                "jetstream_replicas": args.replicas,
                "jetstream_entries": args.js_entries,
                "jetstream_entries_per_s": round(med(js["rate"])),
                "jetstream_mb_per_s": round(med(js["rate"]) * ENTRY / 1e6, 2),
                "jetstream_vs_file": round(med(js["rate"]) / med(rates), 3),
                "jetstream_saturation_p50_ms": round(med(js["p50"]), 3),
                "jetstream_saturation_p99_ms": round(med(js["p99"]), 3),
                "jetstream_half_load_rate_per_s": round(med(js["hrate"])),
                "jetstream_half_load_p50_ms": round(med(js["hp50"]), 3),
                "jetstream_half_load_p99_ms": round(med(js["hp99"]), 3),
                "jetstream_leader_kill_pause_s": round(med(js["pause"]), 3),
                "jetstream_leader_kill_pause_max_s": round(max(js["pause"]), 3),
                "jetstream_leader_kill_failed_appends": round(sum(js["failed"])),
            }
        )
    print(json.dumps(result))


def run_jetstream(base: Path, args: argparse.Namespace, out: dict[str, list[float]]) -> None:
    """One repetition on a fresh 3-node cluster (killed by PID afterwards)."""
    cluster = NatsCluster.start(base / "nats", nodes=3)
    try:
        target = Target(cluster.urls, args.replicas)
        rate, lat = asyncio.run(saturate(base, args.js_entries, args.inflight, target))
        out["rate"].append(rate)
        out["p50"].append(pct(lat, 0.5) * 1e3)
        out["p99"].append(pct(lat, 0.99) * 1e3)
        achieved, lat = asyncio.run(fixed_rate(base, rate / 2, args.rate_seconds, target=target))
        out["hrate"].append(achieved)
        out["hp50"].append(pct(lat, 0.5) * 1e3)
        out["hp99"].append(pct(lat, 0.99) * 1e3)
        pause, failed = asyncio.run(leader_kill_pause(cluster, target))
        out["pause"].append(pause)
        out["failed"].append(failed)
    finally:
        cluster.stop()
    print(
        f"jetstream R{args.replicas}: {rate:,.0f}/s sat p50/p99 {out['p50'][-1]:.2f}/"
        f"{out['p99'][-1]:.2f} ms; 50% load {achieved:,.0f}/s p50/p99 "
        f"{out['hp50'][-1]:.2f}/{out['hp99'][-1]:.2f} ms; stream leader SIGKILL: "
        f"longest gap between acks {pause:.2f} s, {failed:.0f} appends failed",
        flush=True,
    )


async def leader_kill_pause(
    cluster: NatsCluster, target: Target, seconds: float = 8.0, inflight: int = 32
) -> tuple[float, float]:
    """Appends from ``inflight`` tasks for ``seconds``; the stream leader is SIGKILLed a
    quarter of the way in. Returns the longest gap between two acknowledgements (the
    write pause) and how many appends failed."""
    store = MemoryMetadataStore()
    factory = target.factory(Path("/nonexistent"), store)
    assert isinstance(factory, JetStreamManagedLedgerFactory)
    ml = await factory.open("bench", CONFIG)
    payload = os.urandom(ENTRY)
    acks: list[float] = []
    failed = 0
    clock = time.perf_counter
    end = clock() + seconds

    async def appender() -> None:
        nonlocal failed
        while clock() < end:
            try:
                await ml.append(payload)
            except Exception:
                failed += 1
                return
            acks.append(clock())

    tasks = [asyncio.ensure_future(appender()) for _ in range(inflight)]
    await asyncio.sleep(seconds / 4)
    leader = await asyncio.to_thread(cluster.stream_leader, ml.stream)
    await asyncio.to_thread(leader.kill)
    await asyncio.gather(*tasks)
    await factory.close()
    await store.close()
    cluster.start_node(leader.name)
    await asyncio.to_thread(cluster.wait_ready)
    gaps = [b - a for a, b in itertools.pairwise(acks)]
    return max(gaps, default=seconds), float(failed)


if __name__ == "__main__":
    main()
