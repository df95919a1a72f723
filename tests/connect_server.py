"""A local Spark Connect server for the tests, as Databricks serverless runs crag: Spark's own
SparkConnectServer started with spark-submit from the installed pyspark, with Delta Lake configured
exactly as crag.spark configures a local session. Clients connect to sc://127.0.0.1:PORT.

    python tests/connect_server.py PORT      (serves until killed)
"""

import os
import sys
from pathlib import Path

import pyspark

from crag.config import SparkConfig
from crag.spark import LOCAL_SETTINGS, _jars, local_master


def command(port: int) -> list[str]:
    master, slots = local_master("local[2]")  # as get_spark starts a local session: a slot for commits
    settings = {
        **LOCAL_SETTINGS,
        "spark.jars": ",".join(_jars(SparkConfig())),
        "spark.connect.grpc.binding.address": "127.0.0.1",
        "spark.connect.grpc.binding.port": str(port),
        "spark.default.parallelism": str(slots),
    }
    submit = Path(pyspark.__file__).parent / "bin" / "spark-submit"
    args = [str(submit), "--class", "org.apache.spark.sql.connect.service.SparkConnectServer", "--master", master]
    for key, value in settings.items():
        args += ["--conf", f"{key}={value}"]
    return args + ["spark-internal"]


def environment() -> dict[str, str]:
    env = dict(os.environ, PYSPARK_PYTHON=sys.executable, SPARK_LOCAL_IP="127.0.0.1")
    env.pop("SPARK_REMOTE", None)
    return env


if __name__ == "__main__":
    os.execve(command(int(sys.argv[1]))[0], command(int(sys.argv[1])), environment())
