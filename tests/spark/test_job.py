"""The whole job on Spark over the bundled sample, checked through the Delta tables it writes (the
session's shared sample run, tests/spark/conftest.py, where a test only reads them)."""

import json
import logging

import pandas as pd
import pyarrow as pa
import pytest
from deltalake import DeltaTable
from pyspark.sql import functions as F

from crag import batches as crag_batches
from crag import job as crag_job
from crag import ledger as crag_ledger
from crag import schema
from crag.compare import compare
from crag.config import CragConfig
from crag.counts import RunCounts
from crag.errors import CragError, UnusableIndexError
from crag.job import run
from crag.ledger import Ledger
from crag.warehouse import Warehouse
from tests.support import LOCAL_CONF, SAMPLE, SAMPLE_RUN, copy_warehouse, run_rows

QUESTIONS = SAMPLE / "questions.jsonl"
table = run_rows


def test_every_question_exactly_once(sample_run):
    warehouse = sample_run.warehouse
    inputs = pd.read_json(QUESTIONS, lines=True, dtype={"question_id": str})
    answers, rejects = table(warehouse, "answers", SAMPLE_RUN), table(warehouse, "rejects", SAMPLE_RUN)
    assert len(answers) + len(rejects) == len(inputs)
    assert answers["question_id"].is_unique
    assert set(answers["question_id"]) == set(inputs["question_id"].drop_duplicates()) - {"q-bad-blank"}
    assert sorted(rejects["reason"]) == [
        "duplicate question_id 'q-en-01': first seen at input row 0",
        "question is only whitespace",
    ]


def test_routes_match_what_the_sample_was_written_for(sample_run):
    warehouse = sample_run.warehouse
    answers = table(warehouse, "answers", SAMPLE_RUN)
    expected = (
        pd.read_json(QUESTIONS, lines=True).drop_duplicates("question_id").set_index("question_id")["expected_route"]
    )
    answers["expected"] = answers["question_id"].map(expected)
    web = answers[answers["expected"] == "web"]
    none = answers[answers["expected"] == "none"]
    assert len(web) >= 10 and (web["route"] == "web").all(), web[["question_id", "route"]]
    assert len(none) >= 6 and none["refused"].all(), none[["question_id", "route"]]
    assert (answers["error"].isna()).all()


def test_grades_exist_for_every_retrieved_and_searched_document(sample_run):
    warehouse = sample_run.warehouse
    answers, grades = table(warehouse, "answers", SAMPLE_RUN), table(warehouse, "grades", SAMPLE_RUN)
    per_question = (
        grades.groupby(["question_id", "source"])
        .size()
        .unstack(fill_value=0)
        .reindex(index=answers["question_id"], columns=["internal", "web"], fill_value=0)
    )
    assert (per_question["internal"].values == answers["n_retrieved"].values).all()
    assert (per_question["web"].values == answers["n_web"].values).all()
    assert answers["n_retrieved"].sum() > 0 and answers["n_web"].sum() > 0
    assert set(grades["grade"]) == {"yes", "no"} and grades["relevance"].between(0, 1).all()
    assert (grades["parse_status"] == "ok").all() and (grades["grader"] == "semantic").all()
    n_relevant = (
        grades[grades["source"] == "internal"].groupby("question_id")["grade"].apply(lambda g: (g == "yes").sum())
    )
    assert answers.set_index("question_id")["n_relevant"].equals(
        n_relevant.reindex(answers["question_id"]).fillna(0).astype("int32")
    )


def test_decisions_explain_each_question(sample_run):
    warehouse = sample_run.warehouse
    decisions = table(warehouse, "decisions", SAMPLE_RUN)
    route = decisions[decisions["step"] == "route"].set_index("question_id")
    assert route.loc["q-web-04", "decision"] == "incorrect"
    assert route.loc["q-web-04", "reason"] == "nothing retrieved; policy any_irrelevant: web search"
    assert route.loc["q-web-01", "reason"].endswith("irrelevant -> web search")
    last = decisions.groupby("question_id").tail(1)
    assert set(last["step"]) == {"generate"}


def test_answers_columns_and_sources(sample_run):
    warehouse = sample_run.warehouse
    assert list(table(warehouse, "answers").columns) == schema.ANSWERS.names
    answers = table(warehouse, "answers", SAMPLE_RUN).set_index("question_id")
    fuji = answers.loc["q-web-04"]
    assert "3,776" in fuji["answer"] and fuji["web_query"] == "high Mount Fuji"
    assert [s["url"] for s in fuji["sources"]] == ["https://example.org/wiki/Mount_Fuji"]
    assert answers.loc["q-ja-04", "route"] in ("internal", "mixed") and "HF-713" in answers.loc["q-ja-04", "answer"]
    assert (answers["variant"] == "base").all() and answers["created_at"].dt.tz is not None


def test_runs_table_records_config_and_counts(sample_run):
    warehouse = sample_run.warehouse
    runs = table(warehouse, "runs", SAMPLE_RUN)
    assert len(runs) == 1 and runs.loc[0, "status"] == "succeeded"
    counts = dict(runs.loc[0, "counts"])
    assert counts["input_rows"] == 51 and counts["accepted"] == 49 and counts["rejected"] == 2
    assert counts["route_web"] == (table(warehouse, "answers", SAMPLE_RUN)["route"] == "web").sum()
    assert json.loads(runs.loc[0, "config"])["routing"]["policy"] == "any_irrelevant"
    assert runs.loc[0, "finished_at"] >= runs.loc[0, "started_at"]


def test_tables_are_readable_by_any_delta_reader(sample_run):
    """The stored tables are plain Delta tables; the views are a SELECT over them (crag.schema.VIEWS)."""
    warehouse = sample_run.warehouse
    written = [name for name in schema.STORED if (warehouse / name / "_delta_log").is_dir()]
    assert {"runs", "inputs", "results", "metric_values", "stage_cache"} <= set(written)
    for name in written:
        protocol = DeltaTable(str(warehouse / name)).protocol()
        assert (protocol.min_reader_version, protocol.min_writer_version) == (1, 2), name
    assert not any((warehouse / name).exists() for name in schema.VIEWS)  # shown, not stored


def test_rerunning_a_run_id_replaces_its_rows(spark, sample_run, index_overrides, tmp_path):
    # (that a rerun leaves other runs' rows as they were: test_connect's hostile question ids)
    warehouse = copy_warehouse(sample_run.warehouse, tmp_path / "wh")
    run(str(LOCAL_CONF), str(QUESTIONS), str(warehouse), run_id=SAMPLE_RUN, overrides=index_overrides, spark=spark)
    answers = table(warehouse, "answers")
    assert answers.groupby("run_id").size().to_dict() == {SAMPLE_RUN: 49}
    assert not answers.duplicated(["run_id", "question_id"]).any()
    assert len(table(warehouse, "runs")) == 1
    grades = table(warehouse, "grades")
    assert not grades.duplicated(["run_id", "question_id", "source", "rank"]).any()


def test_counts_observed_while_each_batch_was_written_are_the_stored_rows_counted_again(
    spark, index_overrides, tmp_path, monkeypatch
):
    """The run's totals are summed from what Spark observed while writing each batch; counted again
    over the generation's stored results they are the same."""
    from crag import resume

    real, seen = crag_job.check_invariant, []

    def counted_both_ways(counts, question_ids, plan):
        seen.append((counts, resume.recount(plan), question_ids))
        return real(counts, question_ids, plan)

    monkeypatch.setattr(crag_job, "check_invariant", counted_both_ways)
    sets = [*index_overrides, "spark.batch_questions=10", "spark.batch_seconds=null"]
    result = run(str(LOCAL_CONF), str(QUESTIONS), str(tmp_path), run_id="observed", overrides=sets, spark=spark)
    observed, (recounted, recounted_ids), ids = seen[0]
    assert observed == recounted and ids == recounted_ids
    assert result.counts.accepted == 49 and observed.search_calls > 0


def test_a_question_answered_twice_and_another_not_at_all_breaks_the_row_invariant(spark, tmp_path):
    """As many results as accepted questions is not enough: the ids must be the accepted ones."""
    from crag.counts import aggregates

    wh = Warehouse(spark, str(tmp_path))
    plan = crag_job.RunPlan(CragConfig(), Ledger(wh, CragConfig(), "r", "base"), {}, None)
    rows = [{"run_id": "r", "question_id": q, "question": "?", "input_row": i} for i, q in enumerate("abc")]
    totals = (
        wh.frame("inputs", pa.Table.from_pylist(rows, schema.INPUTS)).agg(*crag_batches.input_totals()).collect()[0]
    )
    plan.input_rows = plan.accepted = int(totals["accepted"])
    plan.question_ids = int(totals["question_ids"])

    def answered(ids: str) -> tuple[RunCounts, int]:
        results = wh.frame("results", pa.Table.from_pylist([{"question_id": q} for q in ids], schema.RESULTS))
        counted = results.agg(*aggregates()).collect()[0].asDict()
        return RunCounts.of_results(counted, plan.input_rows, plan.rejected), int(counted["question_ids"])

    crag_job.check_invariant(*answered("cab"), plan)
    with pytest.raises(CragError, match="not the accepted ones"):
        crag_job.check_invariant(*answered("aab"), plan)


def test_missing_index_fails_before_spark_work(spark, tmp_path):
    with pytest.raises(UnusableIndexError, match="no crag index"):
        run(
            str(LOCAL_CONF),
            str(QUESTIONS),
            str(tmp_path),
            overrides=[f"retriever.index={tmp_path / 'none'}"],
            spark=spark,
        )
    assert not (tmp_path / "results").exists() and not (tmp_path / "runs").exists()


def test_bad_run_id(spark, index_overrides, tmp_path):
    with pytest.raises(CragError, match="invalid run id"):
        run(str(LOCAL_CONF), str(QUESTIONS), str(tmp_path), run_id="x'; drop", overrides=index_overrides, spark=spark)


def test_a_finished_run_shows_only_its_generation_and_the_catalog_names_its_tables(sample_run, spark):
    warehouse = sample_run.warehouse
    runs = table(warehouse, "runs", SAMPLE_RUN)
    shown = runs.loc[0, "shown_generation"]
    assert shown == runs.loc[0, "generation"]
    for stored in ("inputs", "results", "metric_values"):
        assert set(table(warehouse, stored, SAMPLE_RUN)["generation"]) == {shown}, stored
    from crag.warehouse import Warehouse

    wh = Warehouse(spark, str(warehouse))
    assert wh.name("results") == f"delta.`{warehouse.resolve() / 'results'}`"  # its path: nothing registered
    assert wh.load_run("answers", SAMPLE_RUN).count() == 49  # Spark reads what delta-rs reads
    # Each stored table was created empty from crag.schema before its first rows: it has the declared
    # columns, types and nullability, not whatever the first writer's frame happened to have; a view
    # has the declared columns too.
    for name in ("answers", "grades", "decisions", "rejects", "gold", "runs", "metrics", "stage_cache", "results"):
        assert wh.load(name).schema == wh.empty(name).schema, name


def test_a_rerun_keeps_the_old_rows_until_it_has_committed(spark, sample_run, index_overrides, tmp_path, monkeypatch):
    """Re-running a run id that then fails leaves the first run's rows as they were."""
    warehouse = copy_warehouse(sample_run.warehouse, tmp_path / "wh")
    before = table(warehouse, "answers", SAMPLE_RUN)
    import crag.batches

    def broken(*args, **kwargs):
        raise RuntimeError("the second attempt dies")

    monkeypatch.setattr(crag.batches, "run_stages", broken)
    with pytest.raises(RuntimeError, match="second attempt"):
        run(
            str(LOCAL_CONF),
            str(QUESTIONS),
            str(warehouse),
            run_id=SAMPLE_RUN,
            overrides=[*index_overrides, "retriever.k=3"],
            spark=spark,
        )
    after = table(warehouse, "answers", SAMPLE_RUN)
    assert (
        after.sort_values("question_id")
        .reset_index(drop=True)
        .equals(before.sort_values("question_id").reset_index(drop=True))
    )
    assert table(warehouse, "runs", SAMPLE_RUN).loc[0, "status"] == "failed"


def test_a_claim_says_whether_the_run_id_was_new_and_refuses_a_live_holder(spark, tmp_path):
    """The first MERGE only inserts; a run id already in `runs` is read and, when not running, taken over."""
    wh = Warehouse(spark, str(tmp_path))

    def attempt():
        return Ledger(wh, CragConfig(), "claimed", "base")

    first = attempt()
    assert first.claim() is True
    with pytest.raises(CragError, match="is being written by another crag process"):
        attempt().claim()  # this process is alive: its run is not stale
    first.record("failed")
    second = attempt()
    assert second.claim(first.read()) is False
    rows = table(tmp_path, "runs")
    assert rows["attempt"].tolist() == [second.attempt] and rows["status"].tolist() == ["running"]


def test_a_run_that_loses_the_claim_leaves_no_input_rows(spark, tmp_path, index_overrides):
    """The input is stored beside the claim: a run whose id another live process holds stops with the
    holder named, and the input rows it wrote under its generation are gone; the holder's row stays."""
    holder = Ledger(Warehouse(spark, str(tmp_path)), CragConfig(), "held", "base")
    assert holder.claim() is True
    before = table(tmp_path, "runs")
    with pytest.raises(CragError, match="is being written by another crag process"):
        run(str(LOCAL_CONF), str(QUESTIONS), str(tmp_path), run_id="held", overrides=index_overrides, spark=spark)
    inputs = DeltaTable(str(tmp_path / "inputs"))
    assert inputs.to_pandas().empty
    assert any(a["operation"] == "WRITE" for a in inputs.history())  # they were written, then removed
    assert table(tmp_path, "runs").equals(before)


def test_a_run_taken_over_by_another_process_keeps_that_process_row(spark, tmp_path):
    """A process that looked stale and was taken over writes nothing more into `runs`: not a beat, not
    its failure, not its outcome (each would have put the run back in its name over the new holder's)."""
    wh = Warehouse(spark, str(tmp_path))

    def attempt():
        return Ledger(wh, CragConfig(), "held", "base")

    first = attempt()
    first.claim()
    first.record("failed")  # as another process would see a stale run: not running
    second = attempt()
    second.claim(first.read())
    for status in ("running", "failed", "succeeded"):
        with pytest.raises(crag_ledger.RunTakenOver, match="was taken over by another crag process"):
            first.record(status)
    first.record_failure()  # quietly: the run is not its to record
    rows = table(tmp_path, "runs")
    assert rows["attempt"].tolist() == [second.attempt] and rows["status"].tolist() == ["running"]
    version = DeltaTable(str(tmp_path / "runs")).version()
    second.check_held()  # held a moment ago: nothing to prove, nothing written
    assert DeltaTable(str(tmp_path / "runs")).version() == version
    first.held_at = second.held_at = 0.0  # as after a pause longer than half the stale period
    second.check_held()
    assert DeltaTable(str(tmp_path / "runs")).version() == version + 1
    with pytest.raises(crag_ledger.RunTakenOver):
        first.check_held()


def test_a_hold_that_cannot_be_recorded_is_read_back(spark, tmp_path, monkeypatch, caplog):
    """A busy `runs` table can refuse a beat's MERGE after every retry: the run goes on while its row is
    still this attempt's (as a failed beat always did), and stops when it is another's."""
    from crag.warehouse import Merge

    wh = Warehouse(spark, str(tmp_path))
    ledger = Ledger(wh, CragConfig(), "busy", "base")
    ledger.claim()
    execute = Merge.execute

    def busy(self, *args, **kwargs):
        raise RuntimeError("[DELTA_CONCURRENT_APPEND] ConcurrentAppendException: Files were added")

    monkeypatch.setattr(Merge, "execute", busy)
    ledger.held_at = 0.0
    ledger.check_held()  # still this attempt's: a warning, and on
    assert "its hold could not be recorded" in caplog.text
    monkeypatch.setattr(Merge, "execute", execute)
    other = Ledger(wh, CragConfig(), "busy", "base")
    wh.replace("runs", wh.frame("runs", other.row("running")), F.col("run_id") == "busy")
    monkeypatch.setattr(Merge, "execute", busy)
    with pytest.raises(crag_ledger.RunTakenOver):
        ledger.check_held()


def test_a_new_run_with_no_rejects_or_gold_still_leaves_those_tables(spark, index_overrides, tmp_path):
    """A new run commits nothing to a table it has no rows for, yet every table is there to query."""
    questions = tmp_path / "clean.jsonl"
    questions.write_text(
        "\n".join(
            json.dumps({"question_id": f"c{i}", "question": q}) for i, q in enumerate(["How high is Mount Fuji?"] * 3)
        )
    )
    warehouse = tmp_path / "wh"
    result = run(
        str(LOCAL_CONF), str(questions), str(warehouse), run_id="clean", overrides=index_overrides, spark=spark
    )
    assert result.counts.rejected == 0 and len(table(warehouse, "answers")) == 3
    for name in ("rejects", "gold"):
        assert table(warehouse, name).empty
        assert list(table(warehouse, name).columns) == schema.TABLES[name].names


def test_progress_counts_the_questions_each_batch_committed(spark, index_overrides, tmp_path, caplog):
    """Not an estimate: each batch's line counts the rows it committed. The first batch is the first
    spark.batch_questions input rows; the next is sized by the rate measured (here: all the rest)."""
    caplog.set_level(logging.INFO, logger="crag")
    overrides = [*index_overrides, "spark.batch_questions=10", "spark.batch_seconds=100000"]
    result = run(
        str(LOCAL_CONF),
        str(QUESTIONS),
        str(tmp_path),
        run_id="counted",
        overrides=overrides,
        spark=spark,
        progress=False,
    )
    lines = [r.getMessage() for r in caplog.records if " committed: " in r.getMessage()]
    accepted = result.counts.accepted
    inputs = table(tmp_path, "inputs", "counted")
    first = int(((inputs["input_row"] < 10) & inputs["reason"].isna()).sum())
    assert first == 10 and accepted == 49 and len(table(tmp_path, "answers", "counted")) == accepted
    assert lines == [
        f"batch 1 committed: {first} of {accepted} questions answered",
        f"batch 2 committed: {accepted} of {accepted} questions answered",
    ]
    assert set(table(tmp_path, "results", "counted")["batch"]) == {0, 1}


def test_a_run_that_cannot_reach_mlflow_keeps_its_tables_and_its_status(
    spark, index_overrides, tmp_path, monkeypatch, caplog
):
    def unreachable(*args, **kwargs):
        raise ConnectionError("tracking server at https://example.invalid refused the connection")

    monkeypatch.setattr(crag_job, "log_run", unreachable)
    tracked = [*index_overrides, "mlflow.enabled=true"]
    result = run(str(LOCAL_CONF), str(QUESTIONS), str(tmp_path), run_id="untracked", overrides=tracked, spark=spark)
    assert table(tmp_path, "runs", "untracked").loc[0, "status"] == "succeeded"
    assert len(table(tmp_path, "answers", "untracked")) == result.counts.accepted > 0
    assert "run untracked is written, but it was not logged to MLflow (ConnectionError: tracking server" in caplog.text


def test_a_rerun_without_gold_leaves_no_metrics_or_comparisons_of_the_earlier_answers(
    spark, variant_pair, index_overrides, tmp_path
):
    """The sample carries gold columns; answered again without them, the run's old metrics would sit
    beside answers they were not computed from (and `crag compare` would report their deltas). Its
    comparisons with other runs compared answers it no longer has."""
    warehouse = copy_warehouse(variant_pair.warehouse, tmp_path / "wh")
    gold, kept = variant_pair.base, variant_pair.candidate  # both answered the sample, gold columns and all
    assert set(table(warehouse, "metrics")["run_id"]) == {gold, kept}
    for base, candidate in ((gold, kept), (kept, gold), (kept, kept)):
        compare(Warehouse(spark, str(warehouse)), base, candidate, tmp_path / "report.html", attach_report=False)
    pairs = {tuple(p) for p in table(warehouse, "comparisons")[["base_run", "candidate_run"]].to_numpy()}
    assert pairs == {(gold, kept), (kept, gold), (kept, kept)}
    plain = tmp_path / "plain.jsonl"
    rows = [json.loads(line) for line in QUESTIONS.read_text().splitlines() if line.strip()]
    plain.write_text("\n".join(json.dumps({k: r[k] for k in ("question_id", "question") if k in r}) for r in rows))
    run(str(LOCAL_CONF), str(plain), str(warehouse), run_id=gold, overrides=index_overrides, spark=spark)
    assert set(table(warehouse, "metrics")["run_id"]) == {kept}
    assert gold not in set(table(warehouse, "gold")["run_id"])
    pairs = {tuple(p) for p in table(warehouse, "comparisons")[["base_run", "candidate_run"]].to_numpy()}
    assert pairs == {(kept, kept)}


def test_a_failed_run_is_recorded_from_a_thread_of_its_own_when_the_main_threads_call_fails(
    spark, index_overrides, tmp_path, monkeypatch, caplog
):
    """A Ctrl-C or SIGTERM can leave the main thread's connection to the JVM inside a call: recording
    the failure is tried again on another thread, and said in a warning if that fails too."""
    import threading

    def broken(*args, **kwargs):
        raise RuntimeError("the batch dies")

    real_record = Ledger.record

    def record(self, status, *args, **kwargs):
        if status == "failed" and (threading.current_thread() is threading.main_thread() or self.run_id == "lost"):
            raise ConnectionError("the main thread's JVM connection is mid-call")
        return real_record(self, status, *args, **kwargs)

    monkeypatch.setattr(crag_batches, "run_stages", broken)
    monkeypatch.setattr(Ledger, "record", record)
    for run_id in ("kept", "lost"):
        with pytest.raises(RuntimeError, match="the batch dies"):
            run(str(LOCAL_CONF), str(QUESTIONS), str(tmp_path), run_id=run_id, overrides=index_overrides, spark=spark)
    assert table(tmp_path, "runs", "kept").loc[0, "status"] == "failed"
    assert table(tmp_path, "runs", "lost").loc[0, "status"] == "running"
    assert "run lost could not be recorded as failed (ConnectionError: the main thread's JVM connection" in caplog.text
