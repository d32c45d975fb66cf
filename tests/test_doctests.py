"""Every module's docstring examples run, so they cannot rot.

The package is walked, not listed, so a new module is covered the day it lands.
Modules whose examples are prose (``Example::`` blocks that need a live broker) must
still import cleanly and fail no example they do contain.
"""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import anabranch

MODULES = sorted(
    info.name
    for info in pkgutil.walk_packages(anabranch.__path__, prefix="anabranch.")
    if "._generated" not in info.name and not info.name.endswith(".__main__")
)

# Pure and storage-facing modules must show at least one runnable example.
MUST_HAVE_EXAMPLES = ("anabranch.core.", "anabranch.storage.", "anabranch.scalable.")


@pytest.mark.parametrize("module_name", MODULES)
def test_docstring_examples(module_name: str) -> None:
    module = importlib.import_module(module_name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0
    if module_name.startswith(MUST_HAVE_EXAMPLES) and not module_name.endswith("__init__"):
        assert result.attempted > 0, f"{module_name} shows no runnable example"


def test_walk_found_the_package() -> None:
    assert "anabranch.metadata.api" in MODULES
    assert "anabranch.broker.session" in MODULES
