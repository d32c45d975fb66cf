"""Which live broker gets an unowned topic: the least loaded, ties broken per topic.

Pure: the lookup handler passes the live brokers with their load (:func:`broker_load` of
the owned-topic count and message rate they last reported, plus the assignments it made
since) and gets one broker id back.
Among equally loaded brokers the choice is by rendezvous hashing of (topic, broker), so
brokers with the same view agree and a batch of new topics spreads evenly.

Example:
    >>> choose_broker("persistent://t/ns/a", {"b1": 3, "b2": 1, "b3": 1}) in ("b2", "b3")
    True
    >>> choose_broker("persistent://t/ns/a", {}) is None
    True
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import mmh3

from anabranch.limits import CLUSTER_PLACEMENT_MSGS_PER_TOPIC


def rendezvous_score(topic: str, broker_id: str) -> int:
    """A stable pseudo-random score of a (topic, broker) pair (murmur3: CRC would make
    the order of two brokers the same for every topic of equal length)."""
    return int(mmh3.hash(f"{topic}\x00{broker_id}".encode(), signed=False))


def smoothed_rate(previous: float, sample: float, elapsed_s: float, horizon_s: float) -> float:
    """Exponentially weighted rate: ``sample`` (measured over the last ``elapsed_s``) moves
    ``previous`` by the share of ``horizon_s`` that passed.

    >>> round(smoothed_rate(0.0, 20_000.0, 5.0, 60.0))   # a 5 s burst: a twelfth of it
    1599
    >>> round(smoothed_rate(1000.0, 1000.0, 5.0, 60.0))  # a steady rate stays
    1000
    """
    weight = 1.0 - math.exp(-max(0.0, elapsed_s) / horizon_s)
    return previous + (max(0.0, sample) - previous) * weight


def broker_load(topics: int, msg_rate: float) -> float:
    """One number for a broker's load: owned topics plus its message rate (in + out)
    in units of ``CLUSTER_PLACEMENT_MSGS_PER_TOPIC``.

    >>> broker_load(2, 0.0), broker_load(2, 3000.0)
    (2.0, 5.0)
    """
    return topics + max(0.0, msg_rate) / CLUSTER_PLACEMENT_MSGS_PER_TOPIC


def choose_broker(topic: str, loads: Mapping[str, float]) -> str | None:
    """The broker with the smallest load; None when there is none."""
    if not loads:
        return None
    return min(loads, key=lambda broker: (loads[broker], rendezvous_score(topic, broker), broker))
