"""A run's answering: its start (the run claimed while its input is stored, both beside the first
batch's answering) and its committed batches.

Each batch is computed by Spark and kept (localCheckpoint) while the batch before it commits to
`results`, so a commit costs the run no time but the last one's. The first batch holds
spark.batch_questions input rows and is committed only once the run is this process's; each later
one is sized to take about spark.batch_seconds at the rate measured so far. The tasks report their
progress as they answer (crag.progress.LiveProgress); each commit's counts are observed by Spark as it
writes them (crag.counts).
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import pandas as pd

from crag.counts import id_fingerprint
from crag.errors import describe
from crag.evaluation import metric_sums, metrics_of, store_metrics
from crag.ledger import Heartbeat, Ledger
from crag.progress import LiveProgress, ProgressReporter, phase
from crag.spark import new_cache_rows, run_stages, with_stored_results
from crag.warehouse import in_generation

if TYPE_CHECKING:
    from crag.job import RunPlan

log = logging.getLogger("crag")


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
    rows = input_rows(plan.checked, plan.ledger)
    take_totals(plan, plan.warehouse.append_observed("inputs", rows, input_totals()))


def input_rows(checked, ledger: Ledger):
    """The checked input's rows as `inputs` stores them: under the run's id, generation and variant."""
    from pyspark.sql import functions as F  # noqa: PLC0415

    return checked.select(
        F.lit(ledger.run_id).alias("run_id"),
        F.lit(ledger.generation).alias("generation"),
        F.lit(ledger.variant).alias("variant"),
        "*",
        F.current_timestamp().alias("created_at"),
    )


# The tables a run writes after its last reply: its outcome, its last batch's results, its metrics
# (only a run whose questions carry gold has any). (Its stage-cache rows too, but their write reads the
# table first, for the keys it holds already.) Read once, while the run answers: in a run of several
# batches, each later commit leaves a new version of `results` unread again; the state of `runs` holds
# (and is read again after each beat).
WRITTEN_LAST = ("runs", "results", "metric_values")


def written_last(plan: RunPlan) -> tuple[str, ...]:
    """WRITTEN_LAST but the metrics of a run without gold, which it never writes: reading a table's
    state takes the JVM a second, beside the answering."""
    return tuple(table for table in WRITTEN_LAST if table != "metric_values" or plan.gold_rows)


def hold(plan: RunPlan, heartbeat: Heartbeat) -> None:
    """A new generation's start, beside the first batch's answering: the run claimed (and kept by the
    heartbeat from then on) while its input is stored under the generation, two commits at once
    rather than one after the other. A claim that fails leaves nothing: the input rows written beside
    it, under a generation no view shows, are removed before the failure is told."""
    plan.tables_ready.result()
    with ThreadPoolExecutor(1, "crag-input") as pool:
        stored = pool.submit(store_input, plan)
        try:
            plan.fresh = plan.ledger.claim()
        except BaseException:
            if stored.exception() is None:
                _forget_input(plan)
            raise
        heartbeat.start()
        stored.result()


def _ready_last_commits(plan: RunPlan, held: Future, answered: threading.Event, after_s: float = 1.0) -> None:
    """What the commits after a run's last reply would otherwise do first, done while it still answers:
    the totals they observe built (RunPlan.result_totals), then the state of the tables they write
    (written_last) read (Warehouse.load_states), table by table until the answering ends. Once the run
    is held and its answering has gone on for `after_s` more: the reads would take the batch's task
    slots before then, and the driver's time goes to the hold's two commits; a short run readies
    nothing (its last commit builds the totals), since the reads would only slow its own commits.
    Best effort: what fails here is done again by the commit, which tells the failure."""
    if held.exception() is not None or answered.wait(after_s):
        return
    try:
        plan.result_totals  # noqa: B018  # built now, kept on the plan
    except Exception:
        log.debug("could not build the run's totals ahead of its commits", exc_info=True)
    for table in written_last(plan):
        if answered.is_set():
            return
        plan.warehouse.load_states((table,))


def _forget_input(plan: RunPlan) -> None:
    """This attempt's input rows removed (best effort: rows under a generation that no run shows are in
    no view, and a later run of the id forgets them with its earlier generations)."""
    ledger = plan.ledger
    try:
        plan.warehouse.forget("inputs", in_generation(ledger.run_id, ledger.generation))
    except Exception as exc:
        log.warning(
            "run %s: the input rows of an attempt that did not get the run stay stored (%s)",
            ledger.run_id,
            describe(exc),
        )


# ------------------------------------------------------------------ answer


@dataclass
class Batches:
    """The input rows in ranges of input_row, answered one range at a time: the first of
    spark.batch_questions rows, each later one sized to take about spark.batch_seconds at the rate
    measured so far (None: of spark.batch_questions rows too)."""

    first: int
    seconds: float | None
    start: int = 0
    answered: int = 0
    busy_s: float = 0.0

    def next(self, end: int | None) -> tuple[int, int] | None:
        """The next range [lo, hi) of rows below `end` (None: not known yet), or None when done."""
        if end is not None and self.start >= end:
            return None
        size = self.first
        if self.answered and self.seconds is not None:
            size = max(1, int(self.answered / self.busy_s * self.seconds))
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

    tasks, totals = plan.tasks, dict[str, int]()
    live = LiveProgress(ProgressReporter(enabled=progress, desc="crag: questions"))
    with live, ThreadPoolExecutor(2, "crag-commit") as pool:
        if plan.resume:
            held = finished()
            heartbeat.start()
            live.start(plan.accepted, answered_so_far(plan))
        else:
            held = pool.submit(hold, plan, heartbeat)
            held.add_done_callback(lambda done: _held(plan, done, live))
        answered = threading.Event()
        threading.Thread(
            target=_ready_last_commits, args=(plan, held, answered), name="crag-ready", daemon=True
        ).start()
        start = first_unanswered(plan) if plan.resume else 0
        batches = Batches(plan.cfg.spark.batch_questions, plan.cfg.spark.batch_seconds, start)
        bounds, number, committing = batches.next(plan.input_rows if held.done() else None), 0, None
        try:
            while bounds is not None:
                started = time.perf_counter()
                computed = _compute(plan, number, bounds, tasks, live)
                held.result()  # the run is this process's, and its input stored
                if committing is not None:
                    _add(totals, committing.result())
                heartbeat.check()
                plan.ledger.check_held()
                batches.done(min(bounds[1], plan.input_rows) - bounds[0], time.perf_counter() - started)
                following = batches.next(plan.input_rows)
                committing = pool.submit(_commit, plan, number, bounds, computed, live, following is None)
                bounds, number = following, number + 1
        finally:  # the last batch is answered (its commit submitted), or the answering failed
            answered.set()
        held.result()
        if committing is not None:
            _add(totals, committing.result())
    return totals


def finished() -> Future:
    """A future that is done already."""
    future: Future = Future()
    future.set_result(None)
    return future


def _held(plan: RunPlan, hold: Future, live: LiveProgress) -> None:
    """The hold's end: the bar starts; or, when the run could not be claimed (another process holds
    it), the first batch's answering stops at once, its tasks interrupted (its calls are for nothing)."""
    if hold.exception() is None:
        live.start(plan.accepted, 0)
        return
    try:
        plan.warehouse.spark.interruptTag(_batch_tag(plan, 0))
    except Exception:  # the session is gone too: the batch fails with it, and the hold's error is the one told
        log.debug("could not interrupt the first batch", exc_info=True)


def _batch_tag(plan: RunPlan, number: int) -> str:
    """The Spark job tag of a batch's answering, by which it can be interrupted."""
    return f"crag-{plan.ledger.attempt}-batch-{number}"


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
    spark, tag = plan.warehouse.spark, _batch_tag(plan, number)
    spark.addTag(tag)
    try:
        return answered_rows.localCheckpoint(eager=True)
    finally:
        spark.removeTag(tag)


def _commit(plan: RunPlan, number: int, bounds: tuple[int, int], computed, live: LiveProgress, last: bool) -> dict:
    """A computed batch committed to `results` (its counts observed as Spark writes it), beside its new
    stage-cache rows and its metrics' sums (the last batch's commit stores the run's metrics)."""
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
    with ThreadPoolExecutor(2, "crag-beside-commit") as pool:
        beside = [pool.submit(_store_cache_rows, plan, computed)] if plan.cfg.cache.enabled else []
        if plan.gold_rows and not plan.resume:  # a resume scores every attempt's results at its end
            beside.append(pool.submit(_score, plan, number, bounds, computed, last))
        observed = wh.append_observed("results", rows, plan.result_totals)
        for done in beside:
            done.result()
    live.committed(number, int(observed["accepted"] or 0))
    return observed  # the computed rows go with the last reference to them (Spark cleans their blocks up)


def _score(plan: RunPlan, number: int, bounds: tuple[int, int], computed, last: bool) -> None:
    """The batch's metric sums, against its questions' gold columns; with the last batch, the run's
    metrics made of every batch's sums, and stored."""
    from pyspark.sql import functions as F  # noqa: PLC0415

    lo, hi = bounds
    source = plan.checked if number == 0 else plan.stored("inputs")
    gold = source.where(
        F.col("reason").isNull() & F.col("has_gold") & (F.col("input_row") >= lo) & (F.col("input_row") < hi)
    )
    plan.metric_sums.append(metric_sums(computed, gold))
    if last:
        with phase("metrics"):
            plan.metrics = metrics_of(pd.concat(plan.metric_sums))
            ledger = plan.ledger
            store_metrics(plan.warehouse, plan.metrics, ledger.run_id, ledger.generation, ledger.variant, replace=False)


def _add(totals: dict[str, int], observed: dict) -> None:
    for key, value in observed.items():
        totals[key] = totals.get(key, 0) + int(value or 0)


def _store_cache_rows(plan: RunPlan, computed) -> None:
    """The batch's new stage-cache rows, each key once (the cache is shared by every run)."""
    wh = plan.warehouse
    rows = new_cache_rows(computed, plan.ledger.run_id)
    wh.append("stage_cache", rows.join(wh.load("stage_cache").select("key"), "key", "left_anti"))
