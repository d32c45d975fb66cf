"""The examples in the core modules' docstrings are run, so they cannot rot."""

from __future__ import annotations

import doctest
import importlib

import pytest

MODULES = [
    "anabranch.core.hash_range",
    "anabranch.core.names",
    "anabranch.core.segment_layout",
    "anabranch.core.assignment",
    "anabranch.core.dedup",
]


@pytest.mark.parametrize("module_name", MODULES)
def test_docstring_examples(module_name: str) -> None:
    module = importlib.import_module(module_name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0
    assert result.attempted > 0, "every public module shows at least one example"
