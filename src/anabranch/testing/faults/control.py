"""The control file: how the harness steers faults inside a broker subprocess.

The harness writes one small JSON document per broker (atomically: a temporary file
renamed over the old one); the broker's test-only hooks (:mod:`.disk`, :mod:`.clock`)
re-read it when its modification time changes, at most every ``POLL_INTERVAL_S``. No
socket, no signal: a paused or dying broker never blocks the harness.

Fields (all optional): ``disk_errno`` (``"EIO"``, ``"ENOSPC"`` or null: every ledger file
write and fsync fails with it), ``wall_offset_s`` (added to the wall clock),
``monotonic_offset_s`` (added to the monotonic clock; the harness only ever raises it, so
that clock still never goes back).

Example:
    >>> import tempfile, pathlib
    >>> path = pathlib.Path(tempfile.mkdtemp()) / "control.json"
    >>> write_control(path, Control(disk_errno="ENOSPC", wall_offset_s=30.0))
    >>> reader = ControlReader(path, poll_interval_s=0.0)
    >>> reader.get().disk_errno, reader.get().wall_offset_s
    ('ENOSPC', 30.0)
    >>> write_control(path, Control())
    >>> reader.get().disk_errno is None
    True
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

POLL_INTERVAL_S = 0.05
"""How stale a broker's view of its control file may be (a stat per check at most)."""

DISK_ERRNOS = {"EIO": errno.EIO, "ENOSPC": errno.ENOSPC}


@dataclass(frozen=True)
class Control:
    """One broker's fault settings (see the module docstring)."""

    disk_errno: str | None = None
    wall_offset_s: float = 0.0
    monotonic_offset_s: float = 0.0

    def disk_error(self) -> OSError | None:
        """The OSError a ledger file operation raises now, if any."""
        if self.disk_errno is None:
            return None
        code = DISK_ERRNOS[self.disk_errno]
        return OSError(code, os.strerror(code))


def write_control(path: Path, control: Control) -> None:
    """Replace ``path`` with ``control`` atomically (readers see the old or the new one)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(asdict(control)))
    os.replace(tmp, path)


def read_control(path: Path) -> Control:
    """The control at ``path``; no file (or a half-written one) means no faults."""
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError):
        return Control()
    return Control(
        disk_errno=raw.get("disk_errno"),
        wall_offset_s=float(raw.get("wall_offset_s", 0.0)),
        monotonic_offset_s=float(raw.get("monotonic_offset_s", 0.0)),
    )


class ControlReader:
    """A cached view of one control file, safe to call from the ledger writer threads."""

    def __init__(self, path: Path, *, poll_interval_s: float = POLL_INTERVAL_S) -> None:
        self.path = path
        self._poll_interval_s = poll_interval_s
        self._lock = threading.Lock()
        self._checked = float("-inf")
        self._mtime_ns = -1
        self._control = Control()

    def get(self) -> Control:
        now = time.monotonic()
        with self._lock:
            if now - self._checked >= self._poll_interval_s:
                self._checked = now
                mtime_ns = -1
                with contextlib.suppress(OSError):
                    mtime_ns = self.path.stat().st_mtime_ns
                if mtime_ns != self._mtime_ns:
                    self._mtime_ns = mtime_ns
                    self._control = read_control(self.path)
            return self._control
