"""The broker-wide bound on published bytes held in memory (upstream's
``maxMessagePublishBufferSizeInMB``).

A SEND's entry is held from the moment its frame is handled until its receipt (or error)
is sent. Per connection the number of such sends is bounded
(``SESSION_PENDING_APPENDS_MAX``), their bytes were not: with messages of several
megabytes and a disk that is slow or full (appends wait for space), a few producers
could make the broker hold gigabytes. Past ``limit`` bytes, a connection that publishes
stops being read (what was read already is handled); every such connection is read
again once the total falls to half the limit. Connections that do not publish (consumers
acknowledging, admin lookups) keep being read.

:class:`PublishBuffer` is the accounting only (no I/O): sessions add and remove bytes and
register a wake-up for when reading may resume.

Example:
    >>> buffer = PublishBuffer(100)
    >>> buffer.add(80)
    >>> buffer.over
    False
    >>> buffer.add(30)
    >>> buffer.over
    True
    >>> woken: list[str] = []
    >>> buffer.wait(lambda: woken.append("session"))
    >>> buffer.remove(50)               # 60 held: above half the limit, still over
    >>> buffer.over, woken
    (True, [])
    >>> buffer.remove(20)               # 40 held
    >>> buffer.over, woken
    (False, ['session'])
"""

from __future__ import annotations

from collections.abc import Callable


class PublishBuffer:
    """Bytes of unanswered SENDs over all connections (see the module docstring)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        """Bytes of the SENDs handled and not yet answered."""
        self.over = False
        """Whether publishing connections are paused (set past ``limit``, cleared at half)."""
        self._waiters: set[Callable[[], None]] = set()

    def add(self, size: int) -> None:
        """A SEND of ``size`` bytes was handled."""
        self.used += size
        if not self.over and self.used > self.limit:
            self.over = True

    def remove(self, size: int) -> None:
        """A SEND of ``size`` bytes was answered."""
        self.used -= size
        if self.over and self.used <= self.limit // 2:
            self.over = False
            waiters, self._waiters = self._waiters, set()
            for wake in waiters:
                wake()

    def wait(self, wake: Callable[[], None]) -> None:
        """Call ``wake`` once the buffer is no longer over (at most once per callable)."""
        self._waiters.add(wake)

    def forget(self, wake: Callable[[], None]) -> None:
        """``wake`` is no longer wanted (its connection closed)."""
        self._waiters.discard(wake)
