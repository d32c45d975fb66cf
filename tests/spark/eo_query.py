"""A streaming query for the exactly-once tests, run as its own process (so that a test can
SIGKILL its driver): source topic -> (key, value) -> exactly-once sink, AvailableNow.

Usage: ``python tests/spark/eo_query.py SERVICE ADMIN SOURCE SINK CHECKPOINT SINK_ID PIDFILE
MAX_RECORDS``. It writes "<python pid> <JVM pid>" to PIDFILE once Spark is up (what the sink's
crash hooks kill) and exits 0 when the query ends.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path


def main(argv: list[str]) -> None:
    service, admin, source, sink, checkpoint, sink_id, pidfile, max_records = argv
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
    os.environ["SPARK_LOCAL_IP"] = "127.0.0.1"
    from pyspark.sql import SparkSession

    spark = (
        SparkSession.builder.master("local[2]")
        .appName("anabranch-eo-query")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    jvm_pid = spark.sparkContext._jvm.java.lang.ProcessHandle.current().pid()  # type: ignore[union-attr]
    Path(pidfile).write_text(f"{os.getpid()} {jvm_pid}\n")
    df = (
        spark.readStream.format("anabranch")
        .option("serviceUrl", service)
        .option("adminUrl", admin)
        .option("topic", source)
        .option("startingOffsets", "earliest")
        .option("maxRecordsPerTrigger", max_records)
        .load()
    )
    query = (
        df.select("key", "value")
        .writeStream.format("anabranch")
        .option("serviceUrl", service)
        .option("adminUrl", admin)
        .option("topic", sink)
        .option("sinkId", sink_id)
        .option("checkpointLocation", checkpoint)
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination()
    spark.stop()


if __name__ == "__main__":
    main(sys.argv[1:])
