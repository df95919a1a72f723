"""`crag run`: questions in, five Delta tables out.

read + validate questions (driver) -> stages on Spark -> split the nested stage output into answers,
grades and decisions -> write every table for this run_id -> check that accepted + rejected = input rows.
"""

from __future__ import annotations

import json
import sys
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import pandas as pd
import pyarrow as pa

from crag import schema, tables
from crag.backends import build_backends, resolve_credentials
from crag.config import CragConfig, load_config, redacted
from crag.errors import CragError
from crag.evaluation import evaluate, metrics_table, store_metrics
from crag.questions import GOLD_COLUMNS, validate_questions


def log(message: str) -> None:
    print(f"crag: {message}", file=sys.stderr, flush=True)


def new_run_id() -> str:
    return f"{datetime.now(timezone.utc):%Y%m%dT%H%M%SZ}-{uuid.uuid4().hex[:6]}"


def resolve_paths(cfg: CragConfig) -> CragConfig:
    """Index paths are relative to the working directory; Spark workers may run elsewhere, so they get
    absolute ones. Names that are not local paths (Unity Catalog, Volumes) are left as they are."""
    cfg = cfg.model_copy(deep=True)
    for section in (cfg.retriever, cfg.web_search):
        if getattr(section, "index", None) and not section.index.startswith(("/", "dbfs:", "s3:", "abfss:", "gs:")):
            section.index = str(Path(section.index).resolve())
    return cfg


@dataclass
class RunResult:
    run_id: str
    variant: str
    warehouse: str
    input_rows: int
    answers: pd.DataFrame
    rejects: pd.DataFrame
    seconds: float
    counts: dict[str, int] = field(default_factory=dict)
    metrics: pd.DataFrame | None = None  # when the questions carry gold columns

    def summary(self) -> str:
        a = self.answers
        lines = [
            f"run {self.run_id} (variant {self.variant}) -> {self.warehouse}",
            f"  questions   {self.input_rows}: {len(a)} accepted, {len(self.rejects)} rejected",
            f"  actions     {_fmt(Counter(a['action'].dropna()))}",
            f"  routes      {_fmt(Counter(a['route']))}",
            f"  refusals    {int(a['refused'].sum())}",
            f"  errors      {int(a['error'].notna().sum())}",
            f"  calls       {int(a['search_calls'].sum())} search, {int(a['llm_calls'].sum())} LLM, "
            f"{int(a['retries'].sum())} retries, {int(a['cache_hits'].sum())} answered from the stage cache",
            f"  tokens      {int(a['prompt_tokens'].sum())} prompt, {int(a['completion_tokens'].sum())} completion",
            f"  grader      {self.counts.get('grade_parse_failed', 0)} unreadable outputs, "
            f"{self.counts.get('grade_parse_repaired', 0)} repaired",
            f"  wall time   {self.seconds:.1f} s",
        ]
        if self.metrics is not None and not self.metrics.empty:
            slices = ["all"] + sorted(s for s in self.metrics["slice"].unique() if s.startswith("language="))
            lines += ["", "quality against the gold columns (crag eval):", metrics_table(self.metrics, slices)]
        return "\n".join(lines)


def _fmt(counter: Counter) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(counter.items())) or "-"


def split_stage_output(result: pa.Table, run_id: str, variant: str, created_at: datetime) -> dict[str, pa.Table]:
    """The nested per-question rows -> answers, grades and decisions tables (in Arrow: a row of Python
    objects per grade would cost seconds on large batches)."""
    nested = ("grades", "decisions", "cache_entries")

    def table(columns: dict, rows: int, target: pa.Schema) -> pa.Table:
        driver_side = {"run_id": run_id, "variant": variant, "created_at": created_at}
        for name, value in driver_side.items():
            if name in target.names:
                columns[name] = pa.array([value] * rows, target.field(name).type)
        return pa.table(columns).select(target.names).cast(target)

    answers = table({name: result.column(name) for name in result.column_names if name not in nested},
                    result.num_rows, schema.ANSWERS)

    def explode(column: str, target: pa.Schema) -> pa.Table:
        lists = result.column(column).combine_chunks()
        items = lists.flatten()
        columns = {"question_id": result.column("question_id").combine_chunks().take(lists.value_parent_indices())}
        columns.update({field.name: items.field(field.name) for field in items.type})
        return table(columns, len(items), target)

    cache_rows = {}
    for items in result.column("cache_entries").to_pylist():
        for item in items or []:
            cache_rows.setdefault(item["key"], {**item, "run_id": run_id, "created_at": created_at})
    return {
        "answers": answers,
        "grades": explode("grades", schema.GRADES),
        "decisions": explode("decisions", schema.DECISIONS),
        "stage_cache": pa.Table.from_pylist(list(cache_rows.values()), schema=schema.STAGE_CACHE),
    }


def _runs_row(run_id, variant, cfg: CragConfig, started, finished, status, counts) -> pa.Table:
    return pa.Table.from_pylist(
        [
            {
                "run_id": run_id,
                "variant": variant,
                "config": json.dumps(redacted(cfg.model_dump(mode="json")), sort_keys=True, ensure_ascii=False),
                "config_hash": cfg.hash(),
                "started_at": started,
                "finished_at": finished,
                "status": status,
                "counts": list(counts.items()),
            }
        ],
        schema=schema.RUNS,
    )


def run_counts(answers: pd.DataFrame, grades: pd.DataFrame, rejects: pd.DataFrame, input_rows: int) -> dict[str, int]:
    counts = {
        "input_rows": input_rows,
        "accepted": len(answers),
        "rejected": len(rejects),
        "refused": int(answers["refused"].sum()),
        "errors": int(answers["error"].notna().sum()),
        "search_calls": int(answers["search_calls"].sum()),
        "llm_calls": int(answers["llm_calls"].sum()),
        "prompt_tokens": int(answers["prompt_tokens"].sum()),
        "completion_tokens": int(answers["completion_tokens"].sum()),
        "retries": int(answers["retries"].sum()),
        "cache_hits": int(answers["cache_hits"].sum()),
        "relevant_docs": int(answers["n_relevant"].sum()),
    }
    counts.update({f"grade_parse_{k}": v for k, v in Counter(grades["parse_status"].dropna()).items()})
    counts.update({f"action_{k}": v for k, v in Counter(answers["action"].dropna()).items()})
    counts.update({f"route_{k}": v for k, v in Counter(answers["route"]).items()})
    return counts


# Tables that hold one run's rows; a fresh run with an existing id clears them first.
RUN_TABLES = ("answers", "grades", "decisions", "rejects", "gold", "metrics")


def _batches(frame: pd.DataFrame, size: int):
    for start in range(0, len(frame), size):
        yield frame.iloc[start : start + size]


def _previous_run(warehouse: str, run_id: str, backend: str, spark, cfg: CragConfig, variant: str) -> pd.Series:
    if not tables.table_exists(warehouse, "runs", backend, spark):
        raise CragError(f"no run {run_id!r} to resume in {warehouse}")
    runs = tables.read_table(warehouse, "runs", backend, spark, run_id=run_id)
    if runs.empty:
        raise CragError(f"no run {run_id!r} to resume in {warehouse}")
    previous = runs.iloc[0]
    if previous["config_hash"] != cfg.hash() or previous["variant"] != variant:
        raise CragError(
            f"run {run_id!r} was started with config {previous['config_hash']} (variant {previous['variant']}); "
            f"this one is {cfg.hash()} (variant {variant}): resume with the same --conf, --variant and --set"
        )
    return previous


def _completed(warehouse: str, run_id: str, backend: str, spark) -> set[str]:
    """Question ids whose answers were committed; grades and decisions of an interrupted batch (written
    before its answers) are deleted, so that batch runs again cleanly."""
    if not tables.table_exists(warehouse, "answers", backend, spark):
        return set()
    done = set(tables.read_table(warehouse, "answers", backend, spark, run_id=run_id)["question_id"])
    for name in ("grades", "decisions"):
        if tables.table_exists(warehouse, name, backend, spark):
            stored = set(tables.read_table(warehouse, name, backend, spark, run_id=run_id)["question_id"])
            tables.delete_rows(warehouse, name, run_id, sorted(stored - done), backend, spark)
    return done


def _stored_results(warehouse: str, questions: pd.Series, backend: str, spark) -> list[list[dict]]:
    """The stage-cache entries filed under each question (crag.cache)."""
    from crag.cache import question_key

    keys = [question_key(q) for q in questions]
    stored = tables.read_cache(warehouse, sorted(set(keys)), backend, spark)
    by_question: dict[str, list[dict]] = {}
    for row in stored.drop_duplicates("key").itertuples(index=False):
        by_question.setdefault(row.question_key, []).append({"key": row.key, "value": row.value})
    return [by_question.get(k, []) for k in keys]


def run(
    conf: str | None,
    questions: str,
    warehouse: str,
    variant: str | None = None,
    run_id: str | None = None,
    overrides: list[str] = (),
    spark=None,
    resume: bool = False,
) -> RunResult:
    """Answer the questions and write every table of the run.

    Accepted questions go through Spark in batches of spark.batch_questions; each batch's grades and
    decisions are committed, then its answers, which mark the batch done. With `resume`, a run that
    was killed or failed continues: committed questions are kept and not sent to any backend again.
    Without it, an existing run id is started over (its rows replaced).
    """
    t0 = time.perf_counter()
    metrics = None
    cfg = resolve_paths(load_config(conf, overrides, variant))
    variant_name = variant or "base"
    if resume and not run_id:
        raise CragError("--resume needs the id of the run to continue")
    run_id = tables.check_run_id(run_id) if run_id else new_run_id()
    backend = cfg.tables.resolved()

    # Credentials, indexes and clients first: a missing one fails in seconds with one clear line,
    # before any input is read or any Spark work starts.
    secrets = resolve_credentials(cfg)
    build_backends(cfg, secrets)

    from crag.spark import get_spark, run_stages

    if spark is None and backend == "unity_catalog":
        spark = get_spark(cfg.spark)  # Unity Catalog tables are read through Spark
    raw = tables.read_questions(questions, spark=spark)
    accepted, rejects = validate_questions(raw, cfg.input.max_question_chars)
    spark = spark or get_spark(cfg.spark)
    write = lambda name, rows: tables.write_run_rows(warehouse, name, rows, run_id, backend, spark)  # noqa: E731
    append = lambda name, rows: tables.append_rows(warehouse, name, rows, backend, spark)  # noqa: E731
    started = datetime.now(timezone.utc)
    if resume:
        started = _previous_run(warehouse, run_id, backend, spark, cfg, variant_name)["started_at"]
    log(f"run {run_id}: {len(raw)} input rows, {len(accepted)} accepted, {len(rejects)} rejected")
    if resume:
        done = _completed(warehouse, run_id, backend, spark)
    else:
        for name in RUN_TABLES:
            tables.delete_rows(warehouse, name, run_id, None, backend, spark)
        done = set()
    write("runs", _runs_row(run_id, variant_name, cfg, started, None, "running", {}))
    try:
        created_at = pd.Timestamp(datetime.now(timezone.utc))
        reject_rows = rejects.assign(run_id=run_id, variant=variant_name, created_at=created_at)
        write("rejects", pa.Table.from_pandas(reject_rows, schema=schema.REJECTS, preserve_index=False))
        gold_columns = [c for c in GOLD_COLUMNS if c in accepted.columns]
        gold = None
        if gold_columns:
            gold = accepted[["question_id", *gold_columns]].assign(run_id=run_id, variant=variant_name)
            for column in set(GOLD_COLUMNS) - set(gold_columns):
                gold[column] = None
            write("gold", pa.Table.from_pandas(gold, schema=schema.GOLD, preserve_index=False))

        todo = accepted[~accepted["question_id"].isin(done)]
        if resume:
            log(f"resuming: {len(done)} questions already answered, {len(todo)} to go")
        n_batches = -(-len(todo) // cfg.spark.batch_questions)
        for i, batch in enumerate(_batches(todo, cfg.spark.batch_questions), 1):
            log(f"batch {i}/{n_batches}: {len(batch)} questions on Spark ({spark.sparkContext.master})")
            if cfg.cache.enabled:
                batch = batch.assign(cache=_stored_results(warehouse, batch["question"], backend, spark))
            parts = split_stage_output(run_stages(spark, batch, cfg, secrets), run_id, variant_name, datetime.now(timezone.utc))
            if parts["stage_cache"].num_rows:
                append("stage_cache", parts["stage_cache"])
            for name in ("grades", "decisions", "answers"):  # answers last: they mark the batch done
                append(name, parts[name])

        answers = tables.read_run_rows(warehouse, "answers", run_id, backend, spark)
        grades = tables.read_run_rows(warehouse, "grades", run_id, backend, spark)
        _check_invariant(answers, accepted, rejects, len(raw))
        counts = run_counts(answers, grades, rejects, len(raw))
        write("runs", _runs_row(run_id, variant_name, cfg, started, datetime.now(timezone.utc), "succeeded", counts))
        if gold is not None:  # evaluated from what the run holds, without reading its tables back again
            metrics = evaluate(answers, grades, gold)
            store_metrics(warehouse, run_id, variant_name, metrics, backend, spark)
        from crag.tracking import log_run

        mlflow_run = log_run(cfg, warehouse, run_id, variant_name, counts, metrics, time.perf_counter() - t0,
                             redacted(cfg.model_dump(mode="json")))
        if mlflow_run:
            log(f"logged to MLflow run {mlflow_run}")
    except BaseException:
        write("runs", _runs_row(run_id, variant_name, cfg, started, datetime.now(timezone.utc), "failed", {}))
        raise
    return RunResult(run_id, variant_name, warehouse, len(raw), answers, rejects, time.perf_counter() - t0, counts, metrics)


def _check_invariant(answers: pd.DataFrame, accepted: pd.DataFrame, rejects: pd.DataFrame, input_rows: int) -> None:
    if len(answers) + len(rejects) != input_rows or set(answers["question_id"]) != set(accepted["question_id"]):
        raise CragError(
            f"row accounting failed: {len(answers)} answers + {len(rejects)} rejects != {input_rows} input rows"
        )
    if answers["question_id"].duplicated().any():
        raise CragError("row accounting failed: duplicate question_id in answers")
