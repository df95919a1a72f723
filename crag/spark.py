"""Spark wiring: the one `get_spark()`, and the stage pipeline over partitions of questions.

The stages run in one mapInArrow task per partition. mapInArrow rather than mapInPandas because each
output row nests its grades and decisions (lists of structs), which Arrow carries natively; inside
the task the stages still work on pandas. Backends are built once per Python worker process (see
crag.backends.cached_backends) and reused by every batch.

Only the DataFrame API is used (no SparkContext, RDD or JVM handle), so every command runs the same
on classic Spark and on Spark Connect (Databricks serverless).
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import shutil
import sys
import tempfile
import threading
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor, as_completed
from contextlib import contextmanager
from pathlib import Path

import pandas as pd
import pyarrow as pa

from crag import schema
from crag.backends import cached_backends, smallest_budget
from crag.backends.base import Document
from crag.backends.remote import running_task
from crag.cache import StageCache, question_key, role_slices, with_cache
from crag.config import LOCAL_MASTER, CragConfig, SparkConfig, shown_key, usable_cores
from crag.connect import bound_waits, connect_session
from crag.errors import ConfigError, describe
from crag.progress import report_answered
from crag.spark_server import shared_session, usable
from crag.stages import frame_rows, run_pipeline

log = logging.getLogger("crag")

# Spark settings for a local session: quiet, UTC, Arrow, small shuffles, and Delta Lake.
LOCAL_SETTINGS = {
    "spark.ui.enabled": "false",
    "spark.ui.showConsoleProgress": "false",  # the stage bar leaves no newline before crag's own lines
    "spark.sql.shuffle.partitions": "4",
    "spark.sql.execution.arrow.pyspark.enabled": "true",
    "spark.sql.session.timeZone": "UTC",
    "spark.sql.extensions": "io.delta.sql.DeltaSparkSessionExtension",
    "spark.sql.catalog.spark_catalog": "org.apache.spark.sql.delta.catalog.DeltaCatalog",
    # a Delta snapshot of crag's small tables needs no 50-partition state reconstruction
    "spark.databricks.delta.snapshotPartitions": "2",
    # A run is a dozen small Delta commits, and each paid for extras a local warehouse does not use: a
    # checksum file computed from the new snapshot's state after every commit, per-file column
    # statistics (crag's tables are read by run, and Parquet's own footers skip the rest), the
    # operation's metrics in its commit, and a cached copy of every MERGE's source (a few rows made on
    # the driver, which a second read reproduces exactly). Without them a warm sample run took 6.3 s
    # against 7.1 s, 11% less of the JVM's CPU (docs/performance.md, the budget).
    "spark.databricks.delta.writeChecksumFile.enabled": "false",
    "spark.databricks.delta.stats.collect": "false",
    "spark.databricks.delta.history.metricsEnabled": "false",
    "spark.databricks.delta.merge.materializeSource": "none",
    # Expressions interpreted rather than compiled to classes per query: a run's queries are many and
    # small (Delta's commits among them), and the JVM spent more CPU compiling and JIT-compiling each
    # query's generated classes than running them (docs/performance.md, the budget)
    "spark.sql.codegen.factoryMode": "NO_CODEGEN",
    "spark.driver.extraJavaOptions": f"-Dlog4j2.configurationFile={(Path(__file__).parent / 'log4j2.properties').as_uri()}",
    # crag's local tables are external (their files under --warehouse): Spark's own warehouse only gets
    # an empty folder per schema, which would otherwise pile up in the working directory
    "spark.sql.warehouse.dir": str(Path(tempfile.gettempdir()) / "crag-spark-warehouse"),
}
# The JIT of every local JVM crag starts (a command's, a Connect server of its own, `crag spark start`):
# C1 alone. A run is dozens of small queries, each run a few times, and the C2 compiler spent a third
# of the JVM's CPU compiling Spark's planner code for them; C1 compiles it at a fraction of the cost,
# and a run's work is in its Python workers and endpoints. C1 alone defaults to a 48 MB code cache,
# which Spark and Delta's code outgrows: its sweeper then flushed and recompiled for a minute of CPU in
# a test session. Only a session that runs hundreds of runs (the tests' shared one) gains from C2
# (`tiered_jit`). Figures: docs/performance.md, the budget.
C1_ONLY = "-XX:TieredStopAtLevel=1 -XX:ReservedCodeCacheSize=256m"
# A JVM's class-data archive (JDK's dynamic CDS) spares every local JVM loading and verifying Spark's
# classes one by one (`make install` writes it: crag.spark_warm.write_class_archive). The JVM checks the
# archive against itself and its class path, and starts without one it cannot use, saying nothing.
QUIET_ARCHIVE = "-Xshare:auto -Xlog:cds=off -Xlog:cds+dynamic=off"
# Where a local JVM writes what it prints (its start-up notices, and errors, which also reach crag as
# exceptions): not on the console between crag's own lines.
SPARK_LOG = Path(tempfile.gettempdir()) / "crag-spark.log"


def jars(cfg: SparkConfig) -> list[str]:
    folder = Path(cfg.jars_dir) if cfg.jars_dir else Path(__file__).resolve().parents[1] / ".crag" / "jars"
    jars = sorted(str(p) for p in folder.glob("*.jar"))
    if not any("delta-spark" in Path(j).name for j in jars):
        raise ConfigError(
            f"the Delta Lake jars for Spark are not in {folder}: run `make install` (it fetches them "
            f"from Maven Central), or set spark.jars_dir"
        )
    return jars


def class_archive(cfg: SparkConfig) -> Path:
    """Where the class-data archive of this JDK, pyspark and these jars is (or goes): in the jars' folder,
    named by what it was made with, so that another JDK or set of jars finds none rather than a stale one."""
    import pyspark  # noqa: PLC0415

    found = jars(cfg)
    java = Path(os.environ["JAVA_HOME"]) / "bin" / "java" if os.environ.get("JAVA_HOME") else shutil.which("java")
    made_with = [str(Path(java).resolve()) if java else "", pyspark.__version__, *(Path(j).name for j in found)]
    return Path(found[0]).parent / f"classes-{hashlib.sha256(chr(0).join(made_with).encode()).hexdigest()[:16]}.jsa"


def java_options(cfg: SparkConfig, tiered_jit: bool = False) -> str:
    """The local JVM's options: crag's log settings, the class-data archive when there is one, and C1
    alone (C1_ONLY) unless the JVM keeps the `tiered_jit`."""
    options = [LOCAL_SETTINGS["spark.driver.extraJavaOptions"]]
    archive = class_archive(cfg)
    if archive.exists():
        options += [QUIET_ARCHIVE, f"-XX:SharedArchiveFile={archive}"]
    if not tiered_jit:
        options.append(C1_ONLY)
    return " ".join(options)


def local_master(master: str) -> tuple[str, int] | None:
    """A local master as Spark is started with it, and its task slots: one slot more than the
    configured threads (local[N] -> local[N+1]; local[*]: the cores this process may run on). A
    batch's tasks hold their slots until the batch ends (minutes on real endpoints), and crag's own
    Spark jobs beside it (the heartbeat's commit) would otherwise wait for all of them; `parallelism`
    leaves that one slot out of a batch. None: not a local master."""
    match = LOCAL_MASTER.fullmatch(master)
    if match is None:
        return None
    if match[1] == "*":
        threads = usable_cores()
    else:
        threads = int(match[1] or 1)
    return f"local[{threads + 1}{match[2] or ''}]", threads + 1


def is_connect(spark) -> bool:
    return type(spark).__module__.startswith("pyspark.sql.connect")


def get_spark(cfg: SparkConfig, tiered_jit: bool = False):
    """The active session (Databricks, a notebook, a test's shared one), else a new one: Spark Connect
    when `spark.remote` is set (every wait on it bounded: crag.connect), classic local Spark otherwise;
    Delta Lake configured either way, and `spark.conf` passed to it (to a session that runs already,
    an active one or a Connect server's, as runtime settings). A new local JVM runs C1 alone unless it
    keeps the `tiered_jit` (C1_ONLY)."""
    from pyspark.sql import SparkSession  # noqa: PLC0415  # crag index on a laptop imports this module and writes with delta-rs

    active = SparkSession.getActiveSession()
    if active is not None and (cfg.remote is None or is_connect(active)):
        return _with_runtime_settings(active, cfg.conf)
    remote = cfg.remote
    server = usable() if remote is None and local_master(cfg.master) is not None else None
    if server is not None:  # crag spark start: a warm local Spark instead of a new one
        log.info("using the Spark server at %s (crag spark start; crag spark stop ends it)", server.url)
        return _with_runtime_settings(shared_session(server, cfg.connect_timeout_s), cfg.conf)
    if remote and remote.startswith("sc://"):  # a running server: only session settings can be passed
        return _with_runtime_settings(connect_session(remote, cfg.connect_timeout_s), cfg.conf)
    return new_session(cfg, java_options(cfg, tiered_jit))


def new_session(cfg: SparkConfig, java: str):
    """A new local session of `cfg`: classic, or Spark Connect with a server in its own JVM
    (`spark.remote` local[N]); its JVM started with the `java` options."""
    from pyspark.sql import SparkSession  # noqa: PLC0415

    # Workers must run this same interpreter (and so see the same packages).
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    remote = cfg.remote
    builder = SparkSession.builder.appName("crag")
    master = remote or cfg.master
    local = local_master(master)
    if local is not None:
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")  # local mode needs no other interface
        master, slots = local
        builder = builder.config("spark.default.parallelism", str(slots))
    builder = builder.remote(master) if remote else builder.master(master)
    settings = {
        **cfg.conf,
        **LOCAL_SETTINGS,
        "spark.jars": ",".join(jars(cfg)),
        "spark.driver.extraJavaOptions": java,
    }
    for key, value in settings.items():
        builder = builder.config(key, value)
    with warnings.catch_warnings(), _stderr_to(SPARK_LOG):
        # A local Connect server is started with these settings; the client then tries to set the static
        # ones again on the session and warns that it cannot.
        warnings.simplefilter("ignore", UserWarning)
        session = builder.getOrCreate()
    if is_connect(session):  # spark.remote=local[N]: a server of its own, in the JVM it started
        bound_waits(session, "sc://localhost (started by crag)", cfg.connect_timeout_s)
    return session


def _with_runtime_settings(session, settings: dict[str, str]):
    """`session` with `settings` set on it: a session that runs already takes runtime settings only (a
    static one, such as spark.executor.memory, is fixed when its JVM starts)."""
    for key, value in settings.items():
        try:
            if session.conf.get(key, None) != value:
                session.conf.set(key, value)
        except Exception as exc:  # CANNOT_MODIFY_CONFIG, CANNOT_MODIFY_STATIC_CONFIG, ...
            raise ConfigError(
                f"spark.conf {shown_key(key)}: the running Spark session does not take it "
                f"({describe(exc, limit=200, with_type=False)}); a static setting is set where the cluster "
                "or server starts"
            ) from None
    return session


@contextmanager
def _stderr_to(path: Path | None):
    """The JVM a local session starts inherits this process's stderr: point it at `path` while the
    JVM starts, then give crag its console back."""
    if path is None:
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    with open(path, "ab") as log:
        os.dup2(log.fileno(), 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


@contextmanager
def kept(df) -> Iterator:
    """`df`, persisted while the block reads it several times, then released. A session that refuses
    to cache (Databricks serverless caches only from environment version 5, as a preview) gets `df`
    itself, computed again at each read: slower, not wrong."""
    try:
        persisted = df.persist()
    except Exception as exc:
        log.info("not cached (%s): each pass computes it again", describe(exc))
        yield df
        return
    try:
        yield persisted
    finally:
        try:
            persisted.unpersist()
        except Exception as exc:  # the block's own error (a server gone, say) is the one to see
            log.debug("the cached frame was not released: %s", describe(exc))


def parallelism(spark, cfg: SparkConfig) -> int:
    """A batch's tasks that run at once: spark.partitions, else every task slot of the session
    (spark.default.parallelism) but one, else 8 (a session that does not say: a cluster need not set
    it, and Spark Connect may not read it). The slot left over runs the run's own commits, the
    heartbeat's, while a batch's tasks hold the others (see local_master)."""
    if cfg.partitions:
        return cfg.partitions
    try:
        value = spark.conf.get("spark.default.parallelism", None)
    except Exception:  # Spark Connect may refuse to read a static setting
        value = None
    return max(1, int(value) - 1) if value and str(value).isdigit() else 8


def _partition_task(config_json: str, secrets: dict[str, str], tasks: int, progress: str | None, number: int):
    # `secrets` is resolved on the driver and captured here in memory: workers on serverless compute
    # have neither the driver's environment nor dbutils. It never enters the config or a table.
    def process(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        from pyspark import TaskContext  # noqa: PLC0415  # as get_spark's

        cfg = CragConfig.model_validate_json(config_json)
        backends = cached_backends(cfg, secrets, tasks, opened_before=True)  # by the driver (crag.job)
        task = TaskContext.get()  # set in every Spark task
        partition = task.partitionId() if task else 0
        running_task(partition)  # which share of each endpoint's budget is this task's
        slices = role_slices(cfg, secrets) if cfg.cache.enabled else None
        answered, lock = 0, threading.Lock()

        def count(questions: int) -> None:
            nonlocal answered
            with lock:
                answered += questions
                report_answered(progress, number, partition, answered)

        for batch in batches:
            if not batch.num_rows:
                continue
            frame = batch.to_pandas()
            cache = None
            if slices is not None:
                cache = StageCache({e["key"]: e["value"] for entries in frame["cache"] for e in entries})
            serving = with_cache(backends, cache, slices) if cache and slices else backends
            new_entries = _NewEntries(cache)
            for table in _run_subpipelines(frame[["question_id", "question"]], serving, cfg, count):
                entries = pa.array(new_entries.of(table["question"].to_pylist()), type=_CACHE_ENTRIES)
                yield from table.set_column(_CACHE_ENTRIES_AT, "cache_entries", entries).to_batches()

    return process


_CACHE_ENTRIES = schema.STAGE_OUTPUT.field("cache_entries").type
_CACHE_ENTRIES_AT = schema.STAGE_OUTPUT.get_field_index("cache_entries")


class _NewEntries:
    """The stage-cache entries a task's answering added (StageCache.new), each handed out once: with
    the first part handed out after the entry was added that holds the question it is filed under
    (an entry added for a question text that two parts hold may go with either; the driver keeps
    each key once)."""

    def __init__(self, cache: StageCache | None):
        self._cache, self._seen, self._waiting = cache, 0, dict[str, list]()

    def of(self, questions: list[str]) -> list[list]:
        if self._cache is None:
            return [[] for _ in questions]
        added = self._cache.new[self._seen :]  # appended by the pipeline threads; read by this one only
        self._seen += len(added)
        for entry in added:
            self._waiting.setdefault(entry["question_key"], []).append(entry)
        return [self._waiting.pop(question_key(q), []) for q in questions]


# At most this many questions go through the stages at a time in a pipeline whose share is not set:
# each part's end moves the run's progress bar (crag.progress.LiveProgress).
PART_QUESTIONS = 100


def _run_subpipelines(
    frame: pd.DataFrame, backends, cfg: CragConfig, done: Callable[[int], None]
) -> Iterator[pa.Table]:
    """The task's questions through `run_pipeline` on `spark.pipelines_per_task` threads, each taking
    the next `spark.questions_per_pipeline` questions (default: an equal share of the task, at most
    PART_QUESTIONS) through all the stages, then the next; `done` hears of each part's questions.
    Small shares keep a question's stages in flight while others are in other stages, so every endpoint
    stays busy instead of one stage's endpoint at a time. Each part's rows are yielded as soon as it is
    done, in the order the parts end: Spark takes them in while the others are answered, and only the
    last part's are left to take in after the last reply."""
    threads = max(1, min(cfg.spark.pipelines_per_task, len(frame)))
    size = cfg.spark.questions_per_pipeline or min(math.ceil(len(frame) / threads), PART_QUESTIONS)
    parts = [frame.iloc[i : i + size] for i in range(0, len(frame), size)]

    def through_stages(part: pd.DataFrame) -> pa.Table:
        answered = to_stage_output(run_pipeline(part, backends, cfg))
        done(len(part))
        return answered

    if threads == 1 or len(parts) == 1:
        yield from (through_stages(part) for part in parts)
        return
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="crag-pipeline") as pool:
        try:
            for answered in as_completed([pool.submit(through_stages, part) for part in parts]):
                yield answered.result()
        finally:  # a part that failed fails the task: the parts not started yet are not
            pool.shutdown(wait=True, cancel_futures=True)


def _grade_rows(graded: list[Document], web: list[Document]) -> list[dict]:
    rows = []
    for doc in graded + [d for d in web if "grade" in d]:
        rows.append(
            {
                "rank": doc.get("rank"),
                "source": doc["source"],
                "doc_id": doc.get("doc_id"),
                "parent_id": doc.get("parent_id"),
                "title": doc.get("title"),
                "url": doc.get("url"),
                "retrieval_score": doc.get("retrieval_score"),
                "relevance": doc.get("relevance"),
                "grade": doc.get("grade"),
                "parse_status": doc.get("parse_status"),
                "rationale": doc.get("rationale"),
                "raw_output": doc.get("raw_output"),
                "grader": doc.get("grader"),
                "prompt_hash": doc.get("prompt_hash"),
            }
        )
    return rows


def to_stage_output(df: pd.DataFrame) -> pa.Table:
    """The pipeline's result as Arrow in schema.STAGE_OUTPUT: one row per question, its grades and
    decisions nested (the driver splits them into their own tables)."""
    rows = []
    for r in frame_rows(df):
        rows.append(
            {
                "question_id": r.question_id,
                "question": r.question,
                "answer": r.answer,
                "action": r.action,
                "route": r.route,
                "refused": r.refused,
                "web_query": r.web_query,
                "n_retrieved": r.n_retrieved,
                "n_relevant": r.n_relevant,
                "n_web": r.n_web,
                "sources": r.sources,
                "error": r.error,
                # llm_calls, search_calls, prompt_tokens, completion_tokens, retries, cache_hits
                **r.usage,
                **{f"ms_{s}": float(getattr(r, f"ms_{s}")) for s in schema.STAGES},
                "grades": _grade_rows(r.graded, r.web_results),
                "decisions": r.decisions,
                "cache_entries": [],  # filled by the Spark task when the stage cache is on
            }
        )
    return pa.Table.from_pylist(rows, schema=schema.STAGE_OUTPUT)


def run_stages(
    questions,
    cfg: CragConfig,
    secrets: dict[str, str] | None,
    partitions: int,
    progress: str | None = None,
    number: int = 0,
):
    """All stages over a DataFrame of questions (schema.STAGE_INPUT: question_id, question, and the
    stored backend results that may serve them), in `partitions` tasks; a DataFrame of
    schema.STAGE_OUTPUT rows, evaluated when it is written. The tasks report the questions they have
    answered into the `progress` folder as batch `number` (crag.progress.report_answered)."""
    from pyspark.sql.pandas.types import from_arrow_schema  # noqa: PLC0415  # as get_spark's

    # The partitions share each endpoint's max_concurrency budget out exactly, partition p taking
    # share p (crag.backends.remote.budget_share): the shares add up to the budget whichever of the
    # tasks run at once (a batch gets no more partitions than task slots, so all of them do).
    return questions.repartition(partitions).mapInArrow(
        _partition_task(cfg.model_dump_json(), secrets or {}, partitions, progress, number),
        from_arrow_schema(schema.STAGE_OUTPUT),
    )


def batch_tasks(spark, cfg: CragConfig) -> int:
    """A batch's tasks: one per task slot but the one left for the run's own commits (`parallelism`),
    never more than the smallest endpoint budget (every task keeps one request in flight)."""
    slots = parallelism(spark, cfg.spark)
    budget = smallest_budget(cfg)
    if budget is not None and budget[1] < slots:
        log.info(
            "%d tasks at once, not %d: the endpoint of %s takes %d requests at a time (max_concurrency)",
            budget[1],
            slots,
            budget[0],
            budget[1],
        )
        return budget[1]
    return slots


def _no_stored_results():
    """An empty `cache` column, typed as schema.STAGE_INPUT types it."""
    from pyspark.sql import functions as F  # noqa: PLC0415  # as get_spark's
    from pyspark.sql.pandas.types import from_arrow_type  # noqa: PLC0415

    return F.expr("array()").cast(from_arrow_type(schema.STAGE_INPUT.field("cache").type))


def with_stored_results(todo, stage_cache=None):
    """The questions of `todo` (question_id, question, question_key) as schema.STAGE_INPUT rows: with
    the stage-cache rows filed under each (crag.cache), joined in Spark, or none (`stage_cache` None:
    the cache is off)."""
    from pyspark.sql import functions as F  # noqa: PLC0415

    if stage_cache is None:
        return todo.select("question_id", "question", _no_stored_results().alias("cache"))
    stored = (
        stage_cache.join(todo.select("question_key").distinct(), "question_key")
        .dropDuplicates(["key"])
        .groupBy("question_key")
        .agg(F.collect_list(F.struct("key", "value")).alias("cache"))
    )
    joined = todo.join(stored, "question_key", "left")
    return joined.select("question_id", "question", F.coalesce("cache", _no_stored_results()).alias("cache"))


def new_cache_rows(answered, run_id: str):
    """The stage-cache rows (schema.STAGE_CACHE) that answered questions (STAGE_OUTPUT) brought, each
    key once."""
    from pyspark.sql import functions as F  # noqa: PLC0415

    return (
        answered.select(F.explode("cache_entries").alias("e"))
        .select("e.key", "e.question_key", "e.role", "e.value", F.lit(run_id).alias("run_id"))
        .withColumn("created_at", F.current_timestamp())
        .dropDuplicates(["key"])
    )
