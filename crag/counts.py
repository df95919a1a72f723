"""A run's counts and its result: what its summary, its `runs` row, MLflow and the row invariant read.

Counted by Spark while each batch's results are written (`aggregates`, observed with the write), so
the driver never reads the rows to count them. In `runs` they are a map (`counts['route_web']` in SQL).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pandas as pd

ACTIONS = ("correct", "ambiguous", "incorrect")
ROUTES = ("internal", "web", "mixed", "refused", "error")  # an answer's route (crag.stages.generate)
# Grades that are not plain readings: a repaired output, an unreadable one, and a document whose grading
# call failed (crag.backends.base.NOT_GRADED)
PARSE_STATUSES = ("repaired", "failed", "not_graded")
# The per-question usage columns summed over a run.
USAGE = (
    "search_calls",
    "llm_calls",
    "prompt_tokens",
    "completion_tokens",
    "retries",
    "cache_hits",
    "queued_calls",  # remote calls that waited on the client for a free slot of the endpoint's budget
    "queue_ms",  # how long they waited, in all
)


@dataclass
class RunCounts:
    input_rows: int = 0
    accepted: int = 0
    rejected: int = 0
    refused: int = 0
    errors: int = 0
    search_calls: int = 0
    llm_calls: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    retries: int = 0
    cache_hits: int = 0
    queued_calls: int = 0
    queue_ms: int = 0
    relevant_docs: int = 0
    actions: dict[str, int] = field(default_factory=dict)  # questions per CRAG action
    routes: dict[str, int] = field(default_factory=dict)  # questions per route
    grade_parse: dict[str, int] = field(default_factory=dict)  # grades per parse status (repaired, failed)
    latency: dict[str, int] = field(default_factory=dict)  # remote calls per latency bucket (LATENCY_COUNT_NAMES)

    @classmethod
    def of_results(cls, totals: dict, input_rows: int, rejected: int) -> RunCounts:
        """From the totals of `aggregates` (summed over batches), with the input's row counts."""
        from crag.backends.base import LATENCY_COUNT_NAMES  # noqa: PLC0415  # crag.backends imports crag.evaluation, which imports this module

        value = {k: int(v or 0) for k, v in totals.items()}
        return cls(
            input_rows=input_rows,
            rejected=rejected,
            accepted=value["accepted"],
            refused=value["refused"],
            errors=value["errors"],
            relevant_docs=value["relevant_docs"],
            **{k: value[k] for k in USAGE},
            actions={a: value[f"action_{a}"] for a in ACTIONS if value[f"action_{a}"]},
            routes={r: value[f"route_{r}"] for r in ROUTES if value[f"route_{r}"]},
            grade_parse={s: value[f"grade_parse_{s}"] for s in PARSE_STATUSES if value[f"grade_parse_{s}"]},
            latency={name: value[name] for name in LATENCY_COUNT_NAMES if value[name]},
        )

    def as_map(self) -> dict[str, int]:
        """As stored in `runs.counts`: flat keys (action_correct, route_web, ...), zero groups left out."""
        flat = {
            k: getattr(self, k)
            for k in ("input_rows", "accepted", "rejected", "refused", "errors", *USAGE, "relevant_docs")
        }
        for prefix, group in (("action", self.actions), ("route", self.routes), ("grade_parse", self.grade_parse)):
            flat.update({f"{prefix}_{k}": v for k, v in group.items()})
        return flat | self.latency


@dataclass
class RunResult:
    run_id: str
    variant: str
    warehouse: str
    seconds: float
    counts: RunCounts
    metrics: pd.DataFrame | None = None  # when the questions carry gold columns
    tables: str = ""  # the catalog schema that holds the tables ("" for a local folder)
    status: str = "succeeded"  # as recorded in `runs`: failed when every accepted question is an error
    first_error: str | None = None  # then, one of the errors
    kept_earlier_rows: bool = False  # then, a re-run of the id left the earlier rows in place

    def summary(self) -> str:
        from crag.backends.base import remote_calls_line  # noqa: PLC0415  # as of_results'

        c = self.counts

        def group(counted: dict[str, int]) -> str:
            return ", ".join(f"{k} {v}" for k, v in sorted(counted.items())) or "-"

        lines = [
            f"run {self.run_id} (variant {self.variant}) -> {self.warehouse}"
            + (f" (tables {self.tables}.<name>)" if self.tables and self.tables != self.warehouse else ""),
            f"  questions   {c.input_rows}: {c.accepted} accepted, {c.rejected} rejected",
            f"  actions     {group(c.actions)}",
            f"  routes      {group(c.routes)}",
            f"  refusals    {c.refused}",
            f"  errors      {c.errors}",
            f"  calls       {c.search_calls} search, {c.llm_calls} LLM, {c.retries} retries, "
            f"{c.cache_hits} answered from the stage cache",
            f"  tokens      {c.prompt_tokens} prompt, {c.completion_tokens} completion",
            f"  grader      {c.grade_parse.get('failed', 0)} unreadable outputs, "
            f"{c.grade_parse.get('repaired', 0)} repaired, {c.grade_parse.get('not_graded', 0)} not graded",
            *([f"  latency     {latency}"] if (latency := remote_calls_line(c.as_map())) else []),
            f"  wall time   {self.seconds:.1f} s",
        ]
        if self.metrics is not None and not self.metrics.empty:
            slices = ["all"] + sorted(s for s in self.metrics["slice"].unique() if s.startswith("language="))
            from crag.console import render_metrics  # noqa: PLC0415  # wcwidth and tables: only a summary with metrics

            lines += ["", "quality against the gold columns (crag eval):", render_metrics(self.metrics, slices)]
        return "\n".join(lines)


def aggregates() -> list:
    """The run's totals over result rows, as Spark aggregates: over a whole generation, or observed while
    each batch is written and then summed (every one is a sum or a count). `question_ids` is the
    answered ids' fingerprint, which the row invariant checks (crag.job.check_invariant)."""
    from pyspark.sql import functions as F  # noqa: PLC0415  # crag ask reads this module without Spark

    from crag.backends.base import LATENCY_COUNT_NAMES  # noqa: PLC0415  # as of_results'

    def graded(status: str):
        return F.coalesce(F.sum(F.size(F.filter("grades", lambda g: g["parse_status"] == status))), F.lit(0))

    return [
        F.count(F.lit(1)).alias("accepted"),
        F.coalesce(F.sum(id_fingerprint()), F.lit(0)).alias("question_ids"),
        F.count_if(F.col("refused")).alias("refused"),
        F.count("error").alias("errors"),
        *[F.coalesce(F.sum(c), F.lit(0)).alias(c) for c in USAGE],
        F.coalesce(F.sum("n_relevant"), F.lit(0)).alias("relevant_docs"),
        *[F.count_if(F.col("action") == a).alias(f"action_{a}") for a in ACTIONS],
        *[F.count_if(F.col("route") == r).alias(f"route_{r}") for r in ROUTES],
        *[graded(s).alias(f"grade_parse_{s}") for s in PARSE_STATUSES],
        *[F.coalesce(F.sum(F.col("call_ms_hist")[i]), F.lit(0)).alias(n) for i, n in enumerate(LATENCY_COUNT_NAMES)],
    ]


def id_fingerprint():
    """A question id's share of a multiset fingerprint: summed over rows, it tells whether two tables
    hold the same question ids the same number of times (a duplicate and a missing id do not cancel,
    as in a count). Summed exactly, as a decimal."""
    from pyspark.sql import functions as F  # noqa: PLC0415

    return F.xxhash64("question_id").cast("decimal(38,0)")
