"""Random sequences of NEW_TXN, END_TXN, guarded op writes, sweeps and GC against a model.

The coordinator runs on the memory store with a manual clock; the model is a dict of
transaction -> (state, deadline, finalized_at, op records) written from the rules as
the module docstring of ``core/txn_state.py`` states them, not from its code. Checked
after every step: a header is OPEN exactly at version 1 and final at version 2 (so it
left OPEN once); a guarded op write succeeded iff the model said OPEN; GC removed only
headers with no op records, and only past retention.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, invariant, rule

from anabranch.errors import BadVersion, InvalidTxnStatus, TransactionNotFound
from anabranch.metadata.api import Check, Delete, Put
from anabranch.metadata.memory import MemoryMetadataStore
from anabranch.testing.clock import ManualClock
from anabranch.transactions import records
from anabranch.transactions.coordinator import TransactionCoordinator
from anabranch.transactions.ids import TxnId
from anabranch.transactions.records import OpKind, TxnOp, TxnState

RETENTION_MS = 3_000
TIMEOUTS_MS = [500, 2_000, 10_000]


@dataclass
class Model:
    state: TxnState
    deadline: int
    finalized_at: int | None = None
    ops: int = 0
    next_seq: int = 0


class CoordinatorModel(RuleBasedStateMachine):
    txns = Bundle("txns")

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.clock = ManualClock()
        self.store = MemoryMetadataStore()
        self.tc = TransactionCoordinator(
            self.store,
            self.clock,
            partitions=2,
            sweep_interval_s=0,
            gc_retention_s=RETENTION_MS / 1000,
        )
        self.run(self.tc.start())
        self.model: dict[TxnId, Model] = {}
        self.collected: set[TxnId] = set()

    def run(self, coro: Any) -> Any:
        return self.loop.run_until_complete(coro)

    def teardown(self) -> None:
        self.run(self.tc.close())
        self.run(self.store.close())
        self.loop.close()

    def now(self) -> int:
        return self.clock.wall_ms()

    def finalize(self, txn: TxnId, state: TxnState) -> None:
        entry = self.model[txn]
        assert entry.state is TxnState.OPEN, "a header leaves OPEN once"
        entry.state, entry.finalized_at = state, self.now()

    # --- rules ------------------------------------------------------------------------------

    @rule(target=txns, timeout=st.sampled_from(TIMEOUTS_MS), tc_id=st.sampled_from([0, 1, None]))
    def new_txn(self, timeout: int, tc_id: int | None) -> TxnId:
        txn: TxnId = self.run(self.tc.new_txn(timeout, tc_id=tc_id))
        assert txn not in self.model and txn not in self.collected, "ids are never reused"
        self.model[txn] = Model(TxnState.OPEN, self.now() + timeout)
        return txn

    @rule(txn=txns, wanted=st.sampled_from([TxnState.COMMITTED, TxnState.ABORTED]))
    def end_txn(self, txn: TxnId, wanted: TxnState) -> None:
        entry = self.model.get(txn)
        try:
            got = self.run(self.tc.end_txn(txn, wanted))
        except TransactionNotFound:
            assert entry is None
            return
        except InvalidTxnStatus:
            assert entry is not None
            if entry.state is TxnState.OPEN:
                # Only a commit past the deadline fails on an OPEN transaction: it aborts.
                assert wanted is TxnState.COMMITTED and self.now() > entry.deadline
                self.finalize(txn, TxnState.ABORTED)
            else:
                assert entry.state is not wanted
            return
        assert entry is not None and got is wanted
        if entry.state is TxnState.OPEN:
            assert wanted is TxnState.ABORTED or self.now() <= entry.deadline
            self.finalize(txn, wanted)
        else:
            assert entry.state is wanted  # the idempotent retry

    @rule(txn=txns)
    def guarded_op_write(self, txn: TxnId) -> None:
        entry = self.model.get(txn)
        seq = 0 if entry is None else entry.next_seq
        op = Put(records.op_path(txn, seq), records.encode_op(TxnOp(OpKind.WRITE, "t")))
        try:
            self.run(self.store.commit([Check(records.header_path(txn), 1), op]))
        except BadVersion:
            assert entry is None or entry.state is not TxnState.OPEN
            return
        assert entry is not None and entry.state is TxnState.OPEN
        entry.ops += 1
        entry.next_seq += 1

    @rule(txn=txns)
    def participant_cleans_up(self, txn: TxnId) -> None:
        entry = self.model.get(txn)
        if entry is None or entry.state is TxnState.OPEN or entry.ops == 0:
            return
        page = self.run(self.store.list_prefix(records.op_prefix(txn)))
        self.run(self.store.commit([Delete(r.path) for r in page.records]))
        entry.ops = 0

    @rule(seconds=st.sampled_from([0.1, 0.6, 2.5, 4.0]))
    def advance(self, seconds: float) -> None:
        self.clock.advance(seconds)

    @rule()
    def sweep_timeouts(self) -> None:
        expired = [
            txn
            for txn, entry in self.model.items()
            if entry.state is TxnState.OPEN and self.now() > entry.deadline
        ]
        assert self.run(self.tc.sweep_timeouts()) == len(expired)
        for txn in expired:
            self.finalize(txn, TxnState.ABORTED)

    @rule()
    def sweep_gc(self) -> None:
        cutoff = self.now() - RETENTION_MS
        due = [
            txn
            for txn, entry in self.model.items()
            if entry.finalized_at is not None and entry.finalized_at < cutoff and entry.ops == 0
        ]
        assert self.run(self.tc.sweep_gc()) == len(due)
        for txn in due:
            del self.model[txn]
            self.collected.add(txn)

    # --- invariants -------------------------------------------------------------------------

    @invariant()
    def headers_match_the_model(self) -> None:
        page = self.run(self.store.list_prefix(records.HEADERS))
        stored = {records.parse_txn_key(r.path[len(records.HEADERS) :]): r for r in page.records}
        assert set(stored) == set(self.model)
        for txn, record in stored.items():
            entry = self.model[txn]
            header = records.decode_header(record.value)
            assert header.state is entry.state
            assert record.stat.version == (1 if entry.state is TxnState.OPEN else 2)
            assert header.finalized_at == entry.finalized_at

    @invariant()
    def indexes_match_the_model(self) -> None:
        deadline = self.run(self.store.list_prefix(records.IDX_DEADLINE))
        final = self.run(self.store.list_prefix(records.IDX_FINAL))
        open_txns = {t for t, e in self.model.items() if e.state is TxnState.OPEN}
        assert {records.index_txn(r.path) for r in deadline.records} == open_txns
        assert {records.index_txn(r.path) for r in final.records} == set(self.model) - open_txns


TestCoordinatorModel = CoordinatorModel.TestCase
TestCoordinatorModel.settings = settings(
    max_examples=300,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
