"""`crag run` from the command line on Spark: the summary it prints (the session's sample run), `crag sql`
over the warehouse it wrote, one line for questions that are missing or that Spark cannot read (`crag run`
opens its session before it reads them). (The command line without Spark: tests/unit/test_cli.py; Ctrl-C
and SIGTERM during a run in a process of its own: tests/slow/test_cli.py.)"""

from __future__ import annotations

import re

import pytest

from crag.cli import main
from tests.support import SAMPLE_RUN, crag_run_args


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
