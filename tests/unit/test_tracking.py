"""crag.tracking: a run logged to the local MLflow store beside a warehouse folder."""

import pytest

from crag.config import CragConfig
from crag.counts import RunCounts
from crag.tracking import log_run, tracking_uri


@pytest.mark.parametrize("name", ["nightly 100% #2", "what? now", "my wh"])
def test_a_warehouse_folder_with_url_characters_in_its_name_gets_its_store(tmp_path, name):
    """'%' and '?' are a URL's escapes and query: the store's sqlite URL must carry them as path, and no
    folder named after the URL's spelling of the path is left beside the warehouse."""
    warehouse = tmp_path / name
    cfg = CragConfig()
    mlflow_run = log_run(cfg, str(warehouse), "r1", "base", RunCounts(accepted=3), None, 1.5, {"a": 1})
    assert mlflow_run and (warehouse / "mlflow" / "mlflow.db").is_file()
    assert [p.name for p in tmp_path.iterdir()] == [name]
    from mlflow.tracking import MlflowClient

    logged = MlflowClient(tracking_uri(cfg.mlflow, str(warehouse))).get_run(mlflow_run)
    assert logged.data.params["run_id"] == "r1" and logged.data.metrics["accepted"] == 3


@pytest.mark.parametrize(("status", "mlflow_status"), [("succeeded", "FINISHED"), ("failed", "FAILED")])
def test_a_runs_status_is_its_mlflow_runs(tmp_path, status, mlflow_status):
    from mlflow.tracking import MlflowClient

    cfg = CragConfig()
    mlflow_run = log_run(cfg, str(tmp_path), "r1", "base", RunCounts(accepted=3, errors=3), None, 1.5, {}, status)
    logged = MlflowClient(tracking_uri(cfg.mlflow, str(tmp_path))).get_run(mlflow_run)
    assert logged.info.status == mlflow_status and logged.data.tags["crag.status"] == status


def test_a_report_is_attached_to_its_run_only_and_an_id_cannot_rewrite_the_search(tmp_path):
    from mlflow.tracking import MlflowClient

    from crag.errors import InputError
    from crag.tracking import log_report

    cfg = CragConfig()
    runs = {rid: log_run(cfg, str(tmp_path), rid, "base", RunCounts(accepted=1), None, 1.0, {}) for rid in ("a", "b")}
    report = tmp_path / "report.html"
    report.write_text("<html></html>")
    assert log_report(cfg.mlflow, str(tmp_path), "b", str(report)) == runs["b"]
    client = MlflowClient(tracking_uri(cfg.mlflow, str(tmp_path)))
    assert [f.path for f in client.list_artifacts(runs["b"], "reports")] == ["reports/report.html"]
    assert client.list_artifacts(runs["a"], "reports") == []
    assert log_report(cfg.mlflow, str(tmp_path), "c", str(report)) is None  # never tracked: nothing to attach to
    # MLflow's search has no bound parameters: an id that would end the quoted value is refused first
    with pytest.raises(InputError, match="invalid run id"):
        log_report(cfg.mlflow, str(tmp_path), "x' OR tags.`crag.run_id` != '", str(report))


def test_a_catalog_warehouse_off_databricks_names_its_store_and_makes_no_folder_here(tmp_path, monkeypatch):
    """The store landed in ./<catalog.schema>/mlflow, and the next run took that folder for the warehouse."""
    from crag.errors import ConfigError
    from crag.tracking import check_tracking

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("DATABRICKS_RUNTIME_VERSION", raising=False)
    cfg = CragConfig()
    with pytest.raises(
        ConfigError,
        match=r"warehouse main\.crag is a catalog schema, which holds no MLflow store: set mlflow\.tracking_uri",
    ):
        log_run(cfg, "main.crag", "r1", "base", RunCounts(accepted=1), None, 1.0, {})
    with pytest.raises(ConfigError):
        check_tracking(cfg, "main.crag")  # said before a run starts
    check_tracking(CragConfig(mlflow={"enabled": False}), "main.crag")
    assert list(tmp_path.iterdir()) == []
    store = tmp_path / "elsewhere" / "mlflow.db"
    named = CragConfig(mlflow={"tracking_uri": f"sqlite:///{store}"})
    assert log_run(named, "main.crag", "r1", "base", RunCounts(accepted=1), None, 1.0, {"a": 1})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["elsewhere"]  # artifacts beside the store, not ./mlruns
    assert sorted(p.name for p in (tmp_path / "elsewhere").iterdir()) == ["artifacts", "mlflow.db"]


def test_a_folder_an_earlier_crag_left_for_a_catalog_warehouse_is_told_from_a_warehouse(tmp_path):
    from crag.warehouse import left_store_folder

    (tmp_path / "main.crag" / "mlflow").mkdir(parents=True)
    (tmp_path / "main.crag" / "mlflow" / "mlflow.db").write_bytes(b"")
    assert left_store_folder(str(tmp_path / "main.crag"))
    (tmp_path / "main.crag" / "answers").mkdir()  # a warehouse folder: tables beside its store
    assert not left_store_folder(str(tmp_path / "main.crag"))
    assert not left_store_folder(str(tmp_path / "absent.x"))


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
