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

# ------------------------------------------------------------------ the table reference (docs/tables.md)

# What a row of each table is, in one line.
ABOUT = {
    "answers": "one row per answered question: the answer, the CRAG action, the route and what it cost",
    "grades": "one row per graded document: each retrieved document, and each web result when "
    "`web_search.grade_results` is on",
    "decisions": "the steps of each question, in order, with the reason for each",
    "rejects": "one row per input row that was not answered, with the reason",
    "gold": "the gold columns of each accepted question that has any, for `crag eval`",
    "metrics": "one row per metric and slice of a run (`crag eval`; written by `crag run` when the questions "
    "carry gold)",
    "runs": "one row per run id: its config, status and counts, who holds it (its lease) and which generation "
    "the views show",
    "inputs": "every input row of a run's generation, checked: accepted questions (`reason` null) and rejected rows",
    "results": "one row per answered question of a run's generation, committed batch by batch, its grades "
    "and decisions nested",
    "metric_values": "the metric values of a run's generation",
    "stage_cache": "every backend call's stored result, reused by later runs with the same inputs and config "
    "slice (shared by every run)",
    "comparisons": "one row per question of two compared runs (`crag compare`)",
    "chunks": "one row per child chunk of an index (`crag index`; on Databricks, the Vector Search index's "
    "source table)",
}

# What each column means, by its name; MEANINGS_IN[table] where a column means something else there.
MEANINGS = {
    "run_id": "the run",
    "variant": "the variant the run applied (`base`: none)",
    "generation": "the run's generation the row belongs to (each `crag run` of a run id writes a new one)",
    "question_id": "the question's id, as given in the input",
    "question": "the question's text",
    "created_at": "when the row was written (UTC)",
    "answer": "the answer (the refusal message when refused; null on error)",
    "action": "the CRAG action: `correct`, `ambiguous` or `incorrect`",
    "route": "where the answer's context came from: `internal`, `web`, `mixed`, `refused` or `error`",
    "refused": "the answer is a refusal",
    "web_query": "the query sent to web search (null: no web search)",
    "n_retrieved": "documents retrieved from the knowledge base",
    "n_relevant": "retrieved documents graded relevant",
    "n_web": "web results used",
    "sources": "the documents the answer cites",
    "error": "why the question failed (`route` = `error`); null otherwise",
    "llm_calls": "model calls made for the question",
    "search_calls": "retrieval and web-search calls made for the question",
    "prompt_tokens": "prompt tokens the model calls used",
    "completion_tokens": "completion tokens the model calls used",
    "retries": "calls retried (timeouts, 429, 5xx)",
    "cache_hits": "backend calls answered from the stage cache",
    "queued_calls": "remote calls that waited on the client for a free slot of their endpoint's budget",
    "queue_ms": "milliseconds those calls waited, in all (not counted against their timeout)",
    "call_ms_hist": "remote calls per latency bucket (crag.backends.base.LATENCY_BOUNDS_MS); the run summary's p95",
    **{f"ms_{s}": f"milliseconds the question spent in the {s} stage (see `ms_*` above)" for s in STAGES},
    "rank": "the document's rank among the question's retrieved documents (or web results)",
    "source": "`internal` (the knowledge base) or `web`",
    "doc_id": "the document's id",
    "parent_id": "the parent chunk graded (a retrieved child chunk expanded to its parent)",
    "title": "the document's title",
    "url": "the document's URL (null when it has none)",
    "retrieval_score": "the retriever's score (null when the retriever gives none)",
    "relevance": "the grader's relevance, 0..1",
    "grade": "`yes` (relevant) or `no`",
    "parse_status": "how the grader's output was read: `ok`, `repaired` or `failed` (unreadable: counted irrelevant), "
    "or `not_graded` (the grading call failed: no grade or relevance)",
    "rationale": "the grader's reasons (the lexical and semantic graders: the signals behind the relevance)",
    "raw_output": "the model's reply as received (null for the embedded graders)",
    "grader": "the grader's backend or model endpoint",
    "prompt_hash": "a hash of the grading prompt (null for the embedded graders)",
    "step": "`retrieve`, `grade`, `route`, `rewrite`, `web_search`, `verify_web`, `grade_web`, `last_resort`, "
    "`refine` or `generate`",
    "decision": "what the step decided",
    "reason": "why, in words (e.g. `3 of 10 documents relevant; policy any_irrelevant: 7 irrelevant -> web search`)",
    "input_row": "the row's position in the input, from 0 (blank lines of a JSONL file not counted)",
    "answers": "the gold answers",
    "is_impossible": "the question has no answer and should be refused",
    "expected_route": "where the answer should come from: `internal`, `web` or `none` (refuse)",
    "gold_doc_ids": "the documents that hold the answer",
    "metric": "the metric's name (see docs/quality.md)",
    "slice": "`all`, or the slice the value is over (`route=web`, `language=ja`, ...)",
    "value": "the metric's value",
    "n": "the questions the value is over",
    "config": "the run's config as JSON, secrets masked",
    "config_hash": "a hash of the config (credentials masked); `--resume` checks it",
    "started_at": "when the run started (UTC)",
    "finished_at": "when its outcome was recorded (UTC; null while it runs)",
    "status": "`running`, `succeeded` or `failed`",
    "counts": "the run's totals: input_rows, accepted, rejected, refused, errors, search_calls, llm_calls, "
    "prompt_tokens, completion_tokens, retries, cache_hits, queued_calls, queue_ms, relevant_docs, action_*, "
    "route_*, grade_parse_*, and calls_ms_le_* / calls_ms_over_* (remote calls per latency bucket) (the last "
    "four only where not 0)",
    "attempt": "the attempt that holds the run (its lease): only it may write the run's rows",
    "owner": "the holding process, `host:pid`",
    "heartbeat_at": "the holder's last heartbeat (UTC); a run silent for `tables.stale_run_after_s` may be taken over",
    "input_hash": "a hash of the checked input, which `--resume` checks the questions against",
    "shown_generation": "the generation the views show (null until the run first ends)",
    "question_key": "the stage cache's key of the question (a hash of its text)",
    "has_gold": "the row carries gold columns",
    "batch": "the committed batch the row came in, from 0",
    "grades": "the question's graded documents (the `grades` view's rows)",
    "decisions": "the question's steps (the `decisions` view's rows)",
    "key": "the call's key: a hash of its inputs and of its role's config slice",
    "role": "the backend role: `retriever`, `grader`, `rewriter`, `web_search`, `source_check` or `generator`",
    "base_run": "the base run",
    "candidate_run": "the candidate run",
    "in_base": "the question is in the base run",
    "in_candidate": "the question is in the candidate run",
    "answer_base": "the base run's answer",
    "answer_candidate": "the candidate run's answer",
    "answer_changed": "the answers differ (null: the question was asked differently in the two runs)",
    "answer_similarity": "word-level similarity of the answers, 0..1 (characters for CJK)",
    "action_base": "the base run's action",
    "action_candidate": "the candidate run's action",
    "route_base": "the base run's route",
    "route_candidate": "the candidate run's route",
    "action_flip": "the actions differ",
    "route_flip": "the routes differ",
    "n_relevant_base": "relevant documents in the base run",
    "n_relevant_candidate": "relevant documents in the candidate run",
    "n_relevant_delta": "candidate minus base",
    "grade_flips": "documents whose grade flipped, e.g. `internal:aq7-specs#p0 no->yes`",
    "f1_delta": "candidate minus base token F1 (null without gold)",
    "answer_contained_delta": "candidate minus base `answer_contained` (null without gold)",
    "routing_accuracy_delta": "candidate minus base `routing_accuracy` (null without gold)",
    "chunk_id": "the child chunk's id (what search finds)",
    "source_path": "the file the document was read from",
    "chunk_text": "the child chunk's text (what search matches)",
    "parent_text": "the parent chunk's text (what the grader and the generator read)",
}
MEANINGS_IN = {
    "runs": {"generation": "the generation being written, or last written"},
    "inputs": {"reason": "why the row was rejected; null for an accepted question"},
    "rejects": {"reason": "why the row was rejected"},
    "stage_cache": {
        "value": "the call's result, as JSON",
        "run_id": "the run that stored it",
        "question_key": "the key of the question the call served",
    },
    "chunks": {"doc_id": "the document the chunk comes from", "parent_id": "the parent chunk (section or paragraph)"},
}


def meaning(table: str, column: str) -> str:
    """A column's meaning in one line: the table's own (a view's, else its stored table's), else the
    name's."""
    view = VIEWS.get(table)
    for name in (table, view.stored if view else None):
        if column in MEANINGS_IN.get(name or "", {}):
            return MEANINGS_IN[name or ""][column]
    if column not in MEANINGS:
        raise KeyError(f"crag.schema: column {column!r} of table {table!r} has no meaning in MEANINGS")
    return MEANINGS[column]


def sql_type(kind: pa.DataType) -> str:
    """An Arrow type as Spark SQL names it (what DESCRIBE shows on Databricks)."""
    if pa.types.is_list(kind):
        return f"array<{sql_type(kind.value_type)}>"
    if pa.types.is_map(kind):
        return f"map<{sql_type(kind.key_type)},{sql_type(kind.item_type)}>"
    if pa.types.is_struct(kind):
        return "struct<" + ",".join(f"{f.name}:{sql_type(f.type)}" for f in kind) + ">"
    if pa.types.is_timestamp(kind):
        return "timestamp"
    names = {"string": "string", "bool": "boolean", "int32": "int", "int64": "bigint", "double": "double"}
    return names[str(kind)]


def _column_rows(table: str, columns: pa.Schema) -> list[str]:
    """A table's columns as Markdown table rows; a list of structs that a view shows as rows has its
    fields as rows of their own (`grades[].rank`), described as that view describes them."""
    rows = []
    for f in columns:
        exploded = next((n for n, v in VIEWS.items() if v.stored == table and v.explode == f.name), None)
        kind = "array<struct>" if exploded else sql_type(f.type)
        rows.append(f"| `{f.name}` | `{kind}` | {meaning(table, f.name)} |")
        if exploded:
            item = f.type.value_type
            rows += [f"| `{f.name}[].{i.name}` | `{sql_type(i.type)}` | {meaning(exploded, i.name)} |" for i in item]
    return rows


def _section(name: str, kind: str, columns: pa.Schema, how: list[str]) -> list[str]:
    return [
        f"### {name} ({kind})",
        "",
        f"{ABOUT[name][0].upper()}{ABOUT[name][1:]}.",
        "",
        *how,
        "| column | type | meaning |",
        "| --- | --- | --- |",
        *_column_rows(name, columns),
        "",
    ]


def _view_how(view: View) -> list[str]:
    rows = f"the rows of `{view.stored}`" + (f" where `{view.where}`" if view.where else "")
    if view.explode:
        rows += f", one row per item of its `{view.explode}` list"
    return [f"Shows {rows}, of each run's `shown_generation`.", ""]


def tables_markdown() -> str:
    """The table reference, docs/tables.md: every view and stored table, and the index's chunk table,
    with each column's type and meaning."""
    lines = [
        "# Tables",
        "",
        "<!-- Generated from crag/schema.py by `python -m crag.schema > docs/tables.md`: edit crag/schema.py,",
        "     not this file (tests/unit/test_docs.py fails when the two differ). -->",
        "",
        "A warehouse (a folder, or a catalog schema on Databricks) holds crag's **stored tables**, which",
        "runs write, and the **views** users query. A view shows the rows of each run's shown generation",
        "(`runs.shown_generation`): a re-run's rows replace the earlier ones in the commit that records its",
        "outcome, and a failed re-run leaves the earlier ones shown (docs/architecture.md). On Unity",
        "Catalog the views are catalog views; `crag sql` defines them over a local folder.",
        "",
        "Types are Spark SQL's. `counts['route_web']` reads one of a run's counts. `ms_*`: a stage that calls",
        "its backend once per question records that question's own time; a stage that serves a whole",
        "partition in one call (BM25 retrieval) records the call's time divided by the questions in it.",
        "",
        "## Views",
        "",
    ]
    for name, view in VIEWS.items():
        lines += _section(name, "view", view.columns, _view_how(view))
    lines += ["## Stored tables", ""]
    for name, table in STORED.items():
        how = f"Key: {', '.join(f'`{k}`' for k in table.key)}."
        if table.per_generation:
            how += " Its rows belong to one generation of one run; the others are forgotten once a run's outcome"
            how += " shows a new one."
        lines += _section(name, "stored", table.columns, [how, ""])
    lines += ["## The index's chunk table", ""]
    lines += _section("chunks", "crag index", CHUNKS, [])
    return "\n".join(lines).rstrip("\n") + "\n"


if __name__ == "__main__":
    print(tables_markdown(), end="")
