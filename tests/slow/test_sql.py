"""`crag sql` only reads, stops at its time limit, and reports every failure as one line."""

from __future__ import annotations

import csv
import io
import json
import logging

import pyarrow as pa
import pytest
from deltalake import DeltaTable, write_deltalake

from crag.cli import main
from crag.console import display_width, render
from crag.errors import InputError
from crag.sql import check_read_only, query
from tests.support import ANSWER_EN, ANSWER_JA


@pytest.fixture
def warehouse(tmp_path):
    """A small warehouse of real Delta tables, one with a list-of-struct column as crag's answers have."""
    answers = pa.table(
        {
            "run_id": ["r1", "r1", "r1"],
            "question_id": ["q1", "q2", "q3"],
            "question": ["How tall?", "Where?", "When?"],
            "route": ["web", "internal", "web"],
            "sources": pa.array(
                [[{"doc_id": "a", "title": "A"}], [], [{"doc_id": "b", "title": "B"}]],
                type=pa.list_(pa.struct([("doc_id", pa.string()), ("title", pa.string())])),
            ),
        }
    )
    write_deltalake(str(tmp_path / "answers"), answers)
    write_deltalake(str(tmp_path / "runs"), pa.table({"run_id": ["r1"], "status": ["succeeded"]}))
    return tmp_path


WRITES = [
    "COPY answers TO '{target}'",
    "COPY (SELECT * FROM answers) TO '{target}' STORED AS PARQUET",
    "copy answers to '{target}'",
    "  /* a comment */ COPY answers TO '{target}'",
    "EXPLAIN ANALYZE COPY answers TO '{target}'",
    "SELECT 1; COPY answers TO '{target}'",
    "INSERT INTO answers SELECT * FROM answers",
    "WITH x AS (INSERT INTO answers SELECT * FROM answers RETURNING *) SELECT * FROM x",
    "DELETE FROM answers",
    "UPDATE answers SET route = 'x'",
    "CREATE TABLE t AS SELECT 1",
    "CREATE EXTERNAL TABLE t STORED AS CSV LOCATION '{target}'",
    "CREATE VIEW v AS SELECT 1",
    "DROP TABLE answers",
    "SET datafusion.execution.batch_size = 1",
    "",
    "SELECT",  # not even a query: refused, not guessed at
]


@pytest.mark.parametrize("statement", WRITES)
def test_anything_but_one_reading_statement_is_refused(warehouse, tmp_path_factory, statement):
    target = tmp_path_factory.mktemp("target") / "out.parquet"
    with pytest.raises(InputError, match="SQL not run"):
        query(warehouse, statement.format(target=target))
    assert not target.exists()


def test_copy_cannot_overwrite_a_delta_log(warehouse, capsys):
    log = sorted((warehouse / "runs" / "_delta_log").glob("*.json"))[0]
    before = log.read_bytes()
    assert main(["sql", "--warehouse", str(warehouse), f"COPY answers TO '{log}' STORED AS JSON"]) == 2
    assert log.read_bytes() == before
    assert DeltaTable(str(warehouse / "runs")).to_pyarrow_table().num_rows == 1
    err = capsys.readouterr().err
    assert err.startswith("crag: error: SQL not run") and err.count("\n") == 1


@pytest.mark.parametrize(
    "statement",
    [
        "SELECT route, count(*) AS n FROM answers GROUP BY route ORDER BY route",
        "WITH w AS (SELECT * FROM answers WHERE route = 'web') SELECT count(*) AS n FROM w",
        "EXPLAIN SELECT * FROM answers",
        "DESCRIBE answers",
        "VALUES (1), (2)",
    ],
)
def test_reading_statements_run(warehouse, statement):
    check_read_only(statement)
    assert query(warehouse, statement).num_rows > 0


def test_show_lists_the_tables_and_their_columns(warehouse):
    tables = query(warehouse, "SHOW TABLES").to_pylist()
    assert "answers" in {t["table_name"] for t in tables if t["table_schema"] == "public"}
    columns = {c["column_name"] for c in query(warehouse, "SHOW COLUMNS FROM answers").to_pylist()}
    assert {"question_id", "route", "sources"} <= columns


def test_results_are_right(warehouse):
    result = query(warehouse, "SELECT route, count(*) AS n FROM answers GROUP BY route ORDER BY route").to_pylist()
    assert result == [{"route": "internal", "n": 1}, {"route": "web", "n": 2}]


def test_text_in_any_script_whatever_the_locale(warehouse, monkeypatch):
    """The query goes to its process as UTF-8 and its messages come back as UTF-8, also where Python's
    streams are set to another encoding."""
    monkeypatch.setenv("PYTHONIOENCODING", "latin-1")
    assert query(warehouse, "SELECT '富士山' AS q").to_pylist() == [{"q": "富士山"}]
    with pytest.raises(InputError, match="富士"):
        query(warehouse, "SELECT 富士 FROM answers")


def test_a_runaway_query_stops_at_the_time_limit(warehouse, capsys):
    code = main(
        [
            "sql",
            "--warehouse",
            str(warehouse),
            "--timeout",
            "2",
            "SELECT count(*) FROM generate_series(1, 100000000000)",
        ]
    )
    assert code == 2
    err = capsys.readouterr().err
    assert err == "crag: error: SQL stopped after 2 s (the time limit; raise it with --timeout)\n"


@pytest.mark.parametrize("timeout", ["0", "-1", "nan", "1e9"])
def test_a_timeout_out_of_range_is_one_line(warehouse, capsys, timeout):
    assert main(["sql", "--warehouse", str(warehouse), "--timeout", timeout, "SELECT 1"]) == 2
    assert capsys.readouterr().err.startswith("crag: error: --timeout")


@pytest.mark.parametrize(
    "statement",
    [
        "SELECT CAST(question AS INT) FROM answers",  # fails while running, not while planning
        "SELECT nope FROM answers",
        "SELECT * FROM missing_table",
    ],
)
def test_failures_are_one_line(warehouse, capsys, statement):
    assert main(["sql", "--warehouse", str(warehouse), statement]) == 2
    err = capsys.readouterr().err
    assert err.startswith("crag: error: SQL failed:") and err.count("\n") == 1
    assert "Traceback" not in err


@pytest.mark.parametrize(
    "statement",
    [
        "SELECT sources FROM answers",
        "SELECT unnest(sources) FROM answers",
        "SELECT array_agg(route) AS routes FROM answers",  # a list of string_view from DataFusion
        "SELECT route, array_agg(question_id) AS ids FROM answers GROUP BY route",
    ],
)
def test_list_columns_print(warehouse, capsys, statement):
    assert main(["sql", "--warehouse", str(warehouse), statement]) == 0
    out = capsys.readouterr().out
    assert "q1" in out or "web" in out or "A" in out


def test_a_sql_result_from_a_real_warehouse(tmp_path):
    """What `crag sql` gets: DataFusion's Arrow result over a Delta answers table (view types, lists of
    structs, time zones), in every format."""
    import datetime

    from crag import schema, sql, tables

    created = datetime.datetime(2026, 11, 29, 14, 58, 35, tzinfo=datetime.UTC)
    rows = [
        {
            "run_id": "r1",
            "question_id": "q-ja-02",
            "question": "日本で一番高い山は？",
            "answer": ANSWER_JA,
            "route": "web",
            "refused": False,
            "n_retrieved": 3,
            "prompt_tokens": None,
            "ms_retrieve": 1.25,
            "sources": [{"source": "web", "doc_id": "fuji", "title": "富士山", "url": None}],
            "created_at": created,
        },
        {
            "run_id": "r1",
            "question_id": "q-en-01",
            "question": "How often?",
            "answer": ANSWER_EN,
            "route": "internal",
            "refused": False,
            "n_retrieved": 10,
            "prompt_tokens": 512,
            "ms_retrieve": 0.5,
            "sources": [],
            "created_at": created,
        },
    ]
    tables.write_table(tmp_path / "answers", pa.Table.from_pylist(rows, schema=schema.ANSWERS))
    result = sql.query(
        tmp_path,
        "SELECT question_id, question, answer, n_retrieved, prompt_tokens, ms_retrieve, "
        "refused, sources, created_at FROM answers ORDER BY question_id",
    )

    lines = render(result, "table", width=72).splitlines()
    assert all(display_width(line) <= 72 for line in lines)
    assert lines[2].startswith("q-en-01      How often?") and lines[3].startswith(
        "q-ja-02      日本で一番高い山は？  富士山"
    )
    assert "2026-11-29 14:58:35+00:00" in lines[-1]  # times are never cut
    table_text = render(result, "table", width=300)
    assert '"title":"富士山"' in table_text and "false" in table_text
    records = [json.loads(line) for line in render(result, "json").splitlines()]
    assert records[1]["sources"] == [{"source": "web", "doc_id": "fuji", "title": "富士山", "url": None}]
    assert records[0]["prompt_tokens"] == 512 and records[1]["prompt_tokens"] is None
    assert records[0]["created_at"] == "2026-11-29T14:58:35+00:00" and records[0]["refused"] is False
    rows_back = list(csv.DictReader(io.StringIO(render(result, "csv"))))
    assert rows_back[1]["answer"] == ANSWER_JA and rows_back[1]["prompt_tokens"] == ""
    assert render(result, "markdown").splitlines()[1] == "| --- | --- | --- | ---: | ---: | ---: | --- | --- | --- |"


def test_a_table_that_cannot_be_opened_fails_only_its_own_queries(warehouse, caplog):
    """A run killed while creating a work table leaves a folder with an empty log: the other tables
    still answer, with a warning naming the one left out."""
    (warehouse / "run_inputs__killed_0123abcd" / "_delta_log").mkdir(parents=True)
    with caplog.at_level(logging.WARNING, logger="crag"):
        assert query(warehouse, "SELECT count(*) AS n FROM runs").to_pylist() == [{"n": 1}]
    assert "left out table run_inputs__killed_0123abcd: it cannot be opened" in caplog.text
    with pytest.raises(InputError, match=r"left out, unreadable: run_inputs__killed_0123abcd\)"):
        query(warehouse, "SELECT * FROM run_inputs__killed_0123abcd")


def test_a_reader_that_goes_away_ends_the_command_quietly(warehouse):
    """crag sql ... | head: the pipe closes early; no traceback, no error line, SIGPIPE's exit status."""
    import subprocess
    import sys

    command = [sys.executable, "-m", "crag.cli", "sql", "--warehouse", str(warehouse), "--format", "csv"]
    rows = "SELECT value AS n FROM generate_series(1, 200000)"  # more than a pipe's buffer holds
    with subprocess.Popen([*command, rows], stdout=subprocess.PIPE, stderr=subprocess.PIPE) as proc:
        assert proc.stdout.readline().strip() == b"n"
        proc.stdout.close()  # as head does after its lines
        err = proc.stderr.read().decode()
        assert proc.wait(timeout=120) == 141 and err == "", err


def test_a_broken_pipe_that_is_not_stdout_is_an_error(monkeypatch, capsys):
    """Only a closed standard output ends the command quietly: a broken socket is a failure to report."""
    from crag import cli

    def broken(args):
        raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(cli, "_sql", broken)
    assert main(["sql", "--warehouse", ".", "SELECT 1"]) == 2
    assert capsys.readouterr().err == "crag: error: BrokenPipeError: [Errno 32] Broken pipe\n"


def test_an_unknown_option_is_reported_by_its_command(capsys):
    with pytest.raises(SystemExit) as ended:
        main(["sql", "--bogus", "--warehouse", ".", "SELECT 1"])
    assert ended.value.code == 2
    assert capsys.readouterr().err == "crag: error: crag sql: unrecognized arguments: --bogus (see crag sql --help)\n"


def test_a_usage_error_is_one_line(capsys):
    with pytest.raises(SystemExit) as ended:
        main(["sql", "--timeout", "abc", "SELECT 1"])
    assert ended.value.code == 2
    assert capsys.readouterr().err == (
        "crag: error: crag sql: argument --timeout: invalid float value: 'abc' (see crag sql --help)\n"
    )


def test_a_query_of_hundreds_of_unions_is_checked_and_run(warehouse, capsys):
    """The read-only check walks the parsed query without recursion (600 UNIONs nest deeper than
    Python's limit: the check itself ended in a RecursionError traceback)."""
    rows = " UNION ALL ".join(f"SELECT {i} AS n" for i in range(600))
    assert main(["sql", "--warehouse", str(warehouse), "--format", "csv", rows]) == 0
    header, *values = capsys.readouterr().out.split()
    assert header == "n" and sorted(map(int, values)) == list(range(600))
