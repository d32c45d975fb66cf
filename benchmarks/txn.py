"""Transaction benchmark (issue: PIP-473 transactions), every baseline in the same run.

Per repetition, a fresh broker process (``fsync=always``) on each metadata backend
(SQLite, the embedded default, and a real etcd), our client (``anabranch.aio``):

1. **commit latency** — transactions of 10 messages on 1 topic and on 3 topics: the time
   of ``txn.commit()`` alone (every send already acknowledged), p50/p99;
2. **visibility latency** — commit acknowledged → a subscribed consumer holds all of the
   transaction's messages, p50/p99 (1 topic); also from the commit call (the END_TXN
   round trip included);
3. **throughput** — ``--workers`` concurrent loops (one topic each) of 100-message
   transactions back to back vs the same loops sending the same rounds of 100 messages
   without a transaction (same producer settings; a flush ends each round): msgs/s and
   the ratio; and one loop with no flush (the round waits out the default batch delay,
   as an application that just awaits its sends does). And **pipelined**, as
   ``pulsar-perf produce --txn-enable -nmt 100`` measures it: each loop sends without
   pause and every 100 messages starts the transaction's commit without awaiting it (at
   most ``--commits-in-flight`` per loop) and takes the next transaction; the plain
   baseline sends the same messages without pause. The client keeps ``--spares``
   pre-opened transactions (``Client(transaction_spares=...)``, opt-in; 0 measures the
   default), so ``new_transaction`` mostly hands out a spare, and a producer announces
   its topic at its first send in a transaction;
4. the broker's peak RSS (``VmHWM``), and with each throughput figure the CPU time per
   round of 100 messages of the broker process and of this (client) process, plain vs
   transactional: where a transaction's cost goes.

Once per run, in process: **coordinator cold start** on a SQLite store holding
``--cold-txns`` finished, not yet collected transactions (headers + final-state index
keys) vs the same on an empty store: open the store, start the coordinator, serve one
NEW_TXN + END_TXN. PIP-473 promises that nothing is replayed, so the two should match.

Medians over ``--reps``; ratios are medians of per-rep ratios. The last line is JSON.

Usage: ``python benchmarks/txn.py [--quick] [--reps 3] [--cold-txns 1000000]``
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import cpu_seconds, loadavg, median_tree, pct, peak_rss_bytes

from anabranch.aio import Client
from anabranch.client.txn_spares import SPARES_MAX
from anabranch.clock import SystemClock
from anabranch.metadata.api import Put
from anabranch.metadata.sqlite import SqliteMetadataStore
from anabranch.testing.broker import BrokerProcess
from anabranch.testing.etcd import EtcdServer
from anabranch.transactions import records
from anabranch.transactions.coordinator import TransactionCoordinator
from anabranch.transactions.ids import TxnId
from anabranch.transactions.records import TxnHeader, TxnState

clock = time.perf_counter


class Broker(BrokerProcess):
    """The standalone broker process, optionally on an etcd metadata store."""

    metadata_url = ""

    def _command(self) -> tuple[list[str], dict[str, str]]:
        args, env = super()._command()
        if self.metadata_url:
            env["ANABRANCH_METADATA_URL"] = self.metadata_url
        return args, env


async def commit_latency(client: Client, run: str, topics: int, count: int) -> list[float]:
    producers = [
        await client.create_producer(f"persistent://public/default/{run}-lat{topics}-{i}")
        for i in range(topics)
    ]
    out = []
    for _ in range(count):
        txn = await client.new_transaction(timeout=60)
        futures = []
        for j in range(10):
            producer = producers[j % topics]
            futures.append(await producer.send_async(b"x" * 100, txn=txn))
        await asyncio.gather(*futures)
        start = clock()
        await txn.commit()
        out.append((clock() - start) * 1000)
    for producer in producers:
        await producer.close()
    return out


async def visibility_latency(
    client: Client, run: str, count: int
) -> tuple[list[float], list[float]]:
    """(commit acknowledged → consumer holds all 10, commit called → the same), in ms."""
    topic = f"persistent://public/default/{run}-vis"
    producer = await client.create_producer(topic)
    consumer = await client.subscribe(topic, "vis", initial_position="earliest")
    out, from_call = [], []
    for _ in range(count):
        txn = await client.new_transaction(timeout=60)
        futures = [await producer.send_async(b"v" * 100, txn=txn) for _ in range(10)]
        await asyncio.gather(*futures)
        called = clock()
        await txn.commit()
        committed = clock()
        for _ in range(10):
            msg = await consumer.receive(timeout=10)
            assert msg is not None, "a committed message never arrived"
            await consumer.acknowledge(msg)
        now = clock()
        out.append((now - committed) * 1000)
        from_call.append((now - called) * 1000)
    await producer.close()
    await consumer.close()
    return out, from_call


async def throughput(
    client: Client, run: str, txns: int, *, transactional: bool, workers: int, flush: bool = True
) -> tuple[float, float]:
    """Messages/s of ``workers`` concurrent loops, each on its own topic, each sending
    ``txns`` rounds of 100 messages (``flush``: a flush ends a round, so no batch timer is
    waited for; else the round waits for its receipts under the default batching): in a
    transaction committed per round, or plainly."""
    kind = "txn" if transactional else "plain"

    async def worker(n: int) -> None:
        topic = f"persistent://public/default/{run}-tp-{kind}-{n}"
        producer = await client.create_producer(topic)
        for _ in range(txns):
            txn = await client.new_transaction(timeout=60) if transactional else None
            futures = [await producer.send_async(b"t" * 100, txn=txn) for _ in range(100)]
            if flush:
                await producer.flush()
            await asyncio.gather(*futures)
            if txn is not None:
                await txn.commit()
        await producer.close()

    start = clock()
    await asyncio.gather(*(worker(n) for n in range(workers)))
    return workers * txns * 100 / (clock() - start), workers * txns


async def throughput_pipelined(
    client: Client, run: str, txns: int, *, transactional: bool, workers: int, in_flight: int
) -> tuple[float, float]:
    """Messages/s of ``workers`` loops, each on its own topic, sending ``txns`` x 100
    messages without pause (receipts awaited 1000 behind); transactional: every 100
    messages the transaction's commit starts, unawaited (at most ``in_flight`` per loop
    at once), and the next 100 go in a new transaction, as ``pulsar-perf`` does."""
    kind = "txn" if transactional else "plain"

    async def worker(n: int) -> None:
        topic = f"persistent://public/default/{run}-pp-{kind}-{n}"
        producer = await client.create_producer(topic)
        room = asyncio.Semaphore(in_flight)
        commits: set[asyncio.Task[None]] = set()
        receipts: list[asyncio.Future[Any]] = []

        def committed(task: asyncio.Task[None]) -> None:
            commits.discard(task)
            room.release()

        for _ in range(txns):
            txn = await client.new_transaction(timeout=60) if transactional else None
            for _ in range(100):
                receipts.append(await producer.send_async(b"t" * 100, txn=txn))
            if txn is not None:
                await room.acquire()
                task = asyncio.ensure_future(txn.commit())
                commits.add(task)
                task.add_done_callback(committed)
            if len(receipts) >= 2000:
                await asyncio.gather(*receipts[:1000])
                del receipts[:1000]
        await producer.flush()
        await asyncio.gather(*receipts, *commits)
        await producer.close()

    start = clock()
    await asyncio.gather(*(worker(n) for n in range(workers)))
    return workers * txns * 100 / (clock() - start), workers * txns


async def one_backend(tmp: Path, metadata_url: str, args: argparse.Namespace) -> dict[str, Any]:
    broker = Broker(tmp / "data")
    broker.metadata_url = metadata_url
    await broker.start()
    try:
        run = f"r{time.time_ns() % 10**9}"
        async with Client(broker.service_url, transaction_spares=args.spares) as client:
            await commit_latency(client, run + "w", 1, 20)  # warm-up
            one = await commit_latency(client, run, 1, args.latency_txns)
            three = await commit_latency(client, run, 3, args.latency_txns)
            vis, vis_call = await visibility_latency(client, run, args.latency_txns)
            # Alternate to share the machine's noise fairly; median of the pairs.
            tp: dict[str, dict[str, Any]] = {}
            pid = broker.pid
            assert pid is not None
            runs = [(w, "flush") for w in args.workers] + [(1, "batch_timer")]
            runs += [(w, "pipelined") for w in args.pipelined_workers]
            for workers, mode in runs:
                if mode == "pipelined":
                    # As many messages per run as 8 loops of --tp-txns: a pipelined loop
                    # is fast and short runs are all noise.
                    measure = functools.partial(
                        throughput_pipelined,
                        txns=max(1, 8 * args.tp_txns // workers),
                        in_flight=args.commits_in_flight,
                    )
                else:
                    measure = functools.partial(
                        throughput, txns=args.tp_txns, flush=mode == "flush"
                    )
                ratios: list[float] = []
                plain_rates: list[float] = []
                txn_rates: list[float] = []
                cpu: dict[str, list[float]] = {"broker_plain": [], "broker_txn": []}
                cpu.update(client_plain=[], client_txn=[])
                for i in range(3):
                    name = f"{run}w{workers}i{i}"
                    for transactional, kind in ((False, "plain"), (True, "txn")):
                        before = cpu_seconds(pid), time.process_time()
                        rate, rounds = await measure(
                            client, name, transactional=transactional, workers=workers
                        )
                        broker_s = (cpu_seconds(pid) or 0.0) - (before[0] or 0.0)
                        cpu[f"broker_{kind}"].append(1000 * broker_s / rounds)
                        client_s = time.process_time() - before[1]
                        cpu[f"client_{kind}"].append(1000 * client_s / rounds)
                        (txn_rates if transactional else plain_rates).append(rate)
                    ratios.append(txn_rates[-1] / plain_rates[-1])
                tp[f"workers_{workers}" + ("" if mode == "flush" else f"_{mode}")] = {
                    "plain": statistics.median(plain_rates),
                    "txn100": statistics.median(txn_rates),
                    "ratio": statistics.median(ratios),
                    "cpu_ms_per_round": {k: statistics.median(v) for k, v in cpu.items()},
                }
        assert broker.pid is not None
        rss = peak_rss_bytes(broker.pid)
    finally:
        await broker.stop()
    return {
        "commit_ms_1topic": {"p50": pct(one, 0.5), "p99": pct(one, 0.99)},
        "commit_ms_3topics": {"p50": pct(three, 0.5), "p99": pct(three, 0.99)},
        "visibility_ms": {"p50": pct(vis, 0.5), "p99": pct(vis, 0.99)},
        "commit_call_to_visible_ms": {"p50": pct(vis_call, 0.5), "p99": pct(vis_call, 0.99)},
        "throughput_msgs_s": tp,
        "broker_peak_rss_mb": (rss or 0) / 2**20,
    }


async def fill(store: SqliteMetadataStore, count: int) -> None:
    """``count`` finished, uncollected transactions: header + final-state index key."""
    now = int(time.time() * 1000)
    batch = 64  # two keys per transaction, within one commit's op limit
    sem = asyncio.Semaphore(32)

    async def write(first: int) -> None:
        async with sem:
            ops = []
            for n in range(first, min(first + batch, count)):
                txn = TxnId(n % 16, 1_000_000 + n)
                header = TxnHeader(TxnState.COMMITTED, now - 1000, 60_000, finalized_at=now)
                ops.append(Put(records.header_path(txn), records.encode_header(header)))
                ops.append(Put(records.final_index_path(TxnState.COMMITTED, now, txn), b""))
            await store.commit(ops)

    await asyncio.gather(*(write(i) for i in range(0, count, batch)))


async def cold_start_ms(path: Path) -> float:
    start = clock()
    store = await SqliteMetadataStore.open(path)
    coordinator = TransactionCoordinator(store, SystemClock())
    await coordinator.start()
    txn = await coordinator.new_txn(10_000)
    await coordinator.end_txn(txn, TxnState.COMMITTED)
    elapsed = (clock() - start) * 1000
    await coordinator.close()
    await store.close()
    return elapsed


async def cold_start(tmp: Path, count: int) -> dict[str, Any]:
    full = tmp / "full.db"
    store = await SqliteMetadataStore.open(full)
    started = clock()
    await fill(store, count)
    fill_s = clock() - started
    await store.close()
    empty = [await cold_start_ms(tmp / f"empty-{i}.db") for i in range(3)]
    loaded = [await cold_start_ms(full) for _ in range(3)]
    return {
        "finished_txns": count,
        "fill_s": fill_s,
        "cold_start_ms": statistics.median(loaded),
        "empty_store_ms": statistics.median(empty),
        "ratio": statistics.median(loaded) / statistics.median(empty),
    }


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--latency-txns", type=int, default=200)
    parser.add_argument("--tp-txns", type=int, default=50)
    parser.add_argument("--cold-txns", type=int, default=1_000_000)
    parser.add_argument(
        "--workers",
        type=lambda text: [int(n) for n in text.split(",")],
        default=[1, 8, 32],
        help="concurrent producer loops, comma-separated (each count is measured)",
    )
    parser.add_argument(
        "--pipelined-workers",
        type=lambda text: [int(n) for n in text.split(",") if n],
        default=[1, 8],
        help="concurrent loops of the pipelined (pulsar-perf) run, comma-separated",
    )
    parser.add_argument(
        "--commits-in-flight", type=int, default=16, help="unawaited commits per pipelined loop"
    )
    parser.add_argument(
        "--spares", type=int, default=SPARES_MAX, help="the client's transaction_spares"
    )
    parser.add_argument("--quick", action="store_true", help="small counts, one rep")
    parser.add_argument("--skip-etcd", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.reps, args.latency_txns, args.tp_txns, args.cold_txns = 1, 50, 10, 20_000
    results: dict[str, list[dict[str, Any]]] = {"sqlite": [], "etcd": []}
    with tempfile.TemporaryDirectory(prefix="bench-txn-") as tmpdir:
        tmp = Path(tmpdir)
        etcd = None if args.skip_etcd else EtcdServer.start(tmp / "etcd")
        try:
            for rep in range(args.reps):
                rep_dir = tmp / f"rep{rep}"
                results["sqlite"].append(await one_backend(rep_dir / "sqlite", "", args))
                print(f"rep {rep} sqlite: {results['sqlite'][-1]}", file=sys.stderr)
                if etcd is not None:
                    url = f"etcd://{etcd.endpoint.removeprefix('http://')}"
                    results["etcd"].append(await one_backend(rep_dir / "etcd", url, args))
                    print(f"rep {rep} etcd: {results['etcd'][-1]}", file=sys.stderr)
        finally:
            if etcd is not None:
                etcd.stop()
        cold = await cold_start(tmp, args.cold_txns)
    summary = {
        "benchmark": "txn",
        "reps": args.reps,
        "cpus": os.cpu_count(),
        "loadavg": loadavg(),
        "sqlite": median_tree(results["sqlite"]),
        "etcd": median_tree(results["etcd"]) if results["etcd"] else None,
        "cold_start": cold,
    }
    print(json.dumps(summary, sort_keys=True))


if __name__ == "__main__":
    asyncio.run(main())
