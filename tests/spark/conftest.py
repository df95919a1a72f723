"""Fixtures of the Spark tier shared by its modules: a warm local Spark Connect server, started once by
`crag spark start` as a user would start it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.support import REPO


@pytest.fixture(scope="session")
def crag_home(tmp_path_factory):
    """A CRAG_HOME of the tests' own: the server's state and the MLflow store template live there."""
    return tmp_path_factory.mktemp("crag-home")


@pytest.fixture(scope="session")
def spark_server(crag_home):
    """`crag spark start` in a process of its own; its state (ServerState). `crag spark stop` at the end."""
    env = {**os.environ, "CRAG_HOME": str(crag_home)}
    started = subprocess.run(
        [sys.executable, "-m", "crag.cli", "spark", "start"],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=600,
    )
    assert started.returncode == 0, started.stderr[-3000:]
    from crag.spark_server import ServerState

    os.environ["CRAG_HOME"] = str(crag_home)
    try:
        state = ServerState.read()
    finally:
        os.environ.pop("CRAG_HOME")
    assert state is not None, started.stdout
    yield state
    subprocess.run([sys.executable, "-m", "crag.cli", "spark", "stop"], env=env, cwd=REPO, timeout=120, check=True)


@pytest.fixture(scope="session")
def connect_url(spark_server) -> str:
    return spark_server.url
