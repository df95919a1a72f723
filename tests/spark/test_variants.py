"""Variants: comparison rows against the two runs' tables (the session's shared variant pair,
tests/spark/conftest.py, compared in a copy of its warehouse), the HTML report, and the MLflow record."""

import pytest

from crag.cli import main
from crag.config import load_config, safe_yaml
from tests.support import LOCAL_CONF, REPO, ReportMarkup, copy_warehouse, crag_run_args, run_rows


def table(warehouse, name, **where):
    df = run_rows(warehouse, name)
    for k, v in where.items():
        df = df[df[k] == v]
    return df.reset_index(drop=True)


def test_compare_and_calibrate_bring_no_run_rows_to_the_driver(variant_pair, spark, monkeypatch, tmp_path, capsys):
    """They compute in Spark, as run and eval do: the driver receives aggregates (metrics, counts by
    value, the few rows a report shows), never a run's answers or grades."""
    frame_class = type(spark.range(1))
    real = frame_class.toPandas

    def guarded(self):
        rows_of_a_run = {"answer", "rationale", "question", "raw_output"} & set(self.columns)
        assert not rows_of_a_run, f"a run's rows reached the driver: {self.columns}"
        return real(self)

    monkeypatch.setattr(frame_class, "toPandas", guarded)
    base, cand = variant_pair.base, variant_pair.candidate
    argv = ["--warehouse", str(copy_warehouse(variant_pair.warehouse, tmp_path / "wh"))]
    report = tmp_path / "r.html"
    assert main(["compare", *argv, "--base", base, "--candidate", cand, "--no-mlflow", "--report", str(report)]) == 0
    assert main(["calibrate", *argv, "--run", cand]) == 0
    out = capsys.readouterr().out
    assert f"compare {base} (base) -> {cand} (candidate): 49 questions in both" in out and "proposed lower" in out


def test_comparison_rows_match_the_run_tables(variant_pair, capsys, index_overrides, tmp_path):
    wh = copy_warehouse(variant_pair.warehouse, tmp_path / "wh")
    base, cand = variant_pair.base, variant_pair.candidate
    report = wh / "report.html"
    argv = ["compare", "--warehouse", str(wh), "--base", base, "--candidate", cand, "--report", str(report)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert f"compare {base} (base) -> {cand} (candidate): 49 questions in both" in out and f"report: {report}" in out
    rows = table(wh, "comparisons").set_index("question_id")
    a = (
        table(wh, "answers", run_id=base)
        .set_index("question_id")
        .reindex(rows_index := sorted(table(wh, "comparisons")["question_id"]))
    )
    b = table(wh, "answers", run_id=cand).set_index("question_id").reindex(rows_index)
    assert len(rows) == 49 and (rows["base_run"] == base).all()
    rows = rows.reindex(rows_index)
    assert (rows["route_flip"] == (a["route"] != b["route"])).all()
    assert (rows["action_flip"] == (a["action"] != b["action"])).all()
    assert (rows["n_relevant_delta"] == (b["n_relevant"] - a["n_relevant"])).all()
    assert (rows["answer_changed"] == (a["answer"] != b["answer"])).all()
    assert rows.loc[~rows["answer_changed"], "answer_similarity"].eq(1.0).all()
    # grade flips, counted independently from the grades tables
    ga, gb = table(wh, "grades", run_id=base), table(wh, "grades", run_id=cand)
    merged = ga.merge(gb, on=["question_id", "source", "parent_id"], suffixes=("_a", "_b"))
    flipped = merged[merged["grade_a"] != merged["grade_b"]]
    assert rows["grade_flips"].map(len).sum() == len(flipped) > 0  # the lower threshold flips some "no" to "yes"
    assert rows["f1_delta"].notna().sum() == 41  # answerable questions, gold present in both runs
    assert "grade flips" in out and "web_search_rate" in out
    # the summary names what the two configs differ in: the variant's keys and the --set, with values
    base_cfg, cand_cfg = (
        load_config(LOCAL_CONF, index_overrides).model_dump(mode="json"),
        load_config(LOCAL_CONF, [*index_overrides, "grader.threshold=0.4"], "paper_thresholds").model_dump(mode="json"),
    )
    overlay = safe_yaml((REPO / "conf" / "variants" / "paper_thresholds.yaml").read_text())["routing"]
    changed = {f"routing.{k}" for k, v in overlay.items() if base_cfg["routing"][k] != v} | {"grader.threshold"}
    assert cand_cfg["routing"]["upper"] != base_cfg["routing"]["upper"]  # so the check below shows four keys
    (line,) = [line for line in out.splitlines() if line.startswith("  config ")]
    assert line.split(":")[0].split() == ["config", str(len(changed)), "keys", "differ"]
    assert "grader.threshold 0.5 -> 0.4" in line
    shown = [part.split()[0] for part in line.split(": ", 1)[1].split("; ")]
    assert sorted(shown) == sorted(changed)
    page = report.read_text()
    assert all(f"<td><code>{key}</code></td>" in page for key in changed)
    # running the comparison again replaces its rows
    assert main(argv) == 0
    assert len(table(wh, "comparisons")) == 49


def test_compare_report_given_a_folder_is_one_line_before_any_work(spark, tmp_path, capsys):
    """Before the runs are read (`crag compare` opens its Spark session first)."""
    code = main(
        [
            "compare",
            "--warehouse",
            str(tmp_path / "nowhere"),
            "--base",
            "a",
            "--candidate",
            "b",
            "--report",
            str(tmp_path),
            "--no-mlflow",
        ]
    )
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"crag: error: --report {tmp_path} is a folder") and err.count("\n") == 1


def test_a_report_path_that_cannot_be_written_is_one_line_and_said_before_the_runs_are_read(
    variant_pair, capsys, tmp_path, monkeypatch
):
    import crag.compare

    warehouse, reports = copy_warehouse(variant_pair.warehouse, tmp_path / "wh"), tmp_path / "reports"
    reports.mkdir()
    (reports / "afile").write_text("x")
    base, cand = variant_pair.base, variant_pair.candidate
    argv = ["compare", "--warehouse", str(warehouse), "--base", cand, "--candidate", base, "--no-mlflow"]
    report = reports / "afile" / "sub" / "x.html"
    with monkeypatch.context() as patched:  # said before the runs are read, and nothing is made
        patched.setattr(crag.compare, "_compare_in_spark", lambda *a: pytest.fail("the runs were read"))
        assert main([*argv, "--report", str(report)]) == 2
    said = f"crag: error: cannot write the report {report}: {reports / 'afile'} is a file, not a folder\n"
    assert capsys.readouterr().err == said
    assert sorted(p.name for p in reports.iterdir()) == ["afile"]
    # only writing it can tell: the comparison is stored, and the line says so
    assert main([*argv, "--report", "/proc/crag-report.html"]) == 2
    assert capsys.readouterr().err == (
        "crag: error: the comparison is in the comparisons table, but the report could not be written to "
        "/proc/crag-report.html: No such file or directory\n"
    )
    assert len(table(warehouse, "comparisons", base_run=cand)) == 49


def test_the_report_renders_its_sections(variant_pair, tmp_path):
    warehouse = copy_warehouse(variant_pair.warehouse, tmp_path / "wh")
    report = warehouse / "report2.html"
    argv = ["--base", variant_pair.base, "--candidate", variant_pair.candidate, "--report", str(report)]
    assert main(["compare", "--warehouse", str(warehouse), *argv]) == 0
    page = report.read_text()
    parser = ReportMarkup()
    parser.feed(page)
    assert parser.sections == ["summary", "metrics", "routes", "relevance", "changed", "flips"]
    assert parser.tags.count("svg") == 6 and "script" not in parser.tags and parser.external == []
    assert "<del>" in page and "<ins>" in page  # word-level diff of a changed answer
    assert "routing_accuracy" in page
    # gold exists in both runs, so every changed answer carries its verdict in each run
    changed = page.count('<tr class="changed-answer">')
    assert changed > 0 and page.count('class="badge correct"') + page.count('class="badge wrong"') == 2 * changed
    assert page.count('<tr class="grade-flip">') > 0


def test_runs_are_logged_to_mlflow(spark, sample_indexes, tmp_path, capsys):
    """The runs log to an experiment of their config's; `crag compare`, given no config, finds the
    candidate's MLflow run with the tracking settings stored in its runs row (as the bundle's
    compare_variants job, which passes no overrides, must)."""
    from mlflow.tracking import MlflowClient

    sets = ["--set", f"retriever.index={sample_indexes['kb']}", "--set", f"web_search.index={sample_indexes['web']}"]
    sets += ["--set", "mlflow.experiment=crag-variants"]
    for run_id, extra in (("ml-base", []), ("ml-cand", ["--variant", "paper_thresholds"])):
        assert main(crag_run_args(tmp_path, *sets, *extra, "--run-id", run_id)) == 0
    report = tmp_path / "cmp.html"
    assert (
        main(
            [
                "compare",
                "--warehouse",
                str(tmp_path),
                "--base",
                "ml-base",
                "--candidate",
                "ml-cand",
                "--report",
                str(report),
            ]
        )
        == 0
    )
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow' / 'mlflow.db'}")
    assert client.get_experiment_by_name("crag") is None
    experiment = client.get_experiment_by_name("crag-variants")
    runs = {r.data.tags["crag.run_id"]: r for r in client.search_runs([experiment.experiment_id])}
    assert set(runs) == {"ml-base", "ml-cand"}
    cand = runs["ml-cand"]
    assert cand.data.params["variant"] == "paper_thresholds" and cand.data.params["routing.policy"] == "thresholds"
    answers = table(tmp_path, "answers", run_id="ml-cand")
    assert cand.data.metrics["accepted"] == 49 and cand.data.metrics["search_calls"] == answers["search_calls"].sum()
    assert cand.data.metrics["route_web_rate"] == pytest.approx((answers["route"] == "web").mean())
    assert 0 < cand.data.metrics["eval.routing_accuracy"] <= 1 and cand.data.metrics["wall_time_s"] > 0
    artifacts = {a.path for a in client.list_artifacts(cand.info.run_id)}
    assert artifacts == {"config.json", "reports"}
    assert [a.path for a in client.list_artifacts(cand.info.run_id, "reports")] == ["reports/cmp.html"]
    config = client.download_artifacts(cand.info.run_id, "config.json", str(tmp_path / "dl"))
    assert '"policy": "thresholds"' in open(config).read()
