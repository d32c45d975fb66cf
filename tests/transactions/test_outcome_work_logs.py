"""A participant's outcome work failing the way faults make it fail logs one line: a
topic unloaded after its broker lost the metadata session tries its leftovers once, and
the fenced delete answers NotOwner (the new owner's recovery finishes them); etcd out of
reach answers MetadataUnavailable (retried). Both printed a traceback each time, found by
a transactions fault driver pausing etcd past the session TTL."""

from __future__ import annotations

import logging

import pytest

from anabranch.clock import SystemClock
from anabranch.errors import MetadataUnavailable, NotOwner
from anabranch.transactions.ids import TxnId
from anabranch.transactions.op_records import OutcomeWork
from anabranch.transactions.records import TxnState


@pytest.mark.parametrize(
    "error",
    [NotOwner("persistent://public/default/t", None), MetadataUnavailable("etcd unreachable")],
)
async def test_expected_failures_log_one_line(
    caplog: pytest.LogCaptureFixture, error: Exception
) -> None:
    async def work(txn: TxnId, state: TxnState) -> bool:
        raise error

    outcomes = OutcomeWork(SystemClock(), work, "buffer t")
    outcomes.submit(TxnId(0, 1), TxnState.COMMITTED)
    with caplog.at_level(logging.WARNING, logger="anabranch.transactions.op_records"):
        await outcomes.close()  # what an unload does: one last pass
    [record] = [r for r in caplog.records if "not applied yet" in r.getMessage()]
    assert not record.exc_info
    assert str(error) in record.getMessage()
    assert outcomes.failures >= 1


async def test_an_unexpected_failure_keeps_its_traceback(caplog: pytest.LogCaptureFixture) -> None:
    async def work(txn: TxnId, state: TxnState) -> bool:
        raise RuntimeError("a bug")

    outcomes = OutcomeWork(SystemClock(), work, "buffer t")
    outcomes.submit(TxnId(0, 1), TxnState.ABORTED)
    with caplog.at_level(logging.WARNING, logger="anabranch.transactions.op_records"):
        await outcomes.close()
    assert any(r.exc_info for r in caplog.records)
