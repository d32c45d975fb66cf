"""Consume-transform-produce with Spark: read a scalable topic, upper-case each value, write
the result to another scalable topic keyed like the input, exactly once.

Exactly once (``deliveryGuarantee=exactly_once``, the sink's default): each micro-batch is one
batch transaction of the broker, committed by the driver with one CAS; a task retry, a
speculative duplicate or a driver killed and restarted from the checkpoint never shows a row
twice to read-committed readers (the source reads committed data only). ``sinkId`` names the
batch transactions (default: the query id); reusing it with a new checkpoint fails loudly.

Run against a standalone broker (``anabranch standalone``)::

    PYSPARK_PYTHON=$(which python) python examples/pipeline.py \\
        --service-url pulsar://localhost:6650 --admin-url http://localhost:8080 \\
        --source topic://public/default/orders --sink topic://public/default/orders-upper \\
        --checkpoint /tmp/orders-upper-checkpoint

Without ``--available-now`` the query keeps running until interrupted.
"""

from __future__ import annotations

import argparse
import os
import sys

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.streaming.query import StreamingQuery


def transform(df: DataFrame) -> DataFrame:
    """The pipeline's logic: keep the key, upper-case the value, carry the source position."""
    return df.select(
        F.col("key"),
        F.upper(F.col("value").cast("string")).alias("value"),
        F.create_map(
            F.lit("source"), F.concat_ws(":", F.col("segmentId"), F.col("position"))
        ).alias("properties"),
    )


def start(
    spark: SparkSession,
    *,
    service_url: str,
    admin_url: str,
    source: str,
    sink: str,
    checkpoint: str,
    available_now: bool = False,
    sink_id: str | None = None,
) -> StreamingQuery:
    """Start the streaming query (the caller awaits or stops it)."""
    df = (
        spark.readStream.format("anabranch")
        .option("serviceUrl", service_url)
        .option("adminUrl", admin_url)
        .option("topic", source)
        .option("startingOffsets", "earliest")
        .option("maxRecordsPerTrigger", "100000")
        .load()
    )
    writer = (
        transform(df)
        .writeStream.format("anabranch")
        .option("serviceUrl", service_url)
        .option("adminUrl", admin_url)
        .option("topic", sink)
        .option("deliveryGuarantee", "exactly_once")
        .option("txnTimeoutMs", "120000")
        .option("checkpointLocation", checkpoint)
    )
    if sink_id is not None:
        writer = writer.option("sinkId", sink_id)
    if available_now:
        writer = writer.trigger(availableNow=True)
    return writer.start()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--service-url", default="pulsar://localhost:6650")
    parser.add_argument("--admin-url", default="http://localhost:8080")
    parser.add_argument("--source", required=True)
    parser.add_argument("--sink", required=True)
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--available-now", action="store_true")
    args = parser.parse_args(argv)
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    spark = (
        SparkSession.builder.master("local[2]")
        .appName("anabranch-pipeline")
        .config("spark.sql.shuffle.partitions", "2")
        .getOrCreate()
    )
    query = start(
        spark,
        service_url=args.service_url,
        admin_url=args.admin_url,
        source=args.source,
        sink=args.sink,
        checkpoint=args.checkpoint,
        available_now=args.available_now,
    )
    query.awaitTermination()
    spark.stop()


if __name__ == "__main__":
    main()
