"""The nemesis: which faults, when, on which process -- a schedule drawn from a seed.

Kinds (``KINDS``):

=================  ==================================================================
``kill``           SIGKILL a broker, drop its unfsynced bytes, restart it after a while
``pause-short``    SIGSTOP a broker for less than the session TTL, then SIGCONT
``pause-long``     SIGSTOP a broker for 1.5-3x the session TTL (its session expires)
``partition``      blackhole the broker's link to etcd (its session expires)
``isolate``        blackhole the broker's link to etcd and every link reaching it
``client-cut``     blackhole the links clients and other brokers use to reach the
                   broker; it keeps its etcd session (and its topics: they wait)
``delay``          slow the broker's link to etcd by 50-300 ms per chunk
``etcd-kill``      SIGKILL etcd, restart it on the same data after 1-4 s
``disk-eio``       every ledger write and fsync of the broker fails with EIO
``disk-enospc``    ... with ENOSPC
``clock-jump``     the broker's wall clock jumps by minutes, its monotonic clock forward
=================  ==================================================================

:func:`schedule` draws the faults from a seed: a quiet start, then one fault at a time
with random gaps, targets (a broker index, or ``"leader"``: the topic's controller
leader when the fault starts) and durations; nothing overlaps, so at most one broker
is impaired at once. :class:`Nemesis` performs a schedule on a
:class:`~anabranch.testing.faults.cluster.FaultCluster`, logging ``start`` and ``stop``
ops, and :meth:`Nemesis.heal` undoes everything (logged as ``heal``).

Example:
    >>> import random
    >>> faults = schedule(random.Random(7), ("kill", "pause-long"), 30.0, session_ttl_s=3.0)
    >>> faults == schedule(random.Random(7), ("kill", "pause-long"), 30.0, session_ttl_s=3.0)
    True
    >>> all(f.at_s >= QUIET_START_S and f.kind in ("kill", "pause-long") for f in faults)
    True
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from anabranch.testing.faults.cluster import FaultCluster
from anabranch.testing.faults.history import History

KINDS = (
    "kill",
    "pause-short",
    "pause-long",
    "partition",
    "isolate",
    "client-cut",
    "delay",
    "etcd-kill",
    "disk-eio",
    "disk-enospc",
    "clock-jump",
)
QUIET_START_S = 3.0
"""No fault before this: the workload gets going first."""
GAP_S = (1.0, 4.0)
"""Seconds between one fault's end and the next one's start."""
LEADER_SHARE = 0.5
"""How often a broker fault targets the controller leader instead of a random broker."""
BROKER_KINDS = frozenset(KINDS) - {"etcd-kill"}


@dataclass(frozen=True)
class Fault:
    """One scheduled fault: starts ``at_s`` after the run started, lasts ``duration_s``."""

    at_s: float
    kind: str
    duration_s: float
    target: int | str | None = None
    """A broker index, ``"leader"``, ``"owner"`` (of the topic's first active segment,
    when the fault starts), or None (etcd)."""
    detail: dict[str, Any] = field(default_factory=dict)

    def describe(self) -> dict[str, Any]:
        return asdict(self)


def _duration(rng: random.Random, kind: str, ttl: float) -> tuple[float, dict[str, Any]]:
    if kind == "pause-short":
        return rng.uniform(0.3, 0.7) * ttl, {}
    if kind in ("pause-long", "partition", "isolate"):
        return rng.uniform(1.5, 3.0) * ttl, {}
    if kind == "client-cut":
        return rng.uniform(0.5, 2.0) * ttl, {}
    if kind == "kill":
        return rng.uniform(1.0, 2.0 * ttl), {}
    if kind == "delay":
        return rng.uniform(3.0, 8.0), {"delay_s": round(rng.uniform(0.05, 0.3), 3)}
    if kind == "etcd-kill":
        return rng.uniform(1.0, 4.0), {}
    if kind in ("disk-eio", "disk-enospc"):
        return rng.uniform(1.0, 4.0), {}
    if kind == "clock-jump":
        wall = rng.choice((-1, 1)) * rng.uniform(60.0, 600.0)
        return rng.uniform(2.0, 6.0), {
            "wall_offset_s": round(wall, 3),
            "monotonic_jump_s": round(rng.choice((0.0, 2.0 * ttl)), 3),
        }
    raise ValueError(f"unknown fault kind {kind!r}; known: {KINDS}")


def schedule(
    rng: random.Random,
    kinds: tuple[str, ...],
    window_s: float,
    *,
    session_ttl_s: float,
    brokers: int = 3,
) -> list[Fault]:
    """Faults from ``kinds``, one at a time, that all end within ``window_s``."""
    faults: list[Fault] = []
    t = QUIET_START_S
    while kinds:
        kind = rng.choice(kinds)
        duration, detail = _duration(rng, kind, session_ttl_s)
        if t + duration > window_s:
            break
        target: int | str | None = None
        if kind in BROKER_KINDS:
            target = "leader" if rng.random() < LEADER_SHARE else rng.randrange(brokers)
        faults.append(Fault(round(t, 3), kind, round(duration, 3), target, detail))
        t += duration + rng.uniform(*GAP_S)
    return faults


class Nemesis:
    """Performs faults on a cluster and logs them (see the module docstring)."""

    def __init__(self, cluster: FaultCluster, history: History, topic: str) -> None:
        self.cluster = cluster
        self.history = history
        self.topic = topic
        self.windows: list[tuple[float, float, str]] = []
        """(start, stop, kind) of every fault performed, on the history's clock."""
        self._monotonic_offset = [0.0] * len(cluster.brokers)

    async def run(self, faults: list[Fault], start_t: float) -> None:
        """Perform ``faults`` at their times (``start_t``: the history time of 0)."""
        for fault in faults:
            delay = start_t + fault.at_s - self.history.now()
            if delay > 0:
                await asyncio.sleep(delay)
            await self.perform(fault)

    async def _target(self, fault: Fault) -> int:
        if fault.target == "leader":
            leader = await self.cluster.controller_leader(self.topic)
            return leader if leader is not None else 0
        if fault.target == "owner":
            owner = await self._segment_owner()
            return owner if owner is not None else 0
        assert isinstance(fault.target, int)
        return fault.target

    async def _segment_owner(self) -> int | None:
        """The broker owning the topic's first active segment (one producers write to)."""
        short = self.topic.split("://", 1)[1]
        with contextlib.suppress(Exception):
            status, layout = await self.cluster.http("GET", f"/admin/v2/scalable/{short}")
            if status != 200:
                return None
            active = sorted(
                (s["hashRange"]["start"], s["hashRange"]["end"], int(i))
                for i, s in layout["segments"].items()
                if s["state"] == "ACTIVE"
            )
            start, end, segment_id = active[0]
            name = f"segment://{short}/{start:04x}-{end:04x}-{segment_id}"
            owner = await self.cluster.segment_owner(name)
            return owner.index if owner is not None else None
        return None

    async def perform(self, fault: Fault) -> None:
        """Start ``fault``, hold it for its duration, undo it."""
        target = await self._target(fault) if fault.kind in BROKER_KINDS else None
        info: dict[str, Any] = {"fault": fault.kind, "target": target, **fault.detail}
        began = self.history.nemesis("start", info).t
        try:
            await self._start(fault, target)
            await asyncio.sleep(fault.duration_s)
        finally:
            await self._stop(fault, target)
            ended = self.history.nemesis("stop", info).t
            self.windows.append((began, ended, fault.kind))

    async def _start(self, fault: Fault, target: int | None) -> None:
        cluster = self.cluster
        kind = fault.kind
        if kind == "kill":
            assert target is not None
            await cluster.crash(target)
        elif kind.startswith("pause"):
            assert target is not None
            cluster.brokers[target].pause()
        elif kind == "partition":
            assert target is not None
            cluster.proxies[target].partition()
        elif kind in ("isolate", "client-cut"):
            assert target is not None
            for proxy in cluster.fronts[target]:
                proxy.partition()
            if kind == "isolate":
                cluster.proxies[target].partition()
        elif kind == "delay":
            assert target is not None
            cluster.proxies[target].delay_s = float(fault.detail["delay_s"])
        elif kind == "etcd-kill":
            assert cluster.etcd is not None
            cluster.etcd.kill()
        elif kind.startswith("disk-"):
            assert target is not None
            cluster.control(target, disk_errno=kind.removeprefix("disk-").upper())
        elif kind == "clock-jump":
            assert target is not None
            self._monotonic_offset[target] += float(fault.detail["monotonic_jump_s"])
            cluster.control(
                target,
                wall_offset_s=float(fault.detail["wall_offset_s"]),
                monotonic_offset_s=self._monotonic_offset[target],
            )

    async def _stop(self, fault: Fault, target: int | None) -> None:
        cluster = self.cluster
        kind = fault.kind
        if kind == "kill":
            assert target is not None
            await _start_broker(cluster, target)
        elif kind.startswith("pause"):
            assert target is not None
            cluster.brokers[target].resume()
        elif kind in ("partition", "delay"):
            assert target is not None
            cluster.proxies[target].heal()
        elif kind in ("isolate", "client-cut"):
            assert target is not None
            for proxy in (*cluster.fronts[target], cluster.proxies[target]):
                proxy.heal()
        elif kind == "etcd-kill":
            assert cluster.etcd is not None
            await asyncio.to_thread(cluster.etcd.restart)
        elif kind.startswith("disk-"):
            assert target is not None
            cluster.control(target, disk_errno=None)
        elif kind == "clock-jump":
            assert target is not None
            cluster.control(target, wall_offset_s=0.0)  # the wall clock jumps back

    async def heal(self) -> float:
        """Undo every fault: resume, restart, reconnect, clear disk and wall-clock faults
        (a jumped monotonic clock stays ahead: it must never go back). Returns the heal's
        history time."""
        cluster = self.cluster
        if cluster.etcd is not None and not cluster.etcd.running:
            await asyncio.to_thread(cluster.etcd.restart)
        for proxy in (*cluster.proxies, *(p for front in cluster.fronts for p in front)):
            proxy.heal()
        for index, broker in enumerate(cluster.brokers):
            broker.resume()
            cluster.control(index, disk_errno=None, wall_offset_s=0.0)
            if not broker.running:
                await _start_broker(cluster, index)
        return self.history.nemesis("heal", {}).t


async def _start_broker(cluster: FaultCluster, index: int) -> None:
    """Start a dead broker; a start that fails (etcd down at that moment) is retried, so a
    fault's end never leaves a broker dead for good."""
    deadline = time.monotonic() + 60.0
    while True:
        try:
            await cluster.brokers[index].start()
            return
        except (RuntimeError, TimeoutError):
            if time.monotonic() > deadline:
                raise
            with contextlib.suppress(Exception):
                cluster.brokers[index].kill()
            await asyncio.sleep(1.0)
