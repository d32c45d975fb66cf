"""The examples in the protocol modules' docstrings run and pass."""

from __future__ import annotations

import doctest
import importlib

import pytest

MODULES = ["batch", "checksum", "commands", "compression", "connection", "frames", "generate"]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name: str) -> None:
    module = importlib.import_module(f"anabranch.protocol.{name}")
    result = doctest.testmod(module)
    assert result.failed == 0
    assert result.attempted > 0 or name == "generate"
