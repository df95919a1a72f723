"""The command line where it waits: the `crag` console script in a process of its own, a Spark Connect
server that does not answer within its deadline, and Ctrl-C / SIGTERM during a `crag run` (its local
Spark in the child process), which say how to resume."""

import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from crag import cli
from crag.cli import main
from tests.support import LOCAL_CONF, REPO, SAMPLE, committed_questions, crag_run_args, run_rows


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


def _start_run(tmp_path, sample_indexes, extra: list[str]):
    sets = [
        f"retriever.index={sample_indexes['kb']}",
        f"web_search.index={sample_indexes['web']}",
        "mlflow.enabled=false",
        "spark.batch_questions=3",
        "spark.batch_seconds=null",
        "routing.policy=thresholds",
    ]
    args = [sys.executable, "-m", "crag.cli", *crag_run_args(tmp_path / "wh", "--no-cache", *extra, overrides=sets)]
    err = open(tmp_path / "stderr.txt", "w+", encoding="utf-8")
    return subprocess.Popen(
        args, stdout=subprocess.DEVNULL, stderr=err, cwd=REPO, env={**os.environ, "CRAG_DEBUG": ""}
    ), err


def _wait_for(err, text: str, proc, limit_s: float = 180) -> None:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline and proc.poll() is None:
        err.seek(0)
        if text in err.read():
            return
        time.sleep(0.2)
    raise AssertionError(f"{text!r} never appeared")


@pytest.mark.slow
@pytest.mark.parametrize(
    "signum, code, how", [(signal.SIGTERM, 143, "terminated (SIGTERM)"), (signal.SIGINT, 130, "interrupted")]
)
def test_a_signal_during_crag_run_ends_with_the_resume_line(tmp_path, sample_indexes, signum, code, how):
    proc, err = _start_run(tmp_path, sample_indexes, ["--run-id", "sig"])
    try:
        _wait_for(err, "batch 2 committed", proc)
        proc.send_signal(signum)
        assert proc.wait(timeout=120) == code
    finally:
        if proc.poll() is None:
            proc.kill()
    err.seek(0)
    text = err.read()
    assert "Traceback" not in text and "Exception" not in text, text
    last = text.strip().splitlines()[-1]
    assert last.startswith(f"crag: {how}: run sig did not finish; continue it with: crag run --resume sig ")
    # The line is the interrupted command as a resume: the same config, overrides, questions and
    # warehouse (that such a command finishes the run is tested in test_resume and test_connect).
    resume = shlex.split(last.split("continue it with: ", 1)[1])
    assert resume[:2] == ["crag", "run"]
    started, resumed = (cli.parser().parse_args(words) for words in (proc.args[3:], resume[1:]))
    assert (started.run_id, started.resume, resumed.run_id, resumed.resume) == ("sig", None, None, "sig")
    assert cli._overrides(started) == cli._overrides(resumed)
    same = [k for k in vars(started) if k not in ("run_id", "resume", "overrides", "override_list")]
    assert [getattr(started, k) for k in same] == [getattr(resumed, k) for k in same]
    # and what it resumes is there: the run recorded as failed, its committed batches kept

    assert run_rows(tmp_path / "wh", "runs").loc[0, "status"] == "failed"
    assert 0 < len(committed_questions(tmp_path / "wh", "sig")) < 49
