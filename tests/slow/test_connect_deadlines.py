"""Every wait on Spark Connect has a deadline (spark.connect_timeout_s): a `crag` process whose server
does not speak Spark Connect ends within it with one line and exit code 2, and SIGTERM ends it at any
point. pyspark's own client would retry for about ten minutes, printing nothing (and at exit, once
more). No JVM: the servers here are a silent port and an HTTP server. A server that stops answering in
the middle of a run: tests/spark/test_connect_deadlines.py."""

from __future__ import annotations

import http.server
import os
import signal
import socket
import subprocess
import threading

import pytest

from tests.support import ended, start_crag

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
