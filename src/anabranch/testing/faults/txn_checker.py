"""The transactions part of the checker: a pure function of the recorded history.

Inputs (see :meth:`~anabranch.testing.faults.workload.Workload.transactions`): per
transaction an ``invoke`` op ``f="txn"`` naming its ``txn``, its ``decision`` (``commit``
or ``abort``) and its ``writes`` (``topic``, ``key``, unique ``value``), then one of
``ok`` (``outcome``: it ended as decided), ``fail`` (it never committed) or ``info``
(unknown); reads are ``recv`` ops (the scalable topic; ``kind="final"`` is the final
read) and ``txn-read`` ops (the plain topics' final read; ``txn-read-done`` ends one).

It finds:

``committed-lost``
    a write of a committed transaction that the final read of its topic did not return;
``aborted-visible``
    any read of a value written by a transaction that never committed: aborted as
    decided, failed before its commit, or decided ``abort`` with an unknown outcome (an
    abort can time out, never commit);
``partial-txn``
    a transaction decided ``commit`` with an unknown outcome (or none: the run ended
    first) that some read shows committed while the final reads miss some of its
    writes -- a commit is all or nothing;
``txn-phantom``
    a read transactional value no transaction wrote;
``txn-unavailable``
    transactions ran after the heal but none committed after it.

One value stored at two positions (a read from two places) is not judged: it is counted
in ``stats["txn_duplicates"]`` with examples, since whether a transactional resend is
deduplicated depends on where it went (a resend after a split lands in another segment).

Example:
    >>> from anabranch.testing.faults.checker import Report
    >>> from anabranch.testing.faults.history import History
    >>> h = History(clock=iter(range(100)).__next__)
    >>> w = [{"topic": "persistent://t/n/a", "key": "k", "value": "x=t.1;id=1:2;i=0"}]
    >>> _ = h.record("txn-0", "invoke", "txn", {"txn": "t.1", "decision": "commit", "writes": w})
    >>> _ = h.record("txn-0", "ok", "txn", {"txn": "t.1", "outcome": "commit"})
    >>> report = Report()
    >>> check_transactions(report, h.ops, heal_t=0.0)
    >>> report.counts()
    {'committed-lost': 1}
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from anabranch.testing.faults.history import Op
from anabranch.testing.faults.values import TxnValue

if TYPE_CHECKING:
    from anabranch.testing.faults.checker import Report

SCALABLE_PREFIX = "topic://"


@dataclass
class _Txn:
    label: str
    txn_id: str
    decision: str
    writes: list[tuple[str, str]]  # (topic, value)
    outcome: str = "pending"  # ok | fail | info | pending
    end_t: float | None = None
    error: str = ""


@dataclass
class _Reads:
    """What the reads returned, by value."""

    visible: set[str] = field(default_factory=set)
    """Every transactional value any read returned."""
    stored: dict[str, set[str]] = field(default_factory=lambda: defaultdict(set))
    """Per topic (``SCALABLE_PREFIX`` for the scalable one), what its final read returned."""
    finished: set[str] = field(default_factory=set)
    """Topics whose final read ran (for the others, any read counts as stored)."""
    positions: dict[str, set[tuple[Any, ...]]] = field(default_factory=lambda: defaultdict(set))
    by_topic: dict[str, set[str]] = field(default_factory=lambda: defaultdict(set))


def check_transactions(report: Report, ops: Sequence[Op], heal_t: float) -> None:
    """Add the transactional anomalies of ``ops`` to ``report`` (see the module docstring)."""
    txns = _txns(ops)
    if not txns:
        return
    reads = _reads(ops)
    written = {value for txn in txns.values() for _, value in txn.writes}
    for value in sorted(reads.visible - written):
        report.add("txn-phantom", value=value)
    for txn in txns.values():
        _check_one(report, txn, reads)
    _check_duplicates(report, reads)
    _check_after_heal(report, ops, txns, heal_t)
    outcomes: dict[str, int] = defaultdict(int)
    for txn in txns.values():
        done = f"ok-{txn.decision}" if txn.outcome == "ok" else txn.outcome
        outcomes[done] += 1
    report.stats["txns"] = dict(sorted(outcomes.items()))


def _txns(ops: Sequence[Op]) -> dict[str, _Txn]:
    txns: dict[str, _Txn] = {}
    for op in ops:
        if op.f != "txn" or "txn" not in op.value:
            continue
        label = str(op.value["txn"])
        if op.type == "invoke":
            writes = [(str(w["topic"]), str(w["value"])) for w in op.value.get("writes", [])]
            txns[label] = _Txn(
                label, str(op.value.get("id", "")), str(op.value["decision"]), writes
            )
            continue
        txn = txns.get(label)
        if txn is not None:
            txn.outcome, txn.end_t = op.type, op.t
            txn.error = str(op.value.get("error", ""))
    return txns


def _reads(ops: Sequence[Op]) -> _Reads:
    reads = _Reads()
    for op in ops:
        if op.f == "txn-read-done":
            reads.finished.add(str(op.value["topic"]))
            continue
        if op.type != "ok" or op.f not in ("recv", "txn-read") or "value" not in op.value:
            continue
        value = str(op.value["value"])
        if TxnValue.decode(value) is None:
            continue
        if op.f == "recv":
            topic = SCALABLE_PREFIX
            final = op.value.get("kind") == "final"
        else:
            topic = str(op.value["topic"])
            final = True
        reads.visible.add(value)
        reads.by_topic[topic].add(value)
        if final:
            reads.stored[topic].add(value)
        where = op.value.get("id")
        if where:
            reads.positions[value].add((topic, *where))
    if any(op.f == "final-done" for op in ops):
        reads.finished.add(SCALABLE_PREFIX)
    return reads


def _stored(reads: _Reads, topic: str) -> set[str]:
    key = SCALABLE_PREFIX if topic.startswith(SCALABLE_PREFIX) else topic
    # Without a final read of the topic, what any read returned is what was stored.
    return reads.stored[key] if key in reads.finished else reads.by_topic[key]


def _check_one(report: Report, txn: _Txn, reads: _Reads) -> None:
    values = [value for _, value in txn.writes]
    seen = [value for value in values if value in reads.visible]
    missing = [(t, v) for t, v in txn.writes if v not in _stored(reads, t)]
    facts = {"txn": txn.label, "id": txn.txn_id, "end_t": txn.end_t}
    never_committed = txn.decision == "abort" or txn.outcome == "fail"
    if never_committed:
        if seen:
            report.add(
                "aborted-visible", **facts, outcome=txn.outcome, decision=txn.decision,
                visible=seen, error=txn.error,
            )  # fmt: skip
        return
    if txn.outcome == "ok":
        for topic, value in missing:
            report.add("committed-lost", **facts, topic=topic, value=value)
        return
    # Unknown outcome of a commit: nothing or everything.
    if seen and missing:
        report.add(
            "partial-txn", **facts, outcome=txn.outcome, visible=seen,
            missing=[v for _, v in missing], error=txn.error,
        )  # fmt: skip


def _check_duplicates(report: Report, reads: _Reads) -> None:
    examples: list[dict[str, Any]] = []
    count = 0
    for value, where in sorted(reads.positions.items()):
        if len(where) > 1:
            count += 1
            if len(examples) < 10:
                examples.append({"value": value, "positions": sorted(list(p) for p in where)})
    report.stats["txn_duplicates"] = {"count": count, "examples": examples}


def _check_after_heal(
    report: Report, ops: Sequence[Op], txns: dict[str, _Txn], heal_t: float
) -> None:
    """Transactions tried after the heal: one of them commits (any time after it: the
    workload keeps trying only for a bounded time)."""
    # A transaction that could not even open (``txn-open``) was tried too.
    attempts = sum(
        1
        for op in ops
        if op.t >= heal_t and (op.f == "txn-open" or (op.f == "txn" and op.type == "invoke"))
    )
    if not attempts:
        return
    commits = [
        txn.end_t
        for txn in txns.values()
        if txn.outcome == "ok" and txn.decision == "commit" and txn.end_t is not None
        if txn.end_t >= heal_t
    ]
    if not commits:
        report.add("txn-unavailable", heal_t=heal_t, attempts=attempts)
        return
    report.stats["heal_to_txn_commit_s"] = round(min(commits) - heal_t, 3)
