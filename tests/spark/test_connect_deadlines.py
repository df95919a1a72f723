"""Every wait on Spark Connect has a deadline (spark.connect_timeout_s): a `crag run` whose server stops
answering in the middle of the run ends within it with one line and exit code 2, and SIGTERM ends it
sooner. pyspark's own client would retry for about ten minutes, printing nothing (and at exit, once
more). A server that never spoke Spark Connect: tests/slow/test_connect_deadlines.py."""

from __future__ import annotations

import os
import signal
import time

import pytest

from tests import connect_server
from tests.support import REPO, crag_run_args, ended, start_crag, uniform_questions

DEADLINE_S = 5


@pytest.fixture
def doomed_server(tmp_path):
    """A Spark Connect server of this test's own, to be killed: its URL and process."""
    url, server = connect_server.start(tmp_path)
    yield url, server
    if server.poll() is None:
        os.killpg(server.pid, signal.SIGKILL)
    server.wait(timeout=60)


@pytest.mark.parametrize("ended_by", ["the deadline", "SIGTERM"])
def test_a_server_killed_mid_run_ends_the_run_within_the_deadline(ended_by, doomed_server, emulator, tmp_path):
    """The server is killed while a batch runs (the model endpoint answers slowly): the client gives
    up within the deadline, and so does each call after (recording the run's failure), with one line.
    SIGTERM ends it sooner: the failure is then recorded with one try, not waited for."""
    url, server = doomed_server
    deadline_s = DEADLINE_S if ended_by == "the deadline" else 600
    emulator.behaviour["serving"].latency_s = 0.3  # a batch of tens of seconds
    questions = uniform_questions(tmp_path / "questions.jsonl", 32)
    overrides = [
        f"spark.remote={url}",
        f"spark.connect_timeout_s={deadline_s}",
        "spark.pipelines_per_task=1",
        "spark.questions_per_pipeline=1",
        "cache.enabled=false",
        "mlflow.enabled=false",
    ]
    conf = REPO / "conf" / "databricks.yaml"
    run = start_crag(
        *crag_run_args(tmp_path / "wh", "--run-id", "doomed", questions=questions, conf=conf, overrides=overrides)
    )
    started = time.time() + 300
    while time.time() < started and run.poll() is None and len(emulator.spans) < 3:
        time.sleep(0.2)
    assert run.poll() is None, "the run ended before its server could be killed: " + run.communicate()[1][-2000:]
    os.killpg(server.pid, signal.SIGKILL)
    killed = time.monotonic()
    if ended_by == "SIGTERM":
        time.sleep(1)
        os.killpg(run.pid, signal.SIGTERM)
    code, err = ended(run, DEADLINE_S * 4 + 30)
    waited = time.monotonic() - killed
    assert "Traceback" not in err, err
    last = err.strip().splitlines()[-1]
    if ended_by == "SIGTERM":
        assert code == 143 and last.startswith(
            "crag: terminated (SIGTERM): run doomed did not finish; continue it with: "
        ), err
        return
    assert code == 2, err
    assert last.startswith(f"crag: error: the Spark Connect server at {url} stopped answering: no answer within"), err
    # the call under way gives up at the deadline; the ones after it (the run's failure recorded, the
    # session's clean-up at exit) are tried once, not retried: one deadline, not one for each call
    assert waited < DEADLINE_S * 2 + 15, (waited, err)
