"""The warm Spark server's end, without a JVM: `crag spark stop` stops every process of the server's
group (a stand-in here: a shell and its child) and forgets the server."""

from __future__ import annotations

import signal
import subprocess
import threading
import time

from crag import spark_server
from crag.spark_server import ServerState


def test_stop_ends_the_whole_process_group_and_forgets_the_server(tmp_path, monkeypatch):
    monkeypatch.setenv("CRAG_HOME", str(tmp_path))
    # a stand-in for the JVM and a Python worker it started: a shell and its child, in a session of their own
    group = subprocess.Popen(["sh", "-c", "sleep 300 & wait"], start_new_session=True)
    time.sleep(0.3)
    children = subprocess.run(["pgrep", "-g", str(group.pid)], capture_output=True, text=True).stdout.split()
    assert len(children) == 2
    ServerState(group.pid, 1, spark_server.code_fingerprint(), "log").write()
    reaper = threading.Thread(target=group.wait)  # as init reaps a server whose `crag spark start` has ended
    reaper.start()
    stopped = spark_server.stop()
    reaper.join(timeout=10)
    assert stopped is not None and stopped.pid == group.pid and group.returncode == -signal.SIGTERM
    assert subprocess.run(["pgrep", "-g", str(group.pid)], capture_output=True).returncode == 1  # none left
    assert not ServerState.path().exists() and spark_server.stop() is None
