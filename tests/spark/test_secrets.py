"""No secret in any table, Delta log, log line, screen line or MLflow store of a whole run: the production
backends' token, and credentials in a host's URL that the run's errors quote (the scrubber itself and
stored configs are tested in tests/unit/test_secrets.py)."""

import pytest
from deltalake import DeltaTable

from crag.cli import main
from tests.support import PASSWORD, REPO, TOKEN, crag_run_args, databricks_grader, first_questions, run_rows

pytestmark = pytest.mark.usefixtures("fresh_registry")


def test_crag_run_stores_no_credential_in_errors_reasons_or_config(
    spark, monkeypatch, capfd, tmp_path, closed_port, sample_indexes
):
    monkeypatch.setenv("DATABRICKS_HOST", f"http://user:{PASSWORD}@127.0.0.1:{closed_port}")
    monkeypatch.setenv("DATABRICKS_TOKEN", "dapi-" + PASSWORD[::-1])
    questions = first_questions(tmp_path / "q.jsonl", 4)
    warehouse = tmp_path / "wh"
    overrides = [
        o.replace("mlflow.enabled=false", "mlflow.enabled=true")
        for o in databricks_grader(sample_indexes["kb"], sample_indexes["web"])
    ]
    code = main(crag_run_args(warehouse, "--run-id", "leak", questions=questions, overrides=overrides))
    out, err = capfd.readouterr()
    # every question's grading failed: the run is recorded as failed, and its line quotes an error
    assert code == 2 and "crag: error: run leak is recorded as failed" in err and f":{closed_port}" in err
    answers = run_rows(warehouse, "answers")
    assert answers["error"].notna().sum() >= 1  # the grader's calls failed, and said so
    assert answers["error"].str.contains(f"127.0.0.1:{closed_port}").any()
    decisions = run_rows(warehouse, "decisions")
    assert decisions["reason"].str.contains("Connection refused").any()
    for path in [p for p in warehouse.rglob("*") if p.is_file()]:
        data = path.read_bytes()
        assert PASSWORD.encode() not in data and PASSWORD[::-1].encode() not in data, path
    assert PASSWORD not in out + err


def test_no_secret_in_tables_logs_or_run_config(spark, emulator, tmp_path, capfd):
    code = main(crag_run_args(tmp_path, "--run-id", "secret-check", conf=REPO / "conf" / "databricks.yaml"))
    assert code == 0
    out, err = capfd.readouterr()
    assert TOKEN not in out and TOKEN not in err
    assert len(out) > 100  # the summary was printed (and searched)
    tables = [p for p in sorted(tmp_path.iterdir()) if (p / "_delta_log").is_dir()]
    assert {"runs", "inputs", "results", "metric_values", "stage_cache"} <= {p.name for p in tables}
    for path in tables:
        assert TOKEN not in DeltaTable(str(path)).to_pandas().to_csv(), path.name
        for log in (path / "_delta_log").glob("*.json"):
            assert TOKEN not in log.read_text(), log
    mlflow_files = [p for p in (tmp_path / "mlflow").rglob("*") if p.is_file()]
    assert any(p.name == "config.json" for p in mlflow_files)  # the MLflow store and artifacts exist ...
    for path in mlflow_files:
        assert TOKEN.encode() not in path.read_bytes(), path  # ... and hold no secret
    config = run_rows(tmp_path, "runs").loc[0, "config"]
    assert "DATABRICKS_TOKEN" in config and TOKEN not in config  # where the secret comes from, not what it is
