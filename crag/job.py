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
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from crag.backends import build_backends, resolve_credentials
from crag.config import CragConfig, load_config, redacted, resolve_paths
from crag.counts import RunCounts, RunResult, aggregates, id_fingerprint
from crag.errors import CragError, InputError, describe
from crag.evaluation import evaluate_run
from crag.ids import run_id_or_new
from crag.ledger import Heartbeat, Ledger
from crag.progress import LiveProgress, ProgressReporter, phase
from crag.questions import read_questions, validate
from crag.spark import batch_tasks, get_spark, new_cache_rows, run_stages, with_stored_results
from crag.tracking import log_run
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
    resume: bool = False
    fresh: bool = True  # the run id was new: no earlier generation to forget
    input_rows: int = 0
    accepted: int = 0
    gold_rows: int = 0
    question_ids: int = 0  # the accepted question ids' fingerprint (counts.id_fingerprint summed)
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
    tables = RUN_TABLES + (("stage_cache",) if cfg.cache.enabled else ())
    with ThreadPoolExecutor(2, "crag-prepare") as pool:
        backends_built = pool.submit(build_backends, cfg, secrets)
        if spark is None:
            backends_built.result()
        wh = Warehouse(spark or get_spark(cfg.spark), warehouse, cfg.tables)
        ledger = Ledger(wh, cfg, run_id, variant or "base")
        if resume:
            wh.prepare(tables)
            previous = ledger.resumable()
        else:
            tables_checked = pool.submit(wh.prepare, tables)
        checked = validate(wh.spark, read_questions(wh.spark, questions), cfg.input.max_question_chars, questions)
        backends_built.result()
        if not resume:
            tables_checked.result()
    plan = RunPlan(cfg, ledger, secrets, checked, resume)
    if resume:
        from crag.resume import continue_run  # noqa: PLC0415  # only a resume pays for its checks

        continue_run(plan, previous)
    return plan


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


def input_totals() -> list:
    """The input's row counts and fingerprints, as Spark aggregates (observable while writing)."""
    from pyspark.sql import functions as F  # noqa: PLC0415  # crag ask loads crag.config's resolve_paths only

    accepted = F.col("reason").isNull()
    return [
        F.count(F.lit(1)).alias("rows"),
        F.count_if(accepted).alias("accepted"),
        F.count_if(accepted & F.col("has_gold")).alias("gold_rows"),
        # order-free: what `--resume` checks the input against
        F.coalesce(F.bit_xor(F.xxhash64("question_id", "question", "reason", "input_row")), F.lit(0)).alias(
            "input_hash"
        ),
        F.sum(F.when(accepted, id_fingerprint())).alias("question_ids"),
    ]


def take_totals(plan: RunPlan, totals: dict) -> None:
    plan.input_rows, plan.accepted, plan.gold_rows = (int(totals[k] or 0) for k in ("rows", "accepted", "gold_rows"))
    plan.ledger.input_hash = str(totals["input_hash"])
    plan.question_ids = int(totals["question_ids"] or 0)
    log.info(
        "run %s: %d input rows, %d accepted, %d rejected",
        plan.ledger.run_id,
        plan.input_rows,
        plan.accepted,
        plan.rejected,
    )


def store_input(plan: RunPlan) -> None:
    """The checked input stored under the run's generation, its totals observed while it is written."""
    from pyspark.sql import functions as F  # noqa: PLC0415

    ledger = plan.ledger
    rows = plan.checked.select(
        F.lit(ledger.run_id).alias("run_id"),
        F.lit(ledger.generation).alias("generation"),
        F.lit(ledger.variant).alias("variant"),
        "*",
        F.current_timestamp().alias("created_at"),
    )
    take_totals(plan, plan.warehouse.append_observed("inputs", rows, input_totals()))


def hold(plan: RunPlan, heartbeat: Heartbeat) -> None:
    """A new generation's start: the run claimed (and kept by the heartbeat from then on), then its
    input stored (a claim that fails stores nothing). Runs beside the first batch's answering."""
    plan.fresh = plan.ledger.claim()
    heartbeat.start()
    store_input(plan)


# ------------------------------------------------------------------ answer


@dataclass
class Batches:
    """The input rows in ranges of input_row, answered one range at a time: the first of
    spark.batch_questions rows, each later one sized to take about spark.batch_seconds at the rate
    measured so far."""

    first: int
    seconds: float
    start: int = 0
    answered: int = 0
    busy_s: float = 0.0

    def next(self, end: int | None) -> tuple[int, int] | None:
        """The next range [lo, hi) of rows below `end` (None: not known yet), or None when done."""
        if end is not None and self.start >= end:
            return None
        size = self.first if not self.answered else max(1, int(self.answered / self.busy_s * self.seconds))
        lo, self.start = self.start, self.start + size
        return lo, self.start

    def done(self, questions: int, seconds: float) -> None:
        self.answered, self.busy_s = self.answered + questions, self.busy_s + seconds


def answer(plan: RunPlan, progress: bool | None, heartbeat: Heartbeat) -> dict[str, int]:
    """Answer the accepted questions in batches: each batch computed (Spark's localCheckpoint) while
    the batch before it commits; the first one computed while the run is claimed and its input
    stored, and committed only once the run is this process's (the heartbeat starts then). The
    totals Spark observed."""
    from crag.resume import answered_so_far, first_unanswered  # noqa: PLC0415  # only a resume pays for these

    tasks, totals = batch_tasks(plan.warehouse.spark, plan.cfg), dict[str, int]()
    live = LiveProgress(ProgressReporter(enabled=progress, desc="crag: questions"))
    with live, ThreadPoolExecutor(2, "crag-commit") as pool:
        if plan.resume:
            held = _done()
            heartbeat.start()
            live.start(plan.accepted, answered_so_far(plan))
        else:
            held = pool.submit(hold, plan, heartbeat)
            held.add_done_callback(lambda done: None if done.exception() else live.start(plan.accepted, 0))
        start = first_unanswered(plan) if plan.resume else 0
        batches = Batches(plan.cfg.spark.batch_questions, plan.cfg.spark.batch_seconds, start)
        bounds, number, committing = batches.next(plan.input_rows if held.done() else None), 0, None
        while bounds is not None:
            started = time.perf_counter()
            computed = _compute(plan, number, bounds, tasks, live)
            held.result()  # the run is this process's, and its input stored
            if committing is not None:
                _add(totals, committing.result())
            heartbeat.check()
            plan.ledger.check_held()
            committing = pool.submit(_commit, plan, number, computed, live)
            batches.done(bounds[1] - bounds[0], time.perf_counter() - started)
            bounds, number = batches.next(plan.input_rows), number + 1
        held.result()
        if committing is not None:
            _add(totals, committing.result())
    return totals


def _done() -> Future:
    future: Future = Future()
    future.set_result(None)
    return future


def _compute(plan: RunPlan, number: int, bounds: tuple[int, int], tasks: int, live: LiveProgress):
    """The batch's questions (accepted, not answered yet, input_row in `bounds`) through the stages,
    computed and kept by Spark (localCheckpoint) until they are committed."""
    from pyspark.sql import functions as F  # noqa: PLC0415

    source = plan.checked if number == 0 and not plan.resume else plan.stored("inputs")
    lo, hi = bounds
    todo = source.where(F.col("reason").isNull() & (F.col("input_row") >= lo) & (F.col("input_row") < hi))
    if plan.resume:
        todo = todo.join(plan.stored("results").select("question_id"), "question_id", "left_anti")
    questions = with_stored_results(todo, plan.warehouse.load("stage_cache") if plan.cfg.cache.enabled else None)
    live.batch(number)
    answered_rows = run_stages(questions, plan.cfg, plan.secrets, tasks, live.path, number)
    return answered_rows.localCheckpoint(eager=True)


def _commit(plan: RunPlan, number: int, computed, live: LiveProgress) -> dict:
    """A computed batch committed to `results` (its counts observed as Spark writes it), and its new
    stage-cache rows to `stage_cache`."""
    from pyspark.sql import functions as F  # noqa: PLC0415

    ledger, wh = plan.ledger, plan.warehouse
    rows = computed.select(
        F.lit(ledger.run_id).alias("run_id"),
        F.lit(ledger.generation).alias("generation"),
        F.lit(ledger.variant).alias("variant"),
        F.lit(number).cast("int").alias("batch"),
        "*",
        F.current_timestamp().alias("created_at"),
    )
    with ThreadPoolExecutor(1, "crag-cache") as pool:
        cached = pool.submit(_store_cache_rows, plan, computed) if plan.cfg.cache.enabled else _done()
        observed = wh.append_observed("results", rows, aggregates())
        cached.result()
    live.committed(number, int(observed["accepted"] or 0))
    computed.unpersist()
    return observed


def _add(totals: dict[str, int], observed: dict) -> None:
    for key, value in observed.items():
        totals[key] = totals.get(key, 0) + int(value or 0)


def _store_cache_rows(plan: RunPlan, computed) -> None:
    """The batch's new stage-cache rows, each key once (the cache is shared by every run)."""
    wh = plan.warehouse
    rows = new_cache_rows(computed, plan.ledger.run_id)
    wh.append("stage_cache", rows.join(wh.load("stage_cache").select("key"), "key", "left_anti"))


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
    """The generation's metrics, stored (when its questions carry gold, and it is to be shown)."""
    ledger, wh = plan.ledger, plan.warehouse
    if not plan.gold_rows or _keeps_earlier(plan, counts):
        return None
    with phase("metrics"):
        views = {n: wh.load_generation(n, ledger.run_id, ledger.generation) for n in ("answers", "grades", "gold")}
        return evaluate_run(wh, ledger.run_id, ledger.variant, views, ledger.generation, replace=plan.resume)


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
        f"{wh.catalog}.{wh.schema}",
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
