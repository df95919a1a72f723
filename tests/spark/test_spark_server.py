"""`crag spark start`: a warm local Spark Connect server that every command uses while it runs."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.support import REPO, crag_run_args, run_rows


def test_a_command_uses_the_warm_server_and_says_so_first(spark_server, crag_home, index_overrides, tmp_path):
    env = {**os.environ, "CRAG_HOME": str(crag_home)}
    status = subprocess.run(
        [sys.executable, "-m", "crag.cli", "spark", "status"], capture_output=True, text=True, env=env, timeout=60
    )
    assert status.stdout.strip() == f"a Spark server runs at {spark_server.url} (pid {spark_server.pid})"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "crag.cli",
            *crag_run_args(tmp_path / "wh", "--run-id", "warm", overrides=index_overrides),
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    first = done.stderr.splitlines()[0]
    assert first == f"crag: using the Spark server at {spark_server.url} (crag spark start; crag spark stop ends it)"
    assert len(run_rows(tmp_path / "wh", "answers", "warm")) == 49
    again = subprocess.run(
        [sys.executable, "-m", "crag.cli", "spark", "start"], capture_output=True, text=True, env=env, timeout=60
    )
    assert (
        again.stdout.strip() == f"a Spark server runs at {spark_server.url}: crag commands use it until crag spark stop"
    )
