"""The transactions' checker on synthetic histories: each anomaly is found, a clean
history of every outcome passes, and transactional values stay out of the send checks.

Histories are :func:`tests.faults.test_checker.clean_history` (sends, a heal at t=8, a
probe) plus transactions over one plain topic ``A`` and the scalable topic (read by the
stream consumer and the final read, key ``"a"`` in child segment 1).
"""

from __future__ import annotations

from typing import Any

from anabranch.testing.faults.checker import Report, check
from anabranch.testing.faults.values import TxnValue
from tests.faults.test_checker import LAYOUT, Builder, clean_history

A = "persistent://public/default/faults-txn-0"
S = "topic://public/default/faults"
Write = tuple[str, str]  # (topic, value)


class Txns:
    """Transactions recorded into a :class:`Builder`'s history."""

    def __init__(self, b: Builder) -> None:
        self.b = b
        self.entries: dict[str, int] = {}

    def txn(self, label: str, *, outcome: str = "ok", decision: str = "commit",
            topics: tuple[str, ...] = (A, S), t: float = 1.0) -> list[Write]:  # fmt: skip
        """One transaction writing one value per topic, completed as ``outcome``."""
        writes = [(topic, TxnValue(label, "1:2", i).text()) for i, topic in enumerate(topics)]
        op = {
            "txn": label, "id": "1:2", "decision": decision,
            "writes": [{"topic": tp, "key": "a", "value": v} for tp, v in writes],
        }  # fmt: skip
        self.b.at(t).history.record("txn-0", "invoke", "txn", op)
        done: dict[str, Any] = {"txn": label}
        if outcome == "ok":
            done["outcome"] = decision
        else:
            done["error"] = "TimeoutError()"
        self.b.at(t + 0.5).history.record("txn-0", outcome, "txn", done)  # type: ignore[arg-type]
        return writes

    def read(self, write: Write, *, kind: str = "final", position: list[int] | None = None) -> None:
        """``write`` read back: by a plain topic's final read, or on the scalable topic by
        the final read or a consumer session (``kind``); one position per value unless
        ``position`` says otherwise."""
        topic, value = write
        entry = self.entries.setdefault(value, 100 + len(self.entries))
        where = position or [1 if topic == S else -1, 7, entry, -1]
        if topic == S:
            got = {"key": "a", "value": value, "id": where, "kind": kind,
                   "subscription": "-" if kind == "final" else "sub"}  # fmt: skip
            session = "final" if kind == "final" else f"{kind}-0#0"
            self.b.at(30).history.record(session, "ok", "recv", got)
        else:
            got = {"topic": topic, "value": value, "id": where}
            self.b.at(30).history.record("final", "ok", "txn-read", got)

    def read_all(self, writes: list[Write]) -> None:
        for write in writes:
            if write[0] == S:
                self.read(write, kind="stream")
            self.read(write)

    def finish(self) -> None:
        """The final reads ran to their end (so what they missed is not stored)."""
        self.b.at(40).history.record("final", "info", "final-done", {"read": 8})
        self.b.history.record("final", "info", "txn-read-done", {"topic": A, "complete": True})


def clean() -> tuple[Builder, Txns]:
    """Every outcome, each as it should be, and a commit after the heal (t=8)."""
    b = clean_history()
    txns = Txns(b)
    txns.read_all(txns.txn("t.1", t=1))
    txns.txn("t.2", decision="abort", t=2)
    txns.txn("t.3", outcome="fail", t=3)
    txns.read_all(txns.txn("t.4", outcome="info", t=4))  # unknown, then all of it shows
    txns.txn("t.5", outcome="info", t=5)  # unknown, and none of it shows
    txns.txn("t.6", outcome="info", decision="abort", t=6)
    txns.read_all(txns.txn("t.7", t=10))
    txns.finish()
    return b, txns


def test_a_clean_history_of_every_outcome_has_no_anomaly() -> None:
    b, _ = clean()
    report = check(b.ops, LAYOUT)
    assert report.ok, report.to_dict()
    assert report.stats["txns"] == {"fail": 1, "info": 3, "ok-abort": 1, "ok-commit": 2}
    assert report.stats["heal_to_txn_commit_s"] == 2.5
    assert report.stats["txn_duplicates"]["count"] == 0


def test_a_committed_value_the_final_read_missed_is_committed_lost() -> None:
    b, txns = clean()
    plain, scalable = txns.txn("t.9", t=11)
    txns.read(scalable)  # the plain topic's value: nobody read it
    report = check(b.ops, LAYOUT)
    assert report.counts() == {"committed-lost": 1}
    assert report.anomalies["committed-lost"][0]["value"] == plain[1]


def test_a_scalable_value_only_a_live_consumer_got_is_committed_lost() -> None:
    b, txns = clean()
    plain, scalable = txns.txn("t.9", t=11)
    txns.read(plain)
    txns.read(scalable, kind="stream")  # delivered, then gone from the final read
    assert check(b.ops, LAYOUT).counts() == {"committed-lost": 1}


def test_a_value_of_an_aborted_or_failed_transaction_read_anywhere_is_aborted_visible() -> None:
    b, txns = clean()
    txns.read(txns.txn("t.9", decision="abort", t=11)[1], kind="queue")
    txns.read(txns.txn("t.10", outcome="fail", t=12)[0])
    txns.read(txns.txn("t.11", outcome="info", decision="abort", t=13)[0])
    report = check(b.ops, LAYOUT)
    assert report.counts() == {"aborted-visible": 3}
    outcomes = {e["txn"]: e["outcome"] for e in report.anomalies["aborted-visible"]}
    assert outcomes == {"t.9": "ok", "t.10": "fail", "t.11": "info"}


def test_an_unknown_commit_with_some_but_not_all_values_stored_is_partial() -> None:
    b, txns = clean()
    plain, scalable = txns.txn("t.9", outcome="info", t=11)
    txns.read(plain)
    report = check(b.ops, LAYOUT)
    assert report.counts() == {"partial-txn": 1}
    assert report.anomalies["partial-txn"][0]["missing"] == [scalable[1]]


def test_an_unknown_commit_seen_live_but_not_stored_is_partial() -> None:
    b, txns = clean()
    _, scalable = txns.txn("t.9", outcome="info", t=11)
    txns.read(scalable, kind="stream")  # it committed (someone saw it), yet nothing stored
    assert check(b.ops, LAYOUT).counts() == {"partial-txn": 1}


def test_a_transactional_value_no_transaction_wrote_is_a_txn_phantom() -> None:
    b, txns = clean()
    txns.read((A, TxnValue("ghost", "9:9", 0).text()))
    assert check(b.ops, LAYOUT).counts() == {"txn-phantom": 1}


def test_no_commit_after_the_heal_is_txn_unavailable() -> None:
    b = clean_history()
    txns = Txns(b)
    txns.read_all(txns.txn("t.1", t=1))  # committed before the heal at 8
    for i, t in enumerate((10, 20, 30)):
        txns.txn(f"t.{i + 2}", outcome="fail", t=t)
    b.at(35).history.record("txn-0", "info", "txn-open", {"error": "TimeoutError()"})
    txns.finish()
    report = check(b.ops, LAYOUT)
    assert report.counts() == {"txn-unavailable": 1}
    assert report.anomalies["txn-unavailable"][0]["attempts"] == 4


def test_a_transactional_value_stored_twice_is_reported_but_not_an_anomaly() -> None:
    b, txns = clean()
    plain, scalable = txns.txn("t.9", t=11)
    txns.read_all([plain, scalable])
    txns.read(plain, position=[-1, 7, 998, -1])  # a second position on the plain topic
    txns.read(scalable, position=[1, 7, 999, -1])
    report = check(b.ops, LAYOUT)
    assert report.ok, report.counts()
    assert report.stats["txn_duplicates"]["count"] == 2


def test_transactional_values_are_not_phantom_sends_but_share_the_position_check() -> None:
    b, txns = clean()
    (scalable,) = txns.txn("t.9", topics=(S,), decision="abort", t=11)
    # The clean history's acknowledged send of key "a" to segment 1.
    send = next(op.value for op in b.ops if op.type == "ok" and op.value.get("key") == "a"
                and op.value["id"][0] == 1)  # fmt: skip
    txns.read(scalable, position=list(send["id"]))  # a second value at a send's position
    counts = check(b.ops, LAYOUT).counts()
    assert counts == {"aborted-visible": 1, "inconsistent": 1}


def test_without_transactions_the_report_has_no_transaction_stats() -> None:
    report = check(clean_history().ops, LAYOUT)
    assert report.ok
    assert "txns" not in report.stats and isinstance(report, Report)
