"""crag eval and crag calibrate on a run of the sample, through the Warehouse."""

import json

from crag.cli import main
from tests.support import SAMPLE_RUN, copy_warehouse, crag_run_args, run_rows


def test_eval_and_calibrate_commands_on_the_sample(spark, sample_run, tmp_path, capsys):
    assert "quality against the gold columns" in sample_run.out
    gold = SAMPLE_RUN
    warehouse = copy_warehouse(sample_run.warehouse, tmp_path / "wh")
    assert main(["eval", "--warehouse", str(warehouse), "--run", gold]) == 0
    out = capsys.readouterr().out
    assert "routing_accuracy" in out and "language=ja" in out
    from deltalake import DeltaTable

    metrics = run_rows(warehouse, "metrics")
    assert set(metrics["run_id"]) == {gold} and not metrics.duplicated(["metric", "slice"]).any()
    routing = metrics[(metrics["metric"] == "routing_accuracy") & (metrics["slice"] == "all")]
    assert routing["n"].iloc[0] == 49 and routing["value"].iloc[0] >= 0.9
    assert main(["calibrate", "--warehouse", str(warehouse), "--run", gold]) == 0
    out = capsys.readouterr().out
    assert "proposed lower" in out and "--set routing.policy=thresholds" in out and "grader yes/no threshold" in out
    # computed in Spark (the driver receives sums by value), it is what the pure function gives over
    # the run's whole frames
    from crag.calibration import calibrate, report

    config = json.loads(DeltaTable(str(warehouse / "runs")).to_pandas()["config"].iloc[0])
    frames = {name: run_rows(warehouse, name) for name in ("grades", "gold")}
    routing, grader = config["routing"], config["grader"]
    local = calibrate(
        frames["grades"], frames["gold"], routing["lower"], routing["upper"], grader["threshold"], routing["policy"]
    )
    assert out.strip() == report(local) and "semantic grader weights per language" in out
    assert main(["calibrate", "--warehouse", str(warehouse), "--run", "nosuch"]) == 2
    assert capsys.readouterr().err == f"crag: error: no run 'nosuch' in {warehouse}\n"
    assert main(["calibrate", "--warehouse", str(tmp_path / "nowh"), "--run", gold]) == 2
    assert capsys.readouterr().err == f"crag: error: no warehouse at {tmp_path / 'nowh'}: the folder does not exist\n"

    # a run that has not succeeded (a failed re-run keeps the earlier attempt's rows): refused unless asked
    DeltaTable(str(warehouse / "runs")).update({"status": "'failed'"}, predicate=f"run_id = '{gold}'")
    # eval, and calibrate too: the failed run's row may hold a later attempt's config beside earlier grades
    for command, doing, shown in (
        ("eval", "evaluate", "routing_accuracy"),
        ("calibrate", "calibrate", "proposed lower"),
    ):
        assert main([command, "--warehouse", str(warehouse), "--run", gold]) == 2
        assert capsys.readouterr().err == (
            f"crag: error: run '{gold}' has not succeeded (status failed): {doing} it when it has, "
            f"or pass --allow-unfinished to {doing} the rows it has\n"
        )
        assert main([command, "--warehouse", str(warehouse), "--run", gold, "--allow-unfinished"]) == 0
        assert shown in capsys.readouterr().out
    report = str(tmp_path / "r.html")
    assert (
        main(["compare", "--warehouse", str(warehouse), "--base", gold, "--candidate", gold, "--report", report]) == 2
    )
    assert "has not succeeded (status failed): compare it when" in capsys.readouterr().err


def test_eval_without_gold_is_a_clear_error(spark, tmp_path, index_overrides, capsys):
    questions = tmp_path / "q.jsonl"
    questions.write_text('{"question_id": "1", "question": "How high is Mount Fuji?"}\n')
    assert (
        main(crag_run_args(tmp_path / "w", "--run-id", "nogold", questions=questions, overrides=index_overrides)) == 0
    )
    capsys.readouterr()
    assert main(["eval", "--warehouse", str(tmp_path / "w"), "--run", "nogold"]) == 2
    assert "has no gold columns" in capsys.readouterr().err


def test_eval_counts_the_questions_without_gold_in_the_metrics_that_need_none(spark, tmp_path, index_overrides, capsys):
    """A JSONL line without gold keys has no gold row: its refusal and web search still count."""
    questions = tmp_path / "q.jsonl"
    questions.write_text(
        '{"question_id": "1", "question": "How high is Mount Fuji?", "expected_route": "web"}\n'
        '{"question_id": "2", "question": "How often should the HEPA-13 main filter be replaced?"}\n'
    )
    assert main(crag_run_args(tmp_path / "w", "--run-id", "some", questions=questions, overrides=index_overrides)) == 0
    capsys.readouterr()
    from deltalake import DeltaTable

    # a slice name no run can have is said before any metric is written
    version = DeltaTable(str(tmp_path / "w" / "metric_values")).version()
    assert main(["eval", "--warehouse", str(tmp_path / "w"), "--run", "some", "--slices", "all,langauge"]) == 2
    assert capsys.readouterr().err.startswith("crag: error: unknown slice 'langauge': a slice is all, or one of route")
    # and so is a value no run can have (it was refused after the metrics were computed and written)
    assert main(["eval", "--warehouse", str(tmp_path / "w"), "--run", "some", "--slices", "answerable=true"]) == 2
    assert capsys.readouterr().err == "crag: error: unknown slice 'answerable=true': answerable is one of yes, no\n"
    assert DeltaTable(str(tmp_path / "w" / "metric_values")).version() == version
    assert (
        main(["eval", "--warehouse", str(tmp_path / "w"), "--run", "some", "--slices", "all", "--format", "json"]) == 0
    )
    n = {row["metric"]: row["n"] for row in map(json.loads, capsys.readouterr().out.splitlines())}
    assert n["refused"] == n["web_search_rate"] == n["action_incorrect"] == 2 and n["routing_accuracy"] == 1
