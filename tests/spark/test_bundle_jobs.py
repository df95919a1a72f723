"""Each bundle job's script in jobs/, run locally against the embedded default with the bundle's exact
parameter list. crag_batch's runs are the session's variant pair (tests/spark/conftest.py), which that
job's script writes."""

from crag.cli import main
from tests.support import REPO, SAMPLE, copy_warehouse, run_job_task, run_rows, set_args


def test_every_job_runs_locally_with_the_bundle_parameters(
    spark, variant_pair, sample_indexes, index_overrides, tmp_path, capsys
):
    warehouse = copy_warehouse(variant_pair.warehouse, tmp_path / "wh")
    variables = {"warehouse": str(warehouse)}
    local = {"config": str(REPO / "conf" / "local.yaml"), "overrides": "mlflow.enabled=false"}
    index = tmp_path / "kb"
    assert run_job_task("build_index", {**local, "docs": str(SAMPLE / "kb"), "index_dir": str(index)}, variables) == 0
    assert (index / "manifest.json").exists() and "indexed 9 documents" in capsys.readouterr().out
    # the job's index answers as the one the variant pair's runs read (built by crag.indexing)
    question, printed = "How often should the HEPA-13 main filter be replaced?", []
    for kb in (index, sample_indexes["kb"]):
        sets = set_args([*index_overrides, f"retriever.index={kb}"])
        assert main(["ask", "--conf", local["config"], *sets, question]) == 0
        printed.append(capsys.readouterr().out)
    assert printed[0] == printed[1] and "[retrieve]" in printed[0]
    # crag_batch wrote the pair's two runs, named and labelled as the job names them
    runs = run_rows(warehouse, "runs").set_index("run_id")
    assert (
        runs.loc["base-local1", "variant"] == "base"
        and runs.loc["paper_thresholds-local1", "variant"] == "paper_thresholds"
    )
    report = tmp_path / "compare.html"
    values = {"base": "base-local1", "candidate": "paper_thresholds-local1", "report": str(report)}
    assert run_job_task("compare_variants", values, variables) == 0
    assert report.exists()
    assert "questions in both" in capsys.readouterr().out
    assert run_job_task("compare_variants", {**values, "base": "no-such-run"}, variables) == 2
    assert "no run 'no-such-run'" in capsys.readouterr().err
