"""The soak tier of the fault harness: many seeded runs, a JSON summary each, one table.

``python -m anabranch.testing.soak --runs 100 --seed 1000`` runs seeds 1000..1099 one
after another (each a 3-broker cluster with the storm and every workload, under the
seeded schedule of the chosen fault kinds, see :mod:`anabranch.testing.faults.run`),
writes ``<out>/seed-<n>/summary.json`` per run (config, schedule, fault windows, report)
next to its history and logs, ``<out>/soak.json`` over all runs, and prints a table.
A passing run's ledger and etcd data are deleted (``--keep-data`` keeps them); a failing
run keeps everything. Any run replays from its seed: ``--runs 1 --seed <n>`` with the
same options.

Example:
    >>> args = parse_args(["--runs", "3", "--seed", "7", "--kinds", "kill,pause-long"])
    >>> [config.seed for config in configs(args)], configs(args)[0].kinds
    ([7, 8, 9], ('kill', 'pause-long'))
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from anabranch.testing.faults.nemesis import KINDS
from anabranch.testing.faults.run import RunConfig, run_once


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m anabranch.testing.soak")
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--duration", type=float, default=40.0, help="fault window, s")
    parser.add_argument("--kinds", default=",".join(KINDS), help=f"of {','.join(KINDS)}")
    parser.add_argument("--failpoints", default="", help="seeded bugs in every broker")
    parser.add_argument("--out", type=Path, default=None, help="default: a new temp dir")
    parser.add_argument("--keep-data", action="store_true")
    args = parser.parse_args(argv)
    unknown = set(_split(args.kinds)) - set(KINDS)
    if unknown:
        parser.error(f"unknown fault kinds {sorted(unknown)}")
    return args


def _split(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())


def configs(args: argparse.Namespace) -> list[RunConfig]:
    return [
        RunConfig(
            seed=args.seed + i,
            duration_s=args.duration,
            kinds=_split(args.kinds),
            failpoints=_split(args.failpoints),
        )
        for i in range(args.runs)
    ]


async def soak(args: argparse.Namespace) -> list[dict[str, Any]]:
    out: Path = args.out or Path(tempfile.mkdtemp(prefix="anabranch-soak-"))
    rows: list[dict[str, Any]] = []
    for config in configs(args):
        root = out / f"seed-{config.seed}"
        began = time.monotonic()
        try:
            result = await run_once(config, root)
        except Exception as err:  # a harness failure is a row, not the end of the soak
            rows.append({"seed": config.seed, "error": repr(err)[:300], "root": str(root)})
            print(f"seed {config.seed}: harness error {err!r}", file=sys.stderr)
            continue
        report = result.report
        row = {
            "seed": config.seed,
            "ok": report.ok,
            "anomalies": report.counts(),
            "faults": report.stats["faults"],
            "sends_ok": report.stats["sends"].get("ok", 0),
            "layout_changes": report.stats["layout_changes"],
            "heal_to_split_s": report.stats.get("heal_to_split_s"),
            "worst_lag_s": report.stats["worst_delivery_lag_after_heal_s"],
            "txns": report.stats.get("txns", {}),
            "wall_s": round(time.monotonic() - began, 1),
            "root": str(root),
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
        if report.ok and not args.keep_data:
            for sub in ("data", "etcd"):
                shutil.rmtree(root / sub, ignore_errors=True)
    (out / "soak.json").write_text(json.dumps({"runs": rows, "totals": totals(rows)}, indent=1))
    print_table(rows)
    print(f"results under {out}")
    return rows


def totals(rows: list[dict[str, Any]]) -> dict[str, Any]:
    anomalies: dict[str, int] = {}
    for row in rows:
        for kind, count in row.get("anomalies", {}).items():
            anomalies[kind] = anomalies.get(kind, 0) + count
    return {
        "runs": len(rows),
        "passed": sum(1 for r in rows if r.get("ok")),
        "harness_errors": sum(1 for r in rows if "error" in r),
        "failed_seeds": [r["seed"] for r in rows if not r.get("ok")],
        "anomalies": anomalies,
    }


def print_table(rows: list[dict[str, Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="fault-harness soak")
    for column in ("seed", "result", "faults", "sends ok", "splits/merges", "heal->split s",
                   "worst lag s", "wall s"):  # fmt: skip
        table.add_column(column)
    for row in rows:
        if "error" in row:
            table.add_row(str(row["seed"]), f"[yellow]harness error[/] {row['error'][:60]}")
            continue
        result = "[green]ok[/]" if row["ok"] else "[red]" + json.dumps(row["anomalies"]) + "[/]"
        faults = ",".join(f"{k}x{v}" for k, v in row["faults"].items())
        changes = row["layout_changes"]
        table.add_row(
            str(row["seed"]),
            result,
            faults,
            str(row["sends_ok"]),
            f"{changes.get('split', 0)}/{changes.get('merge', 0)}",
            str(row["heal_to_split_s"]),
            str(row["worst_lag_s"]),
            str(row["wall_s"]),
        )
    Console().print(table)
    print(json.dumps(totals(rows)))


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.ERROR)
    args = parse_args(sys.argv[1:] if argv is None else argv)
    rows = asyncio.run(soak(args))
    return 0 if all(r.get("ok") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
