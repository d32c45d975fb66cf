"""Broker footprint: idle RSS, then N persistent topics each with a producer and a consumer.

One run, one broker subprocess (standalone, SQLite metadata, ``fsync=always``):

1. the idle broker (started, nothing connected): RSS, OS threads, open descriptors — the
   baseline of this same run;
2. a separate client process (our asyncio client: ``--connections`` clients, so many
   producers share few connections, and the client's memory never counts) creates
   ``--topics`` topics, a producer and an Exclusive consumer on each, sends one message per
   topic and receives it; while it holds them all open the broker is measured again:
   RSS (``VmRSS``; ``VmHWM`` is the peak), threads (``Threads:`` of /proc/<pid>/status),
   descriptors (/proc/<pid>/fd), and the per-topic cost over the idle baseline.

While topics are being created the broker's heap grows by a quarter again and again, and
each time CPython runs a full garbage collection whose pause grows with the heap (0.3-1.5 s
at a few thousand topics on a loaded 2-core box): the client here tolerates such pauses.

With ``--baseline-src DIR`` (a ``src`` directory of another checkout, e.g. the commit
before a change) the same two phases run first against a broker started from that code,
and the JSON carries both. Targets (issue 15): idle <= 80 MB; 10,000 topics <= 600 MB
RSS and <= 40 threads. The last printed line is one JSON object.

Usage: ``python benchmarks/broker_footprint.py [--topics 10000] [--connections 4]``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import loadavg

MB = 1_000_000
TARGET_IDLE_MB = 80
TARGET_RSS_MB = 600
TARGET_THREADS = 40
SETTLE_S = 2.0
"""Pause before reading /proc after a phase (writer threads idle out, GC settles)."""


def proc_status(pid: int) -> dict[str, int]:
    """VmRSS / VmHWM (bytes) and Threads of a live process, and its open descriptors."""
    out: dict[str, int] = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0]) * 1024
        elif key == "Threads":
            out[key] = int(value)
    out["fds"] = len(os.listdir(f"/proc/{pid}/fd"))
    return out


# --- the client process -------------------------------------------------------------------


async def client_main(url: str, topics: int, connections: int, concurrency: int) -> None:
    """Create everything, report, then hold it open until stdin closes or says 'stop'."""
    from anabranch.aio import Client

    # Tolerant of pauses: while thousands of topics load, the broker's full garbage
    # collections take up to a second or two (see the module docstring), which the
    # default 1 s probe would take for a dead broker.
    clients = [
        Client(url, operation_timeout_s=600.0, operation_stuck_s=60.0, probe_timeout_s=30.0)
        for _ in range(connections)
    ]
    semaphore = asyncio.Semaphore(concurrency)
    handles: list[Any] = []
    received = 0

    async def one(i: int) -> None:
        nonlocal received
        async with semaphore:
            client = clients[i % connections]
            topic = f"persistent://public/default/footprint-{i}"
            consumer = await client.subscribe(topic, "sub", receiver_queue_size=10)
            producer = await client.create_producer(topic, batching=False)
            await producer.send(b"x" * 100)
            message = await consumer.receive()
            assert message is not None
            await consumer.acknowledge(message)
            received += 1
            handles.extend((producer, consumer))

    start = time.monotonic()
    await asyncio.gather(*(one(i) for i in range(topics)))
    setup_s = time.monotonic() - start
    print(json.dumps({"ready": True, "setup_s": round(setup_s, 1), "received": received}))
    sys.stdout.flush()
    await asyncio.to_thread(sys.stdin.readline)
    for client in clients:
        await client.close()


# --- the driver ---------------------------------------------------------------------------


class Broker:
    def __init__(self, data_dir: Path, src: Path | None) -> None:
        self.data_dir = data_dir
        self.src = src
        self.process: subprocess.Popen[bytes] | None = None
        self.port = 0

    def start(self) -> None:
        from anabranch.testing.ports import free_port

        self.port = free_port()
        env = {k: v for k, v in os.environ.items() if not k.startswith("ANABRANCH_")}
        if self.src is not None:
            env["PYTHONPATH"] = str(self.src)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        log = open(self.data_dir.with_suffix(".log"), "ab")  # noqa: SIM115 (the child owns it)
        args = [
            sys.executable, "-m", "anabranch.cli.main", "standalone",
            "--data-dir", str(self.data_dir),
            "--port", str(self.port), "--http-port", str(free_port()),
        ]  # fmt: skip
        try:
            self.process = subprocess.Popen(args, stdout=log, stderr=log, env=env)
        finally:
            log.close()

    async def ready(self) -> None:
        from anabranch.broker.probe import handshake

        end = time.monotonic() + 60
        while True:
            try:
                await handshake("127.0.0.1", self.port)
                return
            except (OSError, ConnectionError, asyncio.IncompleteReadError):
                if time.monotonic() > end or self.process is None or self.process.poll():
                    raise RuntimeError(f"broker did not start; see {self.data_dir}.log") from None
                await asyncio.sleep(0.1)

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def stop(self) -> None:
        process = self.process
        if process is None or process.poll() is not None:
            return
        process.terminate()
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


async def measure(base: Path, src: Path | None, args: argparse.Namespace) -> dict[str, Any]:
    broker = Broker(base / "broker", src)
    broker.start()
    client: subprocess.Popen[bytes] | None = None
    try:
        await broker.ready()
        await asyncio.sleep(SETTLE_S)
        idle = proc_status(broker.pid)
        env = dict(os.environ)
        if src is not None:
            env["PYTHONPATH"] = str(src)
        client = subprocess.Popen(  # noqa: ASYNC220 (returns at once; reads go off-loop)
            [
                sys.executable, __file__, "--client", f"pulsar://127.0.0.1:{broker.port}",
                "--topics", str(args.topics), "--connections", str(args.connections),
                "--concurrency", str(args.concurrency),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
        )  # fmt: skip
        assert client.stdout is not None and client.stdin is not None
        line = await asyncio.to_thread(client.stdout.readline)
        if not line:
            raise RuntimeError("the client process failed (see its stderr above)")
        report = json.loads(line)
        await asyncio.sleep(SETTLE_S)
        loaded = proc_status(broker.pid)
        client.stdin.write(b"stop\n")
        client.stdin.flush()
        await asyncio.to_thread(client.wait, 120)
    finally:
        if client is not None and client.poll() is None:
            client.kill()
            client.wait()
        broker.stop()
    per_topic = (loaded["VmRSS"] - idle["VmRSS"]) / max(args.topics, 1)
    return {
        "idle_rss_mb": round(idle["VmRSS"] / MB, 1),
        "idle_threads": idle["Threads"],
        "idle_fds": idle["fds"],
        "rss_mb": round(loaded["VmRSS"] / MB, 1),
        "peak_rss_mb": round(loaded["VmHWM"] / MB, 1),
        "threads": loaded["Threads"],
        "fds": loaded["fds"],
        "rss_kb_per_topic": round(per_topic / 1000, 1),
        "setup_s": report["setup_s"],
        "messages_received": report["received"],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--topics", type=int, default=10_000)
    parser.add_argument("--connections", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=200)
    parser.add_argument("--baseline-src", type=Path, default=None)
    parser.add_argument("--client", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.client is not None:
        asyncio.run(client_main(args.client, args.topics, args.connections, args.concurrency))
        return
    base = Path(tempfile.mkdtemp(prefix="footprint-", dir="/tmp"))
    result: dict[str, Any] = {
        "benchmark": "broker_footprint",
        "topics": args.topics,
        "connections": args.connections,
        "loadavg_start": round(loadavg(), 2),
    }
    try:
        if args.baseline_src is not None:
            baseline = asyncio.run(measure(base / "baseline", args.baseline_src, args))
            print(f"baseline ({args.baseline_src}): {baseline}", flush=True)
            result["baseline"] = baseline
        current = asyncio.run(measure(base / "current", None, args))
        print(f"current: {current}", flush=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    result.update(current)
    result["targets"] = {
        "idle_rss_mb": TARGET_IDLE_MB,
        "rss_mb": TARGET_RSS_MB,
        "threads": TARGET_THREADS,
    }
    result["meets_targets"] = (
        current["idle_rss_mb"] <= TARGET_IDLE_MB
        and current["rss_mb"] <= TARGET_RSS_MB
        and current["threads"] <= TARGET_THREADS
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
