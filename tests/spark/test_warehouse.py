"""The Warehouse's local folders: one session, several folders, each table's rows in its own folder; and
two runs writing one warehouse at once."""

from __future__ import annotations

import threading

import pyarrow as pa
import pytest
from deltalake import DeltaTable

from crag import schema
from crag.job import run
from crag.warehouse import Warehouse
from tests.support import LOCAL_CONF, SAMPLE_QUESTIONS, run_rows


def _rows(spark, wh: Warehouse, key: str):
    """One stage-cache row (a stored table every run may write), filed under `key`."""
    row = {name: None for name in schema.STAGE_CACHE.names} | {"key": key, "run_id": "r", "role": "x"}
    return wh.frame("stage_cache", pa.Table.from_pylist([row], schema=schema.STAGE_CACHE))


def test_two_folders_used_in_turn_by_one_session_keep_their_own_rows(spark, tmp_path):
    first, second = Warehouse(spark, str(tmp_path / "a")), Warehouse(spark, str(tmp_path / "b"))
    first.append("stage_cache", _rows(spark, first, "a1"))
    second.append("stage_cache", _rows(spark, second, "b1"))
    first.append("stage_cache", _rows(spark, first, "a2"))
    second.append("stage_cache", _rows(spark, second, "b2"))
    for folder, expected in (("a", ["a1", "a2"]), ("b", ["b1", "b2"])):
        rows = DeltaTable(str(tmp_path / folder / "stage_cache")).to_pyarrow_table(columns=["key"])
        assert sorted(rows.column("key").to_pylist()) == expected, folder
    assert sorted(r["key"] for r in first.load("stage_cache").collect()) == ["a1", "a2"]


def _jobs(context, group: str) -> list[int]:
    """The Spark jobs of a job group, once Spark's listeners have taken in every event so far (the
    status store is filled from them on a thread of its own)."""
    context._jsc.sc().listenerBus().waitUntilEmpty()
    return list(context.statusTracker().getJobIdsForGroup(group))


def _job_descriptions(context, group: str) -> list[str]:
    """The descriptions of the Spark jobs of a job group (Delta describes its own: "Delta: ...")."""
    store = context._jsc.sc().statusStore()
    described = (store.job(job).description() for job in _jobs(context, group))
    return [d.get() for d in described if d.isDefined()]


def test_reading_a_tables_state_writes_nothing_and_spares_the_next_write_its_state(spark, tmp_path):
    """`load_states` (a run reads the state of the tables it writes last while it answers) reads an
    existing table with Spark and writes nothing: the table stays at its version, and its next write
    (here the first rows of a new, empty table) rebuilds no state of it from the log; a table not there
    is not read, nor made. (A count alone left "Compute snapshot" jobs to the write.)"""
    wh = Warehouse(spark, str(tmp_path / "w"))
    wh.prepare(("stage_cache",))
    context = spark.sparkContext
    try:
        context.setJobGroup("crag-test-state-missing", "a missing table's state")
        wh.load_states(("results",))
        assert _jobs(context, "crag-test-state-missing") == []
        context.setJobGroup("crag-test-state", "a table's state")
        wh.load_states(("stage_cache", "results"))
        assert any("Compute snapshot" in d for d in _job_descriptions(context, "crag-test-state"))
        assert DeltaTable(str(tmp_path / "w" / "stage_cache")).version() == 0
        assert not (tmp_path / "w" / "results").exists()
        context.setJobGroup("crag-test-state-write", "the write after the read")
        wh.append("stage_cache", _rows(spark, wh, "k"))
        assert not [d for d in _job_descriptions(context, "crag-test-state-write") if "Compute snapshot" in d]
    finally:
        context.setLocalProperty("spark.jobGroup.id", None)
    assert [r["key"] for r in wh.load("stage_cache").collect()] == ["k"]


def test_folders_written_at_once_by_one_session_keep_their_own_rows(spark, tmp_path):
    """Threads of one session (as clients of one Spark Connect server) write three folders at once:
    each folder's tables have names of their own, so no row lands in another folder's files. (With one
    name per table shared by all folders, this test failed; at 60 appends per thread, 35 of 175 rows
    landed in another folder's files.)"""
    tags, errors = ("x", "y", "z"), []

    def write(tag: str) -> None:
        wh = Warehouse(spark, str(tmp_path / tag))
        for i in range(12):
            try:
                wh.append("stage_cache", _rows(spark, wh, f"{tag}{i}"))
            except Exception as exc:  # collected: the assertion below names it
                errors.append(f"{tag}{i}: {str(exc)[:300]}")

    threads = [threading.Thread(target=write, args=(tag,)) for tag in tags]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    for tag in tags:
        rows = DeltaTable(str(tmp_path / tag / "stage_cache")).to_pyarrow_table(columns=["key"])
        assert sorted(rows.column("key").to_pylist()) == sorted(f"{tag}{i}" for i in range(12)), tag
    names = {Warehouse(spark, str(tmp_path / tag)).name("stage_cache") for tag in tags}
    assert len(names) == 3, names


def test_a_dotted_folder_name_that_does_not_exist_yet_is_one_line(
    spark, tmp_path, monkeypatch, index_overrides, capsys
):
    """`results.v2` names no folder here, so it is read as catalog.schema; this session has no such
    catalog, and the error says how to name a folder."""
    from crag.cli import main
    from tests.support import crag_run_args

    monkeypatch.chdir(tmp_path)
    assert main(crag_run_args("results.v2", overrides=index_overrides)) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "warehouse results.v2 was read as catalog.schema" in err, err
    assert "no catalog 'results' (it has spark_catalog): for a local folder, give ./results.v2" in err


def test_two_runs_write_the_same_warehouse_at_once(spark, tmp_path, index_overrides, sample_run):
    errors, results = [], {}

    def one(run_id, extra):
        try:
            results[run_id] = run(
                str(LOCAL_CONF),
                str(SAMPLE_QUESTIONS),
                str(tmp_path),
                run_id=run_id,
                overrides=[*index_overrides, "spark.batch_questions=17", "spark.batch_seconds=null", *extra],
                spark=spark,
            )
        except Exception as exc:  # the assertion below shows it
            errors.append(f"{type(exc).__name__}: {exc}")

    threads = [
        threading.Thread(target=one, args=("left", [])),
        threading.Thread(target=one, args=("right", ["routing.policy=thresholds"])),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    answers = run_rows(tmp_path, "answers")
    assert answers.groupby("run_id").size().to_dict() == {"left": 49, "right": 49}
    assert not answers.duplicated(["run_id", "question_id"]).any()
    runs = run_rows(tmp_path, "runs").set_index("run_id")
    assert set(runs["status"]) == {"succeeded"}
    grades = run_rows(tmp_path, "grades")
    for run_id in results:
        mine = answers[answers["run_id"] == run_id]
        assert len(grades[grades["run_id"] == run_id]) == mine["n_retrieved"].sum() + mine["n_web"].sum()
    # Three batches each, their metrics summed batch by batch: the metrics the shared sample run (the
    # same config and questions, in one batch) has
    metric = ["metric", "slice", "value", "n"]
    left = run_rows(tmp_path, "metrics", "left")[metric].sort_values(metric[:2]).reset_index(drop=True)
    whole = run_rows(sample_run.warehouse, "metrics")[metric].sort_values(metric[:2]).reset_index(drop=True)
    assert len(left) > 50 and left[["metric", "slice", "n"]].equals(whole[["metric", "slice", "n"]])
    assert left["value"].to_numpy() == pytest.approx(whole["value"].to_numpy(), abs=1e-12)
