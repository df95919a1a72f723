"""A local Spark Connect server for the tests, as Databricks serverless runs crag: Spark's own
SparkConnectServer started with spark-submit from the installed pyspark, with Delta Lake configured
exactly as crag.spark configures a local session. Clients connect to sc://127.0.0.1:PORT.

    python tests/connect_server.py PORT      (serves until killed)
"""

import os
import socket
import subprocess
import sys
import time
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


def start(folder: Path) -> tuple[str, subprocess.Popen]:
    """A server on a free port, in a process group of its own, its output in `folder`/server.log:
    its URL and process, once its port is open."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    log = (folder / "server.log").open("w")
    server = subprocess.Popen(
        command(port), env=environment(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    deadline = time.time() + 180
    while time.time() < deadline:
        if server.poll() is not None:
            raise AssertionError("the Spark Connect server stopped; see " + log.name)
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return f"sc://127.0.0.1:{port}", server
        except OSError:
            time.sleep(0.5)
    os.killpg(server.pid, 9)
    raise AssertionError("the Spark Connect server did not open its port; see " + log.name)


if __name__ == "__main__":
    os.execve(command(int(sys.argv[1]))[0], command(int(sys.argv[1])), environment())
