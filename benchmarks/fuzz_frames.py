"""Fuzz: a million generated and mutated frames, then malformed admin requests, against one
live standalone broker (issue 15's bar: 0 crashes, no stall over 100 ms, bounded memory).

The driver is :mod:`anabranch.testing.fuzz` (the CI test ``tests/faults/test_fuzz.py``
runs the same code with fewer frames). The broker is a real ``anabranch standalone``
subprocess; a separate probe process PINGs it every 10 ms on a healthy connection, and the
longest PING→PONG round trip is ``max_stall_ms``. RSS is sampled from ``/proc``. After
the frames, ``--http`` requests go to every admin route with random and mutated bodies
and parameters: ``http_500`` counts 5xx answers other than 503 and ``http_leaks`` bodies
showing a traceback or the data directory. The broker's log is then searched for
tracebacks (an exception a handler did not expect, even if the client got an error):
``logged_tracebacks``.

Usage: ``python benchmarks/fuzz_frames.py [--frames 1000000] [--http 20000] [--seed 1]``;
the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from anabranch.testing.broker import BrokerProcess
from anabranch.testing.fuzz import FuzzReport, fuzz_frames, fuzz_http, rss_mb


async def run(
    frames: int, http: int, seed: int, connections: int, keep: Path | None
) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        root = keep or Path(tmp)
        broker = BrokerProcess(root / "data")
        await broker.start()
        try:
            assert broker.pid is not None
            last = [0]

            def progress(report: FuzzReport) -> None:
                if report.frames - last[0] >= 50_000:
                    last[0] = report.frames
                    print(
                        f"{report.frames} frames, rss {rss_mb(broker.pid or 0):.0f} MB",
                        file=sys.stderr,
                        flush=True,
                    )

            report = await fuzz_frames(
                broker.host,
                broker.port,
                frames=frames,
                seed=seed,
                connections=connections,
                broker_pid=broker.pid,
                progress=progress,
                leak_markers=(str(root),),
            )
            http_report = await fuzz_http(
                f"http://{broker.host}:{broker.http_port}",
                requests=http,
                seed=seed,
                leak_markers=(str(root),),
            )
            report.rss_end_mb = rss_mb(broker.pid)
            report.crashes = int(not broker.running)
        finally:
            await broker.stop()
        log = broker.log_path.read_text(errors="replace")
    out = {
        "frames": report.frames,
        "mutated": report.mutated,
        "frames_answered": report.frames_answered,
        "connections": report.connections,
        "crashes": report.crashes,
        "max_stall_ms": report.max_stall_ms,
        "p99_stall_ms": report.p99_stall_ms,
        "probe_pings": report.probe_pings,
        "probe_failures": report.probe_failures,
        "unanswered_pings": report.unanswered_pings,
        "rss_start_mb": round(report.rss_start_mb, 1),
        "rss_peak_mb": round(report.rss_peak_mb, 1),
        "rss_end_mb": round(report.rss_end_mb, 1),
        "frames_elapsed_s": report.elapsed_s,
        "http_requests": http_report.http_requests,
        "http_500": http_report.http_500,
        "http_leaks": http_report.http_leaks,
        "frame_leaks": report.frame_leaks,
        "http_statuses": http_report.http_statuses,
        "logged_tracebacks": log.count("Traceback"),
        "examples": (report.examples + http_report.examples)[:5],
    }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frames", type=int, default=1_000_000)
    parser.add_argument("--http", type=int, default=20_000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--connections", type=int, default=6)
    parser.add_argument("--keep", type=Path, default=None, help="data dir to keep (and its log)")
    args = parser.parse_args()
    result = asyncio.run(run(args.frames, args.http, args.seed, args.connections, args.keep))
    print(json.dumps(result, sort_keys=True))


if __name__ == "__main__":
    main()
