"""`crag run`: a table of questions in, the run's Delta tables out, every step in Spark.

prepare   config, credentials and backends checked; the run id claimed (one writer at a time); the
          questions read, validated and de-duplicated by Spark into the run's `run_inputs__<run>` table
answer    the accepted questions not yet answered go through the stages in batches; each batch's
          stage output is committed once to `run_staging__<run>` (a killed run resumes after the last one)
finalise  answers, grades, decisions, rejects, gold and cache rows derived from the staged output,
          each table's rows of the run replaced in one commit; the row invariant and the counts
          checked with Spark aggregates; metrics, MLflow; the run's two work tables dropped

The driver plans, commits and prints aggregates: it never holds the questions, answers or grades.
"""

from __future__ import annotations

import json
import logging
import math
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import pandas as pd
import pyarrow as pa

from crag import schema
from crag.backends import build_backends, resolve_credentials, smallest_budget
from crag.backends.base import LATENCY_COUNT_NAMES, remote_calls_line
from crag.backends.remote import call_with_deadline
from crag.config import ConfigDifference, CragConfig, load_config, redacted
from crag.console import render_metrics
from crag.errors import CragError, InputError, describe
from crag.evaluation import ACTIONS, evaluate_run
from crag.ids import check_run_id
from crag.progress import ProgressReporter
from crag.questions import read_questions, validate
from crag.secrets import scrub
from crag.spark import get_spark, parallelism, run_stages
from crag.tracking import log_run
from crag.warehouse import Warehouse, is_catalog_schema, is_conflict, quote

log = logging.getLogger("crag")


def new_run_id() -> str:
    return f"{datetime.now(UTC):%Y%m%dT%H%M%SZ}-{uuid.uuid4().hex[:6]}"


def resolve_paths(cfg: CragConfig) -> CragConfig:
    """Index paths are relative to the working directory; Spark workers may run elsewhere, so they get
    absolute ones. Names that are not local paths (Unity Catalog, Volumes) are left as they are."""
    cfg = cfg.model_copy(deep=True)
    for section in (cfg.retriever, cfg.web_search):
        index = getattr(section, "index", None)
        if isinstance(index, str) and index and not index.startswith(("/", "dbfs:", "s3:", "abfss:", "gs:")):
            setattr(section, "index", str(Path(index).resolve()))
    return cfg


# ------------------------------------------------------------------ the run's record


@dataclass
class RunPlan:
    """What `prepare` settled: the run, its session and tables, and its input's size."""

    cfg: CragConfig
    run_id: str
    variant: str
    warehouse: Warehouse
    secrets: dict[str, str]
    attempt: str
    started: datetime
    input_hash: str = ""
    input_rows: int = 0
    accepted: int = 0
    rejected: int = 0
    gold_rows: int = 0
    question_ids: int = 0  # the accepted question ids' fingerprint (_id_fingerprint summed)
    # The staged rows' counts, summed over the batches this attempt committed, when it committed all of
    # them (Spark observed them while writing); None when earlier attempts staged some.
    staged_counts: dict[str, int] | None = None
    t0: float = field(default_factory=time.perf_counter)
    fresh: bool = True  # no earlier rows of this run id in the run tables: appends need not replace
    fresh_staging: bool = False  # this attempt created the staging table: no batch was committed before
    held_at: float = 0.0  # time.monotonic() of the last write that found the run this attempt's

    def heartbeat(self) -> Heartbeat:
        """Beats that keep the run this attempt's while a long step runs (three per stale period)."""
        return Heartbeat(lambda: self.record("running"), self.cfg.tables.stale_run_after_s / 3)

    def check_held(self) -> None:
        """Before a step that writes the run's rows: when this attempt has not proven its hold on the
        run for half the stale period (a process paused, a beat that could not commit), another
        process may have taken the run over, so a beat is recorded now (RunTakenOver if so). Within
        that time no other process can have found the run stale: nothing is read or written."""
        if time.monotonic() - self.held_at <= self.cfg.tables.stale_run_after_s / 2:
            return
        try:
            self.record("running")
        except RunTakenOver:
            raise
        except Exception as exc:  # not written (a busy `runs` table): the row read back says whose the run is
            row = self._row()
            if row is None or row["attempt"] != self.attempt:
                raise self._taken_over(row) from None
            log.warning(
                "run %s: its hold could not be recorded (%s); it is still this process's", self.run_id, describe(exc)
            )

    @property
    def inputs(self) -> str:
        return Warehouse.staging("run_inputs", self.run_id)

    @property
    def staging(self) -> str:
        return Warehouse.staging("run_staging", self.run_id)

    def runs_row(self, status: str, counts: dict[str, int] | None = None, finished: datetime | None = None) -> pa.Table:
        return pa.Table.from_pylist(
            [
                {
                    "run_id": self.run_id,
                    "variant": self.variant,
                    "config": json.dumps(
                        redacted(self.cfg.model_dump(mode="json")), sort_keys=True, ensure_ascii=False
                    ),
                    "config_hash": self.cfg.hash(),
                    "started_at": self.started,
                    "finished_at": finished,
                    "status": status,
                    "counts": list((counts or {}).items()),
                    "attempt": self.attempt,
                    "owner": _owner(),
                    "heartbeat_at": datetime.now(UTC),
                    "input_hash": self.input_hash,
                }
            ],
            schema=schema.RUNS,
        )

    def record(self, status: str, counts: dict[str, int] | None = None, finished: datetime | None = None) -> None:
        """The run's row in `runs` rewritten, only while it is still this attempt's: a MERGE on the run
        id and this attempt. A process that found this one stale and took the run over (claim_run) has
        put its own attempt there; then nothing is written, and RunTakenOver says so."""
        wh = self.warehouse
        result = wh.merge(
            "runs",
            wh.frame("runs", self.runs_row(status, counts, finished)),
            on="t.run_id = s.run_id AND t.attempt = s.attempt",
            clauses=f"WHEN MATCHED THEN UPDATE SET {_RUNS_SET}",
        )
        if result is None or result["num_affected_rows"] != 1:
            row = self._row()  # without row counts, the row read back says whether it was written
            if result is not None or row is None or (row["attempt"], row["status"]) != (self.attempt, status):
                raise self._taken_over(row)
        self.held_at = time.monotonic()

    def _row(self):
        rows = self.warehouse.load_run("runs", self.run_id).collect()
        return rows[0] if rows else None

    def _taken_over(self, row) -> RunTakenOver:
        holder = f"{row['owner']}, attempt {row['attempt']}" if row is not None else "its row is gone"
        return RunTakenOver(
            f"run {self.run_id!r} was taken over by another crag process ({holder}) after this one looked "
            f"stale (no heartbeat for tables.stale_run_after_s): this process stops without writing more"
        )


# A MERGE's update of every column of a `runs` row from its source row
_RUNS_SET = ", ".join(f"t.{quote(c)} = s.{quote(c)}" for c in schema.RUNS.names)


class RunTakenOver(CragError):
    """The run is no longer this attempt's: another process claimed it after this one looked stale."""


def _owner() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


@dataclass
class RunResult:
    run_id: str
    variant: str
    warehouse: str
    seconds: float
    counts: dict[str, int]
    metrics: pd.DataFrame | None = None  # when the questions carry gold columns
    tables: str = ""  # the catalog schema the tables are registered in
    status: str = "succeeded"  # as recorded in `runs`: failed when every accepted question is an error
    first_error: str | None = None  # then, one of the errors
    kept_earlier_rows: bool = False  # then, a re-run of the id left the earlier rows in place

    def summary(self) -> str:
        c = self.counts

        def group(prefix: str) -> str:
            return ", ".join(f"{k[len(prefix) :]} {v}" for k, v in sorted(c.items()) if k.startswith(prefix)) or "-"

        lines = [
            f"run {self.run_id} (variant {self.variant}) -> {self.warehouse}"
            + (f" (tables {self.tables}.<name>)" if self.tables and self.tables != self.warehouse else ""),
            f"  questions   {c['input_rows']}: {c['accepted']} accepted, {c['rejected']} rejected",
            f"  actions     {group('action_')}",
            f"  routes      {group('route_')}",
            f"  refusals    {c['refused']}",
            f"  errors      {c['errors']}",
            f"  calls       {c['search_calls']} search, {c['llm_calls']} LLM, {c['retries']} retries, "
            f"{c['cache_hits']} answered from the stage cache",
            f"  tokens      {c['prompt_tokens']} prompt, {c['completion_tokens']} completion",
            f"  grader      {c.get('grade_parse_failed', 0)} unreadable outputs, {c.get('grade_parse_repaired', 0)} repaired",
            *([f"  latency     {latency}"] if (latency := remote_calls_line(c)) else []),
            f"  wall time   {self.seconds:.1f} s",
        ]
        if self.metrics is not None and not self.metrics.empty:
            slices = ["all"] + sorted(s for s in self.metrics["slice"].unique() if s.startswith("language="))
            lines += ["", "quality against the gold columns (crag eval):", render_metrics(self.metrics, slices)]
        return "\n".join(lines)


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
    run_id = check_run_id(run_id) if run_id else new_run_id()
    if resume and spark is None and not is_catalog_schema(warehouse):
        _check_resumable_folder(Path(warehouse), run_id)
    # Credentials, indexes and clients first: a missing one fails with one clear line before anything
    # is written, and before a JVM starts when there is no session yet. With a session, the indexes
    # load while the warehouse is attached (and, to resume a run, its record read).
    secrets = resolve_credentials(cfg)
    with ThreadPoolExecutor(1, "crag-backends") as pool:
        backends_built = pool.submit(build_backends, cfg, secrets)
        if spark is None:
            backends_built.result()
        wh = Warehouse(spark or get_spark(cfg.spark), warehouse, cfg.tables)
        plan = RunPlan(cfg, run_id, variant or "base", wh, secrets, uuid.uuid4().hex, datetime.now(UTC))
        previous = _run_to_resume(plan) if resume else None
        backends_built.result()
    raw = read_questions(wh.spark, questions)
    checked = validate(wh.spark, raw, cfg.input.max_question_chars, questions)
    if previous is not None:  # resumed
        from pyspark.sql import functions as F

        plan.started = previous["started_at"]
        # The input is committed in one append into its table, created empty at the claim: a run that
        # stopped in between committed nothing, and its input is checked and written now
        stored = wh.load(plan.inputs)
        committed = bool(stored.limit(1).count())
        if committed:
            _check_same_input(checked, stored, run_id)
        claim_run(plan, previous)
        plan.fresh = False
        with failure_recorded(plan):
            if committed:
                totals = stored.agg(*_input_totals()).collect()[0].asDict()
            else:
                totals = wh.append_observed(plan.inputs, checked.withColumn("run_id", F.lit(run_id)), _input_totals())
    else:
        from pyspark.sql import functions as F

        _claim_with_work_tables(plan)
        with failure_recorded(plan):  # the input is read and checked here, as Spark writes it
            totals = wh.append_observed(plan.inputs, checked.withColumn("run_id", F.lit(run_id)), _input_totals())
    plan.input_rows, plan.accepted, plan.gold_rows = (
        int(totals["rows"]),
        int(totals["accepted"]),
        int(totals["gold_rows"]),
    )
    plan.rejected = plan.input_rows - plan.accepted
    plan.input_hash = str(totals["input_hash"])
    plan.question_ids = int(totals["question_ids"] or 0)
    log.info("run %s: %d input rows, %d accepted, %d rejected", run_id, plan.input_rows, plan.accepted, plan.rejected)
    return plan


def _check_resumable_folder(warehouse: Path, run_id: str) -> None:
    """A run to resume in a local folder is looked up with delta-rs first: a wrong id is one line in a
    second, before a JVM starts."""
    from deltalake import DeltaTable

    runs = warehouse / "runs"
    found = (
        DeltaTable.is_deltatable(str(runs))
        and DeltaTable(str(runs)).to_pyarrow_table(columns=["run_id"], filters=[("run_id", "=", run_id)]).num_rows
    )
    if not found:
        raise CragError(f"no run {run_id!r} to resume in {warehouse}")


def _input_totals() -> list:
    """The input's row counts and fingerprints, as Spark aggregates (observable while writing)."""
    from pyspark.sql import functions as F

    accepted = F.col("reason").isNull()
    return [
        F.count(F.lit(1)).alias("rows"),
        F.count_if(accepted).alias("accepted"),
        F.count_if(accepted & F.col("has_gold")).alias("gold_rows"),
        # order-free: what `--resume` checks the input against
        F.coalesce(F.bit_xor(F.xxhash64("question_id", "question", "reason", "input_row")), F.lit(0)).alias(
            "input_hash"
        ),
        F.sum(F.when(accepted, _id_fingerprint())).alias("question_ids"),
    ]


def _id_fingerprint():
    """A question id's share of a multiset fingerprint: summed over rows, it tells whether two tables
    hold the same question ids the same number of times (a duplicate and a missing id do not cancel,
    as in a count). Summed exactly, as a decimal."""
    from pyspark.sql import functions as F

    return F.xxhash64("question_id").cast("decimal(38,0)")


def _run_to_resume(plan: RunPlan):
    """The run's row in `runs`: it must exist, match the config and be unfinished."""
    rows = plan.warehouse.load_run("runs", plan.run_id).collect()
    previous = rows[0] if rows else None
    if previous is None:
        raise CragError(f"no run {plan.run_id!r} to resume in {plan.warehouse.location}")
    if previous["config_hash"] != plan.cfg.hash() or previous["variant"] != plan.variant:
        raise CragError(
            f"run {plan.run_id!r} was started with config {previous['config_hash']} (variant {previous['variant']}); "
            f"this one is {plan.cfg.hash()} (variant {plan.variant}){_differing_keys(previous, plan)}: "
            "resume with the same --conf, --variant and --set"
        )
    if previous["status"] == "succeeded":
        # a process stopped between recording the run and dropping its work tables left them behind
        left = [t for t in (plan.inputs, plan.staging) if plan.warehouse.exists(t)]
        for table in left:
            plan.warehouse.drop(table)
        removed = " (the work tables it had left behind are removed)" if left else ""
        raise CragError(f"run {plan.run_id!r} has already succeeded: nothing to resume{removed}")
    if not plan.warehouse.exists(plan.inputs):
        raise CragError(
            f"run {plan.run_id!r} left no record of its input to resume from: start it again without --resume"
        )
    return previous


def _differing_keys(previous, plan: RunPlan, shown: int = 5) -> str:
    """Which keys of the stored config differ from this one's, by name only, to keep the line short:
    ", differing in k1, k2". Nothing when only the variant's name differs (the line gives both)."""
    if previous["config_hash"] == plan.cfg.hash():
        return ""
    difference = ConfigDifference.between(
        json.loads(previous["config"]),
        previous["config_hash"],
        redacted(plan.cfg.model_dump(mode="json")),
        plan.cfg.hash(),
    )
    if difference.masked:
        return ", differing in a value stored masked"  # a setting kept out of stored configs (a store's text_key)
    keys = difference.keys()
    more = f" and {len(keys) - shown} more" if len(keys) > shown else ""
    return f", differing in {', '.join(keys[:shown])}{more}"


def _check_same_input(checked, stored, run_id: str) -> None:
    """Refuse to resume over questions that differ from the ones the run started with: the rows here
    and not in the run's input, and the other way round, counted as multisets (each is what
    `exceptAll` would leave) in one pass over both."""
    from pyspark.sql import functions as F

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


def claim_run(plan: RunPlan, previous=None) -> bool:
    """Make this process the run's only writer: a MERGE into `runs` that inserts the run, or takes over
    one that is not running (or whose writer is gone). Delta lets only one of two concurrent MERGEs
    commit, so two processes cannot both hold a run id. The MERGE says how many rows it changed: one
    means the run is this attempt's; none, that the run id is not new, or another process got there
    first, and only then is the run's row read. `previous`: the run's row, if read already (None: the
    id is taken to be new, which a new run's id nearly always is). True when the MERGE inserted the
    run (its id was new)."""
    wh = plan.warehouse
    for _ in range(10):
        takeover = None
        if previous is not None and previous["status"] == "running" and previous["attempt"] != plan.attempt:
            if not _writer_gone(previous, plan.cfg.tables.stale_run_after_s):
                raise CragError(
                    f"run {plan.run_id!r} is being written by another crag process ({previous['owner']}, last "
                    f"heartbeat {previous['heartbeat_at']:%Y-%m-%d %H:%M:%S} UTC): wait for it to end, or resume it "
                    f"after it stops (crag run --resume {plan.run_id})"
                )
            takeover = previous["attempt"]
        try:
            inserted = _merge_claim(plan, takeover, new_run=previous is None)
            if inserted is not None:
                plan.held_at = time.monotonic()
                return inserted
        except Exception as exc:
            if not is_conflict(exc):
                raise
        rows = wh.load_run("runs", plan.run_id).collect()
        previous = rows[0] if rows else None
        if previous is not None and previous["attempt"] == plan.attempt:  # committed, though no reply said so
            plan.held_at = time.monotonic()
            return False  # new or not, unknown: the run's rows are replaced, which is right either way
        time.sleep(0.2)
    raise CragError(f"could not claim run {plan.run_id!r}: the runs table kept changing under this process")


def _claim_with_work_tables(plan: RunPlan) -> None:
    """Claim the run (plan.fresh: its id was new) and give it two empty work tables. When none is left
    by an earlier attempt, they are created beside the claim (empty tables of a fixed schema: a
    process that then fails to claim the run harms no one by having created them); otherwise the
    earlier attempt's are dropped once the run is this process's."""
    wh = plan.warehouse
    work = (plan.inputs, plan.staging)
    left_over = any(wh.exists(t) for t in work)
    with ThreadPoolExecutor(2, "crag-create") as pool:
        created = [] if left_over else [pool.submit(wh.ensure, t) for t in work]
        try:
            plan.fresh = claim_run(plan)
        except BaseException:
            wait(created)  # the claim's failure is the one to report
            raise
        with failure_recorded(plan):
            for creation in created:
                creation.result()
            if left_over:
                for table in work:
                    wh.drop(table)
                for creation in [pool.submit(wh.ensure, t) for t in work]:
                    creation.result()
    plan.fresh_staging = True


@contextmanager
def failure_recorded(plan: RunPlan) -> Iterator[None]:
    """Once the run is this process's, a failure (an exception, Ctrl-C, SIGTERM) is recorded as the
    run's `failed` status before it propagates: the run never stays `running` with no writer."""
    try:
        yield
    except BaseException:
        _record_failure(plan)
        raise


def _record_failure(plan: RunPlan) -> None:
    """The run recorded as failed, the failure that ended it left to be reported. A Ctrl-C or SIGTERM
    can leave the main thread's connection to the JVM in the middle of a call, so a first attempt that
    fails is made again on a thread of its own (a connection of its own)."""

    def record() -> None:
        plan.record("failed", finished=datetime.now(UTC))

    try:
        record()
        return
    except RunTakenOver:
        return  # the run is another process's now: its row is that process's to write
    except Exception:
        log.debug("could not record the failed run from the main thread", exc_info=True)
    try:
        call_with_deadline(record, 120, "recording the failed run")
    except RunTakenOver:
        return
    except Exception as exc:
        log.warning(
            "run %s could not be recorded as failed (%s): it shows as running until resumed", plan.run_id, describe(exc)
        )


def _writer_gone(row, stale_after_s: float) -> bool:
    host, _, pid = (row["owner"] or "").rpartition(":")
    if host == socket.gethostname() and pid.isdigit():
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
    beat = row["heartbeat_at"]
    return beat is None or (datetime.now(UTC) - beat.replace(tzinfo=UTC)).total_seconds() > stale_after_s


def _merge_claim(plan: RunPlan, takeover: str | None, new_run: bool) -> bool | None:
    """Whether the run id was new (the MERGE inserted it) when this attempt now holds the run; None
    when it does not. A run id taken to be new is claimed by an insert-only MERGE (one join, no file
    rewritten); otherwise the MERGE also updates a run that is not running (or is `takeover`'s)."""
    wh = plan.warehouse
    row = plan.runs_row("running")
    if not wh.ensure("runs"):  # another process is creating it: claim_run looks again shortly
        return None
    columns = schema.RUNS.names
    names = ", ".join(quote(c) for c in columns)
    values = ", ".join(f"s.{quote(c)}" for c in columns)
    update = ""
    if not new_run:
        update = f"WHEN MATCHED AND (t.status <> 'running' OR t.attempt <=> s.takeover) THEN UPDATE SET {_RUNS_SET} "
    result = wh.merge(
        "runs",
        wh.spark.createDataFrame(row.append_column("takeover", pa.array([takeover], pa.string()))),
        on="t.run_id = s.run_id",
        clauses=f"{update}WHEN NOT MATCHED THEN INSERT ({names}) VALUES ({values})",
    )
    # Delta's MERGE returns its row counts; without them, claim_run reads the run's row back
    if result is None or result["num_affected_rows"] != 1:
        return None
    return bool(result["num_inserted_rows"])


# ------------------------------------------------------------------ answer


class Heartbeat:
    """Calls `beat` every `every_s` seconds on a thread of its own until the block ends, so that a
    long batch never makes a live run look stale to another process (tables.stale_run_after_s), and
    the heartbeat's commit never stands between two batches. A failed beat is logged; the next one
    tries again. A beat that finds the run taken over (RunTakenOver) ends the beats, and the run with
    them: `check` raises it between batches, and so does the block's end."""

    def __init__(self, beat: Callable[[], None], every_s: float):
        self._beat, self._every_s = beat, every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="crag-heartbeat", daemon=True)
        self.lost: RunTakenOver | None = None

    def _loop(self) -> None:
        while not self._stop.wait(self._every_s):
            try:
                self._beat()
            except RunTakenOver as exc:
                self.lost = exc
                return
            except Exception as exc:  # the run goes on; a beat missed is a beat late
                log.warning("heartbeat not recorded (%s): the next one tries again", scrub(str(exc))[:200])

    def check(self) -> None:
        if self.lost is not None:
            raise self.lost

    def __enter__(self) -> Heartbeat:
        self._thread.start()
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self._stop.set()
        self._thread.join()  # a beat in progress ends before the run records its outcome
        if exc_type is None:
            self.check()


def answer_batches(plan: RunPlan, progress: bool | None = None) -> None:
    """The accepted questions without a staged answer, in committed batches of spark.batch_questions,
    one batch at a time: a batch queued behind a running one would take the task slot the heartbeat's
    commit needs (crag.spark.parallelism), and its tasks would run beside the running batch's, over
    the endpoints' budgets (each shared out among one batch's tasks). `progress`: questions done /
    total, rate and time left after each batch on stderr (None: when stderr is a terminal)."""
    from pyspark.sql import functions as F

    wh, cfg = plan.warehouse, plan.cfg
    inputs = wh.load(plan.inputs).where(F.col("reason").isNull()).select("question_id", "question")
    counted: dict[str, int] = {}
    if plan.fresh_staging:
        todo, remaining = inputs, plan.accepted
        plan.staged_counts = counted  # complete once every batch is committed (finalise reads it then)
    else:  # resumed: what the earlier attempts committed is not answered again
        todo = inputs.join(wh.load(plan.staging).select("question_id"), "question_id", "left_anti")
        remaining = todo.count()
    if remaining < plan.accepted:
        log.info("resuming: %d questions already answered, %d to go", plan.accepted - remaining, remaining)
    if not remaining:
        return
    batches = math.ceil(remaining / cfg.spark.batch_questions)
    slots = parallelism(wh.spark, cfg.spark)
    bucket = F.pmod(F.xxhash64("question_id"), F.lit(batches))
    size = math.ceil(remaining / batches)
    partitions = max(1, min(slots, size))  # slots: spark.partitions when set (crag.spark.parallelism)
    budget = smallest_budget(cfg)
    if budget is not None and budget[1] < partitions:
        log.info(
            "%d tasks at once, not %d: the endpoint of %s takes %d requests at a time (max_concurrency), "
            "and every task keeps one in flight",
            budget[1],
            partitions,
            budget[0],
            budget[1],
        )
        partitions = budget[1]
    reporter = ProgressReporter(enabled=progress, desc="crag: questions").start(
        plan.accepted, plan.accepted - remaining
    )

    def staged(i: int):
        batch = todo.where(bucket == i)
        if cfg.cache.enabled:
            batch = _with_stored_results(wh, batch)
        else:
            batch = batch.withColumn("cache", _no_stored_results())
        return run_stages(batch, cfg, plan.secrets, partitions).select(
            F.lit(plan.run_id).alias("run_id"),
            F.lit(i).cast("int").alias("batch"),
            "*",
            F.current_timestamp().alias("created_at"),
        )

    answered = plan.accepted - remaining
    with plan.heartbeat() as heartbeat:
        for i in range(batches):
            plan.check_held()
            observed = wh.append_observed(plan.staging, staged(i), _count_aggregates())
            for key, value in observed.items():
                counted[key] = counted.get(key, 0) + int(value or 0)
            committed = int(observed["accepted"] or 0)  # the batch's rows, counted as Spark wrote them
            answered += committed
            reporter.advance(committed)
            heartbeat.check()
            if not reporter.enabled:  # the bar says it on a terminal; a log line says it elsewhere
                log.info("batch %d/%d committed: %d of %d questions answered", i + 1, batches, answered, plan.accepted)
    reporter.close()


def _no_stored_results():
    """An empty `cache` column, typed as schema.STAGE_INPUT types it."""
    from pyspark.sql import functions as F
    from pyspark.sql.pandas.types import from_arrow_type

    return F.expr("array()").cast(from_arrow_type(schema.STAGE_INPUT.field("cache").type))


def _with_stored_results(wh: Warehouse, batch):
    """The batch's questions with the stage-cache rows filed under them (crag.cache), joined in Spark."""
    from pyspark.sql import functions as F

    keyed = batch.withColumn("question_key", F.substring(F.sha2("question", 256), 1, 24))
    stored = (
        wh.load("stage_cache")
        .join(keyed.select("question_key").distinct(), "question_key")
        .dropDuplicates(["key"])
        .groupBy("question_key")
        .agg(F.collect_list(F.struct("key", "value")).alias("cache"))
    )
    empty = _no_stored_results()
    return keyed.join(stored, "question_key", "left").select(
        "question_id", "question", F.coalesce("cache", empty).alias("cache")
    )


# ------------------------------------------------------------------ finalise


def _derived_tables(plan: RunPlan, staged) -> dict:
    """Each run table's rows, derived from the staged stage output (one row per question)."""
    from pyspark.sql import functions as F

    wh = plan.warehouse
    run_cols = [F.lit(plan.run_id).alias("run_id"), F.lit(plan.variant).alias("variant")]
    created = F.col("created_at")

    def exploded(column: str, target: pa.Schema):
        items = staged.select("question_id", created, F.explode(column).alias("item"))
        fields = [f for f in target.names if f not in ("run_id", "variant", "question_id", "created_at")]
        return items.select(*run_cols, "question_id", *[F.col(f"item.{f}").alias(f) for f in fields])

    inputs = wh.load(plan.inputs)
    gold_fields = [f for f in schema.GOLD.names if f not in ("run_id", "variant")]
    return {
        "answers": staged.select(*run_cols, *[c for c in schema.ANSWERS.names if c not in ("run_id", "variant")]),
        "grades": exploded("grades", schema.GRADES),
        "decisions": exploded("decisions", schema.DECISIONS),
        "rejects": inputs.where(F.col("reason").isNotNull()).select(
            *run_cols, "question_id", "question", "input_row", "reason", F.current_timestamp().alias("created_at")
        ),
        "gold": inputs.where(F.col("reason").isNull() & F.col("has_gold")).select(*run_cols, *gold_fields),
    }


def finalise(plan: RunPlan, status: str = "succeeded") -> RunResult:
    """The run's tables written from its staged output, and the run recorded with `status` and its
    counts (`failed` for a run that accepted no question: its rejects are its only rows)."""
    from pyspark.sql import functions as F

    wh, run_id = plan.warehouse, plan.run_id
    staged = wh.load(plan.staging)
    counts = run_counts(plan)
    if counts["accepted"] > plan.accepted:
        # A batch that was still being written when its process died (a Spark Connect server finishes
        # what a killed client started) can commit after --resume has answered its questions again.
        staged = staged.dropDuplicates(["question_id"])
        deduplicated = run_counts(plan, staged)
        log.warning(
            "%d questions were staged twice (a batch committed after its process stopped): each is kept once",
            counts["accepted"] - deduplicated["accepted"],
        )
        counts = deduplicated
    check_invariant(counts, plan)
    del counts["question_ids"]  # a fingerprint, not a count
    all_errors = bool(counts["accepted"]) and counts["errors"] == counts["accepted"]
    if all_errors:
        status = "failed"  # nothing was answered: an endpoint was down all along
    # A re-run that failed so keeps the earlier rows of its run id, as any failed re-run does; a new
    # run's tables get its error rows, which say why
    keep_earlier = all_errors and not plan.fresh
    first_error = staged.where(F.col("error").isNotNull()).select("error").first()[0] if all_errors else None
    derived = _derived_tables(plan, staged)
    is_run = F.col("run_id") == F.lit(run_id)
    # Independent tables: their commits overlap. Each is one atomic replace of the run's rows (an
    # append when the run id is new, or the table is, which need not look for rows to replace; a table
    # the new run has no rows for, known from the input's counts, only has to exist: no empty version
    # in its log).
    # The run stays held while its tables are written (minutes for a large run): without a beat it
    # would look stale to another process, which could take it over in the middle
    plan.check_held()
    with plan.heartbeat(), ThreadPoolExecutor(max_workers=len(derived) + 1, thread_name_prefix="crag-commit") as pool:
        if keep_earlier:
            writes = []
        elif plan.fresh:
            without_rows = {name for name, rows in (("rejects", plan.rejected), ("gold", plan.gold_rows)) if not rows}
            writes = [
                pool.submit(wh.ensure, name) if name in without_rows else pool.submit(wh.append, name, frame)
                for name, frame in derived.items()
            ]
        else:
            writes = [pool.submit(_replace_run_rows, wh, name, frame, is_run) for name, frame in derived.items()]
        writes.append(pool.submit(_store_cache_rows, plan))
        evaluated = None
        if not keep_earlier:
            if plan.gold_rows:  # from the same derived rows, beside their commits
                evaluated = pool.submit(evaluate_run, wh, run_id, plan.variant, derived, not plan.fresh)
            elif not plan.fresh:  # answered again without gold: its earlier metrics describe other answers
                writes.append(pool.submit(_forget_rows, wh, "metrics", is_run))
            if not plan.fresh:  # and its earlier comparisons compared them
                in_pair = (F.col("base_run") == F.lit(run_id)) | (F.col("candidate_run") == F.lit(run_id))
                writes.append(pool.submit(_forget_rows, wh, "comparisons", in_pair))
        for write in writes:
            write.result()
        metrics = evaluated.result() if evaluated else None
    seconds = time.perf_counter() - plan.t0
    plan.record(status, counts, datetime.now(UTC))
    for table in (plan.staging, plan.inputs):
        wh.drop(table)
    try:
        mlflow_run = log_run(
            plan.cfg,
            wh.location,
            run_id,
            plan.variant,
            counts,
            metrics,
            seconds,
            redacted(plan.cfg.model_dump(mode="json")),
            status,
        )
    except Exception as exc:  # the tables are the run's record, written and recorded above: it stands
        log.warning("run %s is written, but it was not logged to MLflow (%s)", run_id, describe(exc))
        mlflow_run = None
    if mlflow_run:
        log.info("logged to MLflow run %s", mlflow_run)
    return RunResult(
        run_id,
        plan.variant,
        wh.location,
        seconds,
        counts,
        metrics,
        f"{wh.catalog}.{wh.schema}",
        status,
        first_error,
        keep_earlier,
    )


def _replace_run_rows(wh: Warehouse, table: str, rows, is_run) -> None:
    """The run's rows in `table` replaced by `rows`. Only the run's claimant writes them, so a table
    that is not there yet holds none of them: appending (which creates it) is then the replace,
    without a search for rows to remove (a resumed run into a new warehouse)."""
    if wh.exists(table):
        wh.replace(table, rows, is_run)
    else:
        wh.append(table, rows)


def _forget_rows(wh: Warehouse, table: str, condition) -> None:
    if wh.exists(table):
        wh.replace(table, wh.empty(table), condition)


def _store_cache_rows(plan: RunPlan) -> None:
    """New stage-cache rows of the run, once each (the cache is shared by every run)."""
    from pyspark.sql import functions as F

    if not plan.cfg.cache.enabled:
        return
    wh = plan.warehouse
    staged = wh.load(plan.staging)
    rows = (
        staged.select(F.explode("cache_entries").alias("e"), "created_at")
        .select("e.key", "e.question_key", "e.role", "e.value", F.lit(plan.run_id).alias("run_id"), "created_at")
        .dropDuplicates(["key"])
    )
    wh.append("stage_cache", rows.join(wh.load("stage_cache").select("key"), "key", "left_anti"))


ROUTES = ("internal", "web", "mixed", "refused", "error")
PARSE_STATUSES = ("repaired", "failed")


def _count_aggregates() -> list:
    """The run's totals over staged stage output, as Spark aggregates: over the whole staging table, or
    observed while each batch is written and then summed (every one is a sum or a count)."""
    from pyspark.sql import functions as F

    def graded(status: str):
        return F.coalesce(F.sum(F.size(F.filter("grades", lambda g: g["parse_status"] == status))), F.lit(0))

    return [
        F.count(F.lit(1)).alias("accepted"),
        F.coalesce(F.sum(_id_fingerprint()), F.lit(0)).alias("question_ids"),
        F.count_if(F.col("refused")).alias("refused"),
        F.count("error").alias("errors"),
        *[
            F.coalesce(F.sum(c), F.lit(0)).alias(c)
            for c in ("search_calls", "llm_calls", "prompt_tokens", "completion_tokens", "retries", "cache_hits")
            + ("queued_calls", "queue_ms")
        ],
        *[F.coalesce(F.sum(F.col("call_ms_hist")[i]), F.lit(0)).alias(n) for i, n in enumerate(LATENCY_COUNT_NAMES)],
        F.coalesce(F.sum("n_relevant"), F.lit(0)).alias("relevant_docs"),
        *[F.count_if(F.col("action") == a).alias(f"action_{a}") for a in ACTIONS],
        *[F.count_if(F.col("route") == r).alias(f"route_{r}") for r in ROUTES],
        *[graded(s).alias(f"grade_parse_{s}") for s in PARSE_STATUSES],
    ]


def run_counts(plan: RunPlan, staged=None) -> dict[str, int]:
    """The run's totals: summed from what was observed while this attempt wrote each batch, or (after
    a resume, or given `staged`) one Spark aggregate over the staged stage output. Zero action, route
    and parse counts are left out; `question_ids` is the staged ids' fingerprint (check_invariant)."""
    if staged is None and plan.staged_counts is not None:
        totals = dict(plan.staged_counts)
    else:
        staged = plan.warehouse.load(plan.staging) if staged is None else staged
        totals = {k: int(v or 0) for k, v in staged.agg(*_count_aggregates()).collect()[0].asDict().items()}
    counts = {"input_rows": plan.input_rows, "rejected": plan.rejected}
    counts.update(
        {k: v for k, v in totals.items() if v or not k.startswith(("action_", "route_", "grade_parse_", "calls_ms_"))}
    )
    return counts


def check_invariant(counts: dict[str, int], plan: RunPlan) -> None:
    """accepted + rejected = input rows, and every accepted question exactly once in answers."""
    if counts["accepted"] + counts["rejected"] != plan.input_rows or counts["accepted"] != plan.accepted:
        raise CragError(
            f"row accounting failed: {counts['accepted']} answers + {counts['rejected']} rejects != "
            f"{plan.input_rows} input rows ({plan.accepted} accepted)"
        )
    if counts["question_ids"] != plan.question_ids:
        raise CragError(
            "row accounting failed: the answered question ids are not the accepted ones "
            "(as many answers as questions, but some question answered twice and another not at all)"
        )


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
    existing run id is answered again, and its previous rows stay until the new ones replace them."""
    plan = prepare(conf, questions, warehouse, variant, run_id, list(overrides), spark, resume)
    with failure_recorded(plan):
        if plan.accepted:
            answer_batches(plan, progress)
            return finalise(plan)
        finalise(plan, status="failed")  # with its counts: every input row is in its rejects
    raise InputError(
        f"no question was accepted: all {plan.input_rows} input rows were rejected "
        f"(see the rejects table of run {plan.run_id})"
    )
