"""`crag run` from the command line on Spark: the summary it prints (the session's sample run), `crag sql`
over the warehouse it wrote, one line for questions that are missing or that Spark cannot read (`crag run`
opens its session before it reads them), and Ctrl-C / SIGTERM during a run, which say how to resume.
(The command line without Spark: tests/unit/test_cli.py.)"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import time

import pytest

from crag import cli
from crag.cli import main
from tests.support import REPO, SAMPLE_RUN, committed_questions, crag_run_args, run_rows


def test_run_prints_the_summary(sample_run):
    out = sample_run.out
    assert f"run {SAMPLE_RUN} (variant base)" in out and "questions   51: 49 accepted, 2 rejected" in out
    assert "refusals" in out and "wall time" in out


def test_sql_over_the_warehouse(capsys, sample_run, tmp_path):
    warehouse = sample_run.warehouse
    sql = (
        "SELECT a.route, count(DISTINCT a.question_id) AS questions, count(g.doc_id) AS graded "
        "FROM answers a LEFT JOIN grades g ON a.run_id = g.run_id AND a.question_id = g.question_id "
        f"WHERE a.run_id = '{SAMPLE_RUN}' GROUP BY a.route ORDER BY a.route"
    )
    assert main(["sql", "--warehouse", str(warehouse), "--format", "csv", sql]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split(",") == ["route", "questions", "graded"]
    assert sum(int(line.split(",")[1]) for line in lines[1:]) == 49
    assert main(["sql", "--warehouse", str(warehouse), sql]) == 0  # the terminal table: a header, a rule, rows
    table = capsys.readouterr().out.splitlines()
    assert (
        table[0].split() == ["route", "questions", "graded"]
        and set(table[1]) <= {"-", " "}
        and len(table) == len(lines) + 1
    )
    assert main(["sql", "--warehouse", str(warehouse), "SELECT nope FROM answers"]) == 2
    assert capsys.readouterr().err.startswith("crag: error: SQL failed:")
    assert main(["sql", "--warehouse", str(tmp_path / "empty"), "SELECT 1"]) == 2


def test_run_with_missing_questions_is_one_line(capsys, tmp_path, index_overrides):
    code = main(crag_run_args(tmp_path, questions=tmp_path / "none.jsonl", overrides=index_overrides))
    assert code == 2
    assert capsys.readouterr().err == f"crag: error: questions not found: {tmp_path / 'none.jsonl'}\n"


def _bad_parquet(tmp_path, content: bytes):
    path = tmp_path / "questions.parquet"
    path.write_bytes(content)
    return path


@pytest.mark.parametrize("content", [b"", b"PAR1 not really parquet"])
def test_unreadable_parquet_input_is_one_line(tmp_path, capsys, index_overrides, content):
    questions = _bad_parquet(tmp_path, content)
    code = main(crag_run_args(tmp_path / "wh", questions=questions, overrides=index_overrides))
    assert code == 2
    err = capsys.readouterr().err
    assert re.fullmatch(r"crag: error: [^\n]*(not a Parquet file|cannot read questions)[^\n]*\n", err), err


def test_a_delta_folder_with_an_empty_log_is_one_line(tmp_path, capsys, index_overrides):
    (tmp_path / "questions" / "_delta_log").mkdir(parents=True)
    code = main(crag_run_args(tmp_path / "wh", questions=tmp_path / "questions", overrides=index_overrides))
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith("crag: error: ") and err.count("\n") == 1, err


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
