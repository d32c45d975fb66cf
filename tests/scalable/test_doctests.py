"""The examples in the scalable modules' docstrings are run, so they cannot rot."""

from __future__ import annotations

import doctest
import importlib

import pytest

MODULES = [
    "anabranch.scalable.paths",
    "anabranch.scalable.segment_ops",
    "anabranch.scalable.controller",
    "anabranch.scalable.subscription_coordinator",
    "anabranch.scalable.dag_watch",
    "anabranch.scalable.service",
]


@pytest.mark.parametrize("module_name", MODULES)
def test_docstring_examples(module_name: str) -> None:
    module = importlib.import_module(module_name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0
    assert result.attempted > 0, "every public module shows at least one example"
