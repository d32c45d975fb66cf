from __future__ import annotations

import doctest
import importlib

import pytest

MODULES = [
    "anabranch.client.backoff",
    "anabranch.client.connection",
    "anabranch.client.errors",
    "anabranch.client.message",
    "anabranch.client.message_id",
    "anabranch.client.producer",
    "anabranch.client.consumer",
    "anabranch.client.reader",
    "anabranch.client.routing",
    "anabranch.client.sync",
]


@pytest.mark.parametrize("name", MODULES)
def test_doctests(name: str) -> None:
    result = doctest.testmod(importlib.import_module(name))
    assert result.failed == 0
