"""A local Spark Connect server for the tests, as Databricks serverless runs crag: the server `crag spark
start` runs (crag.spark_server), in the foreground. Clients connect to sc://127.0.0.1:PORT.

    python tests/connect_server.py PORT      (serves until killed)
"""

import os
import sys

from crag.config import SparkConfig
from crag.spark_server import server_command, server_environment


def command(port: int) -> list[str]:
    return server_command(port, SparkConfig())


def environment() -> dict[str, str]:
    return server_environment()


if __name__ == "__main__":
    os.execve(command(int(sys.argv[1]))[0], command(int(sys.argv[1])), environment())
