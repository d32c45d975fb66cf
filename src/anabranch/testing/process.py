"""A server process a test starts and stops by PID (etcd, NATS): its own process group
(a Ctrl-C aimed at pytest must not kill it mid-test), output appended to a log that keeps
every incarnation for post-mortems, and the signals the fault tests send.

Example:
    >>> import sys, tempfile
    >>> server = ServerProcess("sleeper", Path(tempfile.mkdtemp()) / "out.log", 5.0)
    >>> server.spawn([sys.executable, "-c", "import time; time.sleep(60)"])
    >>> server.running
    True
    >>> server.stop()
    >>> server.running
    False
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path
from typing import IO


class ServerProcess:
    """One child process; ``stop`` is SIGTERM then SIGKILL after ``stop_timeout_s``."""

    def __init__(self, label: str, log_path: Path, stop_timeout_s: float) -> None:
        self.label = label
        self.log_path = log_path
        self.stop_timeout_s = stop_timeout_s
        self._process: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None
        self._paused = False

    def spawn(self, args: list[str]) -> None:
        """Start ``args`` (the caller waits until it serves)."""
        self._log = self.log_path.open("ab")
        self._process = subprocess.Popen(
            args,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self._paused = False

    @property
    def pid(self) -> int:
        """PID of the running process; RuntimeError when stopped."""
        if self._process is None:
            raise RuntimeError(f"{self.label} is not running")
        return self._process.pid

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def log_tail(self, lines: int = 30) -> str:
        """The last ``lines`` lines of the log (for error messages)."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def _signal(self, sig: signal.Signals) -> None:
        if self._process is not None and self._process.poll() is None:
            os.kill(self._process.pid, sig)

    def _reap(self) -> None:
        if self._process is not None:
            self._process.wait()
            self._process = None
        if self._log is not None:
            self._log.close()
            self._log = None
        self._paused = False

    def stop(self) -> None:
        """SIGTERM, wait, then SIGKILL if it lingers. Idempotent."""
        if self._process is None:
            return
        if self._paused:
            # A stopped process never handles SIGTERM; let it run so it can exit cleanly.
            self._signal(signal.SIGCONT)
        self._signal(signal.SIGTERM)
        try:
            self._process.wait(timeout=self.stop_timeout_s)
        except subprocess.TimeoutExpired:
            self._signal(signal.SIGKILL)
        self._reap()

    def kill(self) -> None:
        """SIGKILL (a crash: no clean shutdown). Idempotent."""
        self._signal(signal.SIGKILL)
        self._reap()

    def pause(self) -> None:
        """SIGSTOP: the process holds its sockets but answers nothing (a hung server)."""
        self._signal(signal.SIGSTOP)
        self._paused = True

    def resume(self) -> None:
        """SIGCONT after :meth:`pause`."""
        self._signal(signal.SIGCONT)
        self._paused = False
