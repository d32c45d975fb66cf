"""Which lines of a run of repeated warnings to log: the first, then at most one per
interval, saying how many lines were left out since the last one logged.

A NATS client that cannot reach its servers reports every refused reconnect (four a
second); a broker waiting out a NATS outage would bury everything else in its log. The
decision is pure: the caller passes the time, so it is tested without a clock.

Example:
    >>> throttle = LogThrottle(interval_s=10.0)
    >>> throttle.admit("refused", 0.0), throttle.admit("refused", 1.0)
    (0, None)
    >>> throttle.admit("refused", 10.5)  # one line left out since the last one logged
    1
    >>> throttle.admit("refused", 11.0), throttle.admit("timeout", 11.1)  # a new kind: at once
    (None, 1)
"""

from __future__ import annotations


class LogThrottle:
    """Admits the first of a run of equal keys, then one per ``interval_s``."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self._key: str | None = None
        self._logged_at = 0.0
        self._left_out = 0

    @property
    def left_out(self) -> int:
        """Lines left out since the last one admitted."""
        return self._left_out

    def admit(self, key: str, now: float) -> int | None:
        """None: leave this line out; else log it, noting how many lines (of any key)
        were left out since the last one logged. A new key is always logged."""
        if key != self._key or now - self._logged_at >= self.interval_s:
            left_out = self._left_out
            self._key = key
            self._logged_at = now
            self._left_out = 0
            return left_out
        self._left_out += 1
        return None
