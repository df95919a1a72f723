"""Each bundle job's exact parameter list, run locally against the embedded default."""

from deltalake import DeltaTable

from crag.cli import main
from tests.support import REPO, SAMPLE
from tests.unit.test_bundle import _local_parameters


def test_every_job_runs_locally_with_the_bundle_parameters(spark, tmp_path, capsys):
    variables = {"warehouse": str(tmp_path / "wh")}
    local = {"config": str(REPO / "conf" / "local.yaml"), "overrides": "mlflow.enabled=false"}
    index = tmp_path / "kb"
    assert (
        main(
            _local_parameters("build_index", {**local, "docs": str(SAMPLE / "kb"), "index_dir": str(index)}, variables)
        )
        == 0
    )
    assert (index / "manifest.json").exists()
    assert (
        main(["index", "--conf", local["config"], "--docs", str(SAMPLE / "web.jsonl"), "--out", str(tmp_path / "web")])
        == 0
    )
    overrides = f"retriever.index={index};web_search.index={tmp_path / 'web'};mlflow.enabled=false"
    for variant in ("base", "paper_thresholds"):
        params = _local_parameters(
            "crag_batch",
            {**local, "questions": str(SAMPLE / "questions.jsonl"), "variant": variant, "overrides": overrides},
            variables,
        )
        assert main(params) == 0
    runs = DeltaTable(str(tmp_path / "wh" / "runs")).to_pandas().set_index("run_id")
    assert (
        runs.loc["base-local1", "variant"] == "base"
        and runs.loc["paper_thresholds-local1", "variant"] == "paper_thresholds"
    )
    report = tmp_path / "compare.html"
    params = _local_parameters(
        "compare_variants",
        {"base": "base-local1", "candidate": "paper_thresholds-local1", "report": str(report)},
        variables,
    )
    assert main(params) == 0 and report.exists()
    assert "questions in both" in capsys.readouterr().out
