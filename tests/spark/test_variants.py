"""Variants: comparison rows against the two runs' tables, the HTML report, the stage cache by call
counts on the emulators, and the MLflow record."""

import pytest

from crag.cli import main
from crag.config import load_config, safe_yaml
from crag.job import run
from tests.support import LOCAL_CONF, REPO, SAMPLE, ReportMarkup, crag_run_args, run_rows

QUESTIONS = str(SAMPLE / "questions.jsonl")


def table(warehouse, name, **where):
    df = run_rows(warehouse, name)
    for k, v in where.items():
        df = df[df[k] == v]
    return df.reset_index(drop=True)


@pytest.fixture(scope="module")
def two_runs(spark, index_overrides, tmp_path_factory):
    wh = tmp_path_factory.mktemp("variants")
    run(str(LOCAL_CONF), QUESTIONS, str(wh), run_id="base", overrides=index_overrides, spark=spark)
    run(
        str(LOCAL_CONF),
        QUESTIONS,
        str(wh),
        variant="paper_thresholds",
        run_id="cand",
        overrides=[*index_overrides, "grader.threshold=0.4"],
        spark=spark,
    )
    return wh


def test_compare_and_calibrate_bring_no_run_rows_to_the_driver(two_runs, spark, monkeypatch, tmp_path, capsys):
    """They compute in Spark, as run and eval do: the driver receives aggregates (metrics, counts by
    value, the few rows a report shows), never a run's answers or grades."""
    frame_class = type(spark.range(1))
    real = frame_class.toPandas

    def guarded(self):
        rows_of_a_run = {"answer", "rationale", "question", "raw_output"} & set(self.columns)
        assert not rows_of_a_run, f"a run's rows reached the driver: {self.columns}"
        return real(self)

    monkeypatch.setattr(frame_class, "toPandas", guarded)
    argv = ["--warehouse", str(two_runs)]
    report = tmp_path / "r.html"
    assert (
        main(["compare", *argv, "--base", "base", "--candidate", "cand", "--no-mlflow", "--report", str(report)]) == 0
    )
    assert main(["calibrate", *argv, "--run", "cand"]) == 0
    out = capsys.readouterr().out
    assert "compare base (base) -> cand (candidate): 49 questions in both" in out and "proposed lower" in out


def test_comparison_rows_match_the_run_tables(two_runs, capsys, index_overrides):
    wh = two_runs
    report = wh / "report.html"
    assert (
        main(["compare", "--warehouse", str(wh), "--base", "base", "--candidate", "cand", "--report", str(report)]) == 0
    )
    out = capsys.readouterr().out
    assert "compare base (base) -> cand (candidate): 49 questions in both" in out and f"report: {report}" in out
    rows = table(wh, "comparisons").set_index("question_id")
    a = (
        table(wh, "answers", run_id="base")
        .set_index("question_id")
        .reindex(rows_index := sorted(table(wh, "comparisons")["question_id"]))
    )
    b = table(wh, "answers", run_id="cand").set_index("question_id").reindex(rows_index)
    assert len(rows) == 49 and (rows["base_run"] == "base").all()
    rows = rows.reindex(rows_index)
    assert (rows["route_flip"] == (a["route"] != b["route"])).all()
    assert (rows["action_flip"] == (a["action"] != b["action"])).all()
    assert (rows["n_relevant_delta"] == (b["n_relevant"] - a["n_relevant"])).all()
    assert (rows["answer_changed"] == (a["answer"] != b["answer"])).all()
    assert rows.loc[~rows["answer_changed"], "answer_similarity"].eq(1.0).all()
    # grade flips, counted independently from the grades tables
    ga, gb = table(wh, "grades", run_id="base"), table(wh, "grades", run_id="cand")
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
    assert (
        main(["compare", "--warehouse", str(wh), "--base", "base", "--candidate", "cand", "--report", str(report)]) == 0
    )
    assert len(table(wh, "comparisons")) == 49


def test_a_report_path_that_cannot_be_written_is_one_line_and_said_before_the_runs_are_read(
    two_runs, capsys, tmp_path, monkeypatch
):
    import crag.compare

    (tmp_path / "afile").write_text("x")
    argv = ["compare", "--warehouse", str(two_runs), "--base", "cand", "--candidate", "base", "--no-mlflow"]
    report = tmp_path / "afile" / "sub" / "x.html"
    with monkeypatch.context() as patched:  # said before the runs are read, and nothing is made
        patched.setattr(crag.compare, "_compare_in_spark", lambda *a: pytest.fail("the runs were read"))
        assert main([*argv, "--report", str(report)]) == 2
    said = f"crag: error: cannot write the report {report}: {tmp_path / 'afile'} is a file, not a folder\n"
    assert capsys.readouterr().err == said
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]
    # only writing it can tell: the comparison is stored, and the line says so
    assert main([*argv, "--report", "/proc/crag-report.html"]) == 2
    assert capsys.readouterr().err == (
        "crag: error: the comparison is in the comparisons table, but the report could not be written to "
        "/proc/crag-report.html: No such file or directory\n"
    )
    assert len(table(two_runs, "comparisons", base_run="cand")) == 49


def test_the_report_renders_its_sections(two_runs):
    report = two_runs / "report2.html"
    assert (
        main(
            ["compare", "--warehouse", str(two_runs), "--base", "base", "--candidate", "cand", "--report", str(report)]
        )
        == 0
    )
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


def test_only_the_changed_stage_calls_its_backend(spark, emulator, tmp_path):
    conf = str(REPO / "conf" / "databricks.yaml")
    run(conf, QUESTIONS, str(tmp_path), run_id="v1", spark=spark)
    queries = lambda: [r for r in emulator.of("vector_search") if r.path.endswith("/query")]  # noqa: E731
    first = {
        "serving": len(emulator.of("serving")),
        "vector_search": len(queries()),
        "tavily": len(emulator.of("tavily")),
    }
    emulator.reset()
    result = run(
        conf,
        QUESTIONS,
        str(tmp_path),
        run_id="v2",
        overrides=["generator.prompt=prompts/answer_strict.yaml"],
        spark=spark,
    )
    serving = emulator.of("serving")
    assert queries() == [] and emulator.of("tavily") == []
    assert [r for r in serving if "inputs" in r.body] == []  # no grading
    generate = [r for r in serving if "<context>" in r.body["messages"][1]["content"]]
    assert len(generate) == len(serving) > 0  # every call left is an answer with the new prompt
    assert all("give it as the documents word it" in r.body["messages"][0]["content"] for r in generate)
    saved = first["serving"] + first["vector_search"] + first["tavily"] - len(serving)
    assert result.counts.cache_hits >= saved > 0
    emulator.reset()
    run(conf, QUESTIONS, str(tmp_path), run_id="v3", overrides=["cache.enabled=false"], spark=spark)
    assert len(emulator.of("serving")) == first["serving"] and len(emulator.of("tavily")) == first["tavily"]


def test_runs_are_logged_to_mlflow(spark, sample_indexes, tmp_path, capsys):
    """The runs log to an experiment of their config's; `crag compare`, given no config, finds the
    candidate's MLflow run with the tracking settings stored in its runs row (as the bundle's
    compare_variants job, which passes no overrides, must)."""
    from mlflow.tracking import MlflowClient

    sets = ["--set", f"retriever.index={sample_indexes['kb']}", "--set", f"web_search.index={sample_indexes['web']}"]
    sets += ["--set", "mlflow.experiment=crag-variants"]
    for run_id, extra in (("ml-base", []), ("ml-cand", ["--variant", "paper_thresholds"])):
        assert main(crag_run_args(tmp_path, *sets, *extra, "--run-id", run_id, questions=QUESTIONS)) == 0
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


def test_a_tracking_store_out_of_reach_costs_compare_a_warning_line_not_its_results(tmp_path, caplog):
    """The report is attached after the comparison rows and the HTML file are written: a store that
    cannot be opened (here a SQLite path under a file) is one warning line naming the run."""
    from crag.compare import _attach_report

    (tmp_path / "a-file").write_text("")
    report = tmp_path / "report.html"
    report.write_text("<html></html>")
    stored = {"enabled": True, "tracking_uri": f"sqlite:///{tmp_path / 'a-file' / 'mlflow.db'}", "experiment": "crag"}
    _attach_report(stored, str(tmp_path), "cand-1", report)
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "run cand-1's MLflow run" in warnings[0], warnings
