"""Start-up failures an operator can fix are one line on stderr and exit status 1."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

from anabranch.testing.ports import free_port


def test_a_busy_port_is_one_line_not_a_traceback(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        command = [
            sys.executable, "-m", "anabranch.cli.main", "standalone",
            "--data-dir", str(tmp_path / "data"),
            "--port", str(free_port("127.0.0.1")), "--http-port", str(taken),
        ]  # fmt: skip
        done = subprocess.run(
            command,
            check=False,
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert done.returncode == 1
    assert "Traceback" not in done.stderr and "│" not in done.stderr, done.stderr
    assert "cannot start" in done.stderr and "address already in use" in done.stderr
    assert str(taken) in done.stderr
