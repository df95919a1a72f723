"""Vector Search that refuses, is not there, or never answers at start-up: one line naming the endpoint,
within the start-up time limit, and the process exits."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

from crag.backends.vector_search import VectorSearchRetriever
from crag.config import load_config
from crag.errors import ConfigError
from tests.support import REPO, set_args

DBX = REPO / "conf" / "databricks.yaml"
FAST = ["retriever.policy.timeout_s=1", "retriever.policy.backoff_initial_s=0.01"]


@pytest.fixture
def silent_server():
    """A loopback port that accepts connections (the kernel's backlog) and never answers."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(16)
        yield f"http://127.0.0.1:{s.getsockname()[1]}"


def test_a_wrong_token_is_one_line_at_once(emulator, monkeypatch):
    monkeypatch.setenv("DATABRICKS_TOKEN", "not-the-token")
    cfg = load_config(DBX).retriever
    with pytest.raises(ConfigError) as caught:
        VectorSearchRetriever(cfg)
    message = str(caught.value)
    assert message.startswith(f"Vector Search endpoint {cfg.endpoint!r} (index {cfg.index_name!r}) at {emulator.url}")
    assert "HTTP 401" in message and "DATABRICKS_TOKEN" in message and "\n" not in message
    assert len(emulator.of("vector_search")) == 1  # not retried


def test_a_server_error_at_start_up_is_retried_as_any_call_is(emulator):
    """Every Spark task opens the index: a transient 500 while opening it is retried with the policy's
    attempts (only a service that does not answer is given up after STARTUP_ATTEMPTS)."""
    from crag.backends import vector_search

    cfg = load_config(DBX, ["retriever.policy.backoff_initial_s=0.01"]).retriever
    failures = vector_search.STARTUP_ATTEMPTS + 1
    assert failures < cfg.policy.max_attempts
    emulator.behaviour["vector_search"].scripted = ["500"] * failures
    VectorSearchRetriever(cfg)
    assert len(emulator.of("vector_search")) == failures + 1
    emulator.reset()
    emulator.behaviour["vector_search"].scripted = ["500"] * cfg.policy.max_attempts
    with pytest.raises(ConfigError, match="is not usable"):
        VectorSearchRetriever(cfg)
    assert len(emulator.of("vector_search")) == cfg.policy.max_attempts


def test_hangs_end_the_first_open_but_a_spark_tasks_open_retries_them(emulator):
    """The driver's open gives a silent service STARTUP_ATTEMPTS attempts; a Spark task's open comes
    after the driver's succeeded, so the same hangs are retried as any call's (one task failing over
    two hangs failed a whole fault-injection run)."""
    from crag.backends import vector_search

    cfg = load_config(DBX, FAST).retriever
    hangs = vector_search.STARTUP_ATTEMPTS
    assert hangs < cfg.policy.max_attempts
    emulator.behaviour["vector_search"].scripted = ["hang"] * hangs
    with pytest.raises(ConfigError, match="no answer within 1 s"):
        VectorSearchRetriever(cfg)
    assert len(emulator.of("vector_search")) == hangs
    emulator.reset()
    emulator.behaviour["vector_search"].scripted = ["hang"] * hangs
    VectorSearchRetriever(cfg, opened_before=True)
    assert len(emulator.of("vector_search")) == hangs + 1


def test_a_refused_connection_is_one_line(monkeypatch):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("DATABRICKS_HOST", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("DATABRICKS_TOKEN", "t0ken-value")
    with pytest.raises(ConfigError, match=rf"Vector Search endpoint .* at http://127.0.0.1:{port} is not usable"):
        VectorSearchRetriever(load_config(DBX, FAST).retriever)


def test_a_silent_service_is_given_up_at_the_start_up_limit(monkeypatch, silent_server):
    monkeypatch.setenv("DATABRICKS_HOST", silent_server)
    monkeypatch.setenv("DATABRICKS_TOKEN", "t0ken-value")
    with pytest.raises(ConfigError, match="no answer within 1 s"):
        VectorSearchRetriever(load_config(DBX, FAST).retriever)


def test_the_start_up_limit_caps_a_long_policy_timeout():
    from crag.backends import vector_search

    assert vector_search.STARTUP_TIMEOUT_S < load_config(DBX).retriever.policy.timeout_s


def test_crag_ask_ends_with_one_line_and_exits_when_the_service_hangs(silent_server):
    env = {
        **os.environ,
        "DATABRICKS_HOST": silent_server,
        "DATABRICKS_TOKEN": "t0ken-value",
        "TAVILY_API_KEY": "k3y-value",
    }
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "crag.cli", "ask", "--conf", str(DBX), *set_args(FAST), "q?"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert done.returncode == 2
    assert done.stderr.startswith("crag: error: Vector Search endpoint") and done.stderr.count("\n") == 1, done.stderr
    assert time.monotonic() - started < 60  # it exits: the abandoned request thread does not hold it


def test_crag_index_with_a_wrong_token_is_one_line(emulator, monkeypatch, tmp_path, capsys):
    from crag.cli import main

    monkeypatch.setenv("DATABRICKS_TOKEN", "not-the-token")
    code = main(
        [
            "index",
            "--conf",
            str(DBX),
            "--set",
            "retriever.policy.timeout_s=2",
            "--docs",
            str(REPO / "data" / "sample" / "kb"),
            "--out",
            str(tmp_path / "kb"),
        ]
    )
    assert code == 2
    last = capsys.readouterr().err.splitlines()[-1]  # after the chunking's progress line
    assert last.startswith("crag: error: Vector Search endpoint") and "HTTP 401" in last
