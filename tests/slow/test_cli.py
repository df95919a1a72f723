"""The command line where it waits: the `crag` console script in a process of its own, and a Spark
Connect server that does not answer within its deadline."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from crag.cli import main
from tests.support import LOCAL_CONF, SAMPLE


def test_console_script_builds_an_index(tmp_path):
    crag = shutil.which("crag", path=str(Path(sys.executable).parent))
    assert crag, "the crag console script is installed with the package"
    done = subprocess.run(
        [crag, "index", "--conf", str(LOCAL_CONF), "--docs", str(SAMPLE / "web.jsonl"), "--out", str(tmp_path / "web")],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "indexed 13 documents" in done.stdout
    assert (tmp_path / "web" / "manifest.json").exists()


def test_a_spark_connect_server_that_does_not_answer_is_one_line(capsys, tmp_path):
    """The Connect client would retry its connection for about ten minutes, printing nothing."""
    import socket

    with socket.socket() as closed:  # a port nobody listens on
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    url = f"sc://127.0.0.1:{port}/;token=dapi-SECRET"
    args = ["--set", f"spark.remote={url}", "--set", "spark.connect_timeout_s=2"]
    assert main(["eval", "--warehouse", str(tmp_path), "--run", "r", *args]) == 2
    said = capsys.readouterr().err
    assert said.startswith(f"crag: error: no Spark Connect server answers at sc://127.0.0.1:{port} within 2 s"), said
    # and the process may still start a classic session (pyspark takes this variable for Connect's mode)
    assert "SPARK_CONNECT_MODE_ENABLED" not in os.environ
    # the URL's credentials are not in the error itself (the CLI's scrubber aside: the Python API raises it)
    from crag.connect import connect_session
    from crag.errors import ConfigError

    with pytest.raises(ConfigError) as refused:
        connect_session(f"sc://me:dapi-PASS@127.0.0.1:{port}/;token=dapi-SECRET", 1)
    assert "dapi-" not in str(refused.value) and f"sc://127.0.0.1:{port} within" in str(refused.value)
