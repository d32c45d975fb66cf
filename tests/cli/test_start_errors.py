"""Start-up failures an operator can fix (a busy port, a bad config) are one line on stderr
and exit status 1."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from anabranch.cli.main import app
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


@pytest.mark.parametrize(
    ("config", "reason"),
    [
        (None, "cannot read config"),  # no such file
        ("", "cannot read config"),  # a directory
        ('port = "abc"\n', "port: Input should be a valid integer"),
        (b"\xff\xfe", "can't decode"),
    ],
)
@pytest.mark.parametrize("command", ["standalone", "broker"])
def test_a_bad_config_is_one_line_not_a_traceback(
    tmp_path: Path, command: str, config: str | bytes | None, reason: str
) -> None:
    # Settings load before start-up proper: they were a traceback, not a start-up failure.
    path = tmp_path / "broker.toml"
    if config == "":
        path.mkdir()
    elif isinstance(config, bytes):
        path.write_bytes(config)
    elif config is not None:
        path.write_text(config)
    result = CliRunner().invoke(app, [command, "--config", str(path)])
    assert isinstance(result.exception, SystemExit), result.exception
    assert result.exit_code == 1, result.output
    said = " ".join(result.stderr.split())  # rich wraps long lines at the terminal width
    assert said.startswith(f"anabranch {command} cannot start: "), result.stderr
    assert reason in said and "errors.pydantic.dev" not in said, result.stderr
