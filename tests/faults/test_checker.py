"""The checker on synthetic histories: each anomaly is found, clean histories pass.

The layout is one root segment 0 split into 1 [0000-7fff] and 2 [8000-ffff];
``segment_hash("key-0") == 0xe337``, so key-0 lives in 0 then 2, and ``"a"`` (0x3c25)
in 0 then 1.
"""

from __future__ import annotations

from typing import Any

import pytest

from anabranch.core.segment_layout import SegmentLayout
from anabranch.testing.faults.checker import check
from anabranch.testing.faults.history import History, Op
from anabranch.testing.faults.values import Value

LAYOUT = SegmentLayout.initial(1, 0).split(0, 1)
K = "key-0"


class Builder:
    """A history with a settable clock, so tests place ops in time."""

    def __init__(self) -> None:
        self.t = 0.0
        self.history = History(clock=lambda: self.t)
        self.entry = 0

    def at(self, t: float) -> Builder:
        self.t = t
        return self

    def send(self, counter: int, *, segment: int = 0, key: str = K, outcome: str = "ok",
             producer: str = "p0", entry: int | None = None) -> str:  # fmt: skip
        value = Value(producer, key, counter).text()
        self.history.record(producer, "invoke", "send", {"key": key, "value": value})
        done: dict[str, Any] = {"key": key, "value": value}
        if outcome == "ok":
            self.entry += 1
            done["id"] = [segment, 10 + segment, self.entry if entry is None else entry, -1]
        self.history.record(producer, outcome, "send", done)  # type: ignore[arg-type]
        return value

    def recv(self, value: str, session: str, *, kind: str = "stream", segment: int | None = None,
             position: list[int] | None = None) -> None:  # fmt: skip
        decoded = Value.decode(value)
        assert decoded is not None
        if position is None:
            position = self._position_of(value, segment)
        self.history.record(
            session, "ok", "recv",
            {"key": decoded.key, "value": value, "id": position, "kind": kind,
             "subscription": "sub" if kind != "final" else "-"},
        )  # fmt: skip

    def _position_of(self, value: str, segment: int | None) -> list[int]:
        for op in reversed(self.history.ops):
            if op.f == "send" and op.type == "ok" and op.value["value"] == value:
                pos = list(op.value["id"])
                if segment is not None:
                    pos[0] = segment
                return pos
        return [segment or 0, 99, 99, -1]

    def heal(self) -> None:
        self.history.nemesis("heal", {})

    @property
    def ops(self) -> list[Op]:
        return self.history.ops


def clean_history() -> Builder:
    """Two keys, a split in the middle, every consumer sees everything in order."""
    b = Builder()
    values = [b.at(i).send(i, segment=0) for i in range(3)]
    values += [b.at(3 + i).send(3 + i, segment=2) for i in range(3)]
    other = [b.at(6).send(0, key="a", segment=0), b.at(7).send(1, key="a", segment=1)]
    b.at(8).heal()
    for i, v in enumerate(values + other):
        b.at(9 + i * 0.1).recv(v, "stream-0#0")
        b.at(9 + i * 0.1).recv(v, "queue-0#0", kind="queue")
        b.at(20).recv(v, "final", kind="final")
    b.at(10).history.record("probe", "invoke", "split", {"segment": 2})
    b.at(11).history.record("probe", "ok", "split", {"segment": 2})
    return b


def test_a_clean_history_has_no_anomaly() -> None:
    report = check(clean_history().ops, LAYOUT)
    assert report.ok, report.counts()
    assert report.stats["sends"] == {"ok": 8}
    assert report.stats["heal_to_split_s"] == pytest.approx(3.0)


def test_redelivery_in_order_is_allowed() -> None:
    b = clean_history()
    first = b.ops[0].value["value"]
    b.at(30).recv(first, "stream-0#1")  # a new session starts again from the parent
    report = check(b.ops, LAYOUT)
    assert report.ok, report.counts()


def test_an_acknowledged_send_nobody_read_is_lost_and_undelivered() -> None:
    b = clean_history()
    b.at(12).send(9, segment=2)
    report = check(b.ops, LAYOUT)
    assert report.counts() == {"lost": 1, "queue-undelivered": 1, "undelivered": 1}


def test_an_indeterminate_send_nobody_read_is_not_lost() -> None:
    b = clean_history()
    b.at(7.5).send(9, outcome="info")  # before the heal (after it, see producer-unavailable)
    assert check(b.ops, LAYOUT).ok


def test_a_value_stored_twice_is_a_duplicate() -> None:
    b = clean_history()
    v = b.ops[0].value["value"]
    b.at(21).recv(v, "final", kind="final", position=[2, 12, 50, -1])
    counts = check(b.ops, LAYOUT).counts()
    assert counts["duplicate"] == 1
    # the second copy, from the child after the parent, is also a redelivery of order
    assert set(counts) <= {"duplicate", "order"}


def test_one_position_with_two_values_is_inconsistent() -> None:
    b = clean_history()
    b.at(12).send(9, segment=2, entry=1)  # entry 1 of segment 0's ledger is taken...
    sent = b.ops[-1].value
    b.at(13).recv(sent["value"], "final", kind="final", position=[0, 10, 1, -1])
    assert "inconsistent" in check(b.ops, LAYOUT).counts()


def test_reading_a_value_nobody_sent_or_a_failed_send_is_a_phantom() -> None:
    b = clean_history()
    failed = b.at(7.5).send(7, outcome="fail")
    b.at(13).recv(failed, "final", kind="final", position=[2, 12, 77, -1])
    b.at(13).recv(Value("ghost", K, 0).text(), "final", kind="final", position=[2, 12, 78, -1])
    assert check(b.ops, LAYOUT).counts() == {"phantom": 2}


def test_a_later_value_before_an_earlier_one_in_a_session_is_out_of_order() -> None:
    b = Builder()
    v0, v1 = b.at(0).send(0), b.at(1).send(1)
    b.at(2).heal()
    b.at(3).recv(v1, "stream-0#0")
    b.at(4).recv(v0, "stream-0#0")
    for v in (v0, v1):
        b.at(5).recv(v, "final", kind="final")
    assert check(b.ops, LAYOUT).counts() == {"order": 1}


def test_order_across_producers_of_one_key_is_not_promised() -> None:
    b = Builder()
    v0, v1 = b.at(0).send(5, producer="p0"), b.at(1).send(0, producer="p1")
    b.at(2).heal()
    for v in (v0, v1):
        b.at(3).recv(v, "stream-0#0")
        b.at(4).recv(v, "final", kind="final")
    assert check(b.ops, LAYOUT).ok


def test_a_queue_consumer_may_reorder() -> None:
    b = Builder()
    v0, v1 = b.at(0).send(0), b.at(1).send(1)
    b.at(2).heal()
    for v in (v1, v0):
        b.at(3).recv(v, "queue-0#0", kind="queue")
    for v in (v0, v1):
        b.at(4).recv(v, "final", kind="final")
    assert check(b.ops, LAYOUT).ok


def test_a_parent_redelivered_after_its_child_breaks_the_dag_promise() -> None:
    b = Builder()
    parent, child = b.at(0).send(0, segment=0), b.at(1).send(1, segment=2)
    b.at(2).heal()
    b.at(3).recv(parent, "stream-0#0")
    b.at(4).recv(child, "stream-0#0")
    b.at(5).recv(parent, "stream-0#0")  # issue 19 bug 4: the parent's cursor rewound
    for v in (parent, child):
        b.at(6).recv(v, "final", kind="final")
    report = check(b.ops, LAYOUT)
    assert report.counts() == {"parent-after-child": 1}
    assert report.stats["redelivered"] == 1


def test_the_same_redelivery_in_a_new_session_is_allowed() -> None:
    b = Builder()
    parent, child = b.at(0).send(0, segment=0), b.at(1).send(1, segment=2)
    b.at(2).heal()
    b.at(3).recv(parent, "stream-0#0")
    b.at(4).recv(child, "stream-0#0")
    b.at(5).recv(parent, "stream-0#1")
    b.at(5).recv(child, "stream-0#1")
    for v in (parent, child):
        b.at(6).recv(v, "final", kind="final")
    assert check(b.ops, LAYOUT).ok


def test_a_key_read_from_a_segment_that_does_not_hold_it_is_misrouted() -> None:
    b = Builder()
    v = b.at(0).send(0, segment=1)  # key-0 hashes to 0xe337, segment 1 is [0000-7fff]
    b.at(1).heal()
    b.at(2).recv(v, "final", kind="final")
    assert check(b.ops, LAYOUT).counts() == {"misrouted": 1}


def test_a_delivery_long_after_the_heal_is_late() -> None:
    b = clean_history()
    v = b.at(12).send(9, segment=2)
    b.at(13).recv(v, "final", kind="final")
    b.at(13).recv(v, "queue-0#0", kind="queue")
    b.at(12 + 45).recv(v, "stream-0#0")
    report = check(b.ops, LAYOUT, liveness_bound_s=30.0)
    assert report.counts() == {"late": 1}
    assert report.stats["worst_delivery_lag_after_heal_s"] == pytest.approx(45.0)


def test_no_successful_split_after_the_heal_is_controller_unavailability() -> None:
    b = clean_history()
    b.ops[:] = [op for op in b.ops if op.process != "probe"]
    for t in (10, 20, 30):
        b.at(t).history.record("probe", "invoke", "split", {"segment": 2})
        b.at(t + 1).history.record("probe", "fail", "split", {"error": "503"})
    assert check(b.ops, LAYOUT).counts() == {"controller-unavailable": 1}


def test_a_split_that_succeeds_too_late_is_controller_unavailability() -> None:
    b = clean_history()
    b.ops[:] = [op for op in b.ops if op.process != "probe"]
    b.at(10).history.record("probe", "invoke", "split", {"segment": 2})
    b.at(60).history.record("probe", "ok", "split", {"segment": 2})
    report = check(b.ops, LAYOUT, availability_bound_s=30.0)
    assert report.counts() == {"controller-unavailable": 1}


def test_a_producer_with_no_ack_after_the_heal_is_unavailable() -> None:
    b = clean_history()
    for t in (20, 30, 40):  # after the heal at 8: every send times out
        b.at(t).send(100 + t, segment=2, outcome="info")
    report = check(b.ops, LAYOUT, availability_bound_s=30.0)
    assert report.counts() == {"producer-unavailable": 1}


def test_a_producer_acknowledged_soon_after_the_heal_is_available() -> None:
    b = clean_history()
    b.at(20).send(100, segment=2, outcome="info")
    v = b.at(25).send(101, segment=2)
    for session, kind in (("final", "final"), ("queue-0#0", "queue"), ("stream-0#0", "stream")):
        b.at(26).recv(v, session, kind=kind)
    report = check(b.ops, LAYOUT, availability_bound_s=30.0)
    assert report.ok, report.counts()
    assert report.stats["heal_to_send_s"] == pytest.approx(17.0)


def test_the_report_serialises_with_examples() -> None:
    b = clean_history()
    b.at(12).send(9, segment=2)
    doc = check(b.ops, LAYOUT).to_dict()
    assert doc["ok"] is False
    assert doc["examples"]["lost"][0]["value"] == Value("p0", K, 9).text()


def test_a_resend_the_broker_stored_again_is_a_duplicate() -> None:
    b = clean_history()
    v = b.ops[0].value["value"]
    b.history.record("p0", "invoke", "resend", {"key": K, "value": v})
    b.history.record("p0", "ok", "resend", {"key": K, "value": v, "id": [2, 12, 40, -1]})
    assert check(b.ops, LAYOUT).counts() == {"duplicate": 1}


def test_a_resend_dropped_by_dedup_is_fine() -> None:
    b = clean_history()
    v = b.ops[0].value["value"]
    b.history.record("p0", "invoke", "resend", {"key": K, "value": v})
    b.history.record("p0", "ok", "resend", {"key": K, "value": v, "id": [2, -1, -1, -1]})
    assert check(b.ops, LAYOUT).ok


def test_a_value_a_consumer_got_but_the_final_read_did_not_is_lost() -> None:
    b = clean_history()
    v = b.at(12).send(9, segment=2)
    b.at(13).recv(v, "stream-0#0")
    b.at(13).recv(v, "queue-0#0", kind="queue")
    b.history.record("final", "info", "final-done", {"read": 8})
    report = check(b.ops, LAYOUT)
    assert report.counts() == {"lost": 1}
