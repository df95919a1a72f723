"""Column layouts of every table crag writes, as Arrow schemas: the single source for the Delta writer,
the Spark stage output and the README's table reference."""

from __future__ import annotations

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
        # remote calls that waited on the client for a free in-flight slot, the time they waited, and
        # every remote call by latency (counts per crag.backends.base.LATENCY_BOUNDS_MS bucket)
        ("queued_calls", pa.int32()),
        ("queue_ms", pa.int64()),
        ("call_ms_hist", pa.list_(pa.int32())),
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

TABLES = {
    "answers": ANSWERS,
    "grades": GRADES,
    "decisions": DECISIONS,
    "runs": RUNS,
    "rejects": REJECTS,
    "gold": GOLD,
    "metrics": METRICS,
    "stage_cache": STAGE_CACHE,
    "comparisons": COMPARISONS,
}

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

# Work in progress of a run, kept until the run is finalised (crag.job): the validated input rows,
# and each committed batch's stage output, from which answers, grades, decisions and cache rows are
# derived once every batch is done. A killed run resumes from them; a re-run of a finished run id
# leaves that run's rows in place until the new one replaces them in one commit per table.
RUN_INPUTS = pa.schema(
    [
        ("run_id", pa.string()),
        ("question_id", pa.string()),
        ("question", pa.string()),
        ("input_row", pa.int64()),
        ("reason", pa.string()),  # why the row is rejected; null for accepted rows
        ("has_gold", pa.bool_()),
        *[f for f in GOLD if f.name not in ("run_id", "variant", "question_id")],
    ]
)
RUN_STAGING = pa.schema([("run_id", pa.string()), ("batch", pa.int32()), *STAGE_OUTPUT, ("created_at", UTC_TIMESTAMP)])
STAGING_TABLES = {"run_inputs": RUN_INPUTS, "run_staging": RUN_STAGING}
ALL_TABLES = {**TABLES, **STAGING_TABLES}

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
