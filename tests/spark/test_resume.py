"""A run that dies mid-way resumes: no duplicate rows, and no backend call for questions already
stored."""

import json
import logging
import os
import subprocess
import sys
import threading

import pandas as pd
import pytest
from pyspark.sql import functions as F

from crag import batches as crag_batches
from crag import job as crag_job
from crag.config import CragConfig
from crag.errors import CragError
from crag.job import run
from crag.ledger import Ledger, RunTakenOver
from tests.support import (
    LOCAL_CONF,
    REPO,
    SAMPLE,
    SAMPLE_RUN,
    committed_questions,
    copy_warehouse,
    crag_run_args,
    killed_once_committed,
    run_rows,
)

QUESTIONS = SAMPLE / "questions.jsonl"
table = run_rows


def run_sample(spark, warehouse, run_id: str, overrides: list[str], questions=QUESTIONS, resume: bool = False):
    """crag run of conf/local.yaml on `questions` (the sample's) into `warehouse`."""
    return run(
        str(LOCAL_CONF), str(questions), str(warehouse), run_id=run_id, overrides=overrides, spark=spark, resume=resume
    )


def resume_sample(spark, warehouse, run_id: str, overrides: list[str], questions=QUESTIONS):
    return run_sample(spark, warehouse, run_id, overrides, questions, resume=True)


def run_stages_dying_on(batch_number: int, sent: list[list[str]]):
    """crag.job.run_stages that raises "driver lost" when it is given its `batch_number`-th batch, once;
    `sent` gets each batch's question ids."""
    real, failures = crag_batches.run_stages, [batch_number]

    def stages(batch, *args):
        sent.append([r["question_id"] for r in batch.select("question_id").collect()])
        if failures and len(sent) == failures[0]:
            failures.clear()
            raise RuntimeError("driver lost")
        return real(batch, *args)

    return stages


def test_resume_after_a_failure_mid_run(spark, tmp_path, index_overrides, monkeypatch):
    sent: list[list[str]] = []
    monkeypatch.setattr(crag_batches, "run_stages", run_stages_dying_on(3, sent))
    sets = [*index_overrides, "spark.batch_questions=10", "spark.batch_seconds=null"]
    with pytest.raises(RuntimeError, match="driver lost"):
        run_sample(spark, tmp_path, "r1", sets)
    assert table(tmp_path, "runs").loc[0, "status"] == "failed"
    answered = committed_questions(tmp_path, "r1")  # committed batches, not yet shown
    assert answered == set(sent[0] + sent[1])
    assert table(tmp_path, "answers").empty  # nothing half-done is shown

    sent.clear()
    result = resume_sample(spark, tmp_path, "r1", sets)
    resent = {q for batch in sent for q in batch}
    assert not resent & answered  # nothing already stored went to the backends again
    assert len(resent) == 49 - len(answered)
    answers, grades = table(tmp_path, "answers"), table(tmp_path, "grades")
    assert len(answers) == 49 and answers["question_id"].is_unique
    assert not grades.duplicated(["question_id", "source", "rank"]).any()
    assert len(table(tmp_path, "rejects")) == 2
    assert table(tmp_path, "runs").loc[0, "status"] == "succeeded" and result.counts.accepted == 49


def test_resume_after_a_failure_while_finalising(spark, tmp_path, index_overrides, monkeypatch):
    """A run that fails after its every batch is committed (its metrics stored, its outcome not) is
    resumed: it answers nothing again, stores its metrics once, and shows each of its rows once."""
    from crag.evaluation import store_metrics

    def stored_then_lost(*args, **kwargs):
        store_metrics(*args, **kwargs)
        raise RuntimeError("driver lost")

    monkeypatch.setattr(crag_batches, "store_metrics", stored_then_lost)
    with pytest.raises(RuntimeError, match="driver lost"):
        run_sample(spark, tmp_path, "r5", index_overrides)
    monkeypatch.undo()
    assert table(tmp_path, "answers").empty and table(tmp_path, "metrics").empty  # none of it is shown yet
    assert len(committed_questions(tmp_path, "r5")) == 49
    stored_metrics = len(table(tmp_path, "metric_values"))

    sent: list[list[str]] = []
    monkeypatch.setattr(crag_batches, "run_stages", run_stages_dying_on(0, sent))
    resume_sample(spark, tmp_path, "r5", index_overrides)
    assert sent == []  # every question had its answer committed
    answers, grades, decisions = (table(tmp_path, name) for name in ("answers", "grades", "decisions"))
    assert len(answers) == 49 and answers["question_id"].is_unique
    assert len(grades) and not grades.duplicated(["question_id", "source", "rank"]).any()
    assert len(decisions) > 0 and len(table(tmp_path, "metrics")) == stored_metrics > 0
    assert len(table(tmp_path, "rejects")) == 2
    assert table(tmp_path, "runs").loc[0, "status"] == "succeeded"


def test_a_failure_while_the_input_is_checked_leaves_the_run_failed_not_running(
    spark, sample_run, tmp_path, index_overrides, monkeypatch
):
    """The run id is claimed before its input is read and checked (as Spark writes it): a failure
    there records `failed`, also over an earlier succeeded run of the same id (the session's sample
    run, whose rows stay shown), and `--resume` checks and writes the input then (it was never
    committed: no 'other questions' to refuse)."""
    from crag.warehouse import Warehouse

    warehouse = copy_warehouse(sample_run.warehouse, tmp_path / "wh")
    real = Warehouse.append_observed

    def append_observed(self, table, df, aggregates):
        if table == "inputs":
            raise RuntimeError("worker lost while checking the input")
        return real(self, table, df, aggregates)

    monkeypatch.setattr(Warehouse, "append_observed", append_observed)
    with pytest.raises(RuntimeError, match="worker lost"):
        run_sample(spark, warehouse, SAMPLE_RUN, index_overrides)
    runs = table(warehouse, "runs")
    assert list(runs["status"]) == ["failed"] and runs.loc[0, "finished_at"] is not None
    assert len(table(warehouse, "answers")) == 49  # the earlier run's answers are kept
    monkeypatch.undo()
    result = resume_sample(spark, warehouse, SAMPLE_RUN, index_overrides)
    assert (result.counts.input_rows, result.counts.accepted, result.counts.rejected) == (51, 49, 2)
    assert list(table(warehouse, "runs")["status"]) == ["succeeded"] and len(table(warehouse, "answers")) == 49


def test_a_batch_committed_after_its_process_stopped_is_kept_once(
    spark, tmp_path, index_overrides, monkeypatch, caplog
):
    """On Spark Connect a killed client's last write can still commit after `--resume` has answered its
    questions again: the run finalises with each question once and says so."""
    from crag.warehouse import Warehouse

    monkeypatch.setattr(crag_batches, "run_stages", run_stages_dying_on(2, []))
    sets = [*index_overrides, "spark.batch_questions=25", "spark.batch_seconds=null"]
    with pytest.raises(RuntimeError, match="driver lost"):
        run_sample(spark, tmp_path, "z1", sets)
    wh = Warehouse(spark, str(tmp_path))
    late = wh.load_run("results", "z1").limit(3).toArrow()  # the same questions, committed once more
    wh.append("results", spark.createDataFrame(late))
    with caplog.at_level(logging.WARNING, logger="crag"):
        result = resume_sample(spark, tmp_path, "z1", sets)
    assert "3 questions were answered twice" in caplog.text
    answers = table(tmp_path, "answers")
    assert len(answers) == 49 and answers["question_id"].is_unique
    assert result.counts.accepted == 49
    assert not table(tmp_path, "grades").duplicated(["question_id", "source", "rank"]).any()


def test_resume_refuses_a_different_config(spark, sample_run, tmp_path, index_overrides):
    warehouse = copy_warehouse(sample_run.warehouse, tmp_path / "wh")  # a refused resume must write nothing
    with pytest.raises(
        CragError, match=r"was started with config .*, differing in retriever\.k: resume with the same --conf"
    ):
        resume_sample(spark, warehouse, SAMPLE_RUN, [*index_overrides, "retriever.k=3"])
    with pytest.raises(CragError, match="no run 'nope' to resume"):
        resume_sample(spark, warehouse, "nope", index_overrides)
    before = table(warehouse, "runs", SAMPLE_RUN)
    with pytest.raises(CragError, match="has already succeeded: nothing to resume$"):
        resume_sample(spark, warehouse, SAMPLE_RUN, index_overrides)
    after = table(warehouse, "runs", SAMPLE_RUN)
    assert after.equals(before) and after.loc[0, "status"] == "succeeded"  # a refused resume writes nothing


def test_resume_refuses_other_questions(spark, tmp_path, index_overrides, monkeypatch):
    """--resume over input that changed (a question edited, a row removed, rows reordered) is refused,
    saying which."""

    def dies(*args, **kwargs):
        raise RuntimeError("killed")

    monkeypatch.setattr(crag_batches, "run_stages", dies)
    with pytest.raises(RuntimeError):
        run_sample(spark, tmp_path, "r3", index_overrides)
    monkeypatch.undo()
    rows = [json.loads(line) for line in QUESTIONS.read_text().splitlines() if line.strip()]
    edited = tmp_path / "edited.jsonl"
    rows[0]["question"] = "A different question?"
    edited.write_text("\n".join(json.dumps(r, ensure_ascii=False) for r in rows[:-1]))
    with pytest.raises(
        CragError, match=r"started on other questions: 1 row\(s\) here are not in its input and 2 of its rows"
    ):
        resume_sample(spark, tmp_path, "r3", index_overrides, questions=edited)
    # the same rows, two of them swapped: said as such, not as other questions
    rows = [json.loads(line) for line in QUESTIONS.read_text().splitlines() if line.strip()]
    rows[0], rows[1] = rows[1], rows[0]
    swapped = tmp_path / "swapped.jsonl"
    swapped.write_text("\n".join(json.dumps(r, ensure_ascii=False) for r in rows))
    with pytest.raises(CragError, match=r"started on these questions in another order \(2 row\(s\) moved\)"):
        resume_sample(spark, tmp_path, "r3", index_overrides, questions=swapped)
    result = resume_sample(spark, tmp_path, "r3", index_overrides)
    assert result.counts.accepted == 49


@pytest.mark.slow
def test_sigkill_of_the_driver_then_resume(spark, emulator, sample_indexes, tmp_path, capsys):
    """A real `crag run` process tree (driver, JVM, Python workers) is killed with SIGKILL once its
    first batch is committed; `crag run --resume` then finishes the run. (The resume runs in this
    process, on the suite's session: a second process would add a JVM's start-up and nothing tested.)"""
    from crag.cli import main

    emulator.behaviour["serving"].latency_s = 0.03  # slow enough to kill mid-way
    warehouse, work = tmp_path / "wh", tmp_path / "work"
    work.mkdir()
    args = crag_run_args(
        warehouse,
        questions=QUESTIONS,
        conf=REPO / "conf" / "openai.yaml",
        overrides=[
            f"retriever.index={sample_indexes['kb']}",
            f"web_search.index={sample_indexes['web']}",
            "retriever.k=3",  # fewer grading requests per question: the test is about which questions ask
            "spark.batch_questions=16",
            "spark.batch_seconds=null",
            "mlflow.enabled=false",
        ],
    )
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable}
    first = subprocess.Popen(
        [sys.executable, "-m", "crag.cli", *args, "--run-id", "killed"],
        cwd=work,
        env=env,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    done = killed_once_committed(first, warehouse, "killed", 16, within_s=240)
    assert 16 <= len(done) < 49
    runs = table(warehouse, "runs")
    assert runs.loc[0, "status"] == "running"  # nobody could mark it otherwise
    # crag's local tables are external: Spark's own warehouse folder went to the temporary directory
    assert list(work.iterdir()) == []

    emulator.reset()
    capsys.readouterr()
    assert main([*args, "--resume", "killed"]) == 0, capsys.readouterr().err[-2000:]
    assert f"resuming: {len(done)} questions already answered" in capsys.readouterr().err
    # no request of the resumed run concerns a question that was already answered
    questions = pd.read_json(QUESTIONS, lines=True).drop_duplicates("question_id").set_index("question_id")["question"]
    bodies = [json.dumps(r.body, ensure_ascii=False) for r in emulator.requests]
    assert bodies
    for qid in done:
        text = json.dumps(questions[qid], ensure_ascii=False)[1:-1]
        assert not any(text in b for b in bodies), qid
    answers = table(warehouse, "answers")
    assert len(answers) == 49 and answers["question_id"].is_unique
    grades = table(warehouse, "grades")
    assert not grades.duplicated(["question_id", "source", "rank"]).any()
    assert table(warehouse, "runs").loc[0, "status"] == "succeeded"


def test_a_run_taken_over_while_it_answers_stops_before_writing_its_tables(
    spark, tmp_path, index_overrides, monkeypatch
):
    """Another process takes the run over while a batch runs (this one looked stale to it): the next beat
    finds out, and the run stops after the batch instead of writing the run's tables and its outcome
    over the new holder's."""
    from crag.warehouse import Warehouse

    append_observed, record = Warehouse.append_observed, Ledger.record
    taken_by = []
    # The other process's write lands between two of this one's beats. Unordered, it lost every retry
    # to beats that followed each other as fast as this one's MERGEs commit (a slow machine, beats every
    # 0.2 s), and the test failed with Delta's conflict instead of reaching the takeover.
    between_beats = threading.Lock()

    def recorded_between_takeovers(self, *args, **kwargs):
        with between_beats:
            return record(self, *args, **kwargs)

    def taken_over_meanwhile(self, table, df, aggregates):
        if table == "results" and not taken_by:
            other = Ledger(self, CragConfig(), "taken", "base")
            with between_beats:
                self.replace("runs", self.frame("runs", other.row("running")), F.col("run_id") == "taken")
            taken_by.append(other.attempt)
            threading.Event().wait(1.5)  # several beats (every 0.2 s) while the batch runs
        return append_observed(self, table, df, aggregates)

    monkeypatch.setattr(Ledger, "record", recorded_between_takeovers)
    monkeypatch.setattr(Warehouse, "append_observed", taken_over_meanwhile)
    with pytest.raises(RunTakenOver, match="'taken' was taken over by another crag process"):
        run_sample(spark, tmp_path, "taken", [*index_overrides, "tables.stale_run_after_s=0.6"])
    runs = table(tmp_path, "runs")
    assert runs["attempt"].tolist() == taken_by and runs["status"].tolist() == ["running"]
    assert table(tmp_path, "answers").empty


def test_the_heartbeat_goes_on_until_the_outcome_is_recorded(spark, tmp_path, index_overrides, monkeypatch):
    """A large run's metrics take minutes after its last batch: the run must not look stale to another
    process then (which could take it over in the middle), so the heartbeat goes on until its outcome
    is recorded."""
    from crag.evaluation import store_metrics

    record = Ledger.record
    statuses: list[str] = []
    evaluating, beat_while_evaluating = threading.Event(), threading.Event()

    def recorded(self, status, *args, **kwargs):
        record(self, status, *args, **kwargs)
        statuses.append(status)
        if status == "running" and evaluating.is_set():
            beat_while_evaluating.set()

    def slow(*args, **kwargs):
        metrics = store_metrics(*args, **kwargs)
        # a long evaluation: it lasts until a beat has been recorded, however long a beat's commit takes on
        # this machine (one took 2.7 s on CI's); without a heartbeat here it gives up after a minute
        evaluating.set()
        beat_while_evaluating.wait(60)
        evaluating.clear()
        return metrics

    monkeypatch.setattr(Ledger, "record", recorded)
    monkeypatch.setattr(crag_batches, "store_metrics", slow)
    overrides = [*index_overrides, "tables.stale_run_after_s=0.6"]  # a beat every 0.2 s
    run_sample(spark, tmp_path, "hb", overrides)
    assert beat_while_evaluating.is_set(), statuses
    assert statuses[-1] == "succeeded"  # no beat after the outcome


def test_a_resume_never_changes_a_live_or_finished_run(spark, tmp_path, index_overrides, monkeypatch):
    """`--resume` of a run that another process is writing (claimed, answering, finalising) or that has
    succeeded is refused, and leaves the run's record and rows as they were, whichever moment it comes
    at (it once took a run over as it finished, and recorded the succeeded run as failed)."""
    from crag import ledger as crag_ledger
    from crag.errors import CragError as Refused

    phases = ["claimed", "answering", "finalising"]
    reached = {phase: threading.Event() for phase in phases}
    go_on = {phase: threading.Event() for phase in phases}

    def pause(phase: str) -> None:
        reached[phase].set()
        assert go_on[phase].wait(300), phase

    claim, commit, conclude = crag_ledger.Ledger.claim, crag_batches._commit, crag_job.conclude

    def claimed(self, *args, **kwargs):
        held = claim(self, *args, **kwargs)
        if threading.current_thread() is not threading.main_thread():  # the original run's hold thread
            pause("claimed")
        return held

    def committing(*args, **kwargs):
        pause("answering")
        return commit(*args, **kwargs)

    def concluding(*args, **kwargs):
        pause("finalising")
        return conclude(*args, **kwargs)

    monkeypatch.setattr(crag_ledger.Ledger, "claim", claimed)
    monkeypatch.setattr(crag_batches, "_commit", committing)
    monkeypatch.setattr(crag_job, "conclude", concluding)
    outcome: list = []
    original = threading.Thread(target=lambda: outcome.append(run_sample(spark, tmp_path, "live", index_overrides)))
    original.start()

    def rows() -> tuple[pd.DataFrame, ...]:
        # in one order: delta-rs reads a table's files in whatever order its threads finish them
        return tuple(
            frame.sort_values(key).reset_index(drop=True)
            for frame, key in (
                (table(tmp_path, "runs", "live"), "attempt"),
                (table(tmp_path, "results", "live"), "question_id"),
                (table(tmp_path, "answers"), "question_id"),
            )
        )

    def unchanged_by_a_resume(refusal: str) -> None:
        before = rows()
        with pytest.raises(Refused, match=refusal):
            resume_sample(spark, tmp_path, "live", index_overrides)
        for was, now in zip(before, rows()):
            assert now.equals(was)

    try:
        for phase in phases:
            assert reached[phase].wait(300), phase
            unchanged_by_a_resume("is being written by another crag process")
            assert table(tmp_path, "runs", "live").loc[0, "status"] == "running"
            go_on[phase].set()
    finally:
        for event in go_on.values():
            event.set()
        original.join(300)
    assert outcome and outcome[0].status == "succeeded"
    unchanged_by_a_resume("has already succeeded: nothing to resume")
    assert table(tmp_path, "runs", "live").loc[0, "status"] == "succeeded"
    assert len(table(tmp_path, "answers", "live")) == 49
