"""Column layouts of every table crag writes or shows, as Arrow schemas, and which are stored and which
are views: the single source for the Delta writer, the Spark stage output, `crag sql`'s views and the
table reference (docs/tables.md, made from this module by `python -m crag.schema`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pyarrow as pa

UTC_TIMESTAMP = pa.timestamp("us", tz="UTC")

SOURCE = pa.struct([("source", pa.string()), ("doc_id", pa.string()), ("title", pa.string()), ("url", pa.string())])

# Per-stage wall time in milliseconds. A stage that calls its backend once per question records each
# question's own time; a stage that serves a whole partition in one call (BM25 retrieval) records the
# batch time divided by the questions in it.
STAGES = ("retrieve", "grade", "decide", "rewrite", "web_search", "refine", "generate")
STAGE_MS = [(f"ms_{s}", pa.float64()) for s in STAGES]

ANSWERS = pa.schema(
    [
        ("run_id", pa.string()),
        ("variant", pa.string()),
        ("question_id", pa.string()),
        ("question", pa.string()),
        ("answer", pa.string()),
        ("action", pa.string()),
        ("route", pa.string()),
        ("refused", pa.bool_()),
        ("web_query", pa.string()),
        ("n_retrieved", pa.int32()),
        ("n_relevant", pa.int32()),
        ("n_web", pa.int32()),
        ("sources", pa.list_(SOURCE)),
        ("error", pa.string()),
        ("llm_calls", pa.int32()),
        ("search_calls", pa.int32()),
        ("prompt_tokens", pa.int64()),
        ("completion_tokens", pa.int64()),
        ("retries", pa.int32()),
        ("cache_hits", pa.int32()),
        *STAGE_MS,
        ("created_at", UTC_TIMESTAMP),
    ]
)

GRADES = pa.schema(
    [
        ("run_id", pa.string()),
        ("variant", pa.string()),
        ("question_id", pa.string()),
        ("rank", pa.int32()),
        ("source", pa.string()),
        ("doc_id", pa.string()),
        ("parent_id", pa.string()),
        ("title", pa.string()),
        ("url", pa.string()),
        ("retrieval_score", pa.float64()),
        ("relevance", pa.float64()),
        ("grade", pa.string()),
        ("parse_status", pa.string()),
        ("rationale", pa.string()),
        ("raw_output", pa.string()),
        ("grader", pa.string()),
        ("prompt_hash", pa.string()),
    ]
)

DECISIONS = pa.schema(
    [
        ("run_id", pa.string()),
        ("variant", pa.string()),
        ("question_id", pa.string()),
        ("step", pa.string()),
        ("decision", pa.string()),
        ("reason", pa.string()),
    ]
)

RUNS = pa.schema(
    [
        ("run_id", pa.string()),
        ("variant", pa.string()),
        ("config", pa.string()),
        ("config_hash", pa.string()),
        ("started_at", UTC_TIMESTAMP),
        ("finished_at", UTC_TIMESTAMP),
        ("status", pa.string()),
        ("counts", pa.map_(pa.string(), pa.int64())),
        # who is running it: one writer per run id at a time (crag.job claims the run)
        ("attempt", pa.string()),
        ("owner", pa.string()),  # host:pid
        ("heartbeat_at", UTC_TIMESTAMP),
        ("input_hash", pa.string()),  # what `--resume` checks the questions against
        # Each `crag run` of a run id writes a new generation of its rows (a resume continues the one it
        # resumes); the tables users query show the rows of `shown_generation` only, so a re-run's rows
        # replace the earlier ones in the commit that records its outcome.
        ("generation", pa.string()),  # the generation being written, or last written
        ("shown_generation", pa.string()),  # the one the views show (null until a run first ends)
    ]
)

REJECTS = pa.schema(
    [
        ("run_id", pa.string()),
        ("variant", pa.string()),
        ("question_id", pa.string()),
        ("question", pa.string()),
        ("input_row", pa.int64()),
        ("reason", pa.string()),
        ("created_at", UTC_TIMESTAMP),
    ]
)

# The gold columns of a run's questions (when the question table has any), for `crag eval`.
GOLD = pa.schema(
    [
        ("run_id", pa.string()),
        ("variant", pa.string()),
        ("question_id", pa.string()),
        ("answers", pa.list_(pa.string())),
        ("is_impossible", pa.bool_()),
        ("expected_route", pa.string()),
        ("gold_doc_ids", pa.list_(pa.string())),
    ]
)

METRICS = pa.schema(
    [
        ("run_id", pa.string()),
        ("variant", pa.string()),
        ("metric", pa.string()),
        ("slice", pa.string()),
        ("value", pa.float64()),
        ("n", pa.int64()),
    ]
)

# Stored backend results, for re-running only what changed (crag.cache).
STAGE_CACHE = pa.schema(
    [
        ("key", pa.string()),
        ("question_key", pa.string()),
        ("role", pa.string()),
        ("value", pa.string()),
        ("run_id", pa.string()),
        ("created_at", UTC_TIMESTAMP),
    ]
)
CACHE_ENTRY = pa.struct(
    [("key", pa.string()), ("question_key", pa.string()), ("role", pa.string()), ("value", pa.string())]
)

# One row per question of two compared runs (crag compare).
COMPARISONS = pa.schema(
    [
        ("base_run", pa.string()),
        ("candidate_run", pa.string()),
        ("question_id", pa.string()),
        ("question", pa.string()),
        ("in_base", pa.bool_()),
        ("in_candidate", pa.bool_()),
        ("answer_base", pa.string()),
        ("answer_candidate", pa.string()),
        ("answer_changed", pa.bool_()),
        ("answer_similarity", pa.float64()),
        ("action_base", pa.string()),
        ("action_candidate", pa.string()),
        ("route_base", pa.string()),
        ("route_candidate", pa.string()),
        ("action_flip", pa.bool_()),
        ("route_flip", pa.bool_()),
        ("n_relevant_base", pa.int32()),
        ("n_relevant_candidate", pa.int32()),
        ("n_relevant_delta", pa.int32()),
        ("grade_flips", pa.list_(pa.string())),
        ("f1_delta", pa.float64()),
        ("answer_contained_delta", pa.float64()),
        ("routing_accuracy_delta", pa.float64()),
        ("created_at", UTC_TIMESTAMP),
    ]
)

# What the Spark stage returns per question: the answer row without the driver-side columns, with the
# question's grades and decisions nested so that one pass over the partition yields all three tables.
_DRIVER_SIDE = {"run_id", "variant", "created_at"}
GRADE_ITEM = pa.struct([f for f in GRADES if f.name not in _DRIVER_SIDE | {"question_id"}])
DECISION_ITEM = pa.struct([f for f in DECISIONS if f.name not in _DRIVER_SIDE | {"question_id"}])
STAGE_OUTPUT = pa.schema(
    [f for f in ANSWERS if f.name not in _DRIVER_SIDE]
    + [
        pa.field("grades", pa.list_(GRADE_ITEM)),
        pa.field("decisions", pa.list_(DECISION_ITEM)),
        pa.field("cache_entries", pa.list_(CACHE_ENTRY)),
    ]
)
# What each Spark task receives per question: the question and the stored backend results that may
# serve it (empty with the cache off).
STAGE_INPUT = pa.schema(
    [
        ("question_id", pa.string()),
        ("question", pa.string()),
        ("cache", pa.list_(pa.struct([("key", pa.string()), ("value", pa.string())]))),
    ]
)

# ------------------------------------------------------------------ stored tables and the views over them

_GENERATION = [("run_id", pa.string()), ("generation", pa.string()), ("variant", pa.string())]
# Every input row of a run's generation, checked: the accepted questions (reason null), which the run
# answers, and the rejected rows with their reason. What `rejects` and `gold` show; `--resume` reads
# the input from here.
INPUTS = pa.schema(
    [
        *_GENERATION,
        ("question_id", pa.string()),
        ("question", pa.string()),
        ("question_key", pa.string()),  # the stage cache's key of the question (crag.cache.question_key)
        ("input_row", pa.int64()),
        ("reason", pa.string()),  # why the row is rejected; null for accepted rows
        ("has_gold", pa.bool_()),
        *[f for f in GOLD if f.name not in ("run_id", "variant", "question_id")],
        ("created_at", UTC_TIMESTAMP),
    ]
)
# One row per answered question of a run's generation, committed batch by batch: the stage output with
# its grades and decisions nested. What `answers`, `grades` and `decisions` show.
RESULTS = pa.schema(
    [
        *_GENERATION,
        ("batch", pa.int32()),
        *[f for f in STAGE_OUTPUT if f.name != "cache_entries"],
        ANSWERS.field("created_at"),
    ]
)
# The metric values of a run's generation. What `metrics` shows.
METRIC_VALUES = pa.schema([*_GENERATION, *[f for f in METRICS if f.name not in ("run_id", "variant")]])


@dataclass(frozen=True)
class Table:
    """A table crag stores, and its rules. `per_generation`: its rows belong to one generation of one
    run (run_id, generation), shown through views and forgotten when the run's next generation is
    shown; otherwise the table is shared by every run. `key`: the columns that name one row."""

    columns: pa.Schema
    key: tuple[str, ...]
    per_generation: bool = False


@dataclass(frozen=True)
class View:
    """A table users query, made of the rows of one stored table that each run shows
    (`runs.shown_generation`): its `columns`, the `stored` table's rows that pass `where` (SQL over
    the stored table's columns; no values), with the items of the list column `explode` as rows
    (their fields as columns) when it is set."""

    columns: pa.Schema
    stored: str
    explode: str | None = None
    where: str | None = None

    def item_fields(self) -> list[str]:
        """The columns taken from the exploded item, not from the stored row."""
        if self.explode is None:
            return []
        item = STORED[self.stored].columns.field(self.explode).type.value_type
        return [f.name for f in item]

    def sql(self, table: Callable[[str], str], explode: str = "explode", shown: bool = True) -> str:
        """The view as one SELECT over the stored tables, each named by `table(name)`, in Spark SQL or
        (`explode="unnest"`) DataFusion's: the two differ only in the function that makes a list's
        items rows. Not `shown`: the rows of every generation, with their `generation` column (a run
        reads its own rows before its outcome shows them). Identifiers only, from this module."""
        source = table(self.stored)
        if shown:
            source = (
                f"(SELECT s.* FROM {source} s JOIN {table('runs')} r "
                f"ON s.run_id = r.run_id AND s.generation = r.shown_generation)"
            )
        rows = f"SELECT *{f', {explode}({self.explode}) AS item' if self.explode else ''} FROM {source} stored"
        if self.where:
            rows += f" WHERE {self.where}"
        items = self.item_fields()
        columns = [f"item.{c} AS {c}" if c in items else c for c in self.columns.names]
        return f"SELECT {', '.join(columns + ([] if shown else ['generation']))} FROM ({rows}) rows"


STORED = {
    "runs": Table(RUNS, ("run_id",)),
    "inputs": Table(INPUTS, ("run_id", "generation", "question_id", "input_row"), per_generation=True),
    "results": Table(RESULTS, ("run_id", "generation", "question_id"), per_generation=True),
    "metric_values": Table(METRIC_VALUES, ("run_id", "generation", "metric", "slice"), per_generation=True),
    "stage_cache": Table(STAGE_CACHE, ("key",)),
    "comparisons": Table(COMPARISONS, ("base_run", "candidate_run", "question_id")),
}
VIEWS = {
    "answers": View(ANSWERS, "results"),
    "grades": View(GRADES, "results", explode="grades"),
    "decisions": View(DECISIONS, "results", explode="decisions"),
    "rejects": View(REJECTS, "inputs", where="reason IS NOT NULL"),
    "gold": View(GOLD, "inputs", where="reason IS NULL AND has_gold"),
    "metrics": View(METRICS, "metric_values"),
}
# Every table name crag writes or shows, and its columns.
TABLES = {**{name: t.columns for name, t in STORED.items()}, **{name: v.columns for name, v in VIEWS.items()}}

# The chunk table an index directory holds (and, on Databricks, the source of the Vector Search index).
CHUNKS = pa.schema(
    [
        ("chunk_id", pa.string()),
        ("parent_id", pa.string()),
        ("doc_id", pa.string()),
        ("title", pa.string()),
        ("url", pa.string()),
        ("source_path", pa.string()),
        ("chunk_text", pa.string()),
        ("parent_text", pa.string()),
    ]
)
