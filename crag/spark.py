"""Runs the stage pipeline on Spark: one mapInArrow task per partition of questions.

mapInArrow rather than mapInPandas because each output row nests its grades and decisions (lists of
structs), which Arrow carries natively; inside the task the stages still work on pandas. Backends are
built once per Python worker process (see crag.backends.cached_backends) and reused by every batch.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Iterator

import pandas as pd
import pyarrow as pa

from crag import schema
from crag.config import CragConfig, SparkConfig


def get_spark(cfg: SparkConfig):
    """The active session (Databricks, or a test's shared one), else a local one."""
    from pyspark.sql import SparkSession

    active = SparkSession.getActiveSession()
    if active is not None:
        return active
    # Workers must run this same interpreter (and so see the same packages).
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    if cfg.master.startswith("local"):
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")  # local mode needs no other interface
    return (
        SparkSession.builder.master(cfg.master)
        .appName("crag")
        .config("spark.ui.enabled", "false")
        .config("spark.sql.shuffle.partitions", "4")
        .config("spark.sql.execution.arrow.pyspark.enabled", "true")
        .config("spark.sql.session.timeZone", "UTC")
        .config("spark.driver.extraJavaOptions", "-Dlog4j2.level=WARN")
        .getOrCreate()
    )


def _partition_task(config_json: str, secrets: dict[str, str], concurrent_tasks: int):
    # `secrets` is resolved on the driver and captured here in memory: workers on serverless compute
    # have neither the driver's environment nor dbutils. It never enters the config or a table.
    def process(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        # Imported here: this runs in the worker process.
        from crag.backends import cached_backends

        from crag.cache import StageCache, question_key, role_slices, with_cache

        cfg = CragConfig.model_validate_json(config_json)
        backends = cached_backends(cfg, secrets, concurrent_tasks)
        slices = role_slices(cfg) if cfg.cache.enabled else None
        for batch in batches:
            if not batch.num_rows:
                continue
            frame = batch.to_pandas()
            cache = None
            if slices is not None:
                cache = StageCache({e["key"]: e["value"] for entries in frame["cache"] for e in entries})
            serving = with_cache(backends, cache, slices) if cache else backends
            table = _run_subpipelines(frame[["question_id", "question"]], serving, cfg)
            by_question: dict[str, list] = {}
            for entry in cache.new if cache else []:
                by_question.setdefault(entry["question_key"], []).append(entry)
            entries = pa.array([by_question.pop(question_key(q), []) for q in frame["question"]],
                               type=schema.STAGE_OUTPUT.field("cache_entries").type)
            yield from table.set_column(table.schema.get_field_index("cache_entries"), "cache_entries", entries).to_batches()

    return process


def _run_subpipelines(frame: pd.DataFrame, backends, cfg: CragConfig) -> pa.Table:
    """The task's questions through `run_pipeline` on `spark.pipelines_per_task` threads, each taking
    the next `spark.questions_per_pipeline` questions (default: an equal share of the task) through all
    the stages, then the next. Small shares keep a question's stages in flight while others are in other
    stages, so every endpoint stays busy instead of one stage's endpoint at a time."""
    from concurrent.futures import ThreadPoolExecutor

    from crag.stages import run_pipeline, to_stage_output

    threads = max(1, min(cfg.spark.pipelines_per_task, len(frame)))
    size = cfg.spark.questions_per_pipeline or math.ceil(len(frame) / threads)
    parts = [frame.iloc[i:i + size] for i in range(0, len(frame), size)]

    def through_stages(part: pd.DataFrame) -> pa.Table:
        return to_stage_output(run_pipeline(part, backends, cfg))

    if threads == 1 or len(parts) == 1:
        return pa.concat_tables([through_stages(part) for part in parts])
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="crag-pipeline") as pool:
        return pa.concat_tables(list(pool.map(through_stages, parts)))  # map keeps the parts' order


def _question_frame(spark, table: pa.Table, partitions: int):
    """The questions as a DataFrame of `partitions` partitions. Classic PySpark spreads the Arrow
    record batches it is given (up to arrow.maxRecordsPerBatch rows each) over defaultParallelism
    partitions, so when that is the number wanted, a table of that many batches needs no shuffle (a
    shuffle cost about 0.5 s a batch here). Other counts, larger slices and Spark Connect (one local
    relation) are repartitioned."""
    size = math.ceil(table.num_rows / partitions)
    largest = int(spark.conf.get("spark.sql.execution.arrow.maxRecordsPerBatch", "10000"))
    classic = not type(spark).__module__.startswith("pyspark.sql.connect")
    if classic and partitions == spark.sparkContext.defaultParallelism and 0 < size <= largest:
        slices = [batch for start in range(0, table.num_rows, size) for batch in table.slice(start, size).to_batches()]
        return spark.createDataFrame(pa.Table.from_batches(slices, schema=table.schema))
    return spark.createDataFrame(table).repartition(partitions)


def run_stages(spark, questions: pd.DataFrame, cfg: CragConfig, secrets: dict[str, str] | None = None) -> pa.Table:
    """All stages over the accepted questions on Spark; returns schema.STAGE_OUTPUT rows. `questions`
    may carry a `cache` column of stored backend results (schema.STAGE_INPUT)."""
    from pyspark.sql.pandas.types import from_arrow_schema

    slots = spark.sparkContext.defaultParallelism
    partitions = max(1, min(cfg.spark.partitions or slots, len(questions)))
    # Partitions running at the same time share each endpoint's max_concurrency budget.
    concurrent_tasks = min(partitions, slots)
    if "cache" not in questions:
        questions = questions.assign(cache=[[] for _ in range(len(questions))])
    table = pa.Table.from_pandas(questions[["question_id", "question", "cache"]], schema=schema.STAGE_INPUT, preserve_index=False)
    result = _question_frame(spark, table, partitions).mapInArrow(
        _partition_task(cfg.model_dump_json(), secrets or {}, concurrent_tasks), from_arrow_schema(schema.STAGE_OUTPUT)
    )
    return result.toArrow()
