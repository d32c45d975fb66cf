"""``anabranch tokens``: a key file that cannot be written is a usage error, not a traceback."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from anabranch.cli.main import app

runner = CliRunner()


@pytest.mark.parametrize("where", ["missing-dir", "a-dir"])
def test_an_unwritable_key_file_is_a_usage_error(tmp_path: Path, where: str) -> None:
    target = tmp_path / "missing" / "k.key" if where == "missing-dir" else tmp_path
    reason = "No such file or directory" if where == "missing-dir" else "Is a directory"
    commands = [
        ["tokens", "create-secret-key", "--output", str(target)],
        ["tokens", "create-key-pair", "--output-private-key", str(target),
         "--output-public-key", str(tmp_path / "pub.key")],
        ["tokens", "create-key-pair", "--output-private-key", str(tmp_path / "priv.key"),
         "--output-public-key", str(target)],
    ]  # fmt: skip
    for args in commands:
        result = runner.invoke(app, args)
        assert isinstance(result.exception, SystemExit), result.exception
        assert result.exit_code == 2, result.output
        said = " ".join(result.stderr.replace("│", " ").split())  # unboxed, unwrapped
        assert "cannot write" in said and reason in said, result.stderr


def test_a_secret_key_file_is_written_owner_only(tmp_path: Path) -> None:
    key = tmp_path / "secret.key"
    result = runner.invoke(app, ["tokens", "create-secret-key", "--output", str(key)])
    assert result.exit_code == 0, result.output
    assert key.stat().st_mode & 0o777 == 0o600 and len(key.read_bytes()) == 32
