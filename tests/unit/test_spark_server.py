"""The warm Spark server's state, without a JVM: a server is found by its state file, and used only when
it serves this crag's code and answers (its end: tests/slow/test_spark_server.py)."""

from __future__ import annotations

import logging
import os
import subprocess
import time

import pytest

from crag import spark_server
from crag.spark_server import ServerState


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("CRAG_HOME", str(tmp_path))
    return tmp_path


def test_no_state_file_means_no_server(home):
    assert ServerState.read() is None and spark_server.usable() is None


def test_a_server_whose_process_is_gone_is_not_there(home):
    gone = subprocess.Popen(["true"])
    gone.wait()
    ServerState(gone.pid, 1, spark_server.code_fingerprint(), "log").write()
    assert ServerState.read() is None


def test_a_server_of_other_crag_code_is_not_used_and_a_line_says_why(home, caplog):
    ServerState(os.getpid(), 1, "0" * 16, "log").write()  # a live process: this one
    assert ServerState.read() is not None
    with caplog.at_level(logging.INFO, logger="crag"):
        assert spark_server.usable() is None
    assert "serves other crag code than this one's: local Spark is started instead" in caplog.text


def test_a_server_that_does_not_answer_is_not_used(home):
    ServerState(os.getpid(), spark_server.free_port(), spark_server.code_fingerprint(), "log").write()
    assert spark_server.usable() is None


def test_the_code_fingerprint_changes_when_a_source_file_does(tmp_path, monkeypatch):
    (tmp_path / "a.py").write_text("x = 1\n")
    monkeypatch.setattr(spark_server, "PACKAGE", tmp_path)
    before = spark_server.code_fingerprint()
    time.sleep(0.01)
    (tmp_path / "a.py").write_text("x = 22\n")
    assert spark_server.code_fingerprint() != before


def test_crag_spark_start_gives_the_server_the_configs_own_spark_settings(home, jars_dir, monkeypatch, capsys):
    """`crag spark start --set spark.conf.KEY=VALUE` (or a --conf file's spark.conf) reaches the server's
    spark-submit, as a local session gets it: a bigger heap for a server that serves many runs, say.
    crag's own settings stay crag's."""
    from crag.cli import main
    from crag.spark import LOCAL_SETTINGS

    started: list = []

    def start(cfg, port=None):
        started.append(spark_server.server_command(15002, cfg))
        return ServerState(os.getpid(), 15002, spark_server.code_fingerprint(), "log")

    monkeypatch.setattr(spark_server, "start", start)
    overrides = ["--set", "spark.conf.spark.driver.memory=3g", "--set", f"spark.jars_dir={jars_dir}"]
    assert main(["spark", "start", *overrides]) == 0
    (command,) = started
    settings = [command[i + 1] for i, arg in enumerate(command) if arg == "--conf"]
    assert "spark.driver.memory=3g" in settings
    assert f"spark.sql.codegen.factoryMode={LOCAL_SETTINGS['spark.sql.codegen.factoryMode']}" in settings
    assert "started at sc://" in capsys.readouterr().out
