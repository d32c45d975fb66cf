"""Rates of counters over a minimum window, shared by every caller (pure: the caller
passes the time).

Admin stats report msgRateIn/Out as "per second lately". Measuring from the previous
call alone gives two dashboards polling the same topic a few milliseconds apart a zero
each; measuring since start gives a lifetime average. A :class:`RateWindow` keeps the
last two marks and measures from the newest one that is at least ``window_s`` old.

Example:
    >>> w = RateWindow(window_s=1.0, now=0.0, counters=(0,))
    >>> w.rates(2.0, (10,)), w.rates(2.0, (10,))   # two callers at once: the same rate
    ((5.0,), (5.0,))
    >>> w.rates(3.0, (10,))                          # a second later, nothing new
    (0.0,)
"""

from __future__ import annotations


class RateWindow:
    """Per-second rates of a tuple of monotonically growing counters."""

    __slots__ = ("_marks", "window_s")

    def __init__(self, window_s: float, now: float, counters: tuple[int, ...]) -> None:
        self.window_s = window_s
        self._marks: list[tuple[float, tuple[int, ...]]] = [(now, counters)]

    def rates(self, now: float, counters: tuple[int, ...]) -> tuple[float, ...]:
        """Each counter's growth per second since the newest mark ``window_s`` old (the
        oldest mark while none is), and a new mark when the last is that old."""
        base = self._marks[0]
        for mark in self._marks:
            if now - mark[0] >= self.window_s:
                base = mark
        if now - self._marks[-1][0] >= self.window_s:
            self._marks = [*self._marks[-1:], (now, counters)]
        elapsed = max(now - base[0], 1e-9)
        return tuple((c - b) / elapsed for c, b in zip(counters, base[1], strict=True))
