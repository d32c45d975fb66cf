"""The harness can fail: each seeded bug (a failpoint in the brokers) is flagged by the
checker in a targeted real run.

Every scenario is a :class:`~anabranch.testing.faults.run.RunConfig` with the failpoint
set in every broker's environment and a fixed fault schedule aimed at the guarantee the
failpoint breaks. A scenario may take a second seed: real timing decides whether, say, a
killed broker held unsynced acknowledged data at that moment.

- ``ack-before-fsync``: SIGKILL keeps the page cache, so a plain crash never loses a
  write that was acknowledged before its fdatasync. The harness's brokers write ledger
  files through :mod:`anabranch.testing.faults.disk`, which records each file's last
  fsynced length; the ``kill`` fault truncates every file the killed broker wrote to that
  length before anyone recovers it (what a power cut leaves). With the failpoint the
  group commit never fsyncs, so acknowledged entries vanish: ``lost``.
- ``drop-dedup-carry``: the idempotent workload re-sends a key's last acknowledged
  (producer, sequence id, value) to the key's new segment after a split; a child that did
  not inherit its parents' dedup marks stores it again: ``duplicate``.
- ``no-recampaign``: each broker in turn is paused past the session TTL; the failpoint
  stops a broker's controllers from ever opening a new session, so none can lead again
  (a broker that never led would still have won with its old live session: that is
  why every broker, not the leader of the moment, is paused) and the split probe after
  the heal never succeeds: ``controller-unavailable``.
- ``no-assignment-refresh``: the leader is paused past the TTL (its process survives),
  the storm goes on under the new leader, and the stream consumer keeps its stale
  assignment: ``undelivered`` (or ``late``).
- ``skip-parent-cursor-flush``: one broker (so it owns every segment and leads the
  controller) saves cursors lazily every 15 s; the storm kills it 1.5 s after a change,
  when the parent has drained and its children are being read. The restarted controller
  finds the parent's cursor rewound, deals the parent out again, and its messages come
  after the children's in the same consumer session: ``parent-after-child``. (With the
  fix, the drain itself saves the cursor and the same run is clean.)
- ``txn-hold-outcomes``: participants never apply a transaction's outcome, so what the
  transaction workers committed never shows on their topics: ``committed-lost`` (the
  transactions it leaves open also hold back every later send: ``lost``). The final
  reads end after 5 s: waiting longer cannot show what is held.

Each scenario runs only as long as its bug needs: its fault window, then 3 s of sends
after the heal. Where a scenario sets 5 s liveness or availability bounds, that is
because waiting longer only turns one anomaly into another ('undelivered' for 'late', a
probe that never succeeded for one that succeeded too late); the same scenarios without
their failpoint answer the split probe within ~0.1 s of the heal and deliver to the
stream within ~0.05 s, and show no anomaly.

The last three failpoints are wired by the fixes of issue 19 bugs 1, 2 and 4 (in the
broker's controller service, the client's controller registration and the broker's
segment operations); ``no-assignment-refresh`` is a client-side failpoint, which
:func:`~anabranch.testing.faults.run.run_once` switches on in the test process.
"""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from typing import Any

import pytest

from anabranch import failpoints
from anabranch.testing.faults.nemesis import Fault
from anabranch.testing.faults.run import RunConfig, run_once

pytestmark = pytest.mark.timeout(600)


def scenario(failpoint: str, **fields: Any) -> RunConfig:
    """A targeted run: ``failpoint`` in every process, only the consumers it needs (the
    stream consumer; queue and checkpoint consumers and transactions only cost time
    here), and 3 s of sends after the heal (sixty acknowledgements show the topic serves
    again; no scenario's anomaly needs more)."""
    fields.setdefault("post_heal_produce_s", 3.0)
    fields.setdefault("transactions", 0)
    return RunConfig(failpoints=(failpoint,), queue=False, checkpoint=False, **fields)


def flagged(
    tmp_path: Path, config: RunConfig, anomalies: set[str], seeds: int = 2
) -> dict[str, int]:
    """Run ``config`` with up to ``seeds`` seeds; the counts of the first run that shows
    one of ``anomalies`` (else of the last run)."""
    counts: dict[str, int] = {}
    for attempt in range(seeds):
        seed = config.seed + attempt
        run = dataclasses.replace(config, seed=seed)
        result = asyncio.run(run_once(run, tmp_path / f"seed-{seed}"))
        counts = result.report.counts()
        if anomalies & set(counts):
            break
    return counts


def test_ack_before_fsync_loses_acknowledged_writes(tmp_path: Path) -> None:
    # The owner of a segment producers write to, twice: without a single fsync its ledger
    # files are cut to nothing, so whatever it acknowledged is gone.
    kills = (Fault(3.0, "kill", 2.0, target="owner"), Fault(6.5, "kill", 2.0, target="owner"))
    config = scenario(
        failpoints.ACK_BEFORE_FSYNC,
        seed=101,
        duration_s=9.0,
        faults=kills,
        storm_interval_s=None,
        idempotent=False,
    )
    counts = flagged(tmp_path, config, {"lost"})
    assert counts.get("lost", 0) > 0, counts


def test_drop_dedup_carry_stores_a_retried_send_twice(tmp_path: Path) -> None:
    config = scenario(
        failpoints.DROP_DEDUP_CARRY,
        seed=201,
        duration_s=10.0,
        faults=(),
        storm_interval_s=(1.0, 2.0),
        producers=1,
    )
    counts = flagged(tmp_path, config, {"duplicate"})
    assert counts.get("duplicate", 0) > 0, counts


def test_no_recampaign_leaves_the_topic_without_a_controller(tmp_path: Path) -> None:
    # 4.5 s pauses: past the 3 s session TTL of every broker, one at a time.
    pauses = tuple(Fault(3.0 + 5.5 * i, "pause-long", 4.5, target=i) for i in range(3))
    config = scenario(
        failpoints.NO_RECAMPAIGN,
        seed=301,
        duration_s=19.0,
        faults=pauses,
        storm_interval_s=None,
        idempotent=False,
        availability_bound_s=5.0,
        liveness_bound_s=5.0,
    )
    counts = flagged(tmp_path, config, {"controller-unavailable"}, seeds=3)
    assert counts.get("controller-unavailable", 0) > 0, counts


def test_no_assignment_refresh_starves_the_stream_consumer(tmp_path: Path) -> None:
    config = scenario(
        failpoints.NO_ASSIGNMENT_REFRESH,
        seed=401,
        duration_s=11.0,
        faults=(Fault(3.0, "pause-long", 5.0, target="leader"),),
        storm_interval_s=(1.0, 2.5),
        idempotent=False,
        liveness_bound_s=5.0,
    )
    counts = flagged(tmp_path, config, {"undelivered", "late"})
    assert counts.get("undelivered", 0) + counts.get("late", 0) > 0, counts


def test_skip_parent_cursor_flush_delivers_a_parent_after_its_child(tmp_path: Path) -> None:
    config = scenario(
        failpoints.SKIP_PARENT_CURSOR_FLUSH,
        seed=501,
        duration_s=12.0,
        faults=(),
        brokers=1,
        broker_settings={"cursor_persist_interval_ms": 15_000},
        storm_interval_s=(1.5, 2.5),
        storm_crash_every_s=6.0,
        storm_crash_delay_s=1.5,
        keys=4,
        idempotent=False,
    )
    counts = flagged(tmp_path, config, {"parent-after-child"})
    assert counts.get("parent-after-child", 0) > 0, counts


def test_txn_hold_outcomes_loses_committed_transactions(tmp_path: Path) -> None:
    # Participants never apply an outcome: a commit the coordinator acknowledged never
    # shows on its topics (and the transactions it leaves open pin every later message).
    config = scenario(
        failpoints.TXN_HOLD_OUTCOMES,
        seed=601,
        duration_s=8.0,
        faults=(),
        storm_interval_s=None,
        idempotent=False,
        transactions=2,
        liveness_bound_s=5.0,
        availability_bound_s=10.0,
        final_read_s=5.0,
    )
    counts = flagged(tmp_path, config, {"committed-lost"}, seeds=1)
    assert counts.get("committed-lost", 0) > 0, counts
