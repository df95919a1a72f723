"""`crag spark start`: a warm local Spark Connect server that every command uses while it runs (the run's
own server, tests/conftest.py), and its end: `crag spark stop` stops every process of the server's group
(a stand-in here: a shell and its child) and forgets the server. The tests' process holds no JVM."""

from __future__ import annotations

import signal
import subprocess
import threading
import time

import pytest

from crag import spark_server as server_module
from crag.spark_server import ServerState
from tests.support import crag_command, crag_run_args, run_rows


def test_stop_ends_the_whole_process_group_and_forgets_the_server(tmp_path, monkeypatch):
    monkeypatch.setenv("CRAG_HOME", str(tmp_path))
    # a stand-in for the JVM and a Python worker it started: a shell and its child, in a session of their own
    group = subprocess.Popen(["sh", "-c", "sleep 300 & wait"], start_new_session=True)
    time.sleep(0.3)
    children = subprocess.run(["pgrep", "-g", str(group.pid)], capture_output=True, text=True).stdout.split()
    assert len(children) == 2
    ServerState(group.pid, 1, server_module.code_fingerprint(), "log").write()
    reaper = threading.Thread(target=group.wait)  # as init reaps a server whose `crag spark start` has ended
    reaper.start()
    stopped = server_module.stop()
    reaper.join(timeout=10)
    assert stopped is not None and stopped.pid == group.pid and group.returncode == -signal.SIGTERM
    assert subprocess.run(["pgrep", "-g", str(group.pid)], capture_output=True).returncode == 1  # none left
    assert not ServerState.path().exists() and server_module.stop() is None


@pytest.mark.usefixtures("connect_url")  # a run on the shared server
def test_a_command_uses_the_warm_server_and_says_so_first(spark_server, crag_home, index_overrides, tmp_path):
    status = crag_command("spark", "status", home=crag_home, timeout=60)
    assert status.stdout.strip() == f"a Spark server runs at {spark_server.url} (pid {spark_server.pid})"
    done = crag_command(*crag_run_args(tmp_path / "wh", "--run-id", "warm", overrides=index_overrides), home=crag_home)
    assert done.returncode == 0, done.stderr[-3000:]
    first = done.stderr.splitlines()[0]
    assert first == f"crag: using the Spark server at {spark_server.url} (crag spark start; crag spark stop ends it)"
    assert len(run_rows(tmp_path / "wh", "answers", "warm")) == 49
    again = crag_command("spark", "start", home=crag_home, timeout=60)
    assert (
        again.stdout.strip() == f"a Spark server runs at {spark_server.url}: crag commands use it until crag spark stop"
    )
