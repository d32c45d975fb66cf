"""PySpark data source for anabranch scalable topics: ``format("anabranch")``.

Spark finds ``DefaultSource`` here by itself (it scans top-level ``pyspark_*`` modules);
``spark.dataSource.register(DefaultSource)`` registers it explicitly. Executors must run a
Python with this package installed (set ``PYSPARK_PYTHON``). Options, schema and offset JSON:
DESIGN.md §3.7; positions: :mod:`pyspark_anabranch.planning`. The sink
(:mod:`pyspark_anabranch.sink`) is exactly-once by default (``deliveryGuarantee``): one batch
transaction per micro-batch, committed by the driver; the source reads committed data only.

Example::

    from pyspark_anabranch import DefaultSource
    spark.dataSource.register(DefaultSource)
    df = (spark.readStream.format("anabranch")
          .option("serviceUrl", "pulsar://localhost:6650")
          .option("adminUrl", "http://localhost:8080")
          .option("topic", "topic://public/default/orders")
          .option("startingOffsets", "earliest")
          .load())
"""

from pyspark_anabranch.source import DefaultSource, source_schema

__all__ = ["DefaultSource", "source_schema"]
