"""MLflow: every run is logged with its params (variant, config hash, backends), metrics (route and
action rates, refusal rate, mean relevant documents, eval metrics, calls, tokens, wall time) and
artifacts (the redacted config; comparison reports are added by `crag compare`).

The store is mlflow.tracking_uri when set; else, on Databricks, the workspace's tracking server; else,
for a warehouse folder, SQLite inside it (warehouse/mlflow). A catalog.schema warehouse off Databricks
has no folder to hold a store: it takes mlflow.tracking_uri (`databricks` for a workspace's tracking,
or a store of the user's), never a folder made in the working directory. `mlflow.enabled: false` turns
it off.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import threading
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote

from crag.backends.remote import on_databricks
from crag.config import CragConfig, TrackingConfig, crag_home
from crag.counts import USAGE, RunCounts
from crag.errors import ConfigError
from crag.ids import check_run_id
from crag.secrets import scrub
from crag.warehouse import is_catalog_schema

# MLflow's modules import each other in circles: two threads importing two of them at once can each
# get the other's half-made module. So one thread imports them (preload), and whoever logs waits for it.
_loading: list[threading.Thread] = []
# What preload opened: (tracking URI, experiment) -> (client, experiment id), or the error opening raised
_opened: dict[tuple[str, str], Any] = {}


def preload(cfg: TrackingConfig, warehouse: str | None = None) -> None:
    """Import MLflow's client on a thread of its own, when the run will log to it, and with `warehouse`
    open the run's store and experiment there too (a new warehouse's store created): seconds done while
    Spark answers rather than after. Nothing else in this process may import MLflow until `_client`
    has waited for it (the backends that use MLflow are built before)."""
    if cfg.enabled and not _loading:
        _loading.append(threading.Thread(target=_load, args=(cfg, warehouse), name="crag-mlflow-load", daemon=True))
        _loading[0].start()


def _load(cfg: TrackingConfig, warehouse: str | None) -> None:
    import mlflow.entities  # noqa: F401, PLC0415  # see preload
    import mlflow.tracking  # noqa: F401, PLC0415

    if warehouse is not None:
        key = (tracking_uri(cfg, warehouse), cfg.experiment)
        try:
            _opened[key] = _open(cfg, warehouse)
        except Exception as exc:  # told when the run logs, as opening it then would tell it
            _opened[key] = exc


def tracking_uri(cfg: TrackingConfig, warehouse: str) -> str:
    """The MLflow store of a run in `warehouse` (see the module's text); ConfigError when there is none."""
    if cfg.tracking_uri:
        return cfg.tracking_uri
    if on_databricks():
        return "databricks"
    if is_catalog_schema(warehouse):
        raise ConfigError(
            f"warehouse {warehouse} is a catalog schema, which holds no MLflow store: set mlflow.tracking_uri "
            "(databricks for the workspace's tracking, or a store such as sqlite:////path/to/mlflow.db), "
            "or mlflow.enabled=false"
        )
    # SQLAlchemy decodes the path and ends it at a '?': those two are encoded, and nothing else, since
    # MLflow also creates the path's folder as written (a space encoded would make a stray folder)
    path = str((Path(warehouse) / "mlflow" / "mlflow.db").resolve())
    return "sqlite:///" + re.sub(r"[%?]", lambda m: quote(m.group()), path)


def _client(cfg: TrackingConfig, warehouse: str):
    """The client of the run's store, and the experiment's id: preloaded, or opened now."""
    for loading in _loading:
        loading.join()
    uri = tracking_uri(cfg, warehouse)
    opened = _opened.pop((uri, cfg.experiment), None)
    if isinstance(opened, Exception):
        raise opened
    if opened is None or (uri.startswith("sqlite:///") and not Path(unquote(uri[len("sqlite:///") :])).exists()):
        return _open(cfg, warehouse)  # not preloaded, or its store removed since (a process's later run)
    return opened


def _open(cfg: TrackingConfig, warehouse: str):
    from mlflow.tracking import MlflowClient  # noqa: PLC0415  # MLflow takes seconds to import: only a run that logs pays

    logging.getLogger("alembic").setLevel(logging.WARNING)  # the store's schema setup is not news
    logging.getLogger("mlflow.store.db.utils").setLevel(logging.WARNING)
    uri = tracking_uri(cfg, warehouse)
    stray: list[Path] = []
    if uri.startswith("sqlite:///"):
        Path(unquote(uri[len("sqlite:///") :])).parent.mkdir(parents=True, exist_ok=True)
        _new_store(Path(unquote(uri[len("sqlite:///") :])))
        # MLflow creates the folder of the path as written (mlflow.store.db.utils): with a '%' or '?'
        # encoded that is another folder, removed again when MLflow has made it and left it empty
        written = Path(uri[len("sqlite:///") :]).parent
        stray = [folder for folder in (written, *written.parents) if not folder.exists()]
    client = MlflowClient(uri)
    try:
        experiment = client.get_experiment_by_name(cfg.experiment)  # the store is opened here
    finally:
        for folder in stray:  # deepest first
            with contextlib.suppress(OSError):
                folder.rmdir()
    if experiment is not None:
        return client, experiment.experiment_id
    return client, client.create_experiment(cfg.experiment, artifact_location=_artifacts(uri))


def _artifacts(uri: str) -> str | None:
    """Where a new experiment keeps its artifacts: beside a SQLite store (MLflow's default would be
    ./mlruns in the working directory); a server's (databricks, http) its own default."""
    if not uri.startswith("sqlite:///"):
        return None
    return (Path(unquote(uri[len("sqlite:///") :])).parent / "artifacts").resolve().as_uri()


def check_tracking(cfg: CragConfig, warehouse: str) -> None:
    """ConfigError now, before a run starts, when the run could not be logged at its end."""
    if cfg.mlflow.enabled:
        tracking_uri(cfg.mlflow, warehouse)


def _new_store(path: Path) -> None:
    """A new SQLite store as a copy of an empty one made once per MLflow version (crag_home()): MLflow
    builds a new store by running every migration of its schema, seconds that each new warehouse would
    otherwise pay. A store that is there is left as it is."""
    if path.exists():
        return
    import mlflow  # noqa: PLC0415  # as _client's
    from mlflow.store.db.utils import _initialize_tables  # noqa: PLC0415
    from sqlalchemy import create_engine  # noqa: PLC0415

    template = crag_home() / f"mlflow-{mlflow.__version__}-empty.db"
    if not template.exists():
        template.parent.mkdir(parents=True, exist_ok=True)
        building = template.with_name(f".{template.name}.{os.getpid()}")
        engine = create_engine(f"sqlite:///{building}")
        _initialize_tables(engine)
        engine.dispose()
        os.replace(building, template)
    copied = path.with_name(f".{path.name}.{os.getpid()}")
    shutil.copyfile(template, copied)
    try:
        os.link(copied, path)  # never over a store another process has made meanwhile
    except FileExistsError:
        pass
    finally:
        copied.unlink()


def log_run(
    cfg: CragConfig,
    warehouse: str,
    run_id: str,
    variant: str,
    counts: RunCounts,
    metrics,
    seconds: float,
    config_json: dict,
    status: str = "succeeded",
) -> str | None:
    """Log one crag run, ended FINISHED or (status `failed`) FAILED; returns the MLflow run id (None when
    tracking is off)."""
    if not cfg.mlflow.enabled:
        return None
    from mlflow.entities import Metric, Param  # noqa: PLC0415  # as above

    client, experiment_id = _client(cfg.mlflow, warehouse)
    tags = {"crag.run_id": run_id, "crag.variant": variant, "crag.status": status}
    run = client.create_run(experiment_id, run_name=run_id, tags=tags)
    params = {
        "run_id": run_id,
        "variant": variant,
        "config_hash": cfg.hash(),
        "retriever": cfg.retriever.backend,
        "grader": cfg.grader.backend,
        "rewriter": cfg.rewriter.backend,
        "web_search": cfg.web_search.backend,
        "generator": cfg.generator.backend,
        "routing.policy": cfg.routing.policy,
    }
    for name, role in cfg.llm_roles().items():
        params[f"{name}.endpoint"] = role.endpoint
    accepted = max(counts.accepted, 1)
    values = {
        "questions": counts.input_rows,
        "accepted": counts.accepted,
        "rejected": counts.rejected,
        "refusal_rate": counts.refused / accepted,
        "errors": counts.errors,
        **{name: getattr(counts, name) for name in USAGE},
        "mean_relevant_docs": counts.relevant_docs / accepted,
        "wall_time_s": seconds,
    }
    values.update({f"route_{k}_rate": v / accepted for k, v in counts.routes.items()})
    values.update({f"action_{k}_rate": v / accepted for k, v in counts.actions.items()})
    if metrics is not None:
        values.update(
            {f"eval.{m}": v for m, s, v in metrics[["metric", "slice", "value"]].itertuples(index=False) if s == "all"}
        )
    client.log_batch(
        run.info.run_id,
        params=[Param(k, scrub(str(v))) for k, v in params.items()],
        metrics=[Metric(k, float(v), 0, 0) for k, v in values.items()],
    )
    client.log_dict(run.info.run_id, config_json, "config.json")
    client.set_terminated(run.info.run_id, "FAILED" if status == "failed" else "FINISHED")
    return run.info.run_id


def log_report(cfg: TrackingConfig, warehouse: str, run_id: str, report_path: str) -> str | None:
    """Attach a comparison report to the candidate run's MLflow run, if that run was tracked."""
    if not cfg.enabled:
        return None
    # MLflow's search takes a filter string and no bound parameters: the id goes into the text, so it
    # is checked here to hold nothing but letters, digits, '_', '.' and '-' (no quote can end the value)
    check_run_id(run_id)
    client, experiment_id = _client(cfg, warehouse)
    found = client.search_runs([experiment_id], filter_string=f"tags.`crag.run_id` = '{run_id}'", max_results=1)
    if not found:
        return None
    client.log_artifact(found[0].info.run_id, report_path, "reports")
    return found[0].info.run_id
