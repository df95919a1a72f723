"""A local Spark Connect server of a test's own, to kill mid-run: the server `crag spark start` runs
(crag.spark_server), started in the foreground of a process group of its own. Clients connect to
sc://127.0.0.1:PORT. (Tests that only use a server share the run's: tests/conftest.py.)"""

import os
import socket
import subprocess
import time
from pathlib import Path

from crag.config import SparkConfig
from crag.spark_server import free_port, server_command, server_environment


def start(folder: Path) -> tuple[str, subprocess.Popen]:
    """A server on a free port, its output in `folder`/server.log: its URL and process, once its port
    is open."""
    port = free_port()
    log = (folder / "server.log").open("w")
    server = subprocess.Popen(
        server_command(port, SparkConfig()),
        env=server_environment(),
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
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
