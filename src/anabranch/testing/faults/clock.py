"""A broker clock that jumps when the harness says so (the clock nemesis).

:class:`JumpingClock` is the real clock plus the offsets of the broker's control file:
``wall_offset_s`` moves publish times and record timestamps; ``monotonic_offset_s``
moves every deadline the broker computes (session expiry as the broker sees it, grace
periods, timeouts) -- the harness only raises it, so the clock never goes back. Sleeps
stay real: faking the event loop's own clock would break asyncio's timers, not the
broker.

Example:
    >>> import tempfile, pathlib
    >>> from anabranch.testing.faults.control import Control, ControlReader, write_control
    >>> path = pathlib.Path(tempfile.mkdtemp()) / "control.json"
    >>> clock = JumpingClock(ControlReader(path, poll_interval_s=0.0))
    >>> before = clock.wall_ms()
    >>> write_control(path, Control(wall_offset_s=3600.0))
    >>> clock.wall_ms() - before >= 3_600_000
    True
"""

from __future__ import annotations

from anabranch.clock import SystemClock
from anabranch.testing.faults.control import ControlReader


class JumpingClock(SystemClock):
    """The system clock shifted by the control file's offsets."""

    def __init__(self, control: ControlReader) -> None:
        self._control = control

    def monotonic(self) -> float:
        return super().monotonic() + self._control.get().monotonic_offset_s

    def wall_ms(self) -> int:
        return super().wall_ms() + int(self._control.get().wall_offset_s * 1000)
