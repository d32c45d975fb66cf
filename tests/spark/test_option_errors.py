"""Careless options and offsets get a typed InvalidArgument naming the problem, not a
ValueError, OverflowError or KeyError from deep inside the connector (probe 18)."""

from __future__ import annotations

import pytest

from anabranch.errors import InvalidArgument
from pyspark_anabranch.options import SourceOptions
from pyspark_anabranch.planning import Frontier
from pyspark_anabranch.source import AnabranchBatchReader
from tests.spark.conftest import Broker


@pytest.mark.parametrize("value", ["abc", "nan", "inf", "-1", "0"])
def test_bad_client_option_is_invalid_argument(value: str) -> None:
    options = {
        "serviceUrl": "pulsar://127.0.0.1:6650",
        "topic": "orders",
        "client.operation_timeout_s": value,
    }
    with pytest.raises(InvalidArgument, match=r"client\.operation_timeout_s"):
        SourceOptions.parse(options)


def test_an_admin_url_that_is_no_http_url_is_invalid_argument() -> None:
    options = {"serviceUrl": "pulsar://127.0.0.1:6650", "topic": "orders", "adminUrl": "not a url"}
    with pytest.raises(InvalidArgument, match="adminUrl"):
        SourceOptions.parse(options)


def test_infinite_offset_position_is_invalid_argument() -> None:
    text = '{"v":1,"topics":{"public/default/s":{"epoch":0,"segs":{"0":Infinity}}}}'
    with pytest.raises(InvalidArgument, match="malformed"):
        Frontier.from_json(text)


def test_ending_offsets_without_the_topic_is_invalid_argument(broker: Broker) -> None:
    broker.create("topic://public/default/ending-other", 1)
    ending = '{"v":1,"topics":{"public/default/elsewhere":{"epoch":0,"segs":{"0":0}}}}'
    options = broker.options(
        "topic://public/default/ending-other", startingOffsets="earliest", endingOffsets=ending
    )
    reader = AnabranchBatchReader(SourceOptions.parse(options, batch=True))
    with pytest.raises(InvalidArgument, match="endingOffsets does not name"):
        reader.partitions()
