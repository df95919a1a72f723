"""The Databricks bundle: it validates offline, and every job's task runs locally (embedded default)
with exactly the parameter list the bundle passes."""

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from deltalake import DeltaTable

from conftest import REPO, SAMPLE
from crag.cli import main

SCHEMA = REPO.parent / "shared" / "schemas" / "databricks-bundle.schema.json"
BUNDLE_FILES = [REPO / "databricks.yml", *sorted((REPO / "resources").glob("*.yml"))]
JOBS = yaml.safe_load((REPO / "resources" / "jobs.yml").read_text())["resources"]["jobs"]


@pytest.mark.skipif(not SCHEMA.exists(), reason=f"bundle schema not found at {SCHEMA}")
def test_bundle_validates_against_the_official_schema():
    checker = shutil.which("check-jsonschema", path=str(Path(sys.executable).parent))
    done = subprocess.run([checker, "--schemafile", str(SCHEMA), *map(str, BUNDLE_FILES)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize("name", sorted(JOBS))
def test_each_job_is_a_valid_job_definition(name):
    from databricks.bundles.jobs import Job

    job = Job.from_dict(JOBS[name])  # raises on unknown fields
    assert job.tasks and job.tasks[0].python_wheel_task.entry_point == "crag"


def test_every_variable_used_is_declared():
    declared = set(yaml.safe_load((REPO / "databricks.yml").read_text())["variables"])
    used = {m for f in BUNDLE_FILES for m in re.findall(r"\$\{var\.(\w+)\}", f.read_text())}
    assert used <= declared and used


def test_the_schedule_is_paused_in_development():
    bundle = yaml.safe_load((REPO / "databricks.yml").read_text())
    assert bundle["targets"]["dev"]["mode"] == "development" and bundle["targets"]["prod"]["mode"] == "production"
    assert JOBS["crag_batch"]["schedule"]["quartz_cron_expression"] == "${var.schedule_cron}"


def _local_parameters(job: str, values: dict[str, str], variables: dict[str, str]) -> list[str]:
    """The task's parameter list with the bundle's substitutions made for a laptop."""
    params = JOBS[job]["tasks"][0]["python_wheel_task"]["parameters"]
    out = []
    for p in params:
        p = p.replace("/Workspace${workspace.file_path}", str(REPO))
        p = re.sub(r"\$\{var\.(\w+)\}", lambda m: variables[m.group(1)], p)
        p = re.sub(r"\{\{job\.parameters\.(\w+)\}\}", lambda m: values[m.group(1)], p)
        out.append(p.replace("{{job.run_id}}", "local1"))
    return out


def test_every_job_runs_locally_with_the_bundle_parameters(spark, tmp_path, capsys):
    variables = {"warehouse": str(tmp_path / "wh")}
    local = {"config": str(REPO / "conf" / "local.yaml"), "overrides": "mlflow.enabled=false"}
    index = tmp_path / "kb"
    assert main(_local_parameters("build_index", {**local, "docs": str(SAMPLE / "kb"), "index_dir": str(index)}, variables)) == 0
    assert (index / "manifest.json").exists()
    assert main(["index", "--conf", local["config"], "--docs", str(SAMPLE / "web.jsonl"), "--out", str(tmp_path / "web")]) == 0
    overrides = f"retriever.index={index};web_search.index={tmp_path / 'web'};mlflow.enabled=false"
    for variant in ("base", "paper_thresholds"):
        params = _local_parameters("crag_batch", {**local, "questions": str(SAMPLE / "questions.jsonl"), "variant": variant,
                                                   "overrides": overrides}, variables)
        assert main(params) == 0
    runs = DeltaTable(str(tmp_path / "wh" / "runs")).to_pandas().set_index("run_id")
    assert runs.loc["base-local1", "variant"] == "base" and runs.loc["paper_thresholds-local1", "variant"] == "paper_thresholds"
    report = tmp_path / "compare.html"
    params = _local_parameters("compare_variants", {"base": "base-local1", "candidate": "paper_thresholds-local1",
                                                    "report": str(report)}, variables)
    assert main(params) == 0 and report.exists()
    assert "questions in both" in capsys.readouterr().out


@pytest.mark.parametrize("script, command", [("jobs/crag_batch.py", "run"), ("jobs/build_index.py", "index"),
                                             ("jobs/compare_variants.py", "compare")])
def test_job_files_are_the_same_commands(script, command):
    """The spark_python_task alternative: each jobs/*.py passes its arguments to the same command."""
    done = subprocess.run([sys.executable, script, "--help"], capture_output=True, text=True, cwd=REPO)
    assert done.returncode == 0 and f"usage: crag {command}" in done.stdout
