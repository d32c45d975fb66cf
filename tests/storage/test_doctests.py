"""The examples in the storage modules' docstrings are run, so they cannot rot."""

from __future__ import annotations

import doctest
import importlib

import pytest

MODULES = [
    "anabranch.core.ack_state",
    "anabranch.storage.api",
    "anabranch.storage.base",
    "anabranch.storage.cursor",
    "anabranch.storage.files",
    "anabranch.storage.ledger",
    "anabranch.storage.memory",
    "anabranch.storage.record_format",
    "anabranch.storage.segment_file",
    "anabranch.testing.faulty_file",
]


@pytest.mark.parametrize("module_name", MODULES)
def test_docstring_examples(module_name: str) -> None:
    module = importlib.import_module(module_name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0
    assert result.attempted > 0, "every public module shows at least one example"
