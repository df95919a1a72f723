"""Every Spark command on Spark Connect, as Databricks serverless runs jobs, beside classic Spark: the
sample answered on both alike, then eval, compare and calibrate on Connect; hostile ids on both. The
server is Spark's own SparkConnectServer (the run's warm one, tests/conftest.py), Delta configured as
crag configures it; the tables are read back with delta-rs. Connect alone: tests/slow/test_connect.py."""

from __future__ import annotations

import json

import pandas as pd

from tests.support import LOCAL_CONF, SAMPLE_RUN, copy_warehouse, crag_on, crag_run_args, run_rows


def test_run_eval_and_compare_on_connect_match_classic_spark(connect_url, sample_run, index_overrides, tmp_path):
    """The sample run on classic Spark (the session's), then on Connect into (a copy of) its warehouse
    (answered afresh, not from the classic run's stored results): the same answers; then `eval`,
    `compare` (the classic run as the base) and `calibrate` on Connect."""
    warehouse, classic = copy_warehouse(sample_run.warehouse, tmp_path / "wh"), SAMPLE_RUN
    # the stage cache off: the classic run's stored results would otherwise answer the Connect run
    done = crag_on(
        connect_url,
        *crag_run_args(warehouse, "--run-id", "connect", overrides=[*index_overrides, "cache.enabled=false"]),
    )
    assert "51: 49 accepted, 2 rejected" in done.stdout

    def rows(name, run_id):
        df = run_rows(warehouse, name)
        return df[df["run_id"] == run_id].drop(columns="run_id")

    ours, theirs = rows("answers", "connect"), rows("answers", classic)
    columns = ["question_id", "answer", "action", "route", "n_retrieved", "n_relevant", "n_web"]
    key = "question_id"
    assert (
        len(ours) == 49
        and ours["cache_hits"].sum() == 0
        and (
            ours[columns]
            .sort_values(key)
            .reset_index(drop=True)
            .equals(theirs[columns].sort_values(key).reset_index(drop=True))
        )
    )
    assert len(rows("grades", "connect")) == len(rows("grades", classic))
    assert sorted(rows("rejects", "connect")["reason"]) == sorted(rows("rejects", classic)["reason"])
    assert rows("runs", "connect")["status"].tolist() == ["succeeded"]

    evaluated = crag_on(connect_url, "eval", "--warehouse", str(warehouse), "--run", "connect", "--format", "csv")
    metrics = pd.read_csv(pd.io.common.StringIO(evaluated.stdout))
    assert set(metrics["metric"]) == set(rows("metrics", "connect")["metric"])
    report = tmp_path / "report.html"
    crag_on(
        connect_url,
        "compare",
        "--warehouse",
        str(warehouse),
        "--base",
        classic,
        "--candidate",
        "connect",
        "--report",
        str(report),
        "--no-mlflow",
    )
    comparisons = run_rows(warehouse, "comparisons")
    assert report.exists() and set(comparisons["candidate_run"]) == {"connect"}
    # the same answers: compare on Connect finds every question in both runs and nothing changed
    assert len(comparisons) == 49 and comparisons[["in_base", "in_candidate"]].all().all()
    assert not comparisons[["answer_changed", "action_flip", "route_flip"]].any().any()
    calibrated = crag_on(connect_url, "calibrate", "--warehouse", str(warehouse), "--run", "connect")
    assert "routing" in calibrated.stdout


def test_a_question_id_built_to_inject_sql_touches_no_other_run(
    connect_url, spark, sample_run, index_overrides, tmp_path
):
    """Ids full of quotes, backslashes and SQL keywords are values in column expressions, never SQL text:
    re-running one run leaves every other run's rows (the sample's, the bystander) as they were (classic
    and Connect)."""
    hostile = ["\\'') OR 1=1 --", "x' OR '1'='1", "a`; DROP TABLE answers; --", "\\\\' OR run_id <> '", 'q") OR (1=1']
    path = tmp_path / "hostile.jsonl"
    path.write_text("\n".join(json.dumps({"question_id": q, "question": "How high is Mount Fuji?"}) for q in hostile))
    warehouse, bystander = copy_warehouse(sample_run.warehouse, tmp_path / "wh"), SAMPLE_RUN
    from crag.job import run

    base = [*index_overrides]
    before = run_rows(warehouse, "answers")
    for attempt in range(2):  # the second time replaces the hostile run's own rows
        run(str(LOCAL_CONF), str(path), str(warehouse), run_id="hostile", overrides=base, spark=spark)
    crag_on(
        connect_url,
        *crag_run_args(warehouse, "--run-id", "hostile", questions=path, overrides=base),
    )
    after = run_rows(warehouse, "answers")
    kept = after[after["run_id"] == bystander].sort_values("question_id").reset_index(drop=True)
    assert kept.equals(before[before["run_id"] == bystander].sort_values("question_id").reset_index(drop=True))
    assert sorted(after[after["run_id"] == "hostile"]["question_id"]) == sorted(hostile)
