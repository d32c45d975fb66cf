"""The checker: a pure function of a recorded history and the topic's final layout.

It finds, over the ops of :mod:`~anabranch.testing.faults.history`:

``lost``
    an acknowledged send whose value the final full read (a checkpoint read of the whole
    DAG from the earliest position, ``kind="final"``) did not return -- a live consumer
    that got it before a crash wiped it does not make it stored; without a final read,
    one no read returned;
``duplicate``
    one value stored at two positions (dedup is on: a retry -- an ``f="resend"`` op of
    the same value, producer and sequence id -- must never be stored twice; a
    redelivery of one position is not a duplicate);
``inconsistent``
    one position returned with two different values;
``phantom``
    a read value no producer ever sent (or a definitely failed send that was read);
``order``
    within one consumer session (stream and checkpoint consumers), a key's value of one
    producer delivered for the first time after a later value of that producer and key;
``parent-after-child``
    within one consumer session, a key delivered from a segment after the same key was
    delivered from one of that segment's descendants (the DAG promise; redeliveries
    count too);
``misrouted``
    a key delivered from a segment whose hash range does not hold it;
``undelivered`` / ``late``
    an acknowledged send never delivered to a stream (or queue) subscription, or first
    delivered more than ``liveness_bound_s`` after the later of its ack and the heal;
``controller-unavailable``
    no split probe requested after the heal succeeded within ``availability_bound_s``;
``producer-unavailable``
    a producer that sent after the heal got no acknowledgement within
    ``availability_bound_s`` of the heal (a topic wedged by a fault that is over);
``committed-lost`` / ``aborted-visible`` / ``partial-txn`` / ``txn-phantom`` / ``txn-unavailable``
    the transactions' anomalies (:mod:`~anabranch.testing.faults.txn_checker`); their
    values (:class:`~anabranch.testing.faults.values.TxnValue`) are judged there only,
    except for ``inconsistent`` and the per-session checks.

Sessions are ``recv`` ops' ``process``; ``value["kind"]`` is ``stream``, ``queue``,
``checkpoint`` or ``final``; ``value["id"]`` is ``[segment, ledger, entry, batch]``.

Example:
    >>> from anabranch.core.segment_layout import SegmentLayout
    >>> from anabranch.testing.faults.history import History
    >>> h = History(clock=iter(range(100)).__next__)
    >>> send = {"key": "k", "value": "p=a;k=k;c=0"}
    >>> _ = h.record("a", "invoke", "send", send)
    >>> _ = h.record("a", "ok", "send", {**send, "id": [0, 1, 0, -1]})
    >>> report = check(h.ops, SegmentLayout.initial(1, 0))
    >>> report.counts()
    {'lost': 1}
    >>> got = {**send, "id": [0, 1, 0, -1], "kind": "final", "subscription": "-"}
    >>> _ = h.record("final", "ok", "recv", got)
    >>> check(h.ops, SegmentLayout.initial(1, 0)).ok
    True
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from anabranch.core.segment_layout import SegmentLayout
from anabranch.testing.faults.history import NEMESIS, Op
from anabranch.testing.faults.lineage import Lineage
from anabranch.testing.faults.txn_checker import check_transactions
from anabranch.testing.faults.values import TxnValue, Value

LIVENESS_BOUND_S = 30.0
"""Default: every acknowledged message reaches the stream consumer this long after the
later of its ack and the heal (the reliability plan's recovery bar)."""
AVAILABILITY_BOUND_S = 30.0
"""Default: a split requested after the heal completes this long after the heal."""
EXAMPLES_MAX = 20
"""Examples kept per anomaly type (the count is always complete)."""

ORDERED_KINDS = frozenset({"stream", "checkpoint", "final"})
"""Consumer kinds that promise per-key order and parent-before-child (a queue does not)."""
LIVENESS_KINDS = frozenset({"stream", "queue"})
"""Managed subscriptions that must eventually deliver every acknowledged message."""

Position = tuple[int, int, int, int]


@dataclass
class Report:
    """Anomalies by type (examples capped at ``EXAMPLES_MAX``) and run statistics."""

    anomalies: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    totals: dict[str, int] = field(default_factory=dict)
    stats: dict[str, Any] = field(default_factory=dict)

    def add(self, kind: str, **example: Any) -> None:
        self.totals[kind] = self.totals.get(kind, 0) + 1
        examples = self.anomalies.setdefault(kind, [])
        if len(examples) < EXAMPLES_MAX:
            examples.append(example)

    def counts(self) -> dict[str, int]:
        """Anomaly counts by type (only types that occurred)."""
        return dict(sorted(self.totals.items()))

    @property
    def ok(self) -> bool:
        return not self.totals

    def to_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "counts": self.counts(), "examples": self.anomalies, **self.stats}


@dataclass(frozen=True)
class _Read:
    t: float
    session: str
    kind: str
    subscription: str
    key: str
    value: str
    position: Position | None


def check(
    ops: Sequence[Op],
    layout: SegmentLayout,
    *,
    liveness_bound_s: float = LIVENESS_BOUND_S,
    availability_bound_s: float = AVAILABILITY_BOUND_S,
) -> Report:
    """Check ``ops`` against ``layout`` (the topic's final DAG); see the module docstring."""
    report = Report()
    lineage = Lineage(layout)
    sends = _sends(ops)
    reads = [_read(op) for op in ops if op.f == "recv" and op.type == "ok" and "value" in op.value]
    heal_t = _heal_time(ops)
    report.stats.update(_stats(ops, sends, reads, heal_t))
    final_read = any(op.f == "final-done" for op in ops) or any(r.kind == "final" for r in reads)
    _check_storage(report, sends, reads, final_read)
    _check_sessions(report, reads, lineage)
    _check_liveness(report, sends, reads, heal_t, liveness_bound_s)
    _check_availability(report, ops, heal_t, availability_bound_s)
    _check_producers(report, ops, heal_t, availability_bound_s)
    check_transactions(report, ops, heal_t)
    return report


# --- inputs -----------------------------------------------------------------------------------


@dataclass
class _Send:
    key: str
    value: str
    invoke_t: float
    outcome: str = "pending"  # ok | fail | info | pending
    ack_t: float | None = None
    position: Position | None = None
    resent_to: list[Position] = field(default_factory=list)
    """Where resends of the same (producer, sequence id) were stored (dedup: nowhere)."""


def _sends(ops: Iterable[Op]) -> dict[str, _Send]:
    """Sends by value; values are unique, so the value identifies the op."""
    sends: dict[str, _Send] = {}
    for op in ops:
        if op.f == "resend" and op.type == "ok":
            resent = sends.get(str(op.value["value"]))
            position = _position(op.value.get("id"))
            if resent is not None and position is not None:
                resent.resent_to.append(position)
            continue
        if op.f != "send" or "value" not in op.value:
            continue
        value = str(op.value["value"])
        if op.type == "invoke":
            sends[value] = _Send(str(op.value["key"]), value, op.t)
            continue
        send = sends.get(value)
        if send is None:
            continue
        send.outcome = op.type
        if op.type == "ok":
            send.ack_t = op.t
            send.position = _position(op.value.get("id"))
    return sends


def _read(op: Op) -> _Read:
    v = op.value
    return _Read(
        op.t,
        op.process,
        str(v.get("kind", "stream")),
        str(v.get("subscription", "")),
        str(v["key"]),
        str(v["value"]),
        _position(v.get("id")),
    )


def _position(raw: Any) -> Position | None:
    """``[segment, ledger, entry, batch]``; None when unknown or a dedup answer (ledger -1,
    also as its unsigned 64-bit form)."""
    if not raw or len(raw) != 4 or not 0 <= int(raw[1]) < 2**63:
        return None
    return (int(raw[0]), int(raw[1]), int(raw[2]), int(raw[3]))


def _heal_time(ops: Sequence[Op]) -> float:
    """When every fault was healed: the ``heal`` op, else the last nemesis op, else 0."""
    heal = [op.t for op in ops if op.process == NEMESIS and op.f == "heal"]
    if heal:
        return heal[-1]
    nemesis = [op.t for op in ops if op.process == NEMESIS]
    return nemesis[-1] if nemesis else 0.0


def _stats(
    ops: Sequence[Op], sends: dict[str, _Send], reads: list[_Read], heal_t: float
) -> dict[str, Any]:
    outcomes: dict[str, int] = defaultdict(int)
    for send in sends.values():
        outcomes[send.outcome] += 1
    by_kind: dict[str, int] = defaultdict(int)
    for read in reads:
        by_kind[read.kind] += 1
    faults: dict[str, int] = defaultdict(int)
    changes: dict[str, int] = defaultdict(int)
    for op in ops:
        if op.process == NEMESIS and op.f == "start":
            faults[str(op.value.get("fault"))] += 1
        if op.f in ("split", "merge") and op.type == "ok":
            changes[op.f] += 1
    return {
        "sends": dict(sorted(outcomes.items())),
        "reads": dict(sorted(by_kind.items())),
        "faults": dict(sorted(faults.items())),
        "layout_changes": dict(sorted(changes.items())),
        "heal_t": round(heal_t, 3),
    }


# --- storage: lost, duplicate, inconsistent, phantom -----------------------------------------


def _check_storage(
    report: Report, sends: dict[str, _Send], reads: list[_Read], final_read: bool
) -> None:
    positions: dict[str, set[Position]] = defaultdict(set)
    at: dict[Position, str] = {}
    seen: set[str] = set()
    for read in reads:
        if TxnValue.decode(read.value) is not None:
            # A transaction's value: never a send (the transactions' checker judges it);
            # only two values at one position concern it here.
            if read.position is not None:
                other = at.setdefault(read.position, read.value)
                if other != read.value:
                    report.add(
                        "inconsistent", position=list(read.position), values=[other, read.value]
                    )
            continue
        seen.add(read.value)
        send = sends.get(read.value)
        if send is None:
            report.add("phantom", value=read.value, session=read.session, why="never sent")
        elif send.outcome == "fail":
            report.add("phantom", value=read.value, session=read.session, why="send failed")
        if read.position is None:
            continue
        positions[read.value].add(read.position)
        other = at.setdefault(read.position, read.value)
        if other != read.value:
            report.add("inconsistent", position=list(read.position), values=[other, read.value])
    for send in sends.values():
        if send.outcome == "ok" and send.position is not None:
            positions[send.value].add(send.position)
        positions[send.value].update(send.resent_to)
    for value, where in positions.items():
        if len(where) > 1:
            report.add("duplicate", value=value, positions=sorted(list(p) for p in where))
    # What is stored is what the final full read returns: a value a live consumer got
    # before a crash wiped it is still lost. Without a final read, any read counts.
    final = {read.value for read in reads if read.kind == "final"}
    stored = final if final_read else seen
    for send in sends.values():
        if send.outcome == "ok" and send.value not in stored:
            report.add("lost", value=send.value, key=send.key, ack_t=send.ack_t)


# --- sessions: order, parent-before-child, misrouted -----------------------------------------


def _check_sessions(report: Report, reads: list[_Read], lineage: Lineage) -> None:
    delivered: dict[str, set[str]] = defaultdict(set)  # session -> values seen
    highest: dict[tuple[str, str, str], int] = {}  # (session, key, producer) -> counter
    from_segments: dict[tuple[str, str], set[int]] = defaultdict(set)  # (session, key)
    redelivered = 0
    for read in reads:
        segment = read.position[0] if read.position is not None else None
        if segment is not None and lineage.known(segment) and not lineage.holds(segment, read.key):
            report.add("misrouted", value=read.value, segment=segment, session=read.session)
        if read.kind not in ORDERED_KINDS:
            continue
        first = read.value not in delivered[read.session]
        delivered[read.session].add(read.value)
        redelivered += not first
        value = Value.decode(read.value)
        if first and value is not None:
            slot = (read.session, read.key, value.producer)
            top = highest.get(slot, -1)
            if value.counter < top:
                report.add(
                    "order",
                    session=read.session,
                    key=read.key,
                    value=read.value,
                    after_counter=top,
                    t=read.t,
                )
            highest[slot] = max(top, value.counter)
        if segment is None:
            continue
        seen = from_segments[(read.session, read.key)]
        later = [s for s in seen if lineage.is_ancestor(segment, s)]
        if later:
            report.add(
                "parent-after-child",
                session=read.session,
                key=read.key,
                value=read.value,
                segment=segment,
                after_segments=sorted(later),
                t=read.t,
            )
        seen.add(segment)
    report.stats["redelivered"] = redelivered


# --- liveness and availability --------------------------------------------------------------


def _check_liveness(
    report: Report, sends: dict[str, _Send], reads: list[_Read], heal_t: float, bound_s: float
) -> None:
    first: dict[tuple[str, str, str], float] = {}  # (kind, subscription, value) -> t
    subscriptions: set[tuple[str, str]] = set()
    for read in reads:
        if read.kind in LIVENESS_KINDS:
            subscriptions.add((read.kind, read.subscription))
            first.setdefault((read.kind, read.subscription, read.value), read.t)
    worst = 0.0
    for kind, subscription in sorted(subscriptions):
        name = "undelivered" if kind == "stream" else f"{kind}-undelivered"
        for send in sends.values():
            if send.outcome != "ok" or send.ack_t is None:
                continue
            got = first.get((kind, subscription, send.value))
            if got is None:
                report.add(name, subscription=subscription, value=send.value, ack_t=send.ack_t)
                continue
            lag = got - max(send.ack_t, heal_t)
            worst = max(worst, lag)
            if lag > bound_s:
                report.add(
                    "late" if kind == "stream" else f"{kind}-late",
                    subscription=subscription,
                    value=send.value,
                    lag_s=round(lag, 3),
                )
    report.stats["worst_delivery_lag_after_heal_s"] = round(worst, 3)


def _check_producers(report: Report, ops: Sequence[Op], heal_t: float, bound_s: float) -> None:
    """Every producer that sent after the heal has a send acknowledged within the bound."""
    sent_after: set[str] = set()
    first_ack: dict[str, float] = {}
    for op in ops:
        if op.f != "send" or op.t < heal_t:
            continue
        if op.type == "invoke":
            sent_after.add(op.process)
        elif op.type == "ok":
            first_ack.setdefault(op.process, op.t)
    worst = 0.0
    for process in sorted(sent_after):
        acked = first_ack.get(process)
        took = None if acked is None else acked - heal_t
        if took is None or took > bound_s:
            report.add("producer-unavailable", producer=process, heal_t=heal_t, took_s=took)
        else:
            worst = max(worst, took)
    if sent_after:
        report.stats["heal_to_send_s"] = round(worst, 3)


def _check_availability(report: Report, ops: Sequence[Op], heal_t: float, bound_s: float) -> None:
    probes = [op for op in ops if op.process == "probe" and op.f in ("split", "merge")]
    if not probes:
        return
    invoked = [op for op in probes if op.type == "invoke" and op.t >= heal_t]
    done = [op for op in probes if op.type == "ok" and op.t >= heal_t]
    if not invoked:
        return
    if not done:
        report.add("controller-unavailable", heal_t=heal_t, attempts=len(invoked))
        return
    took = done[0].t - heal_t
    report.stats["heal_to_split_s"] = round(took, 3)
    if took > bound_s:
        report.add("controller-unavailable", heal_t=heal_t, took_s=round(took, 3))
