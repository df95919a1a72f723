"""Every wait on Spark Connect has a deadline (spark.connect_timeout_s): a `crag` process whose server
does not speak Spark Connect, or stops answering in the middle of a run, ends within it with one line
and exit code 2, and SIGTERM ends it at any point. pyspark's own client would retry for about ten
minutes, printing nothing (and at exit, once more). The servers here are a silent port, an HTTP server
and a Spark Connect server of the test's own, killed: the tests' process holds no JVM."""

from __future__ import annotations

import http.server
import os
import signal
import socket
import subprocess
import threading
import time

import pytest

from tests import connect_server
from tests.support import REPO, crag_run_args, ended, start_crag, uniform_questions

DEADLINE_S = 5
# What a `crag` process takes besides the deadline: starting Python and importing pyspark (seconds on a
# busy machine). pyspark's own retries, without the deadline, take ten minutes.
START_S = 60


class SilentPort(int):
    """A silent server's port, which also tells when a client has connected to it."""

    connected: threading.Event


@pytest.fixture
def silent_server():
    """A port that accepts connections and never says anything."""
    listener = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []
    port = SilentPort(listener.getsockname()[1])
    port.connected = threading.Event()

    def accept():
        while True:
            try:
                held.append(listener.accept()[0])
            except OSError:
                return
            port.connected.set()

    threading.Thread(target=accept, daemon=True).start()
    yield port
    listener.close()
    for connection in held:
        connection.close()


@pytest.fixture
def http_server():
    """An HTTP/1.1 server: it answers, in another protocol."""

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Quiet)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def _eval_on(url: str, warehouse, deadline_s: float = DEADLINE_S) -> subprocess.Popen:
    return start_crag(
        "eval",
        "--warehouse",
        str(warehouse),
        "--run",
        "r",
        "--set",
        f"spark.remote={url}",
        "--set",
        f"spark.connect_timeout_s={deadline_s}",
    )


@pytest.mark.parametrize(
    ("server", "said"),
    [
        ("silent_server", "something accepts connections there but does not answer in Spark Connect's protocol (gRPC)"),
        ("http_server", "something answers there, but not in Spark Connect's protocol (gRPC over HTTP/2): "),
    ],
)
def test_a_server_that_does_not_speak_spark_connect_ends_the_command_within_the_deadline(
    request, server, said, tmp_path
):
    port = request.getfixturevalue(server)
    code, err = ended(_eval_on(f"sc://127.0.0.1:{port}", tmp_path), DEADLINE_S + START_S)
    assert code == 2, err
    assert err.count("\n") == 1 and err.startswith(
        f"crag: error: no Spark Connect server answers at sc://127.0.0.1:{port} within {DEADLINE_S} s "
        f"(spark.connect_timeout_s): {said}"
    ), err


def test_a_token_to_a_server_without_tls_is_one_line_without_the_token(http_server, tmp_path):
    """With a token (or use_ssl=true) the client speaks TLS to any host but "localhost"."""
    code, err = ended(
        _eval_on(f"sc://me:dapi-PASS@127.0.0.1:{http_server}/;token=dapi-SECRET", tmp_path), DEADLINE_S + START_S
    )
    assert code == 2 and err.count("\n") == 1, err
    assert f"at sc://127.0.0.1:{http_server} within" in err and "the TLS handshake failed" in err, err
    assert "dapi-" not in err


def test_sigterm_ends_a_command_that_waits_for_a_silent_server(silent_server, tmp_path):
    """A deadline of an hour: SIGTERM, not the deadline, ends the wait, and nothing is called at exit."""
    process = _eval_on(f"sc://127.0.0.1:{silent_server}", tmp_path, deadline_s=3600)
    # started, and waiting for the server's answer
    assert silent_server.connected.wait(START_S) and process.poll() is None, process.communicate()
    os.killpg(process.pid, signal.SIGTERM)
    code, err = ended(process, 30)
    assert code == 143 and err == "crag: terminated (SIGTERM)\n", err


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
