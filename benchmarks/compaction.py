"""Topic compaction benchmark: how fast a topic compacts, and what a compacted read saves
against the baseline, a full read of the same topic, in the same run.

Per repetition (fresh temp dir, a fresh ``anabranch standalone`` subprocess, ``fsync=always``):

1. our client publishes ``--messages`` messages of ``--size`` bytes over ``--keys`` keys
   (batching on);
2. baseline: a reader from the earliest message reads the whole topic (messages/s);
3. ``PUT .../compaction``, polled until SUCCESS: compaction time and messages/s compacted;
4. a ``read_compacted`` reader reads the compacted view (one message per key): its time
   against the baseline's;
5. the broker's peak RSS (``VmHWM``) after all of that.

Medians over ``--reps``. The last printed line is one JSON object.

Usage: ``python benchmarks/compaction.py [--quick] [--messages 200000] [--keys 1000] [--reps 3]``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import loadavg, median_tree, peak_rss_bytes

from anabranch.admin.client import AdminClient
from anabranch.aio import Client
from anabranch.testing.broker import BrokerProcess

TOPIC = "persistent://public/default/bench-compaction"
MB = 1024 * 1024


def log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


async def read_through(client: Client, *, compacted: bool, expect: int) -> float:
    """Seconds to read ``expect`` messages from the earliest (the view when ``compacted``)."""
    reader = await client.create_reader(
        TOPIC, "earliest", read_compacted=compacted, receiver_queue_size=1000
    )
    started = time.perf_counter()
    for _ in range(expect):
        msg = await reader.read_next(timeout=120)
        if msg is None:
            raise RuntimeError("a read stalled for 120 s")
    elapsed = time.perf_counter() - started
    await reader.close()
    return elapsed


async def one_rep(root: Path, messages: int, keys: int, size: int) -> dict[str, Any]:
    broker = BrokerProcess(root / "broker")
    await broker.start()
    try:
        async with (
            AdminClient(f"http://127.0.0.1:{broker.http_port}") as admin,
            Client(broker.service_url) as client,
        ):
            producer = await client.create_producer(TOPIC)
            payload = b"x" * size
            sends = [
                await producer.send_async(payload, key=f"key-{i % keys}") for i in range(messages)
            ]
            await asyncio.gather(*sends)
            await producer.close()
            full_s = await read_through(client, compacted=False, expect=messages)
            started = time.perf_counter()
            await admin.compact(TOPIC)
            for _ in range(36_000):  # a hang guard: one hour
                status = await admin.compaction_status(TOPIC)
                if status["status"] != "RUNNING":
                    break
                await asyncio.sleep(0.01)
            compact_s = time.perf_counter() - started
            if status["status"] != "SUCCESS":
                raise RuntimeError(f"compaction ended {status}")
            view_s = await read_through(client, compacted=True, expect=keys)
        rss = peak_rss_bytes(broker.pid) if broker.pid is not None else None
    finally:
        await broker.stop()
    return {
        "full_read_msgs_per_s": round(messages / full_s),
        "full_read_s": round(full_s, 3),
        "compaction_s": round(compact_s, 3),
        "compaction_msgs_per_s": round(messages / compact_s),
        "compacted_read_s": round(view_s, 4),
        "compacted_read_speedup": round(full_s / view_s, 1),
        "broker_peak_rss_mb": round(rss / MB, 1) if rss is not None else None,
    }


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    reps = []
    for rep in range(args.reps):
        with tempfile.TemporaryDirectory(prefix="bench-compaction-") as tmp:
            result = await one_rep(Path(tmp), args.messages, args.keys, args.size)
        log(f"rep {rep + 1}/{args.reps}: {result}")
        reps.append(result)
    return {
        "benchmark": "compaction",
        "baseline": "full (non-compacted) read of the same topic",
        "messages": args.messages,
        "keys": args.keys,
        "size": args.size,
        "reps": args.reps,
        "loadavg": round(loadavg(), 2),
        "median": median_tree(reps),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--messages", type=int, default=200_000)
    p.add_argument("--keys", type=int, default=1000)
    p.add_argument("--size", type=int, default=100)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="20k messages, 2 reps")
    args = p.parse_args(argv)
    if args.quick:
        args.messages, args.reps = 20_000, 2
    result = asyncio.run(main_async(args))
    print(json.dumps(result, separators=(",", ":")), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
