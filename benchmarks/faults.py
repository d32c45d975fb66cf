"""Faults: what producers and consumers see while brokers are killed, paused and cut off.

One run of the fault harness (:mod:`anabranch.testing.faults.run`): 3 brokers on one etcd
(session TTL ``--ttl``), a 2-segment scalable topic with a split/merge storm, two keyed
producers at ``--rate`` msg/s each, the idempotent resender, stream, queue and checkpoint
consumers, and a fixed schedule:

1. SIGKILL the owner of an active segment (lose-unfsynced applied), restart it after 3 s;
2. SIGSTOP the owner of an active segment for 2x the TTL (its session expires), SIGCONT;
3. SIGSTOP a broker for half the TTL;
4. cut a broker off etcd for 2x the TTL;
5. SIGKILL etcd, restart it after 2 s.

Then heal, a split probe, drain and a full read. Figures: acknowledged sends/s inside
fault windows vs outside them (same run), the longest a send waited for its ack when it
was sent during (or up to 1 s before) a kill and a pause (target: TTL + 2 s), time from
the heal to a successful split, the checker's counts of lost / duplicated /
out-of-order / undelivered messages (all expected 0) and the brokers' peak RSS. With
``--reps N`` (seeds ``seed .. seed+N-1``) the figures are medians over the runs, the
anomaly counts sums.

Usage: ``python benchmarks/faults.py [--seed 1] [--reps 3] [--quick]``; the last line is
one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

from anabranch.testing.faults.history import NEMESIS, Op
from anabranch.testing.faults.nemesis import Fault
from anabranch.testing.faults.run import RunConfig, RunResult, run_once


def fault_schedule(ttl: float) -> tuple[Fault, ...]:
    return (
        Fault(5.0, "kill", 3.0, target="owner"),
        Fault(12.0, "pause-long", 2.0 * ttl, target="owner"),
        Fault(12.0 + 2.0 * ttl + 4.0, "pause-short", 0.5 * ttl, target=2),
        Fault(20.0 + 2.5 * ttl, "partition", 2.0 * ttl, target=0),
        Fault(26.0 + 4.5 * ttl, "etcd-kill", 2.0),
    )


def ack_rates(ops: list[Op], windows: list[tuple[float, float, str]]) -> tuple[float, float]:
    """Acknowledged sends per second inside and outside fault windows, over the span
    from the first send to the heal."""
    acks = [op.t for op in ops if op.f == "send" and op.type == "ok"]
    invokes = [op.t for op in ops if op.f == "send" and op.type == "invoke"]
    heal = [op.t for op in ops if op.process == NEMESIS and op.f == "heal"]
    if not acks or not invokes or not heal:
        return 0.0, 0.0
    begin, end = invokes[0], heal[-1]
    inside_s = sum(min(b, end) - max(a, begin) for a, b, _ in windows if b > begin and a < end)
    inside = sum(1 for t in acks if begin <= t <= end and any(a <= t <= b for a, b, _ in windows))
    outside = sum(1 for t in acks if begin <= t <= end) - inside
    outside_s = (end - begin) - inside_s
    return (
        inside / inside_s if inside_s > 0 else 0.0,
        outside / outside_s if outside_s > 0 else 0.0,
    )


def longest_wait(ops: list[Op], start: float, stop: float) -> float:
    """The longest invoke-to-completion time of sends invoked in ``[start - 1, stop]``."""
    invoked: dict[str, float] = {}
    worst = 0.0
    for op in ops:
        if op.f != "send" or "value" not in op.value:
            continue
        value = str(op.value["value"])
        if op.type == "invoke":
            invoked[value] = op.t
        elif value in invoked:
            t0 = invoked.pop(value)
            if start - 1.0 <= t0 <= stop:
                worst = max(worst, op.t - t0)
    return worst


def figures(result: RunResult) -> dict[str, Any]:
    ops = result.history.ops
    inside, outside = ack_rates(ops, result.windows)
    stalls: dict[str, float] = {}
    for start, stop, kind in result.windows:
        name = "kill" if kind == "kill" else "pause" if kind.startswith("pause") else None
        if name is not None:
            stalls[name] = max(stalls.get(name, 0.0), longest_wait(ops, start, stop))
    counts = result.report.counts()
    ttl = result.config.session_ttl_s
    return {
        "seed": result.config.seed,
        "session_ttl_s": ttl,
        "acked_sends_per_s_outside_faults": round(outside, 1),
        "acked_sends_per_s_inside_faults": round(inside, 1),
        "longest_stall_after_kill_s": round(stalls.get("kill", 0.0), 2),
        "longest_stall_after_pause_s": round(stalls.get("pause", 0.0), 2),
        "stall_target_s": ttl + 2.0,
        "heal_to_split_s": result.report.stats.get("heal_to_split_s"),
        "lost": counts.get("lost", 0),
        "duplicated": counts.get("duplicate", 0),
        "out_of_order": counts.get("order", 0) + counts.get("parent-after-child", 0),
        "undelivered": counts.get("undelivered", 0) + counts.get("late", 0),
        "anomalies": counts,
        "sends_ok": result.report.stats["sends"].get("ok", 0),
        "layout_changes": result.report.stats["layout_changes"],
        "broker_peak_rss_mb": round(max(result.peak_rss_kb.values(), default=0) / 1024, 1),
        "wall_s": round(result.wall_s, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--ttl", type=float, default=3.0)
    parser.add_argument("--rate", type=float, default=20.0, help="msg/s per producer")
    parser.add_argument("--quick", action="store_true", help="only the kill and a pause")
    parser.add_argument("--reps", type=int, default=3, help="runs (seeds seed..seed+reps-1)")
    args = parser.parse_args()
    faults = fault_schedule(args.ttl)
    if args.quick:
        faults = faults[:2]
    duration = max(f.at_s + f.duration_s for f in faults) + 5.0
    config = RunConfig(
        seed=args.seed,
        duration_s=duration,
        faults=faults,
        session_ttl_s=args.ttl,
        rate_per_producer=args.rate,
        # Producers and consumers only, as when the README's figures were measured: the
        # transaction workers would add their own load to the sends/s compared.
        transactions=0,
    )
    runs = []
    for rep in range(args.reps):
        root = Path(tempfile.mkdtemp(prefix="anabranch-faults-bench-"))
        seeded = dataclasses.replace(config, seed=args.seed + rep)
        result = asyncio.run(run_once(seeded, root))
        runs.append(figures(result))
        print(f"run {rep + 1}/{args.reps}: {json.dumps(runs[-1])} (under {root})", flush=True)
    print(json.dumps(combine(runs)))


SUMMED = ("lost", "duplicated", "out_of_order", "undelivered", "sends_ok")


def combine(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians of the figures over runs; anomaly counts summed."""
    out: dict[str, Any] = {"reps": len(runs), "seeds": [r["seed"] for r in runs]}
    for name in runs[0]:
        if name in ("seed", "anomalies", "layout_changes"):
            continue
        values = [r[name] for r in runs if r[name] is not None]
        if name in SUMMED:
            out[name] = sum(values)
        elif values and all(isinstance(v, (int, float)) for v in values):
            out[name] = round(statistics.median(values), 3)
    out["anomalies"] = {
        k: sum(r["anomalies"].get(k, 0) for r in runs)
        for k in sorted({k for r in runs for k in r["anomalies"]})
    }
    return out


if __name__ == "__main__":
    main()
