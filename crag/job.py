"""`crag run`: a table of questions in, the run's Delta tables out, every step in Spark.

prepare   config, credentials and backends checked; the warehouse's tables checked (created when
          missing); the questions read and validated by Spark (a lazy frame, not yet stored)
answer    the run id claimed (one writer at a time, crag.ledger) and the checked input stored under the
          run's new generation, both while the first batch is answered; then batch by batch, each
          batch answered while the one before it commits to `results` (a killed run resumes after the
          last commit), sized to take about spark.batch_seconds
finalise  the row invariant checked with the counts Spark observed while writing; metrics; the outcome
          recorded, which shows the generation's rows in the views (crag.warehouse); MLflow; the
          run's earlier generations forgotten

The driver plans, commits and prints aggregates: it never holds the questions, answers or grades.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import cached_property
from pathlib import Path
from typing import Any

import pandas as pd

from crag.backends import build_backends, resolve_credentials
from crag.batches import answer, finished
from crag.config import CragConfig, load_config, redacted, resolve_paths
from crag.counts import RunCounts, RunResult, aggregates
from crag.errors import CragError, InputError, describe
from crag.evaluation import metric_sums, metrics_of, store_metrics
from crag.ids import run_id_or_new
from crag.ledger import Ledger
from crag.progress import phase
from crag.questions import checked_input
from crag.spark import batch_tasks, get_spark
from crag.tracking import check_tracking, log_run, preload
from crag.warehouse import Warehouse, is_catalog_schema

log = logging.getLogger("crag")

# The stored tables a run writes (`stage_cache` too when the cache is on).
RUN_TABLES = ("runs", "inputs", "results", "metric_values")


@dataclass
class RunPlan:
    """What `prepare` settled: the run's config, record, warehouse and input."""

    cfg: CragConfig
    ledger: Ledger
    secrets: dict[str, str]
    checked: Any  # the validated input rows, a lazy DataFrame (for a resume, stored already)
    # the warehouse's tables checked (and created): before the run's first write
    tables_ready: Future = field(default_factory=finished)
    resume: bool = False
    tasks: int = 1  # a batch's tasks (crag.spark.batch_tasks), which also check the input
    fresh: bool = True  # the run id was new: no earlier generation to forget
    input_rows: int = 0
    accepted: int = 0
    gold_rows: int = 0
    question_ids: int = 0  # the accepted question ids' fingerprint (counts.id_fingerprint summed)
    metric_sums: list = field(default_factory=list)  # each committed batch's (crag.evaluation.metric_sums)
    metrics: pd.DataFrame | None = None  # the run's, once stored (with the last batch's commit)
    t0: float = field(default_factory=time.perf_counter)

    @property
    def warehouse(self) -> Warehouse:
        return self.ledger.warehouse

    @property
    def rejected(self) -> int:
        return self.input_rows - self.accepted

    def stored(self, table: str):
        """The generation's rows of a stored table (`inputs`, `results`)."""
        return self.warehouse.load_generation(table, self.ledger.run_id, self.ledger.generation)

    @cached_property
    def result_totals(self) -> list:
        """The aggregates each batch's commit observes over its result rows (crag.counts.aggregates),
        built once: in a local session they are some 1,400 calls into the JVM, 0.15-0.19 s of a run's
        last commit otherwise."""
        return aggregates()


# ------------------------------------------------------------------ prepare


def prepare(
    conf: str | None,
    questions: str,
    warehouse: str,
    variant: str | None,
    run_id: str | None,
    overrides: list[str],
    spark,
    resume: bool,
) -> RunPlan:
    cfg = resolve_paths(load_config(conf, overrides, variant))
    if resume and not run_id:
        raise CragError("--resume needs the id of the run to continue")
    run_id = run_id_or_new(run_id)
    if resume and spark is None and not is_catalog_schema(warehouse):
        check_resumable_folder(Path(warehouse), run_id)
    # Credentials, indexes and clients first: a missing one fails with one clear line before anything
    # is written, and before a JVM starts when there is no session yet. With a session, the indexes
    # load while the warehouse's tables are checked and the questions read.
    secrets = resolve_credentials(cfg)
    check_tracking(cfg, warehouse)  # a run that could not be logged at its end is refused now
    tables = RUN_TABLES + (("stage_cache",) if cfg.cache.enabled else ())
    with ThreadPoolExecutor(1, "crag-prepare") as pool:
        backends_built = pool.submit(build_backends, cfg, secrets)
        if spark is None:
            backends_built.result()
        wh = Warehouse(spark or get_spark(cfg.spark), warehouse, cfg.tables)
        tasks = batch_tasks(wh.spark, cfg)
        checked = checked_input(wh.spark, questions, cfg.input.max_question_chars, tasks)
        backends_built.result()
    preload(cfg.mlflow, warehouse)  # after the backends, some of which import MLflow themselves
    # Nothing is written before here: a bad config, index or input leaves the warehouse as it was. The
    # tables are checked beside the first batch's answering, before the claim.
    ledger = Ledger(wh, cfg, run_id, variant or "base")
    plan = RunPlan(cfg, ledger, secrets, checked, _in_background(wh.prepare, tables), resume, tasks)
    if resume:
        from crag.resume import continue_run  # noqa: PLC0415  # only a resume pays for its checks

        plan.tables_ready.result()
        continue_run(plan, ledger.resumable())
    return plan


def _in_background(task, *args) -> Future:
    """`task(*args)` on a thread of its own (daemon: a failed run does not wait for it at exit)."""
    done: Future = Future()

    def work() -> None:
        try:
            done.set_result(task(*args))
        except BaseException as exc:  # handed to whoever waits for it
            done.set_exception(exc)

    threading.Thread(target=work, name="crag-background", daemon=True).start()
    return done


def check_resumable_folder(warehouse: Path, run_id: str) -> None:
    """A run to resume in a local folder is looked up with delta-rs first: a wrong id is one line in a
    second, before a JVM starts."""
    from deltalake import DeltaTable  # noqa: PLC0415

    runs = warehouse / "runs"
    found = (
        DeltaTable.is_deltatable(str(runs))
        and DeltaTable(str(runs)).to_pyarrow_table(columns=["run_id"], filters=[("run_id", "=", run_id)]).num_rows
    )
    if not found:
        raise CragError(f"no run {run_id!r} to resume in {warehouse}")


# ------------------------------------------------------------------ finalise


def check_invariant(counts: RunCounts, question_ids: int, plan: RunPlan) -> None:
    """accepted + rejected = input rows, and every accepted question exactly once in the results."""
    if counts.accepted + plan.rejected != plan.input_rows or counts.accepted != plan.accepted:
        raise CragError(
            f"row accounting failed: {counts.accepted} answers + {plan.rejected} rejects != "
            f"{plan.input_rows} input rows ({plan.accepted} accepted)"
        )
    if question_ids != plan.question_ids:
        raise CragError(
            "row accounting failed: the answered question ids are not the accepted ones "
            "(as many answers as questions, but some question answered twice and another not at all)"
        )


def evaluate(plan: RunPlan, counts: RunCounts):
    """The generation's metrics, when its questions carry gold and it is to be shown: stored with its
    last batch's commit already, or, for a resumed run, made now over every attempt's results."""
    ledger, wh = plan.ledger, plan.warehouse
    if not plan.gold_rows or _keeps_earlier(plan, counts):
        return None
    if plan.metrics is not None:
        return plan.metrics
    with phase("metrics"):
        gold = wh.load_generation("gold", ledger.run_id, ledger.generation)
        metrics = metrics_of(metric_sums(plan.stored("results"), gold))
        store_metrics(wh, metrics, ledger.run_id, ledger.generation, ledger.variant, replace=True)
        return metrics


def _all_errors(counts: RunCounts) -> bool:
    return bool(counts.accepted) and counts.errors == counts.accepted


def _keeps_earlier(plan: RunPlan, counts: RunCounts) -> bool:
    """A re-run whose every question failed (an endpoint was down all along) keeps the earlier rows."""
    return _all_errors(counts) and not plan.fresh


def conclude(plan: RunPlan, counts: RunCounts, metrics) -> RunResult:
    """The run's outcome recorded, which shows its rows (a run whose every question failed is recorded
    `failed`; as a re-run, it keeps the earlier rows shown); MLflow; the earlier generations forgotten."""
    ledger, wh = plan.ledger, plan.warehouse
    status = "failed" if _all_errors(counts) or not plan.accepted else "succeeded"
    keep_earlier = _keeps_earlier(plan, counts)
    with phase("outcome"):
        ledger.record(status, counts.as_map(), datetime.now(UTC), show=not keep_earlier)
    seconds = time.perf_counter() - plan.t0
    first_error = None
    if _all_errors(counts):
        from pyspark.sql import functions as F  # noqa: PLC0415

        errors = wh.load_generation("answers", ledger.run_id, ledger.generation).where(F.col("error").isNotNull())
        first_error = errors.select("error").first()[0]
    if plan.cfg.mlflow.enabled:
        with phase("MLflow"):
            _log(plan, counts, metrics, seconds, status)
    if not plan.fresh:
        with phase("earlier generations forgotten"):
            _forget_earlier(plan)
    return RunResult(
        ledger.run_id,
        ledger.variant,
        wh.location,
        seconds,
        counts,
        metrics,
        wh.namespace,
        status,
        first_error,
        keep_earlier,
    )


def _log(plan: RunPlan, counts: RunCounts, metrics, seconds: float, status: str) -> None:
    ledger = plan.ledger
    try:
        config = redacted(plan.cfg.model_dump(mode="json"))
        logged = log_run(
            plan.cfg, plan.warehouse.location, ledger.run_id, ledger.variant, counts, metrics, seconds, config, status
        )
    except Exception as exc:  # the tables are the run's record, written and recorded above: it stands
        log.warning("run %s is written, but it was not logged to MLflow (%s)", ledger.run_id, describe(exc))
        return
    if logged:
        log.info("logged to MLflow run %s", logged)


def _forget_earlier(plan: RunPlan) -> None:
    """The rows of the run's other generations (an earlier run of the id, an attempt that failed), and
    its comparisons with other runs, which compared answers it no longer shows."""
    from pyspark.sql import functions as F  # noqa: PLC0415

    wh, ledger = plan.warehouse, plan.ledger
    shown = ledger.read()["shown_generation"]
    other = (F.col("run_id") == F.lit(ledger.run_id)) & ~F.col("generation").eqNullSafe(F.lit(shown))
    paired = (F.col("base_run") == F.lit(ledger.run_id)) | (F.col("candidate_run") == F.lit(ledger.run_id))
    forgets = [("inputs", other), ("results", other), ("metric_values", other)]
    if shown == ledger.generation:
        forgets.append(("comparisons", paired))
    with ThreadPoolExecutor(len(forgets), "crag-forget") as pool:
        for done in [pool.submit(wh.forget, table, condition) for table, condition in forgets]:
            done.result()


# ------------------------------------------------------------------ the whole run


def run(
    conf: str | None,
    questions: str,
    warehouse: str,
    variant: str | None = None,
    run_id: str | None = None,
    overrides: Sequence[str] = (),
    spark=None,
    resume: bool = False,
    progress: bool | None = None,
) -> RunResult:
    """Answer the questions and write every table of the run. With `resume`, a run that was killed or
    failed continues: committed batches are kept and not sent to any backend again. Without it, an
    existing run id is answered again, and its previous rows stay shown until the new ones replace them."""
    plan = prepare(conf, questions, warehouse, variant, run_id, list(overrides), spark, resume)
    with plan.ledger.failure_recorded():
        with plan.ledger.heartbeat() as heartbeat:  # until the outcome: a large run's metrics take minutes
            totals = answer(plan, progress, heartbeat)
            if plan.resume:
                from crag.resume import recount  # noqa: PLC0415

                counts, question_ids = recount(plan)
            else:
                counts = RunCounts.of_results(totals, plan.input_rows, plan.rejected)
                question_ids = totals["question_ids"]
            check_invariant(counts, question_ids, plan)
            metrics = evaluate(plan, counts)
        result = conclude(plan, counts, metrics)
    if not plan.accepted:
        raise InputError(
            f"no question was accepted: all {plan.input_rows} input rows were rejected "
            f"(see the rejects table of run {plan.ledger.run_id})"
        )
    return result
