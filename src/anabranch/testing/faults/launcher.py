"""The test-only entry point of a fault-harness broker: ``anabranch broker`` plus hooks.

``python -m anabranch.testing.faults.launcher --control FILE --broker-name NAME
broker --config broker-0.toml`` runs exactly the ``anabranch broker`` command, after
installing two test-only seams in this process only:

- the ledger factory's file opener becomes a
  :class:`~anabranch.testing.faults.disk.ControlledOpener` (disk faults, durable-length
  records for lose-unfsynced);
- the broker's clock becomes a :class:`~anabranch.testing.faults.clock.JumpingClock`.

Production code carries no hook for this: the seams are the names the standalone
bootstrap looks up when it starts (``standalone.SystemClock`` and
``standalone._ledger_factory``). :func:`install` checks they exist, so a refactor that
removes them fails the harness loudly instead of silently testing nothing.

Example:
    >>> import tempfile, pathlib
    >>> from anabranch.broker import standalone
    >>> saved = (standalone.SystemClock, standalone._ledger_factory)
    >>> install(pathlib.Path(tempfile.mkdtemp()) / "control.json", "b0")
    >>> type(standalone.SystemClock()).__name__
    'JumpingClock'
    >>> standalone.SystemClock, standalone._ledger_factory = saved
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from anabranch.testing.faults.clock import JumpingClock
from anabranch.testing.faults.control import ControlReader
from anabranch.testing.faults.disk import ControlledOpener

SEAMS = ("SystemClock", "_ledger_factory")
"""Names in ``anabranch.broker.standalone`` this launcher replaces."""


def install(control_path: Path, broker_name: str) -> None:
    """Replace the clock and the ledger file opener of brokers started in this process."""
    from anabranch.broker import standalone
    from anabranch.storage.ledger import FileManagedLedgerFactory

    missing = [name for name in SEAMS if not hasattr(standalone, name)]
    if missing:
        raise RuntimeError(f"anabranch.broker.standalone lost the seams {missing}")
    control = ControlReader(control_path)
    original = standalone._ledger_factory

    def ledger_factory(*args: Any, **kwargs: Any) -> Any:
        factory = original(*args, **kwargs)
        if isinstance(factory, FileManagedLedgerFactory):
            factory.opener = ControlledOpener(control, broker_name)
        return factory

    def clock() -> JumpingClock:
        return JumpingClock(control)

    # setattr: these are a module's private names, replaced in this test process only.
    setattr(standalone, "_ledger_factory", ledger_factory)  # noqa: B010
    setattr(standalone, "SystemClock", clock)  # noqa: B010


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="anabranch.testing.faults.launcher")
    parser.add_argument("--control", type=Path, required=True)
    parser.add_argument("--broker-name", required=True)
    parser.add_argument("rest", nargs=argparse.REMAINDER, help="the anabranch command line")
    args = parser.parse_args(argv)
    install(args.control, args.broker_name)
    from anabranch.cli.main import main as cli_main

    sys.argv = ["anabranch", *args.rest]
    cli_main()


if __name__ == "__main__":
    main()
