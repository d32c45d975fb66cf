"""The CI tier of the fault harness: a few seeded real runs, zero anomalies.

Each run is a 3-broker cluster on one etcd with the split/merge storm, producers, the
idempotent resender, two transaction workers (commits and aborts over two plain topics
and the scalable one) and stream, queue and checkpoint consumers, under a seeded schedule
of process, network and etcd faults (``CI_KINDS``: kill with lose-unfsynced,
pauses shorter and longer than the session TTL, a broker cut off etcd, etcd killed).
About 40 s of wall time per run; a failure names its seed and its directory (history,
layout, summary and every process's log) -- ``python -m anabranch.testing.soak --runs 1
--seed N --kinds ...`` replays it.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from anabranch.testing.faults.run import CI_KINDS, RunConfig, run_once

SEEDS = (93, 276)
"""Two schedules that between them hold every kind of ``CI_KINDS``, six of seven aimed at
the controller leader (kill, pauses shorter and longer than the TTL, partition, isolate,
client-cut) plus an etcd kill, under the split/merge storm; the four seeds before (11-14)
never partitioned nor isolated a broker. ``test_the_seeds_cover_every_ci_kind`` keeps
it so."""
DURATION_S = 25.0

pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize("seed", SEEDS)
def test_a_seeded_run_shows_no_anomaly(tmp_path: Path, seed: int) -> None:
    config = RunConfig(seed=seed, duration_s=DURATION_S, kinds=CI_KINDS)
    result = asyncio.run(run_once(config, tmp_path))
    summary = result.summary()
    assert result.report.stats["sends"].get("ok", 0) > 0, "nothing was acknowledged"
    assert result.report.stats["faults"], "the schedule injected no fault"
    assert result.report.stats["layout_changes"], "the storm split or merged nothing"
    txns = result.report.stats["txns"]
    assert txns.get("ok-commit", 0) > 0 and txns.get("ok-abort", 0) > 0, txns
    assert result.report.ok, json.dumps(summary["report"], indent=1)[:4000] + f"\nsee {tmp_path}"


def test_the_seeds_cover_every_ci_kind() -> None:
    configs = [RunConfig(seed=seed, duration_s=DURATION_S, kinds=CI_KINDS) for seed in SEEDS]
    faults = [fault for config in configs for fault in config.schedule()]
    assert {f.kind for f in faults} == set(CI_KINDS)
    on_leader = {f.kind for f in faults if f.target == "leader"}
    assert {"kill", "pause-short", "pause-long"} <= on_leader
