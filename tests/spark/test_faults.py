"""Faults on every endpoint lose nothing: every question ends in an answer or in route=error with its
error text, accepted + rejected = input rows, and retries and errors are counted."""

import json
import re

import pandas as pd

from bench.faults import run_scenario
from tests.support import REPO, SAMPLE, run_rows


def test_twenty_percent_faults_on_every_endpoint(spark, tmp_path, restore_env):
    # A call fails for good only when all its attempts fail: 0.2**5 = 3.2e-4 with the config's five, so
    # over the run's ~230 calls (275 requests with retries) about 7% of runs left a question in error
    # (seen once in a fresh clone); with eight, 2.6e-6 per call. Each Spark task's open of the index is
    # such a call too. When it gave up after two hangs (1 in 225 opens at a hang rate of 1/15), as the
    # driver's first open does, about 1% of runs failed (seen once in CI); the driver's open is let
    # through (bench.faults).
    report = run_scenario(0.2, str(SAMPLE / "questions.jsonl"), tmp_path, spark=spark, hang_s=1.5, max_attempts=8)
    assert sum(report["faults_injected"].values()) > 0.1 * report["requests"]
    assert {"429", "500", "hang"} <= set(report["faults_injected"])
    assert report["rows_lost"] == 0 and report["duplicates"] == 0 and report["unanswered_without_error"] == 0
    assert report["accepted"] + report["rejected"] == report["questions"] == 51
    assert report["retries"] > 0
    # Eight attempts per call absorb a 20% fault rate: no question ends in an error.
    assert report["errors"] == 0 and "error" not in report["routes"]
    # The summary's figures are the tables' counts (report: read from the answers and rejects tables).
    summary = report["summary"]
    questions = re.search(r"^  questions   (\d+): (\d+) accepted, (\d+) rejected$", summary, re.M)
    assert questions and tuple(map(int, questions.groups())) == (
        report["questions"],
        report["accepted"],
        report["rejected"],
    )
    assert re.search(r"^  errors      (\d+)$", summary, re.M).group(1) == str(report["errors"])
    assert int(re.search(r"^  calls .*, (\d+) retries,", summary, re.M).group(1)) == report["retries"]
    routes = re.search(r"^  routes      (.*)$", summary, re.M).group(1)
    assert dict((name, int(n)) for name, n in (part.split(" ") for part in routes.split(", "))) == report["routes"]


def test_an_endpoint_that_always_fails_errors_its_questions_and_the_job_goes_on(spark, emulator, tmp_path):
    from crag.job import run

    emulator.behaviour["serving"].fault_rates = {"500": 1.0}
    fast = [
        f"{role}.policy.{key}"
        for role in ("grader", "rewriter", "generator")
        for key in ("max_attempts=2", "backoff_initial_s=0.01")
    ]
    result = run(
        str(REPO / "conf" / "databricks.yaml"),
        str(SAMPLE / "questions.jsonl"),
        str(tmp_path),
        run_id="down",
        overrides=fast,
        spark=spark,
    )
    answers = run_rows(result.warehouse, "answers", result.run_id)
    assert len(answers) == 49
    errored = answers[answers["route"] == "error"]
    # every question that needed the model failed, with the reason; the others (nothing retrieved,
    # nothing found on the web) were refused without a model call
    assert len(errored) > 0 and errored["error"].str.contains("500").all()
    assert set(answers["route"]) <= {"error", "refused"}
    assert result.counts.errors == len(errored) and result.counts.retries > 0
    assert "errors      " + str(len(errored)) in result.summary()
    assert pd.Series(answers["question_id"]).is_unique


def test_a_run_whose_every_question_ended_in_an_error_is_recorded_as_failed(spark, emulator, tmp_path, capsys):
    """Its command fails (a scheduled job's task with it). A new run's tables get its error rows; a
    re-run of an id keeps the id's earlier rows, as any failed re-run does."""
    from crag.cli import main

    fast = [
        f"--set={role}.policy.{key}"
        for role in ("grader", "rewriter", "generator", "web_search")
        for key in ("max_attempts=1", "backoff_initial_s=0.01")
    ]
    sample = [json.loads(line) for line in (SAMPLE / "questions.jsonl").read_text(encoding="utf-8").splitlines()]
    questions = tmp_path / "questions.jsonl"
    questions.write_text("".join(json.dumps(q) + "\n" for q in sample[:8] if str(q["question"]).strip()))
    n = len(questions.read_text().splitlines())
    args = ["run", "--conf", str(REPO / "conf" / "databricks.yaml"), "--questions", str(questions)]
    args += ["--warehouse", str(tmp_path / "wh"), "--no-cache", *fast]  # the first run's cache would answer the others
    assert main([*args, "--run-id", "kept"]) == 0
    before = run_rows(tmp_path / "wh", "answers", "kept").sort_values("question_id", ignore_index=True)
    for service in ("serving", "tavily"):
        emulator.behaviour[service].fault_rates = {"500": 1.0}
    capsys.readouterr()
    for run_id, where in (
        ("all-down", "its answers table has each one"),
        ("kept", "its tables were left as they were"),
    ):
        assert main([*args, "--run-id", run_id]) == 2
        out, err = capsys.readouterr()
        assert re.search(rf"^  errors      {n}$", out, re.M)
        [line] = err.strip().splitlines()[-1:]
        assert line.startswith(
            f"crag: error: run {run_id} is recorded as failed: every one of its {n} accepted questions ended in an "
            f"error ({where}; one of them: "
        ), line
        assert "500" in line and line.endswith(f"): once that is mended, answer it again with --run-id {run_id}")
        [row] = run_rows(tmp_path / "wh", "runs", run_id).to_dict("records")
        assert row["status"] == "failed" and dict(row["counts"])["errors"] == n
    answers = run_rows(tmp_path / "wh", "answers", "all-down")
    assert len(answers) == n > 5 and (answers["route"] == "error").all()
    after = run_rows(tmp_path / "wh", "answers", "kept").sort_values("question_id", ignore_index=True)
    assert after.equals(before) and not (after["route"] == "error").any()
