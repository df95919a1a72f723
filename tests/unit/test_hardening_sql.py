"""`crag sql` only reads, stops at its time limit, and reports every failure as one line."""

from __future__ import annotations

import pyarrow as pa
import pytest
from deltalake import DeltaTable, write_deltalake

from crag.cli import main
from crag.errors import InputError
from crag.sql import check_read_only, query


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


def test_show_passes_the_check():
    # Read-only, so not refused; delta-rs' DataFusion session answers it (or says it cannot) itself.
    check_read_only("SHOW TABLES")
    check_read_only("SHOW COLUMNS FROM answers")


def test_results_are_right(warehouse):
    result = query(warehouse, "SELECT route, count(*) AS n FROM answers GROUP BY route ORDER BY route").to_pylist()
    assert result == [{"route": "internal", "n": 1}, {"route": "web", "n": 2}]


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
