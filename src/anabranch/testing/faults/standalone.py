"""A standalone broker subprocess whose ledger files go through the fault layer.

:class:`FaultyBrokerProcess` is :class:`~anabranch.testing.broker.BrokerProcess` started
through the test-only :mod:`.launcher`: its ledger files are
:class:`~anabranch.testing.faults.disk.ControlledFile` objects, so a test can

- make every ledger write and fsync fail with EIO or ENOSPC (:meth:`set_disk_errno`,
  through the control file; the broker sees it within ``control.POLL_INTERVAL_S``), and
- simulate a power cut: :meth:`crash` SIGKILLs the broker and truncates every file it
  wrote to its last fsynced length (:func:`~anabranch.testing.faults.disk.lose_unfsynced`),
  which a SIGKILL alone never does (the page cache survives the process).

Example (a subprocess: about a second per start, so not run here)::

    async def demo(tmp_path: Path) -> None:
        broker = FaultyBrokerProcess(tmp_path / "data", fsync="always")
        await broker.start()
        await broker.set_disk_errno("ENOSPC")     # every ledger write fails
        await broker.set_disk_errno(None)
        cut = broker.crash()                 # files that lost unsynced bytes
        await broker.start()                 # recovery sees only what was fsynced
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from anabranch.testing.broker import BrokerProcess
from anabranch.testing.faults.control import POLL_INTERVAL_S, Control, write_control
from anabranch.testing.faults.disk import lose_unfsynced

BROKER_NAME = "b0"


class FaultyBrokerProcess(BrokerProcess):
    """``anabranch standalone`` via the fault launcher (see the module docstring)."""

    def __init__(
        self,
        data_dir: Path,
        *,
        host: str = "127.0.0.1",
        fsync: str = "always",
        failpoints: str = "",
    ) -> None:
        super().__init__(data_dir, host=host, fsync=fsync, failpoints=failpoints)
        self.control_path = self.data_dir.with_name(self.data_dir.name + ".control.json")
        write_control(self.control_path, Control())

    def _command(self) -> tuple[list[str], dict[str, str]]:
        args, env = super()._command()
        assert args[1:3] == ["-m", "anabranch.cli.main"]
        launcher = [
            sys.executable, "-m", "anabranch.testing.faults.launcher",
            "--control", str(self.control_path), "--broker-name", BROKER_NAME,
        ]  # fmt: skip
        return launcher + args[3:], env

    async def set_disk_errno(self, name: str | None) -> None:
        """Fail every ledger write and fsync with ``name`` ("EIO", "ENOSPC"), or stop;
        returns once the broker has seen it (it re-reads the control file within
        ``POLL_INTERVAL_S``)."""
        write_control(self.control_path, Control(disk_errno=name))
        await asyncio.sleep(3 * POLL_INTERVAL_S)

    def crash(self) -> int:
        """SIGKILL, then lose every write the broker had not fsynced; how many files
        lost bytes."""
        self.kill()
        return lose_unfsynced(self.data_dir, BROKER_NAME)
