"""The examples in the admin modules' docstrings run, so they cannot rot."""

from __future__ import annotations

import doctest
import importlib

import pytest

MODULES = [
    "anabranch.broker.policies",
    "anabranch.broker.metrics",
    "anabranch.admin.models",
    "anabranch.admin.routes",
    "anabranch.admin.routes_v2",
    "anabranch.admin.routes_scalable",
    "anabranch.admin.openapi",
    "anabranch.admin.service",
    "anabranch.admin.http",
    "anabranch.admin.client",
]


@pytest.mark.parametrize("module_name", MODULES)
def test_docstring_examples(module_name: str) -> None:
    module = importlib.import_module(module_name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0
    assert result.attempted > 0, "every public module shows at least one example"
