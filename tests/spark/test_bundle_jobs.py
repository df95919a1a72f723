"""Each bundle job's script in jobs/, run locally against the embedded default with the bundle's exact
parameter list."""

import runpy
import sys

import pytest

from crag.cli import main
from tests.support import REPO, SAMPLE, run_rows
from tests.unit.test_bundle import local_task


def _run_task(monkeypatch, job: str, values: dict[str, str], variables: dict[str, str], code: int = 0) -> None:
    """Runs the job's script as a Python script task does (as __main__, the parameters in sys.argv) in
    this process, so it shares the test session's Spark, and checks the code it exits with."""
    script, params = local_task(job, values, variables)
    monkeypatch.setattr(sys, "argv", [str(script), *params])
    with pytest.raises(SystemExit) as exit_:
        runpy.run_path(str(script), run_name="__main__")
    assert exit_.value.code == code, f"{job} exited with {exit_.value.code}"


def test_every_job_runs_locally_with_the_bundle_parameters(spark, tmp_path, capsys, monkeypatch):
    variables = {"warehouse": str(tmp_path / "wh")}
    local = {"config": str(REPO / "conf" / "local.yaml"), "overrides": "mlflow.enabled=false"}
    index = tmp_path / "kb"
    _run_task(monkeypatch, "build_index", {**local, "docs": str(SAMPLE / "kb"), "index_dir": str(index)}, variables)
    assert (index / "manifest.json").exists()
    assert (
        main(["index", "--conf", local["config"], "--docs", str(SAMPLE / "web.jsonl"), "--out", str(tmp_path / "web")])
        == 0
    )
    overrides = f"retriever.index={index};web_search.index={tmp_path / 'web'};mlflow.enabled=false"
    for variant in ("base", "paper_thresholds"):
        values = {**local, "questions": str(SAMPLE / "questions.jsonl"), "variant": variant, "overrides": overrides}
        _run_task(monkeypatch, "crag_batch", values, variables)
    runs = run_rows(tmp_path / "wh", "runs").set_index("run_id")
    assert (
        runs.loc["base-local1", "variant"] == "base"
        and runs.loc["paper_thresholds-local1", "variant"] == "paper_thresholds"
    )
    report = tmp_path / "compare.html"
    values = {"base": "base-local1", "candidate": "paper_thresholds-local1", "report": str(report)}
    _run_task(monkeypatch, "compare_variants", values, variables)
    assert report.exists()
    assert "questions in both" in capsys.readouterr().out
    _run_task(monkeypatch, "compare_variants", {**values, "base": "no-such-run"}, variables, code=2)
    assert "no run 'no-such-run'" in capsys.readouterr().err
