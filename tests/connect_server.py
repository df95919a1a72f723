"""A local Spark Connect server for the tests, as Databricks serverless runs crag: start it with
`python tests/connect_server.py PORT TOKEN`; it prints "ready" once clients can connect
(sc://127.0.0.1:PORT/;token=TOKEN) and serves until killed. Delta Lake is configured exactly as
crag.spark configures a local session."""

import os
import sys
import time

from pyspark.sql import SparkSession

from crag.config import SparkConfig
from crag.spark import LOCAL_SETTINGS, _jars


def main() -> None:
    port, token = sys.argv[1], sys.argv[2]
    os.environ["SPARK_CONNECT_AUTHENTICATE_TOKEN"] = token
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    builder = SparkSession.builder.remote("local[2]").config("spark.connect.grpc.binding.port", port)
    builder = builder.config("spark.default.parallelism", "2").config("spark.jars", ",".join(_jars(SparkConfig())))
    for key, value in LOCAL_SETTINGS.items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    spark.range(1).collect()  # the server answers
    print(f"ready {port} {spark.version}", flush=True)
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    main()
