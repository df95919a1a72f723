"""`crag run --resume`: the run's generation taken over, its input checked against the one it started
with, its unanswered questions found, and its counts made over every attempt's results. Committed
batches are kept and sent to no backend again."""

from __future__ import annotations

import logging

from pyspark.sql import functions as F

from crag.batches import input_totals, store_input, take_totals
from crag.counts import RunCounts, aggregates
from crag.errors import CragError
from crag.job import RunPlan

log = logging.getLogger("crag")


def continue_run(plan: RunPlan, previous) -> None:
    """Claim the run's generation (`previous`: its row in `runs`) and settle its input: the one stored
    when it started, which the questions given now must match, or, when the run stopped before
    storing it, these questions, stored now."""
    ledger = plan.ledger
    stored = plan.stored("inputs")
    committed = bool(stored.limit(1).count())
    if committed:
        check_same_input(plan.checked, stored, ledger.run_id)
    plan.fresh = ledger.claim(previous, resume=True)
    with ledger.failure_recorded():
        if committed:
            take_totals(plan, stored.agg(*input_totals()).collect()[0].asDict())
        else:
            store_input(plan)


def answered_so_far(plan: RunPlan) -> int:
    """The questions the run's earlier attempts answered and committed, said in a line."""
    answered = plan.stored("results").count()
    log.info("resuming: %d questions already answered, %d to go", answered, plan.accepted - answered)
    return answered


def first_unanswered(plan: RunPlan) -> int:
    """The input row of the first accepted question without a committed answer (past the last row when
    every one has one)."""
    todo = (
        plan.stored("inputs")
        .where(F.col("reason").isNull())
        .join(plan.stored("results").select("question_id"), "question_id", "left_anti")
    )
    first = todo.agg(F.min("input_row")).collect()[0][0]
    return plan.input_rows if first is None else int(first)


def check_same_input(checked, stored, run_id: str) -> None:
    """Refuse to resume over questions that differ from the ones the run started with: the rows here
    and not in the run's input, and the other way round, counted as multisets (each is what
    `exceptAll` would leave) in one pass over both."""
    key = ["question_id", "question", "input_row"]
    sides = checked.select(*key, F.lit(1).alias("side")).unionByName(stored.select(*key, F.lit(-1).alias("side")))

    def differences(columns: list[str]) -> tuple[int, int]:
        surplus = sides.groupBy(*columns).agg(F.sum("side").alias("n"))  # copies here minus copies in the input
        totals = surplus.agg(
            F.sum(F.greatest("n", F.lit(0))).alias("added"), F.sum(F.greatest(-F.col("n"), F.lit(0))).alias("removed")
        ).collect()[0]
        return int(totals["added"] or 0), int(totals["removed"] or 0)

    added, removed = differences(key)
    if not (added or removed):
        return
    if differences(key[:2]) == (0, 0):  # the same rows, at other places in the file
        raise CragError(
            f"run {run_id!r} was started on these questions in another order ({added} row(s) moved): a resume "
            f"checks each row at its place in the file, so resume with the file as it was, or start a new run"
        )
    raise CragError(
        f"run {run_id!r} was started on other questions: {added} row(s) here are not in its input and "
        f"{removed} of its rows are not here (changed text counts in both): resume with the same "
        f"--questions, or start a new run"
    )


def recount(plan: RunPlan) -> tuple[RunCounts, int]:
    """The generation's counts over its stored results (after a resume, whose earlier attempts
    committed some of them), with their id fingerprint. A batch that was still being written when
    its process died (a Spark Connect server finishes what a killed client started) can commit after
    the resume answered its questions again: each question is kept once."""
    wh, ledger = plan.warehouse, plan.ledger
    results = plan.stored("results")
    totals = results.agg(*aggregates()).collect()[0].asDict()
    if int(totals["accepted"] or 0) > plan.accepted:
        kept = results.dropDuplicates(["question_id"]).localCheckpoint(eager=True)
        same = (F.col("run_id") == F.lit(ledger.run_id)) & (F.col("generation") == F.lit(ledger.generation))
        wh.replace("results", kept, same)
        log.warning(
            "%d questions were answered twice (a batch committed after its process stopped): each is kept once",
            int(totals["accepted"]) - kept.count(),
        )
        totals = kept.agg(*aggregates()).collect()[0].asDict()
    return RunCounts.of_results(totals, plan.input_rows, plan.rejected), int(totals["question_ids"] or 0)
